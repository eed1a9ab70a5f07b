"""LoRA adapters against HF transformers + PEFT on a tiny random Qwen2: adapters made by PEFT itself
(init_lora_weights=False, so B is not zero), saved with save_pretrained, served by qwenserve; mixed batches, the
adapter errors, the LRU of loaded adapters and the prefix cache's separation of adapters."""
import copy
import json
import os
import re
import shutil

import peft
import pytest
import torch

from qwenserve import LLM, LoRARequest, SamplingParams
from qwenserve.config.errors import ConfigError, RequestError
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence
from qwenserve.lora.batch import LoRABatch
from qwenserve.lora.ops import Expand, LayerAdapter, StackedAdapters, add_lora

from helpers import save_hf_dir, step_until_idle, tiny_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# four adapters that differ in rank, scaling and the projections they adapt (fused slices alone and together)
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    "mlp": dict(r=8, lora_alpha=16, target_modules=MLP),
    "all-rslora": dict(r=2, lora_alpha=4, target_modules=ATTENTION + MLP, use_rslora=True),
    "q-v-down": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make_adapter(base, directory: str, seed: int, safe: bool = True, **lora_config):
    """A PEFT LoRA adapter on a copy of base, with random A and B; saved to directory. Returns the PEFT model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_config)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(directory, safe_serialization=safe)
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    hf = tiny_hf_model(seed=11)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("lora-base")))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (LoRARequest, the PEFT model: the reference)."""
    hf, _ = base
    out = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        path = str(tmp_path_factory.mktemp(f"adapter-{name}"))
        out[name] = (LoRARequest(name, i + 1, path), make_adapter(hf, path, seed=100 + i, **config))
    return out


@pytest.fixture(scope="module")
def llm(base):
    return LLM(base[1], dtype="float32", kv_cache_memory="4MiB", record_logits=True, enable_lora=True,
               max_loras=4, max_lora_rank=8, max_cpu_loras=4)


def manager(llm):
    return llm.engine.executor.worker.lora_manager


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits from full forward passes of an HF (or PEFT) model."""
    tokens, logits = [], []
    for _ in range(n):
        step = model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].float()
        logits.append(step)
        tokens.append(int(step.argmax()))
    return tokens, torch.stack(logits)


def run(llm, prompts, adapters, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters)
    return [o.outputs[0] for o in outs]


def assert_no_blocks_held(llm):
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


# ---- equal to HF + PEFT --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_tokens_and_logits_match_peft(llm, adapters, base, name):
    request, peft_model = adapters[name]
    ids = prompt(13, seed=len(name))
    expected_tokens, expected_logits = reference(peft_model, ids, GREEDY.max_tokens)
    result, = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False, lora_request=request)
    assert result.lora_request == request
    out = result.outputs[0]
    assert out.token_ids == expected_tokens
    torch.testing.assert_close(torch.stack(out.logits), expected_logits, atol=1e-4, rtol=0)
    base_tokens, base_logits = reference(base[0], ids, GREEDY.max_tokens)
    assert (base_logits - expected_logits).abs().max() > 0.1, "the adapter should change the model's answer"


def test_bin_adapter_equals_safetensors(llm, base, adapters, tmp_path):
    """PEFT's other weights format (adapter_model.bin) loads to the same adapter."""
    path = str(tmp_path / "bin")
    peft_model = make_adapter(base[0], path, seed=100, safe=False, **ADAPTERS["attn"])
    assert os.path.exists(os.path.join(path, "adapter_model.bin"))
    ids = prompt(9, seed=5)
    out, = run(llm, [ids], LoRARequest("attn-bin", 50, path))
    assert out.token_ids == reference(peft_model, ids, GREEDY.max_tokens)[0]
    assert out.token_ids == run(llm, [ids], adapters["attn"][0])[0].token_ids


@pytest.mark.parametrize("targets", ["all-linear", ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]])
def test_full_module_paths_in_target_modules_are_served(llm, base, tmp_path, targets):
    """PEFT saves full module paths for "all-linear" on a small model (and keeps paths a user lists): each is
    judged by its last part."""
    path = str(tmp_path / "paths")
    peft_model = make_adapter(base[0], path, seed=7, r=4, lora_alpha=8, target_modules=targets)
    with open(os.path.join(path, "adapter_config.json")) as f:
        assert all("." in name for name in json.load(f)["target_modules"])
    ids = prompt(9, seed=6)
    out, = run(llm, [ids], LoRARequest(f"paths-{len(targets)}", 60 + len(targets), path))
    assert out.token_ids == reference(peft_model, ids, GREEDY.max_tokens)[0]


def test_bfloat16_adapter_stays_close_to_peft(base, adapters):
    """In bf16 (oneDNN-packed base weights on the CPU, adapter weights in bf16) the adapter is applied and the
    logits stay near PEFT's float32 ones."""
    llm = LLM(base[1], dtype="bfloat16", kv_cache_memory="4MiB", record_logits=True, enable_lora=True,
              max_lora_rank=8)
    request, peft_model = adapters["all-rslora"]
    ids = prompt(20, seed=12)
    params = SamplingParams(temperature=0, max_tokens=1)
    got = run(llm, [ids], request, params)[0].logits[0]
    expected = reference(peft_model, ids, 1)[1][0]
    without = reference(base[0], ids, 1)[1][0]
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got - expected).abs().max() < 0.2 * (without - expected).abs().max()


def test_long_prompt_runs_the_mlp_in_parts(llm, adapters):
    """A prompt longer than the MLP's rows per pass splits the adapter's rows with it."""
    request, peft_model = adapters["all-rslora"]
    mlps = [m for m in llm.engine.executor.worker.model.modules() if hasattr(m, "rows_per_pass")]
    saved = [m.rows_per_pass for m in mlps]
    for m in mlps:
        m.rows_per_pass = 7
    try:
        ids = prompt(40, seed=9)
        out, = run(llm, [ids], request, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        for m, rows in zip(mlps, saved):
            m.rows_per_pass = rows
    expected_tokens, expected_logits = reference(peft_model, ids, 3)
    assert out.token_ids == expected_tokens
    torch.testing.assert_close(torch.stack(out.logits), expected_logits, atol=1e-4, rtol=0)


# ---- one forward pass for a mixed batch ----------------------------------------------------------------------

def spy_batches(llm, stacked: list[bool] | None = None) -> list[set[int]]:
    """The adapter ids of each step the worker runs with adapters, from now on; and into stacked, whether each
    such step ran its adapters stacked."""
    mgr, seen = manager(llm), []
    original = mgr.batch

    def batch(spans, num_rows):
        seen.append({r.lora_int_id for _, _, r in spans})
        made, failed = original(spans, num_rows)
        if stacked is not None:
            stacked.append(made is not None and made.stacked is not None)
        return made, failed
    mgr.batch = batch
    return seen


def test_mixed_batch_gives_each_request_what_it_gets_alone(llm, adapters):
    # the same adapter twice, apart, so its rows are not contiguous; base-model requests among them
    order = ["attn", None, "mlp", "attn", "all-rslora", None, "q-v-down"]
    lora = [adapters[name][0] if name else None for name in order]
    prompts = [prompt(8 + 3 * i, seed=20 + i) for i in range(len(order))]
    alone = [run(llm, [p], a)[0] for p, a in zip(prompts, lora)]
    stacked = []
    seen = spy_batches(llm, stacked)
    try:
        together = run(llm, prompts, lora)
    finally:
        del manager(llm).batch
    assert max(len(ids) for ids in seen) == 4, "all four adapters should share steps"
    assert True in stacked and False in stacked, "the prompts should run by groups and the decode steps stacked"
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=0)
    for (name, p, out) in zip(order, prompts, together):
        if name:
            assert out.token_ids == reference(adapters[name][1], p, GREEDY.max_tokens)[0]
    assert_no_blocks_held(llm)


def test_a_step_without_adapters_builds_no_lora_batch(llm):
    """Base-model requests on an engine with LoRA on run the plain layers: no LoRABatch, nothing added."""
    seen = spy_batches(llm)
    try:
        run(llm, [prompt(10, seed=3), prompt(12, seed=4)], None)
    finally:
        del manager(llm).batch
    assert seen == []


def test_max_loras_bounds_the_adapters_of_a_step(base, adapters):
    llm = LLM(base[1], dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)
    names = ["attn", "mlp", "all-rslora", "q-v-down", "attn", "mlp"]
    prompts = [prompt(10, seed=40 + i) for i in range(len(names))]
    seen = spy_batches(llm)
    outs = run(llm, prompts, [adapters[n][0] for n in names])
    assert seen and max(len(ids) for ids in seen) == 2
    for name, p, out in zip(names, prompts, outs):
        assert out.token_ids == reference(adapters[name][1], p, GREEDY.max_tokens)[0]
    assert len(manager(llm).loaded_ids) <= 2
    assert_no_blocks_held(llm)


# ---- tensor and pipeline parallel: each rank runs its slice of every adapter ------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp,kv_heads", [(2, 1, 2), (2, 1, 1), (1, 2, 2)])
def test_parallel_layouts_match_peft(tmp_path, tp, pp, kv_heads):
    """tp 2 slices B of q/k/v and gate/up by output rows (kv heads split, or one kv head replicated) and A of o and
    down by input columns (their products join the all-reduce); pp 2 loads each stage's layers only."""
    hf = tiny_hf_model(seed=12, num_attention_heads=4, num_key_value_heads=kv_heads)
    path = save_hf_dir(hf, str(tmp_path / "base"))
    requests, references = [], []
    for i, name in enumerate(["all-rslora", "q-v-down"]):
        adapter_path = str(tmp_path / name)
        references.append(make_adapter(hf, adapter_path, seed=200 + i, **ADAPTERS[name]))
        requests.append(LoRARequest(name, i + 1, adapter_path))
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = [prompt(9, seed=60), prompt(12, seed=61), prompt(7, seed=62)]
        outs = run(llm, prompts, requests + [None])
    finally:
        llm.engine.shutdown()
    for model, p, out in zip(references + [hf], prompts, outs):
        assert out.token_ids == reference(model, p, GREEDY.max_tokens)[0]


# ---- the LRU of loaded adapters ------------------------------------------------------------------------------

def test_loaded_adapters_beyond_max_cpu_loras_are_evicted_least_recently_used(base, adapters):
    llm = LLM(base[1], dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_cpu_loras=2)
    mgr = manager(llm)
    ids = prompt(10, seed=7)
    tokens = {}
    for name, loaded_after in [("attn", [1]), ("mlp", [1, 2]), ("attn", [2, 1]), ("all-rslora", [1, 3]),
                               ("mlp", [3, 2])]:
        out, = run(llm, [ids], adapters[name][0])
        assert mgr.loaded_ids == loaded_after, name
        assert mgr.slot_ids == [adapters[name][0].lora_int_id]
        tokens.setdefault(name, out.token_ids)
        assert out.token_ids == tokens[name], f"{name} answers differently once reloaded"
    assert tokens["mlp"] == reference(adapters["mlp"][1], ids, GREEDY.max_tokens)[0]


# ---- the prefix cache never shares blocks between adapters ---------------------------------------------------

def test_prefix_cache_shares_blocks_within_an_adapter_only(llm, adapters):
    ids = prompt(40, seed=8)  # two full blocks of 16 can be reused
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(adapter):
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=adapter)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    attn, mlp = adapters["attn"][0], adapters["mlp"][0]
    first = cached(attn)
    assert first[0] == 0
    assert cached(mlp)[0] == 0, "another adapter must not reuse the first one's KV blocks"
    assert cached(None)[0] == 0, "the base model must not reuse an adapter's KV blocks"
    again = cached(attn)
    assert again == (32, first[1]), "the same adapter reuses its own blocks, with the same answer"
    assert cached(None)[0] == 32


def test_block_hashes_include_the_cache_salt():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))

    def seq(i, salt):
        return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                        params=SamplingParams(), cache_salt=salt)
    a = seq(0, b"lora:1")
    assert kv.allocate(a, len(tokens))
    assert kv.find_cached_prefix(seq(1, b"lora:2")) == []
    assert kv.find_cached_prefix(seq(2, b"")) == []
    assert kv.find_cached_prefix(seq(3, b"lora:1")) == a.block_table[:2]


# ---- bad adapters fail their request only ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken(base, tmp_path_factory):
    """A factory of adapter directories: a copy of a good one with its config edited or its tensors replaced."""
    hf, _ = base
    good = str(tmp_path_factory.mktemp("good"))
    make_adapter(hf, good, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    root = tmp_path_factory.mktemp("broken")

    def make(name, config=None, tensors=None):
        path = str(root / name)
        shutil.copytree(good, path)
        if config is not None:
            with open(os.path.join(path, "adapter_config.json")) as f:
                cfg = json.load(f)
            cfg.update(config)
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump(cfg, f)
        if tensors is not None:
            from safetensors.torch import load_file, save_file
            file = os.path.join(path, "adapter_model.safetensors")
            save_file(tensors(load_file(file)), file)
        return path
    return make


def _with(extra):
    return lambda tensors: {**tensors, **extra}


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

BAD_ADAPTERS = {
    # name: (config edits, tensor edits, what the error must name)
    "rank-above-max": ({"r": 32}, None, "'r'"),
    "dora": ({"use_dora": True}, None, "use_dora"),
    "modules-to-save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias": ({"bias": "lora_only"}, None, "'bias'"),
    "lora-bias": ({"lora_bias": True}, None, "lora_bias"),
    "rank-pattern": ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
    "other-target": ({"target_modules": ["q_proj", "lm_head"]}, None, "target_modules"),
    "other-target-path": ({"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.act_fn"]}, None,
                          "target_modules' names ['model.layers.0.mlp.act_fn']"),
    # what PEFT writes for a Qwen3-MoE's fused experts: parameters, and a rank for gate_up_proj
    "experts-parameters": ({"target_parameters": ["down_proj", "gate_up_proj"], "rank_pattern": {".*gate_up_proj": 8}},
                           None, "'target_parameters' .* mixture-of-experts layer's experts is not supported"),
    "not-lora": ({"peft_type": "IA3"}, None, "peft_type"),
    "dora-tensor": (None, _with({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                                 torch.ones(64)}), "lora_magnitude_vector"),
    "lora-bias-tensor": (None, _with({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias":
                                      torch.zeros(64)}), "lora_B.bias"),
    "saved-module": (None, _with({"base_model.model.lm_head.modules_to_save.default.weight": torch.zeros(320, 64)}),
                     "lm_head.modules_to_save"),
    "shared-expert": (None, _with({"base_model.model.model.layers.0.mlp.shared_expert.down_proj.lora_A.weight":
                                   torch.zeros(4, 64)}),
                      "shared_expert.down_proj.lora_A.weight' is a LoRA weight of a mixture-of-experts layer's shared "
                      "expert: .* not supported"),
    "embedding": (None, _with({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 320)}),
                  "lora_embedding_A"),
    "wrong-shape": (None, _with({Q_A: torch.zeros(4, 32)}), Q_A),
    "rank-mismatch": (None, _with({Q_B: torch.zeros(64, 2)}), Q_B),
    "layer-beyond-model": (None, _with({Q_A.replace("layers.0", "layers.5"): torch.zeros(4, 64),
                                        Q_B.replace("layers.0", "layers.5"): torch.zeros(64, 4)}), "layers.5"),
    "a-without-b": (None, lambda t: {k: v for k, v in t.items() if k != Q_B}, Q_A),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_fails_its_request_naming_the_field_or_tensor(llm, broken, case):
    config, tensors, named = BAD_ADAPTERS[case]
    path = broken(case, config, tensors)
    with pytest.raises(RequestError, match=".*".join([path, named]).replace("[", r"\[")) as info:
        run(llm, [prompt(6, seed=1)], LoRARequest(case, 900 + sorted(BAD_ADAPTERS).index(case), path))
    assert info.value.param == "lora_request"
    assert_no_blocks_held(llm)
    assert len(run(llm, [prompt(6, seed=1)], None)[0].token_ids) == GREEDY.max_tokens  # the engine goes on


def test_missing_adapter_files_fail_their_request(llm, broken, tmp_path):
    cases = {str(tmp_path / "nowhere"): "no such directory"}
    no_weights = broken("no-weights")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    cases[no_weights] = "adapter_model.safetensors or adapter_model.bin"
    no_config = broken("no-config")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    cases[no_config] = "adapter_config.json is missing"
    for i, (path, named) in enumerate(cases.items()):
        with pytest.raises(RequestError, match=named):
            run(llm, [prompt(6, seed=1)], LoRARequest(f"missing{i}", 950 + i, path))
    assert_no_blocks_held(llm)


def test_a_bad_adapter_in_a_batch_fails_the_whole_call_and_leaves_nothing(llm, adapters, broken):
    path = broken("in-batch", {"use_dora": True})
    with pytest.raises(RequestError, match="use_dora"):
        run(llm, [prompt(6, seed=1), prompt(7, seed=2)], [adapters["attn"][0], LoRARequest("x", 990, path)])
    assert_no_blocks_held(llm)


def test_one_id_or_name_for_one_adapter(llm, adapters):
    attn = adapters["attn"][0]
    run(llm, [prompt(6, seed=1)], attn)  # registered, whichever tests ran before
    with pytest.raises(RequestError, match="lora_int_id 1 already names adapter 'attn'"):
        run(llm, [prompt(6, seed=1)], LoRARequest("other", 1, adapters["mlp"][0].lora_path))
    with pytest.raises(RequestError, match="lora_name 'attn' already names"):
        run(llm, [prompt(6, seed=1)], LoRARequest("attn", 77, attn.lora_path))


def test_lora_request_needs_enable_lora(base, adapters):
    llm = LLM(base[1], dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(RequestError, match="enable_lora"):
        run(llm, [prompt(6, seed=1)], adapters["attn"][0])
    assert_no_blocks_held(llm)


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


# ---- settings -------------------------------------------------------------------------------------------------

def test_lora_settings_are_checked_and_are_flags():
    import argparse

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig.from_kwargs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig.from_kwargs(enable_lora=True, data_parallel_size=2)
    assert EngineConfig.from_kwargs(enable_lora=True, max_loras=3).lora.max_cpu_loras == 3
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    lora = engine_config_from_args(parser.parse_args(
        ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "5"])).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 2, 64, 5)


def test_lora_batch_narrow():
    batch = LoRABatch.from_spans([(0, 4, 0), (6, 9, 1), (10, 12, 0)], torch.device("cpu"))
    assert batch.groups[1] == (1, slice(6, 9))
    assert batch.groups[0][1].tolist() == [0, 1, 2, 3, 10, 11]
    part = batch.narrow(3, 5)  # rows 3..7
    assert part.groups[0][0] == 0 and part.groups[0][1].tolist() == [0]
    assert part.groups[1] == (1, slice(3, 5))
    assert batch.narrow(4, 2) is None
    # long ranges apart: a slice each; adjacent ones merge
    batch = LoRABatch.from_spans([(0, 20, 0), (20, 40, 1), (40, 60, 0), (60, 70, 0)], torch.device("cpu"))
    assert batch.groups == [(0, slice(0, 20)), (0, slice(40, 70)), (1, slice(20, 40))]


@pytest.mark.parametrize("first_span_rows", [1, 5, 40])
@pytest.mark.parametrize("path, dtype", [("bmm", torch.float32), ("kernel", torch.float32),
                                         ("kernel", torch.bfloat16)])
def test_stacked_adapters_add_what_the_groups_add(first_span_rows, path, dtype, request):
    """The batched products over stacked slots equal the products by adapter groups: slots of different ranks and
    slices, an empty slot, rows of the base model, a slot's rows apart; and so do the two halves of a narrowed
    batch (a layer that runs its rows in parts). Through PyTorch's batched matmuls (float32) and through the CPU
    kernel (the run dtype; in bfloat16 the kernel rounds once where the groups round each product)."""
    ops = request.getfixturevalue("ops") if path == "kernel" else None
    torch.manual_seed(0)
    in_features, widths = 12, [6, 4, 4]  # a fused q/k/v-like output
    offsets = [0, 6, 10]

    def adapter(rank, shards):
        expands, first = [], 0
        for shard in shards:
            expands.append(Expand(offsets[shard], first, first + rank, torch.randn(rank, widths[shard])))
            first += rank
        return LayerAdapter(torch.randn(in_features, first), expands)
    slots = [adapter(2, [0, 1, 2]), None, adapter(3, [1]), adapter(1, [0, 2])]
    stack = (0, 2, 3)
    stacked = StackedAdapters.of(slots, stack, in_features, sum(widths), dtype, torch.device("cpu"), ops)
    spans = [(0, first_span_rows, 2), (first_span_rows + 1, first_span_rows + 2, 0),
             (first_span_rows + 2, first_span_rows + 3, 3), (first_span_rows + 4, first_span_rows + 5, 0)]
    num_rows = first_span_rows + 6  # rows between and after the spans are the base model's
    x = torch.randn(num_rows, in_features).to(dtype)
    base = torch.randn(num_rows, sum(widths)).to(dtype)
    grouped, together = base.clone(), base.clone()
    add_lora(grouped, x, LoRABatch.from_spans(spans, torch.device("cpu")), slots)
    add_lora(together, x, LoRABatch.from_spans(spans, torch.device("cpu"), stack), slots, stacked)
    close = dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(together, grouped, **close)
    assert torch.equal(grouped[first_span_rows], base[first_span_rows]) and not torch.equal(grouped, base)
    batch, parts = LoRABatch.from_spans(spans, torch.device("cpu"), stack), base.clone()
    for start, end in ((0, first_span_rows + 2), (first_span_rows + 2, num_rows)):
        part = batch.narrow(start, end - start)
        assert part.stacked is not None
        add_lora(parts[start:end], x[start:end], part, slots, stacked)
    torch.testing.assert_close(parts, grouped, **close)


# ---- adding and removing adapters without a request (the server's load and unload) ------------------------------

def test_add_lora_checks_eagerly_and_remove_lora_frees_the_name_not_the_id(llm, adapters, broken):
    engine = llm.engine
    with pytest.raises(RequestError, match="use_dora"):
        engine.add_lora(LoRARequest("eager", 700, broken("eager", {"use_dora": True})))
    assert 700 not in engine.list_loras()
    engine.add_lora(LoRARequest("early", 701, adapters["mlp"][0].lora_path))
    assert 701 in engine.list_loras()
    assert engine.remove_lora(701) and not engine.remove_lora(701)
    with pytest.raises(RequestError, match="'early' \\(id 701\\) was removed"):
        run(llm, [prompt(6, seed=1)], LoRARequest("early", 701, adapters["mlp"][0].lora_path))
    # the name names another adapter now, under a new id, with that adapter's answer
    ids = prompt(8, seed=2)
    out, = run(llm, [ids], LoRARequest("early", 702, adapters["attn"][0].lora_path))
    assert out.token_ids == reference(adapters["attn"][1], ids, GREEDY.max_tokens)[0]
    assert_no_blocks_held(llm)


def test_add_lora_needs_enable_lora(base, adapters):
    llm = LLM(base[1], dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(RequestError, match="without enable_lora"):
        llm.engine.add_lora(adapters["attn"][0])
    assert not llm.engine.remove_lora(1)


# ---- qwenserve convert --lora: the adapter merged into the weights ---------------------------------------------

def test_convert_with_lora_merges_as_peft_does(llm, base, adapters, tmp_path):
    """The merged checkpoint's weights are PEFT's merge_and_unload ones (fp32), and its greedy tokens, in qwenserve
    and in transformers, are the base model's with the adapter, served."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qwenserve.entrypoints.cli.main import main
    request, peft_model = adapters["all-rslora"]
    out = str(tmp_path / "merged")
    assert main(["convert", "--model", base[1], "--lora", request.lora_path, "--output", out,
                 "--dtype", "float32"]) == 0
    merged_by_peft = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    ours = load_file(os.path.join(out, "model.safetensors"))
    adapted = 0
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, merged_by_peft[name], atol=1e-6, rtol=0)
        adapted += not torch.equal(tensor, base[0].state_dict()[name])
    assert adapted == 2 * 7, "every projection of both layers should change"
    ids = prompt(11, seed=31)
    served = run(llm, [ids], request)[0].token_ids
    assert served == reference(peft_model, ids, GREEDY.max_tokens)[0]
    merged = LLM(out, dtype="float32", kv_cache_memory="4MiB")
    assert run(merged, [ids], None)[0].token_ids == served
    assert reference(AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32), ids,
                     GREEDY.max_tokens)[0] == served


def test_convert_refuses_an_adapter_it_cannot_merge(base, broken, tmp_path, capsys):
    from qwenserve.entrypoints.cli.main import main
    path = broken("merge-dora", {"use_dora": True})
    out = tmp_path / "merged"
    assert main(["convert", "--model", base[1], "--lora", path, "--output", str(out)]) == 2
    assert f"LoRA adapter {path!r}" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "merged.partial").exists()


def test_convert_refuses_to_merge_into_quantized_weights(tmp_path, capsys):
    """An AWQ checkpoint holds its projections as qweight: merging would drop the adapter, so it is an error."""
    from test_awq_gptq import write_quantized

    from qwenserve.entrypoints.cli.main import main
    quantized, _ = write_quantized(tmp_path, "awq")
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    adapter = str(tmp_path / "adapter")
    make_adapter(tiny_hf_model(seed=70, **shape), adapter, seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    assert main(["convert", "--model", quantized, "--lora", adapter, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no dense model.layers.0.self_attn.q_proj.weight" in err and "awq-quantized" in err


# ---- an adapter the worker cannot load fails its own requests, not the step ----------------------------------------


def worker_load_fails_for(engine, base, tmp_path, name: str, lora_int_id: int):
    """An adapter the engine has accepted whose files then change (a tensor of the wrong shape) before a worker
    reads them; returns (its LoRARequest, its PEFT model, a function that puts the good files back)."""
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / name)
    peft_model = make_adapter(base[0], path, seed=lora_int_id, **ADAPTERS["mlp"])
    request = LoRARequest(name, lora_int_id, path)
    engine.add_lora(request)
    file = os.path.join(path, "adapter_model.safetensors")
    with open(file, "rb") as f:
        good = f.read()
    name_a = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    save_file(load_file(file) | {name_a: torch.zeros(8, 32)}, file)

    def restore():
        with open(file, "wb") as f:
            f.write(good)
    return request, peft_model, restore


def test_an_adapter_the_worker_cannot_load_fails_its_requests_only(llm, adapters, base, tmp_path):
    engine = llm.engine
    late, peft_model, restore = worker_load_fails_for(engine, base, tmp_path, "late", 800)
    prompts = {"base": prompt(9, seed=70), "attn": prompt(11, seed=71), "late": prompt(40, seed=72)}
    lora = {"base": None, "attn": adapters["attn"][0], "late": late}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, GREEDY, lora_request=lora[rid])
    outputs, failures = step_until_idle(engine)
    assert set(failures) == {"late"} and set(outputs) == {"base", "attn"}
    assert isinstance(failures["late"], RequestError) and failures["late"].param == "lora_request"
    assert re.search(r"LoRA adapter 'late' could not be loaded: .*up_proj.lora_A.weight.* has shape \(8, 32\)",
                     str(failures["late"]))
    for rid in ("base", "attn"):
        assert outputs[rid].outputs[0].token_ids == run(llm, [prompts[rid]], lora[rid])[0].token_ids
    assert_no_blocks_held(llm)
    assert late.lora_int_id not in manager(llm).loaded_ids
    # the files fixed, the adapter loads; the failed step's blocks were never written, so none is reused
    restore()
    out = llm.generate([{"prompt_token_ids": prompts["late"]}], GREEDY, use_tqdm=False, lora_request=late)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference(peft_model, prompts["late"], GREEDY.max_tokens)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_ranks_agree_on_an_adapter_that_fails_to_load(tmp_path, tp, pp):
    """Every rank (tensor-parallel ranks, pipeline stages with two steps in flight) fails the adapter alike (they
    agree through one all-reduce), and the engine serves on: the worker processes live, and the other requests'
    tokens are PEFT's and HF's."""
    hf = tiny_hf_model(seed=13, num_attention_heads=4, num_key_value_heads=2)
    path = save_hf_dir(hf, str(tmp_path / "base"))
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        good_path = str(tmp_path / "good")
        good_model = make_adapter(hf, good_path, seed=7, **ADAPTERS["all-rslora"])
        good = LoRARequest("good", 1, good_path)
        late, _, restore = worker_load_fails_for(llm.engine, (hf, path), tmp_path, "late", 2)
        prompts = {"good": prompt(9, seed=80), "late": prompt(12, seed=81), "base": prompt(7, seed=82)}
        lora = {"good": good, "late": late, "base": None}
        for rid, ids in prompts.items():
            llm.engine.add_request(rid, {"prompt_token_ids": ids}, GREEDY, lora_request=lora[rid])
        outputs, failures = step_until_idle(llm.engine)
        assert set(failures) == {"late"} and "could not be loaded" in str(failures["late"])
        assert outputs["good"].outputs[0].token_ids == reference(good_model, prompts["good"], GREEDY.max_tokens)[0]
        assert outputs["base"].outputs[0].token_ids == reference(hf, prompts["base"], GREEDY.max_tokens)[0]
        restore()
        assert len(run(llm, [prompts["late"]], late)[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_bundled_model_with_a_random_adapter_matches_peft(tmp_path):
    """The real model (the bundled GGUF, dequantized, float32) with a PEFT adapter on all seven projections:
    qwenserve's greedy tokens are PEFT's, its logits within 1e-4, far from the base model's. Its scale
    (lora_alpha / r = 0.25 on PEFT's random B) keeps the adapter's products small beside the base layers', as a
    fine-tuned adapter's are: at 2, adapters on gate or up alone moved the logits from PEFT's by up to 1e-3 (gate
    alone: with the CPU kernels off too), where each of the other five projections stayed within 1e-4."""
    from qwenserve.model.loader.bundled import bundled_model_path
    from qwenserve.tools.compare import load_hf_model
    path = bundled_model_path()
    peft_model = make_adapter(load_hf_model(path), str(tmp_path / "adapter"), seed=5, r=8, lora_alpha=2,
                              target_modules=ATTENTION + MLP)
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory="64MiB", record_logits=True,
              enable_lora=True, max_lora_rank=8)
    ids = llm.engine.tokenizer.encode("def quick_sort(items):\n")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with torch.no_grad():
        expected_tokens, expected_logits = reference(peft_model, ids, params.max_tokens)
    out, = run(llm, [ids], LoRARequest("random", 1, str(tmp_path / "adapter")), params)
    assert out.token_ids == expected_tokens
    torch.testing.assert_close(torch.stack(out.logits), expected_logits, atol=1e-4, rtol=0)
    base, = run(llm, [ids], None, params)
    assert (torch.stack(base.logits) - expected_logits).abs().max() > 0.1  # the adapter moves the logits
