"""Qwen3 (dense) against HF transformers' own Qwen3ForCausalLM in float32: tiny random checkpoints made with
transformers' Qwen3Config, tied and untied, with a head_dim other than hidden / heads (as the published 0.6B has);
greedy tokens batched and one by one, with our CPU kernels and without; the same weights as a qwen3 GGUF; and the
fused decode call, which runs the q/k norms and gives the layer modules' results to the bit."""
import dataclasses

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.model.layers.decode_layers import FusedDecodeLayers, runs_every_part

from helpers import PROMPTS, assert_hf_greedy, draft_keeps_greedy, greedy_tokens, save_gguf, save_hf_dir, tiny_qwen3

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3(request, tmp_path_factory):
    hf = tiny_qwen3(seed=11, tie_word_embeddings=request.param)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("qwen3")))


def test_config_reads_head_dim_and_bias(qwen3):
    hf, _ = qwen3
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert (config.head_dim, config.attention_bias, config.architectures) == (32, False, ("Qwen3ForCausalLM",))
    assert config.hidden_size // config.num_attention_heads == 16
    with pytest.raises(ConfigError, match="head_dim must be a positive even integer"):
        dataclasses.replace(config, head_dim=31)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_greedy_equals_hf_batched_and_alone(qwen3, cpu_kernels):
    hf, path = qwen3
    llm = LLM(path, dtype="float32", cpu_kernels=cpu_kernels, kv_cache_memory="32MiB")
    batched = greedy_tokens(llm, params=GREEDY)
    assert_hf_greedy(hf, PROMPTS, batched)
    assert [greedy_tokens(llm, [p], GREEDY)[0] for p in PROMPTS] == batched
    hf_logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    expected = torch.log_softmax(hf_logits.double(), -1)
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob.logprob - float(expected[token].detach())) < 1e-4


def test_attention_bias_when_config_asks(tmp_path):
    hf = tiny_qwen3(seed=12, attention_bias=True)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    llm = LLM(save_hf_dir(hf, str(tmp_path / "biased")), dtype="float32", kv_cache_memory="32MiB")
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm, params=GREEDY))


@pytest.fixture(scope="module")
def qwen3_gguf(qwen3, tmp_path_factory):
    hf, _ = qwen3
    return save_gguf(hf, str(tmp_path_factory.mktemp("qwen3gguf") / "tiny-qwen3.gguf"), "F32")


def test_gguf_gives_the_hf_tokens(qwen3, qwen3_gguf):
    hf, _ = qwen3
    llm = LLM(qwen3_gguf, dtype="float32", kv_cache_memory="32MiB")
    config = llm.engine.resolved_model.config
    assert (config.head_dim, config.attention_bias, config.architectures[0]) == (32, False, "Qwen3ForCausalLM")
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert_hf_greedy(hf, PROMPTS, greedy_tokens(llm, params=GREEDY))


def test_block_quantized_decode_in_one_call_equals_the_modules(ops, qwen3, tmp_path, monkeypatch):
    """The fused decode call runs Qwen3's q/k norms (declared in its layer's decode_parts): its decode steps take the
    one call, with enforce_eager's tokens and log-probabilities to the bit."""
    hf, _ = qwen3
    path = save_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    fused = []
    original = FusedDecodeLayers.call_for

    def counting(self, attn_metadata, rows):
        call = original(self, attn_metadata, rows)
        fused.append(call is not None)
        return call
    monkeypatch.setattr(FusedDecodeLayers, "call_for", counting)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    answers = []
    for eager in (False, True):
        llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        answers.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                   for step in o.outputs[0].logprobs]) for o in outs])
        if not eager:
            layer = llm.engine.executor.worker.model.model.own_layers[0]
            assert runs_every_part(layer) and "self_attn.q_norm" in layer.decode_parts
            assert any(fused), "Qwen3's decode steps did not take the one call"
            fused.clear()
    assert not any(fused)
    assert answers[0] == answers[1]


def test_lora_adapter_equals_peft(qwen3, tmp_path):
    """A PEFT adapter on every projection (q/k/v of head width 32, o_proj from 128 inputs) gives PEFT's tokens and
    logits."""
    import copy

    import peft

    from qwenserve import LoRARequest
    hf, path = qwen3
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    adapter = peft.get_peft_model(copy.deepcopy(hf), config).eval()
    adapter.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_lora_rank=4,
              record_logits=True)
    ids = PROMPTS[2]
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))[0].outputs[0]
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            step = adapter(input_ids=torch.tensor([ids + tokens])).logits[0, -1]
            logits.append(step)
            tokens.append(int(step.argmax()))
    assert list(out.token_ids) == tokens
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(logits), atol=1e-4, rtol=0)


def test_speculative_decoding_with_itself_as_draft_accepts_every_token(qwen3):
    """A Qwen3 draft for a Qwen3 target (here the target itself): greedy output unchanged, every proposal accepted,
    which holds only if the draft's KV cache of q/k-normed, head_dim-wide heads is right."""
    _, path = qwen3
    stats = draft_keeps_greedy(path, path, max_tokens=24)
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
