"""Config rules from DESIGN part 1 and loader errors that explain themselves."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.config.model_config import ConfigError, ModelConfig, resolve_dtype
from qwenserve.distributed.layout import check_head_split, shard_kv_heads
from qwenserve.distributed.tensor_parallel import TensorParallel
from qwenserve.model.loader.model_loader import LoadedModel, WeightLoadError

from helpers import save_hf_dir, tiny_hf_model, tiny_qwen3

BASE = dict(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)


def test_defaults_rope_theta_1e6_and_kv_heads_equal_heads():
    cfg = ModelConfig.from_hf_dict(BASE)
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.num_key_value_heads == 4
    assert cfg.head_dim == 16
    assert cfg.rope_scaling is None


def test_rope_theta_from_either_transformers_format():
    assert ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5}).rope_theta == 5e5
    v5 = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 2e5}}
    assert ModelConfig.from_hf_dict(v5).rope_theta == 2e5


def test_max_model_len_default_and_scaling():
    assert ModelConfig.from_hf_dict(BASE).resolve_max_model_len(None) == 512
    linear = ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.resolve_max_model_len(None) == 1024
    yarn = ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 256}})
    assert yarn.resolve_max_model_len(None) == 1024


def test_max_model_len_too_large_names_both_numbers():
    with pytest.raises(ConfigError, match=r"max_model_len 4096 .*\(512, from max_position_embeddings=512"):
        ModelConfig.from_hf_dict(BASE).resolve_max_model_len(4096)


def test_gelu_is_rejected_naming_hidden_act():
    with pytest.raises(ConfigError, match="hidden_act is 'gelu'"):
        ModelConfig.from_hf_dict({**BASE, "hidden_act": "gelu"})


@pytest.mark.parametrize("field,value,pattern", [
    ("num_attention_heads", 5, "hidden_size .64. is not divisible by num_attention_heads .5."),
    ("num_key_value_heads", 3, "num_attention_heads .4. is not a multiple of num_key_value_heads .3."),
    ("rope_scaling", {"type": "longrope", "factor": 2.0}, "rope_scaling has type 'longrope'"),
    ("model_type", "llama", "model_type is 'llama'"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("hidden_size", 0, "hidden_size must be a positive integer"),
])
def test_bad_config_fields_are_named(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_hf_dict({**BASE, field: value})


def test_missing_required_field():
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="lacks required field.*hidden_size"):
        ModelConfig.from_hf_dict(cfg)


def test_dtype_names():
    cfg = ModelConfig.from_hf_dict({**BASE, "torch_dtype": "float32"})
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("bf16", cfg) == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8", cfg)


def test_tensor_parallel_head_split_rules():
    check_head_split(14, 2, 2)  # the bundled model at tp=2
    check_head_split(8, 2, 4)   # kv heads replicated, 2 ranks each
    with pytest.raises(ValueError, match="does not divide num_attention_heads 14"):
        check_head_split(14, 2, 4)
    with pytest.raises(ValueError, match="does not divide num_key_value_heads 6"):
        check_head_split(12, 6, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 is not a multiple of num_key_value_heads 2"):
        check_head_split(12, 2, 3)


def test_kv_head_ownership():
    assert [shard_kv_heads(2, TensorParallel(r, 4)) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [shard_kv_heads(4, TensorParallel(r, 2)) for r in range(2)] == [(2, 0), (2, 2)]


@pytest.fixture
def tiny_dir(tmp_path):
    return save_hf_dir(tiny_hf_model(seed=5), str(tmp_path / "tiny"))


def test_renamed_tensor_is_named_as_missing_and_unexpected(tiny_dir):
    path = os.path.join(tiny_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.query.weight"] = tensors.pop("model.layers.1.self_attn.q_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError) as err:
        LoadedModel(tiny_dir, dtype="float32")
    msg = str(err.value)
    assert "missing tensors: model.layers.1.self_attn.q_proj.weight" in msg
    assert "unexpected tensors: model.layers.1.self_attn.query.weight" in msg
    assert "expected HF names (model.layers.N.self_attn.q_proj.weight" in msg


def test_wrong_shape_is_reported(tiny_dir):
    path = os.path.join(tiny_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"shape \(65,\).*expects \(64,\)"):
        LoadedModel(tiny_dir, dtype="float32")


@pytest.mark.parametrize("field, value, pattern", [
    # narrower than the checkpoint: each rank's narrowing of the tensor used to cut it to fit, without a word
    ("intermediate_size", 96, r"model\.layers\.0\.mlp\.down_proj\.weight: RowParallelLinear: checkpoint tensor has "
                              r"shape \(64, 128\), the model expects \(64, 96\)"),
    ("num_key_value_heads", 1, r"model\.layers\.0\.self_attn\.k_proj\.weight: QKVParallelLinear shard k: checkpoint "
                               r"tensor has shape \(64, 64\), the model expects \(32, 64\)"),
    ("num_attention_heads", 2, r"model\.layers\.0\.self_attn\.o_proj\.weight: RowParallelLinear: checkpoint tensor "
                               r"has shape \(64, 128\), the model expects \(64, 64\)"),
    # wider: torch's own narrowing error, naming no tensor
    ("intermediate_size", 160, r"model\.layers\.0\.mlp\.down_proj\.weight: RowParallelLinear: checkpoint tensor "
                               r"has shape \(64, 128\), the model expects \(64, 160\)"),
])
def test_a_config_width_other_than_the_checkpoints_is_refused(tmp_path, field, value, pattern):
    """config.json's widths against a Qwen3 checkpoint of intermediate_size 128, 4 heads and 2 kv heads of 32: each
    tensor is checked whole, before a rank keeps its part, naming the tensor and both shapes."""
    path = save_hf_dir(tiny_qwen3(3), str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg[field] = value
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(WeightLoadError, match=rf"{path}: {pattern}"):
        LoadedModel(path, dtype="float32")


def test_bad_config_json_field_through_loader(tiny_dir):
    cfg_path = os.path.join(tiny_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["hidden_act"] = "gelu"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="hidden_act"):
        LoadedModel(tiny_dir)


def test_max_model_len_too_large_through_loader(tiny_dir):
    with pytest.raises(ConfigError, match="max_model_len 100000 is larger than the model supports .256"):
        LoadedModel(tiny_dir, max_model_len=100000)


def test_missing_paths_explain_themselves(tmp_path):
    from qwenserve.model.loader.checkpoint import open_checkpoint
    with pytest.raises(ValueError, match="no such file or directory"):
        open_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        open_checkpoint(str(tmp_path))


# ---- settings whose default comes from an environment variable ------------------------------------------------

def test_a_variable_gives_the_default_and_an_explicit_value_wins(monkeypatch):
    from qwenserve.config.engine_config import EngineConfig
    monkeypatch.setenv("QWENSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("QWENSERVE_CPU_OMP_THREADS_BIND", "all")
    config = EngineConfig.from_user_settings()
    assert config.load.cpu_kernels is False and config.parallel.cpu_omp_threads_bind == "all"
    assert EngineConfig.from_user_settings(cpu_kernels=True).load.cpu_kernels is True
    assert EngineConfig.from_kwargs().load.cpu_kernels is True  # only the entry points' builder reads variables
    monkeypatch.setenv("QWENSERVE_CPU_KERNELS", "")  # empty: unset
    assert EngineConfig.from_user_settings().load.cpu_kernels is True


@pytest.mark.parametrize("variable, value, pattern", [
    ("QWENSERVE_CPU_KERNELS", "maybe", r"QWENSERVE_CPU_KERNELS='maybe' is not a boolean for cpu_kernels"),
    ("QWENSERVE_CPU_OMP_THREADS_BIND", "0|x",
     r"'x' is not a list of CPUs.*from the environment: QWENSERVE_CPU_OMP_THREADS_BIND='0\|x'"),
])
def test_a_bad_variable_names_itself_and_its_value(monkeypatch, variable, value, pattern):
    from qwenserve.config.engine_config import EngineConfig
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig.from_user_settings()


def test_cli_flags_name_their_variable_and_beat_it(monkeypatch):
    from qwenserve.entrypoints.cli.engine_args import engine_config_from_args
    from qwenserve.entrypoints.cli.main import build_parser
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())
    assert "(default: on) [env var: QWENSERVE_CPU_KERNELS]" in help_text
    assert "[env var: QWENSERVE_CPU_OMP_THREADS_BIND]" in help_text
    monkeypatch.setenv("QWENSERVE_CPU_KERNELS", "0")
    assert engine_config_from_args(parser.parse_args(["serve"])).load.cpu_kernels is False
    assert engine_config_from_args(parser.parse_args(["serve", "--cpu-kernels"])).load.cpu_kernels is True
    monkeypatch.delenv("QWENSERVE_CPU_KERNELS")
    assert engine_config_from_args(parser.parse_args(["serve"])).load.cpu_kernels is True
    assert engine_config_from_args(parser.parse_args(["serve", "--no-cpu-kernels"])).load.cpu_kernels is False


def test_user_cache_dir_follows_the_variables(monkeypatch, tmp_path):
    from qwenserve.config.environment import user_cache_dir
    monkeypatch.delenv("QWENSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "qwenserve"
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path / "mine"))
    assert user_cache_dir() == tmp_path / "mine"
