"""Prometheus metrics for the server under vLLM's V1 names (`vllm:...`, labelled model_name and engine), so that
dashboards and alerts written for vLLM read them unchanged; figures vLLM has no name for keep a `qwenserve:`
prefix. Request-level series are recorded when the server reads a request's final output; the engine's gauges and
counters are read from its stats() at scrape time."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qwenserve.engine.outputs import RequestOutput

LABELS = ["model_name", "engine"]

# vLLM's bucket boundaries, so that quantiles over a mixed vLLM/qwenserve fleet aggregate
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

FINISHED_REASONS = ("stop", "length", "abort")  # present from the start (at 0), as vLLM has them


def buckets_1_2_5(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `largest`: vLLM's buckets for token counts."""
    buckets, magnitude = [], 1
    while True:
        for step in (1, 2, 5):
            value = step * magnitude
            if value > largest:
                return buckets
            buckets.append(value)
        magnitude *= 10


class ServerMetrics:
    def __init__(self, model_name: str = "", max_model_len: int = 32768):
        """model_name: the served model name, the model_name label of every series; max_model_len bounds the
        token-count histograms' buckets."""
        self.model_name = model_name
        self.registry = CollectorRegistry()  # one per server: no global state shared between instances
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                              "(a request's mean after its first).", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                               "request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING "
                                   "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                 "request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                "request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    token_buckets)
        self.generation_len = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        token_buckets)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                    "parameter.", token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        for family in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.inference, self.prefill, self.decode,
                       self.prompt_len, self.generation_len, self.params_max_tokens, self.params_n):
            family.labels(model_name, "0")  # at 0 from the start, as vLLM's; other engines appear with their first
        # finished requests' counters, per engine: the engine's own counters are read at scrape time instead
        self.prompt_tokens: dict[int, int] = {}
        self.generation_tokens: dict[int, int] = {}
        self.finished: dict[tuple[int, str], int] = {}  # (engine, finished_reason) -> choices
        self.snapshot: dict = {}  # the engine's stats() of the scrape under way
        r.register(_EngineCollector(self))

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        engine = m.engine_index
        labels = (self.model_name, str(engine))
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens[engine] = self.prompt_tokens.get(engine, 0) + len(out.prompt_token_ids)
        self.generation_tokens[engine] = self.generation_tokens.get(engine, 0) + generated
        for c in out.outputs:
            reason = c.finish_reason or "unknown"
            if reason != "abort":  # the engine counts aborted requests itself, those the server never reads too
                self.finished[engine, reason] = self.finished.get((engine, reason), 0) + 1
        self.prompt_len.labels(*labels).observe(len(out.prompt_token_ids))
        self.generation_len.labels(*labels).observe(generated)
        self.params_max_tokens.labels(*labels).observe(m.max_tokens)
        self.params_n.labels(*labels).observe(m.n)
        for gap in m.inter_token_latencies:
            self.itl.labels(*labels).observe(gap)
        if m.finished_time is not None:
            self.e2e.labels(*labels).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(*labels).observe(m.first_scheduled_time - m.arrival_time)
            if m.finished_time is not None:
                self.inference.labels(*labels).observe(m.finished_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.ttft.labels(*labels).observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill.labels(*labels).observe(m.first_token_time - m.first_scheduled_time)
            if m.finished_time is not None:
                self.decode.labels(*labels).observe(m.finished_time - m.first_token_time)
                per_seq = max(len(c.token_ids) for c in out.outputs)
                if per_seq > 1:
                    self.tpot.labels(*labels).observe((m.finished_time - m.first_token_time) / (per_seq - 1))

    def render(self, snap: dict) -> bytes:
        """The exposition text, the engine's series read from `snap` (AsyncLLMEngine.stats())."""
        self.snapshot = snap
        return generate_latest(self.registry)


class _EngineCollector:
    """The series read from the engine's stats() at scrape time: one per engine (data-parallel replica), as
    vLLM labels its engine cores."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        m, snap = self.metrics, self.metrics.snapshot
        if not snap:
            return
        engines = snap.get("replicas") or [snap]  # one engine: its totals are its own
        model = m.model_name

        def family(kind, name: str, doc: str, value_of):
            f = kind(name, doc, labels=LABELS)
            for index, stats in enumerate(engines):
                f.add_metric([model, str(index)], value_of(index, stats))
            return f

        def gauge(name, doc, key):
            return family(GaugeMetricFamily, name, doc, lambda i, s: s[key])

        def counter(name, doc, value_of):
            return family(CounterMetricFamily, name, doc, value_of)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", "running")
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting")
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage")
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      lambda i, s: s["prefix_query_tokens"])
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      lambda i, s: s["prefix_hit_tokens"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      lambda i, s: s["num_preemptions"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed (of finished requests).",
                      lambda i, s: m.prompt_tokens.get(i, 0))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed (of finished requests).",
                      lambda i, s: m.generation_tokens.get(i, 0))
        yield self._request_success(engines)
        yield self._cache_config(engines)
        if snap.get("speculating"):
            yield from self._spec_decode(engines)
        lora = snap.get("lora")
        if lora:
            yield from self._lora(lora)
        # qwenserve's own figures
        yield gauge("qwenserve:model_weights_bytes", "Bytes of model weights the workers hold.", "weights_bytes")
        yield gauge("qwenserve:kv_cache_reserved_bytes", "Bytes reserved for the KV cache (resident only where "
                    "touched).", "kv_reserved_bytes")
        yield gauge("qwenserve:kv_cache_touched_bytes", "Bytes of the KV blocks ever used (the distinct blocks "
                    "handed out): the KV cache's resident memory.", "kv_touched_bytes")
        if "replicas" in snap:
            yield family(GaugeMetricFamily, "qwenserve:replica_alive", "1 while the data-parallel replica serves, "
                         "0 once it has left the pool.", lambda i, s: int(s["alive"]))
            yield counter("qwenserve:replica_requests_routed", "Requests routed to the data-parallel replica.",
                          lambda i, s: s["routed"])

    def _request_success(self, engines: list[dict]) -> CounterMetricFamily:
        m = self.metrics
        f = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                labels=LABELS + ["finished_reason"])
        for index, stats in enumerate(engines):
            counts = {reason: 0 for reason in FINISHED_REASONS}
            counts.update({reason: n for (engine, reason), n in m.finished.items() if engine == index})
            counts["abort"] = stats["aborted"]
            for reason, n in counts.items():
                f.add_metric([m.model_name, str(index), reason], n)
        return f

    def _cache_config(self, engines: list[dict]) -> GaugeMetricFamily:
        f = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=["engine", "block_size", "num_gpu_blocks"])
        for index, stats in enumerate(engines):
            f.add_metric([str(index), str(stats["block_size"]), str(stats["num_blocks"])], 1)
        return f

    def _spec_decode(self, engines: list[dict]):
        m = self.metrics
        for name, doc, key in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
                               ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                "spec_num_draft_tokens"),
                               ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                "spec_num_accepted_tokens")):
            f = CounterMetricFamily(name, doc, labels=LABELS)
            for index, stats in enumerate(engines):
                f.add_metric([m.model_name, str(index)], stats[key])
            yield f
        f = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft's "
                                "position.", labels=LABELS + ["position"])
        for index, stats in enumerate(engines):
            for position, n in enumerate(stats["spec_accepted_per_position"]):
                f.add_metric([m.model_name, str(index), str(position)], n)
        yield f

    def _lora(self, lora: dict):
        """vLLM's info series (the adapters in use in its labels, the time of the reading its value) and a count
        of requests per adapter; an adapter no request uses any more leaves them."""
        running, waiting = lora["running"], lora["waiting"]
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(lora["max_loras"]), ",".join(sorted(waiting)), ",".join(sorted(running))], time.time())
        yield info
        for state, counts in (("running", running), ("waiting", waiting)):
            f = GaugeMetricFamily(f"qwenserve:lora_num_requests_{state}", f"Requests {state} with the LoRA adapter.",
                                  labels=["lora_name"])
            for name, count in counts.items():
                f.add_metric([name], count)
            yield f
