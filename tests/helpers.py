"""Tiny random Qwen2 checkpoints made with HF transformers: HF directories and GGUF files."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from qwenserve import SamplingParams, kernels
from qwenserve.config.cpu_variants import machine_arch, missing_flags, this_cpu_flags, variants_for
from qwenserve.distributed.groups import free_port
from qwenserve.engine.llm_engine import RequestsFailedError
from qwenserve.model.layers.decode_layers import FusedDecodeLayers

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiny_vocab(vocab_size: int, specials: list[str] = SPECIAL_TOKENS) -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges) for a byte-level BPE of `vocab_size` entries."""
    alphabet = byte_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = alphabet + merged + specials
    types = [1] * (len(alphabet) + len(merged)) + [3] * len(specials)
    assert len(tokens) <= vocab_size
    pad = vocab_size - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(pad)], types + [5] * pad, merges


def tiny_tokenizer(vocab_size: int, specials: list[str] = SPECIAL_TOKENS):
    from qwenserve.model.loader.tokenizer import tokenizer_from_gguf
    tokens, types, merges = tiny_vocab(vocab_size, specials)
    return tokenizer_from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    })


def hf_config(**overrides):
    from transformers import Qwen2Config
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, hidden_act="silu")
    kw.update(overrides)
    rope_scaling = kw.pop("rope_scaling", None)
    rope_params = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    if rope_scaling:
        rope_params.update(rope_scaling)
    cfg = Qwen2Config(rope_parameters=rope_params, **kw)
    tokens = tiny_vocab(cfg.vocab_size)[0]
    cfg.eos_token_id = tokens.index("<|im_end|>")
    cfg.bos_token_id = tokens.index("<|endoftext|>")
    return cfg


def randomize(model, norm_spread: float = 0.1, std_by_suffix: dict[str, float] | None = None):
    """Random weights a test can tell apart: norms around 1 (spread norm_spread), biases 0.1, the rest 0.08, or
    std_by_suffix[suffix] for a parameter whose name ends with it. In place, from torch's current seed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            special = next((std for suffix, std in (std_by_suffix or {}).items() if name.endswith(suffix)), None)
            if special is not None:
                p.copy_(special * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + norm_spread * torch.randn_like(p))
            else:
                p.copy_((0.1 if name.endswith(".bias") else 0.08) * torch.randn_like(p))
    return model


def tiny_hf_model(seed: int = 0, **overrides):
    """A random Qwen2ForCausalLM (float32) with non-trivial norms and biases, so loading them is tested too."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    return randomize(Qwen2ForCausalLM(hf_config(**overrides)).eval())


def tiny_qwen3(seed: int, **overrides):
    """A random Qwen3ForCausalLM (float32): 4 heads of width 32 over a hidden size of 64 (hidden / heads = 16),
    non-trivial norms (the q/k norms included)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokens = tiny_vocab(overrides.get("vocab_size", 320))[0]
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              eos_token_id=tokens.index("<|im_end|>"), bos_token_id=tokens.index("<|endoftext|>"))
    kw.update(overrides)
    torch.manual_seed(seed)
    return randomize(Qwen3ForCausalLM(Qwen3Config(**kw)).eval(), norm_spread=0.3)


def save_hf_dir(model, path: str, max_shard_size: str | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": model.config.eos_token_id, "bos_token_id": model.config.bos_token_id}, f)
    return path


# HF name -> GGUF name, the inverse of qwenserve.checkpoint's table (written out here on purpose: a test
# that imported the mapping under test could not catch a mistake in it).
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          # mixture-of-experts layers (gguf's MODEL_TENSOR FFN_GATE_INP, FFN_*_SHEXP, FFN_GATE_INP_SHEXP)
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# llama.cpp's general.architecture for each transformers model_type
_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def hf_to_gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # model.layers.N.<module>.<sub>.weight
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def save_gguf(model, path: str, quant: str = "Q8_0", overrides: dict[str, str] | None = None) -> str:
    """Write `model` (Qwen2, Qwen3, Qwen2-MoE or Qwen3-MoE) as a GGUF of its family: 2-D weights and the experts'
    3-D tensors quantized to `quant` (or to overrides[part] for a tensor whose HF name contains `part`, as
    llama.cpp's Q4_K_M mixes types), 1-D tensors and the routers (llama.cpp keeps ffn_gate_inp unquantized) in F32.

    A MoE model is written as convert_hf_to_gguf writes it: {arch}.expert_count, expert_used_count,
    expert_feed_forward_length (and expert_shared_feed_forward_length with a shared expert), each layer's experts
    stacked into ffn_{gate,up,down}_exps [experts, rows, row length], the shared expert's gate as a vector. Two
    things llama.cpp's files cannot say are written where the model needs them: a dense layer between sparse ones
    keeps the dense names (ffn_gate, ...; llama.cpp's qwen2moe/qwen3moe want experts in every layer), and a
    norm_topk_prob other than llama.cpp's fixed choice (qwen3moe renormalises, qwen2moe does not) is written as
    {arch}.expert_weights_norm."""
    import gguf
    cfg = model.config

    def qtype(name: str):
        part = next((p for p in (overrides or {}) if p in name), None)
        return gguf.GGMLQuantizationType[overrides[part] if part else quant]

    def add(gguf_name: str, hf_name: str, data: np.ndarray, quantize: bool = True) -> None:
        if data.ndim >= 2 and quantize:
            t = qtype(hf_name)
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(data), t), raw_dtype=t)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    arch = _GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(path, arch)
    if arch in ("qwen3", "qwen3moe"):  # its head width is not hidden / heads
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    shared_width = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if shared_width:
            w.add_expert_shared_feed_forward_length(shared_width)
        if cfg.norm_topk_prob != (arch == "qwen3moe"):
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    tokens, types, merges = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".mlp.shared_expert" in name and not shared_width:
            continue  # transformers' shared expert of width 0: convert_hf_to_gguf writes none
        data = tensor.float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * width, hidden]: gate rows, then up rows
            layer, width = name.split(".")[2], data.shape[1] // 2
            add(f"blk.{layer}.ffn_gate_exps.weight", name, data[:, :width])
            add(f"blk.{layer}.ffn_up_exps.weight", name, data[:, width:])
        elif name.endswith("mlp.experts.down_proj"):  # [experts, hidden, width]
            add(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", name, data)
        elif name.endswith("mlp.shared_expert_gate.weight"):  # [1, hidden] -> llama.cpp's vector [hidden]
            add(hf_to_gguf_name(name), name, data.reshape(-1))
        else:
            add(hf_to_gguf_name(name), name, data, quantize=not name.endswith("mlp.gate.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dense_route_from(model, rows: int = 64) -> int:
    """Every block-quantized layer of `model` dequantizes and runs dense from `rows` activation rows (or from its
    own, lower, threshold): some CPUs never take that route on their own (the VNNI tile kernel beats it). Returns
    the rows a batch needs to take it everywhere."""
    layers = [m for m in model.modules() if hasattr(m, "dense_from_rows")]
    for layer in layers:
        layer.dense_from_rows = min(layer.dense_from_rows, rows)
    for module in model.modules():
        if hasattr(module, "fused_decode"):
            module.fused_decode.routes_changed()
    return max(layer.dense_from_rows for layer in layers)


def record_preemptions(llm) -> list[str]:
    """The request ids the engine's scheduler preempts from now on, in order (the list fills as it runs)."""
    preempted = []
    original = llm.engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        original(seq)
    llm.engine.scheduler._preempt = spy
    return preempted


# ---- engines over several processes -----------------------------------------------------------------------

PROMPTS = [list(range(3 + i, 14 + 3 * i)) for i in range(6)]  # 11 to 26 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def greedy_tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    """The token ids llm generates for each prompt (token-id prompts; greedy unless params says otherwise)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def draft_keeps_greedy(target: str, draft: str, prompts=PROMPTS, max_tokens: int = 16):
    """Greedy tokens of `target` with `draft` proposing 3 tokens a step equal those without a draft; returns the
    speculating engine's stats (spec_num_draft_tokens, spec_num_accepted_tokens, ...)."""
    from qwenserve import LLM
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(target, dtype="float32", kv_cache_memory="32MiB")
    spec = LLM(target, dtype="float32", kv_cache_memory="32MiB", speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None,
        "min_acceptance_rate": 0})
    assert greedy_tokens(spec, prompts, params) == greedy_tokens(plain, prompts, params)
    return spec.engine.stats()


def assert_hf_greedy(hf, prompts, outputs):
    """Each output token is HF's argmax given the tokens before it (a random tiny model has near-ties, so one
    within 1e-4 of the best counts: free-running greedy would then diverge on rounding alone)."""
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert (chosen >= logits.max(-1).values - 1e-4).all(), (prompt, out)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent's wait is missing
        return f.read().split(")")[-1].split()[0] != "Z"


def generate_until_killed(llm, pid: int, after_steps: int = 3, timeout: float = 30.0) -> tuple[Exception, float]:
    """Run a long generate on llm in a thread, SIGKILL pid once it is under load (the engine has run after_steps
    steps, so requests are decoding), and wait for generate to end: (the exception it raised, seconds from the
    kill until it returned). Fails if it hangs or succeeds."""
    import signal
    import threading
    result, steps, loaded = {}, [], threading.Event()
    step = llm.engine.step

    def counted_step():
        outputs = step()
        steps.append(1)
        if len(steps) >= after_steps:
            loaded.set()
        return outputs

    def run():
        try:
            greedy_tokens(llm, PROMPTS * 20, SamplingParams(max_tokens=200, ignore_eos=True))
        except Exception as e:  # noqa: BLE001
            result["error"] = e
        result["at"] = time.time()

    llm.engine.step = counted_step  # an instance attribute: `del` below brings back the class's method
    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: loaded.is_set() or not thread.is_alive(), timeout, f"{after_steps} engine steps")
        assert loaded.is_set(), f"generate ended after {len(steps)} steps, before the kill: {result}"
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=timeout)
    finally:
        del llm.engine.step
    assert not thread.is_alive(), "generate hung after a worker died"
    assert "error" in result, "generate finished although a worker was killed"
    return result["error"], result["at"] - killed_at


def _rank_logits(rank: int, world: int, port: int, path: str, quantization: str, ids: list[int], out,
                 expert_parallel: bool = False):
    """One rank of tensor_parallel_logits, in its own spawned process."""
    import torch.distributed as dist

    from qwenserve.config.engine_config import LoadConfig
    from qwenserve.model.loader.model_loader import load_model
    from qwenserve.distributed.tensor_parallel import TensorParallel
    from qwenserve.model.loader.resolve import resolve_model
    from qwenserve.worker.model_runner import full_logits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        resolved = resolve_model(LoadConfig(model=path, dtype="float32", max_model_len=256, quantization=quantization))
        model = load_model(resolved, tp=TensorParallel(rank, world, dist.group.WORLD,
                                                      expert_parallel=expert_parallel))
        logits = full_logits(model, ids)
        out.put((rank, logits.numpy()))  # by value: a shared tensor dies with this process
        # every rank done before any tears gloo down: a rank that left first has aborted a slower one at exit
        # ("terminate called without an active exception", seen once on a loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # the logits are sent; leave without the interpreter's teardown, in which gloo's threads have still aborted a
    # rank now and then after the barrier (SIGABRT, once in a full suite run on a loaded machine)
    out.close()
    out.join_thread()
    os._exit(0)


def tensor_parallel_logits(path: str, tp: int, ids: list[int], quantization: str = "none",
                           expert_parallel: bool = False) -> dict[int, np.ndarray]:
    """rank -> the full logits of `ids` from the model at `path` split over `tp` spawned ranks (gloo, float32);
    expert_parallel: whole experts per rank (enable_expert_parallel)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, tp, port, path, quantization, ids, out, expert_parallel))
             for r in range(tp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(tp))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def wait_for(condition, timeout: float = 10.0, what: str = "the condition", interval: float = 0.02) -> None:
    """Poll condition() until it is true; fail, naming `what`, once timeout seconds have passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(interval)


def pids_gone(pids, timeout=15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


# ---- live servers ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def live_server(app, server_class=None, **config):
    """`app` served by uvicorn on a free loopback port, in a thread; yields its base URL. Extra uvicorn.Config
    arguments pass through (ssl_keyfile / ssl_certfile make it https). uvicorn leaves logging alone
    (log_config=None), so its errors reach pytest's caplog like every other record. server_class(config) makes
    the server instead of uvicorn.Server."""
    import threading

    import uvicorn
    port = free_port()
    config = {"log_level": "warning", "log_config": None} | config
    srv = (server_class or uvicorn.Server)(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "the test server did not start"
    try:
        yield f"{'https' if config.get('ssl_certfile') else 'http'}://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)



@contextlib.contextmanager
def bundled_model_server(**engine_kwargs):
    """The bundled model behind a live OpenAI server (served model name "qwen"); yields (base URL, engine)."""
    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app
    from qwenserve.model.loader.bundled import bundled_model_path
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=bundled_model_path(), **engine_kwargs)))
    try:
        with live_server(build_app(engine, ["qwen"])) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", name="server")
def bundled_openai_server():
    """Fixture `server`, for a test module that imports it: the bundled model behind a live OpenAI server, one per
    module, as (base URL, engine)."""
    with bundled_model_server(kv_cache_memory="512MiB") as served:
        yield served


@pytest.fixture(scope="module", name="client")
def bundled_openai_client(server):
    """Fixture `client`: the openai client of that server."""
    import openai
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)

def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """A Prometheus sample's value in /metrics text (`name` with its _total, _count... suffix), summed over the
    series whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families
    values = [sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
              if sample.name == name and labels.items() <= sample.labels.items()]
    assert values, f"{name} {labels or ''} not in /metrics"
    return sum(values)


def metric_names(metrics_text: str) -> set[str]:
    """The names PromQL reads in /metrics text: a histogram's family name (its _bucket, _sum and _count
    samples'), and every other sample's name (a counter's with its _total)."""
    from prometheus_client.parser import text_string_to_metric_families
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names |= {family.name} if family.type == "histogram" else {s.name for s in family.samples}
    return names


def wait_idle_and_clean(engine, timeout: float = 10.0) -> None:
    """Wait until an AsyncLLMEngine has no live request, then check that every KV block is free (or cached)."""
    import asyncio
    deadline = time.time() + timeout
    while True:
        busy, free, total = asyncio.run(engine.call(
            lambda e: (e.has_unfinished_requests(), e.kv.num_free_blocks, e.kv.num_blocks)))
        if not busy or time.time() > deadline:
            break
        time.sleep(0.05)
    assert not busy and free == total


@contextlib.contextmanager
def hold_engine_thread(engine, timeout: float = 30.0):
    """Keep an AsyncLLMEngine's thread busy, as if mid-step, for the block: the hold has begun when the block
    starts, and what callers send meanwhile (requests, aborts) waits in its queue until the block ends."""
    import asyncio
    import threading
    held, release = threading.Event(), threading.Event()

    def hold(_engine):
        held.set()
        release.wait(timeout)
    holder = threading.Thread(target=lambda: asyncio.run(engine.call(hold)))
    holder.start()
    try:
        assert held.wait(timeout), "the engine thread did not take the hold"
        yield
    finally:
        release.set()
        holder.join(timeout)


def engine_queue_length(engine) -> int:
    """How many commands (requests, aborts, calls) wait for an AsyncLLMEngine's thread to take them."""
    return engine._commands.qsize()


def self_signed_cert(directory) -> tuple[str, str]:
    """(certificate, private key) PEM files for 127.0.0.1 and localhost, valid for a day (openssl)."""
    import subprocess
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


@contextlib.contextmanager
def serve_process(args: list[str], log_path, env: dict | None = None, verify=True, startup_timeout: float = 60.0):
    """`qwenserve serve ARGS --port <free>` as users start it (stdout and stderr to log_path); yields (the
    process, its base URL, https with --ssl-certfile) once /health answers 200. On leaving, a process still
    running gets SIGINT (SIGKILL if it has not exited within 20 s)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    port = free_port()
    base = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.cli.main", "serve", *args,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=Path(__file__).parent.parent)
    try:
        deadline = time.time() + startup_timeout
        while True:
            assert proc.poll() is None, Path(log_path).read_text()
            try:
                if httpx.get(base + "/health", verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, Path(log_path).read_text()
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def descendant_pids(pid: int) -> list[int]:
    """Every live process under `pid` (children, theirs, ...), from /proc (Linux)."""
    import glob
    found, todo = [], [pid]
    while todo:
        for path in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            try:
                with open(path) as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:  # gone meanwhile
                continue
            found += children
            todo += children
    return found


def step_until_idle(engine) -> tuple[dict, dict]:
    """Step an LLMEngine until idle: (finished outputs, failures) by request id."""
    outputs, failures = {}, {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestsFailedError as e:
            failures.update(e.failures)
            outs = e.outputs
        outputs.update((o.request_id, o) for o in outs if o.finished)
    return outputs, failures


@pytest.fixture
def fused_steps(monkeypatch):
    """Rows of each decode step the one-call path ran (0 for a step the modules ran)."""
    steps = []
    original = FusedDecodeLayers.call_for

    def counting(self, attn_metadata, rows):
        call = original(self, attn_metadata, rows)
        steps.append(rows if call is not None else 0)
        return call
    monkeypatch.setattr(FusedDecodeLayers, "call_for", counting)
    return steps


def assert_seeded_samples_agree(samples, fused_steps):
    """samples(eager, with_others) -> a seeded request's n = 3 samples, run alone or beside other requests, with the
    one-call decode or the modules (enforce_eager): the one-call decode ran and drew the modules' samples, the three
    differ, and the request draws the same alone and in a batch."""
    alone = samples(eager=False, with_others=False)
    assert max(fused_steps) > 1, "the decode steps did not take the one-call path"
    assert len({tuple(s) for s in alone}) == 3
    assert samples(eager=False, with_others=True) == alone
    fused_steps.clear()
    assert samples(eager=True, with_others=False) == alone
    assert not any(fused_steps)


def variant_params():
    """Every kernel variant of this architecture, as pytest params; those beyond the one this process runs by
    default compile libraries of their own where none is prebuilt (marked `kernels`)."""
    default = kernels.chosen_variant()
    return [pytest.param(v, id=v.name, marks=() if v == default else pytest.mark.kernels)
            for v in variants_for(machine_arch())]


def variant_ops(variant):
    """The ops of a kernel variant, or a skip naming why this machine cannot run it."""
    if os.environ.get("QWENSERVE_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by QWENSERVE_CPU_KERNELS=0")
    missing = missing_flags(variant, this_cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}, which the {variant.name} variant needs")
    ops = kernels.variant_ops(variant)
    if ops is None and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here to build the variant, and no prebuilt library of it")
    assert ops is not None, f"the {variant.name} kernels are unavailable (qwenserve.kernels logs why)"
    return ops
