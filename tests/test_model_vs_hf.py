"""Our Qwen2 against HF transformers' Qwen2 on tiny random checkpoints: logits and greedy tokens."""
import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.tools.compare import hf_greedy
from qwenserve.worker.model_runner import full_logits

from helpers import save_hf_dir, tiny_hf_model

SHAPES = {
    "untied-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "tied-mqa": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "8-heads-3-layers": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-dynamic": dict(max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "rope-yarn": dict(max_position_embeddings=128,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "theta-1e6": dict(rope_theta=1_000_000.0),
}


QUICK_SHAPE = "untied-gqa"  # the quick loop's one shape; the others run with the slow tests


@pytest.fixture(scope="module", params=[pytest.param(name, marks=() if name == QUICK_SHAPE else pytest.mark.slow)
                                        for name in sorted(SHAPES)])
def pair(request, tmp_path_factory):
    """(HF model, our loaded model) on the same random weights, both float32."""
    hf = tiny_hf_model(seed=len(request.param), **SHAPES[request.param])
    path = save_hf_dir(hf, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf, LLM(path, dtype="float32", kv_cache_memory="4MiB", record_logits=True)


def _prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_hf_over_whole_sequence(pair):
    name, hf, ours = pair
    # the dynamic case runs past max_position_embeddings (48), where its frequencies change
    ids = _prompt(70 if name == "rope-dynamic" else 40, hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = full_logits(ours.engine.executor.worker.model, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_greedy_generation_matches_hf(pair):
    name, hf, ours = pair
    ids = _prompt(12, hf.config.vocab_size, seed=2)
    n = 50 if name == "rope-dynamic" else 24  # decoding crosses position 48 in the dynamic case
    expected = hf_greedy(hf, ids, n)[0]
    out = ours.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


def test_cached_decoding_equals_full_recompute(pair):
    """Logits of each decode step (paged KV cache) equal the logits of one forward over the whole sequence."""
    _, hf, ours = pair
    ids = _prompt(9, hf.config.vocab_size, seed=3)
    out = ours.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    full = full_logits(ours.engine.executor.worker.model, ids + out.token_ids[:-1])
    torch.testing.assert_close(torch.stack(out.logits), full[len(ids) - 1:], atol=1e-5, rtol=1e-5)


def test_bfloat16_agrees_with_float32(tmp_path):
    """bf16 is for speed: its logits stay close to fp32's and its top choice mostly agrees."""
    hf = tiny_hf_model(seed=7)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    ids = _prompt(64, hf.config.vocab_size, seed=4)
    f32 = full_logits(LoadedModel(path, dtype="float32").model, ids)
    b16 = full_logits(LoadedModel(path, dtype="bfloat16").model, ids)
    assert (f32.argmax(-1) == b16.argmax(-1)).float().mean() >= 0.9
    assert (f32 - b16).abs().max() < 0.1 * f32.abs().max()


def test_sharded_safetensors_with_index_load_identically(tmp_path):
    hf = tiny_hf_model(seed=3)
    single = save_hf_dir(hf, str(tmp_path / "single"))
    sharded = save_hf_dir(hf, str(tmp_path / "sharded"), max_shard_size="60KB")
    import os
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a = dict(LoadedModel(single, dtype="float32").model.state_dict())
    b = dict(LoadedModel(sharded, dtype="float32").model.state_dict())
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
