"""Prometheus metrics for the server. Request-level series are recorded when the server reads a request's
final output; gauges are read from the engine's stats() at scrape time."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from qwenserve.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()  # one per server: no global state shared between instances
        r = self.registry
        self.running = Gauge("qwenserve_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("qwenserve_num_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("qwenserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", registry=r)
        self.prefix_hit_rate = Gauge("qwenserve_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens looked up", registry=r)
        self.aborted = Gauge("qwenserve_num_aborted_requests_total", "Requests aborted since start", registry=r)
        self.weights_bytes = Gauge("qwenserve_model_weights_bytes", "Bytes of model weights the workers hold",
                                   registry=r)
        self.kv_reserved = Gauge("qwenserve_kv_cache_reserved_bytes", "Bytes reserved for the KV cache (resident "
                                 "only where touched)", registry=r)
        self.kv_touched = Gauge("qwenserve_kv_cache_touched_bytes", "Bytes of the KV blocks ever used (the "
                                "distinct blocks handed out): the KV cache's resident memory", registry=r)
        # speculative decoding (0 when off), as vLLM's spec_decode series
        self.spec_drafts = Gauge("qwenserve_spec_decode_num_drafts_total", "Verifications of draft tokens (steps in "
                                 "which a sequence brought drafts)", registry=r)
        self.spec_draft_tokens = Gauge("qwenserve_spec_decode_num_draft_tokens_total", "Draft tokens verified",
                                       registry=r)
        self.spec_accepted_tokens = Gauge("qwenserve_spec_decode_num_accepted_tokens_total", "Draft tokens accepted",
                                          registry=r)
        self.prompt_tokens = Counter("qwenserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("qwenserve_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.finished = Counter("qwenserve_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("qwenserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("qwenserve_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TOKEN_BUCKETS, registry=r)
        # LoRA adapters (with enable_lora): vLLM's info series, whose labels name the adapters in use and whose
        # value is the time it was read, and a count of requests per adapter
        self.lora_info = Gauge("qwenserve_lora_requests_info", "LoRA adapters of the running and waiting requests "
                               "(comma-separated names in the labels; the value is the time of the reading)",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self.lora_running = Gauge("qwenserve_lora_num_requests_running", "Requests running with the LoRA adapter",
                                  ["lora_name"], registry=r)
        self.lora_waiting = Gauge("qwenserve_lora_num_requests_waiting", "Requests waiting with the LoRA adapter",
                                  ["lora_name"], registry=r)
        # data-parallel replicas, one series each (the gauges above are their totals)
        per = ["replica"]
        self.replica_alive = Gauge("qwenserve_replica_alive", "1 while the replica serves, 0 once it has left the "
                                   "pool", per, registry=r)
        self.replica_running = Gauge("qwenserve_replica_num_requests_running", "Sequences running on the replica",
                                     per, registry=r)
        self.replica_waiting = Gauge("qwenserve_replica_num_requests_waiting", "Sequences waiting on the replica",
                                     per, registry=r)
        self.replica_kv_usage = Gauge("qwenserve_replica_kv_cache_usage_perc", "Fraction of the replica's KV blocks "
                                      "in use (0-1)", per, registry=r)
        self.replica_hit_rate = Gauge("qwenserve_replica_prefix_cache_hit_rate", "The replica's prefix cache hit "
                                      "rate", per, registry=r)
        self.replica_routed = Gauge("qwenserve_replica_requests_routed_total", "Requests routed to the replica",
                                    per, registry=r)
        self.e2e = Histogram("qwenserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(generated)
        for c in out.outputs:
            self.finished.labels(finished_reason=c.finish_reason or "unknown").inc()
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
                per_seq = max(len(c.token_ids) for c in out.outputs)
                if per_seq > 1:
                    self.tpot.observe((m.finished_time - m.first_token_time) / (per_seq - 1))

    def render(self, snap: dict) -> bytes:
        """The exposition text, with the gauges set from `snap` (AsyncLLMEngine.stats())."""
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.kv_usage.set(snap["kv_usage"])
        self.prefix_hit_rate.set(snap["hit_rate"])
        self.aborted.set(snap["aborted"])
        self.weights_bytes.set(snap["weights_bytes"])
        self.kv_reserved.set(snap["kv_reserved_bytes"])
        self.kv_touched.set(snap["kv_touched_bytes"])
        self.spec_drafts.set(snap.get("spec_num_drafts", 0))
        self.spec_draft_tokens.set(snap.get("spec_num_draft_tokens", 0))
        self.spec_accepted_tokens.set(snap.get("spec_num_accepted_tokens", 0))
        self._render_lora(snap.get("lora") or {})
        for rank, replica in enumerate(snap.get("replicas", ())):
            label = str(rank)
            self.replica_alive.labels(label).set(int(replica["alive"]))
            self.replica_running.labels(label).set(replica["running"])
            self.replica_waiting.labels(label).set(replica["waiting"])
            self.replica_kv_usage.labels(label).set(replica["kv_usage"])
            self.replica_hit_rate.labels(label).set(replica["hit_rate"])
            self.replica_routed.labels(label).set(replica["routed"])
        return generate_latest(self.registry)

    def _render_lora(self, lora: dict) -> None:
        """The adapters' series from LLMEngine.lora_stats(); an adapter no request uses any more leaves them."""
        for gauge in (self.lora_info, self.lora_running, self.lora_waiting):
            gauge.clear()
        if not lora:
            return
        running, waiting = lora["running"], lora["waiting"]
        self.lora_info.labels(",".join(sorted(running)), ",".join(sorted(waiting)),
                              str(lora["max_loras"])).set(time.time())
        for name, count in running.items():
            self.lora_running.labels(name).set(count)
        for name, count in waiting.items():
            self.lora_waiting.labels(name).set(count)
