"""A second architecture through the model registry: a toy model, registered here in one call, runs in the
engine (in its process and in worker processes) exactly as its own forward pass says; a checkpoint of an
architecture nobody registered fails naming the supported ones."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.model.interface import CausalLM, KVCacheSpec
from qwenserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qwenserve.model.layers.layernorm import RMSNorm
from qwenserve.model.layers.quantization import QuantizationScheme
from qwenserve.model.loader.checkpoint import config_from_gguf
from qwenserve.model.loader.model_loader import LoadedModel
from qwenserve.model.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.registry import MODEL_REGISTRY, ModelRegistry
from qwenserve.worker.model_runner import full_logits

from helpers import save_hf_dir, tiny_hf_model

TOY = "ToyAttentionOnlyForCausalLM"


class AttentionOnlyLayer(nn.Module):
    def __init__(self, config, layer_idx, max_position, tp, linear_method):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, layer_idx, max_position, tp, linear_method)

    def forward(self, positions, hidden, attn_metadata):
        return hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)


class ToyAttentionOnlyForCausalLM(nn.Module):
    """Qwen2's pieces without the MLPs: another model, whose checkpoint Qwen2ForCausalLM cannot load. Its
    parameters drop the checkpoint's "model." prefix (checkpoint_target maps the names); one pipeline stage."""
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, config, max_position, tp=TensorParallel(), quantization=QuantizationScheme(),
                 pp=PipelineParallel()):
        super().__init__()
        if pp.size > 1:
            raise ValueError("the toy model runs as a single pipeline stage")
        self.config, self.pp, self.hidden_size, self.dtype = config, pp, config.hidden_size, torch.get_default_dtype()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(AttentionOnlyLayer(config, i, max_position, tp, quantization.layers)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, quantization.lm_head)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    def kv_cache_spec(self):
        attn = self.layers[0].self_attn
        return KVCacheSpec(len(self.layers), attn.num_kv_heads, attn.head_dim, self.dtype)

    def forward(self, input_ids, positions, attn_metadata, intermediate=None):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden):
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name):
        return name.removeprefix("model.")

    def process_weights_after_loading(self, after_each=lambda: None):
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
                after_each()


# at import, so that a worker process, which imports this module to unpickle the class, registers it too
MODEL_REGISTRY.register(TOY, ToyAttentionOnlyForCausalLM)


def write_checkpoint(path: str, architectures: list[str], drop_mlp: bool) -> str:
    save_hf_dir(tiny_hf_model(seed=71, num_attention_heads=4, num_key_value_heads=2), path)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    if drop_mlp:
        tensors = {k: v for k, v in tensors.items() if ".mlp." not in k and "post_attention_layernorm" not in k}
    save_file(tensors, weights, metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    config.update(architectures=architectures, model_type="toy_attention_only")
    json.dump(config, open(config_path, "w"))
    return path


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("toy")), [TOY], drop_mlp=True)


@pytest.fixture(scope="module")
def toy_reference(toy_dir):
    """(prompt, greedy continuation) from the toy's own forward pass: one full prefill per token."""
    loaded = LoadedModel(toy_dir, dtype="float32")
    assert type(loaded.model) is ToyAttentionOnlyForCausalLM
    prompt, ids = [5, 77, 13, 200, 42, 9], []
    for _ in range(12):
        ids.append(int(full_logits(loaded.model, prompt + ids)[-1].argmax()))
    return prompt, ids


def greedy(llm, prompt, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_toy_and_qwen2_implement_the_interface():
    assert isinstance(ToyAttentionOnlyForCausalLM.packed_modules_mapping, dict)
    config = config_from_gguf({"general.architecture": "qwen2", "qwen2.block_count": 2, "qwen2.context_length": 64,
                               "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 128,
                               "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
                               "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a"] * 100})
    assert config.architectures == ("Qwen2ForCausalLM",)
    for cls in (Qwen2ForCausalLM, ToyAttentionOnlyForCausalLM):
        model = cls(config, 64)
        assert isinstance(model, CausalLM)
        assert model.kv_cache_spec() == KVCacheSpec(2, 2, 16, torch.get_default_dtype())


def test_engine_runs_the_registered_toy_as_its_own_forward(toy_dir, toy_reference):
    prompt, expected = toy_reference
    llm = LLM(toy_dir, dtype="float32", kv_cache_memory="8MiB")
    assert llm.engine.resolved_model.architecture == TOY
    assert type(llm.engine.executor.worker.model) is ToyAttentionOnlyForCausalLM
    assert greedy(llm, prompt, len(expected)) == expected


@pytest.mark.multiproc
def test_worker_processes_run_the_toy_registered_here(toy_dir, toy_reference):
    """The class travels to spawned workers inside the resolved config; tensor parallel splits its heads."""
    prompt, expected = toy_reference
    llm = LLM(toy_dir, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    try:
        assert greedy(llm, prompt, len(expected)) == expected
    finally:
        llm.engine.shutdown()


def test_qwen2_cannot_load_the_toy_checkpoint(tmp_path):
    """The registry, not the loader, picks the class: the same weights named Qwen2 fail to load."""
    path = write_checkpoint(str(tmp_path / "toy_as_qwen2"), ["Qwen2ForCausalLM"], drop_mlp=True)
    with pytest.raises(ValueError, match="does not match the Qwen2ForCausalLM model .missing tensors: .*mlp"):
        LoadedModel(path, dtype="float32")


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = write_checkpoint(str(tmp_path / "unknown"), ["NoSuchModelForCausalLM"], drop_mlp=False)
    with pytest.raises(ConfigError) as err:
        LLM(path, dtype="float32")
    message = str(err.value)
    assert "architectures is ['NoSuchModelForCausalLM'], which qwenserve does not run" in message
    assert ("supported architectures: Qwen2ForCausalLM (GGUF qwen2), Qwen2MoeForCausalLM (GGUF qwen2moe), "
            "Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM (GGUF qwen3), "
            "Qwen3MoeForCausalLM (GGUF qwen3moe), " + TOY) in message


def test_first_registered_of_several_architectures_runs(tmp_path):
    path = write_checkpoint(str(tmp_path / "two"), ["NoSuchModelForCausalLM", TOY], drop_mlp=True)
    assert type(LoadedModel(path, dtype="float32").model) is ToyAttentionOnlyForCausalLM


def test_unknown_gguf_architecture_lists_the_supported_ones():
    with pytest.raises(ConfigError, match="general.architecture is 'llama', which qwenserve does not run; "
                                          "supported: qwen2, qwen2moe, qwen3, qwen3moe$"):
        config_from_gguf({"general.architecture": "llama", "llama.block_count": 2})


def test_registering_checks_the_interface_and_names():
    registry = ModelRegistry()

    class NoLogits(nn.Module):
        packed_modules_mapping = {}

        def forward(self, input_ids, positions, attn_metadata, intermediate=None):
            return input_ids

    with pytest.raises(TypeError, match="NoLogits cannot be registered as 'NoLogits': it lacks kv_cache_spec, "
                                        "compute_logits, checkpoint_target, process_weights_after_loading, "
                                        "device"):
        registry.register("NoLogits", NoLogits)
    registry.register("Toy", ToyAttentionOnlyForCausalLM, gguf_architecture="toy")
    registry.register("Toy", ToyAttentionOnlyForCausalLM, gguf_architecture="toy")  # the same again: no change
    with pytest.raises(ValueError, match="'Toy' is already registered"):
        registry.register("Toy", Qwen2ForCausalLM)
    assert registry.model_class("Toy") is ToyAttentionOnlyForCausalLM
    assert registry.architecture_for_gguf("toy") == "Toy"
