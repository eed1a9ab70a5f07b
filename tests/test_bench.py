"""The benchmark commands run end to end (on a tiny model; figures are not asserted, only their shape), and the
HF baseline they build runs exactly the weights qwenserve runs."""
import json

import torch

from qwenserve.benchmarks.common import hf_model_like, varied_workload
from qwenserve.entrypoints.cli.main import main
from qwenserve.model.loader.model_loader import LoadedModel

from helpers import save_hf_dir, tiny_hf_model


def test_hf_baseline_model_is_the_same_model(tmp_path):
    hf = tiny_hf_model(seed=61)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    baseline = hf_model_like(LoadedModel(path, dtype="float32").spec)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(baseline(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_varied_workload_is_deterministic_and_in_range():
    a, b = varied_workload(64, 1000), varied_workload(64, 1000)
    assert a == b
    prompts, outputs = a
    assert all(16 <= len(p) <= 512 for p in prompts) and all(8 <= o <= 256 for o in outputs)


def test_bench_commands_print_one_json_line(tmp_path, capsys):
    path = save_hf_dir(tiny_hf_model(seed=62), str(tmp_path / "m"))
    common = ["--model", path, "--dtype", "float32", "--kv-cache-memory", "8MiB", "--json"]
    runs = {
        "throughput": (["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                        "--baseline", "hf"], {"requests", "prompt_tokens", "output_tokens", "elapsed_s",
                                              "output_tokens_per_s", "total_tokens_per_s", "speedup"}),
        "latency": (["bench", "latency", "--input-len", "8", "--output-len", "4", "--baseline", "hf"],
                    {"ttft_ms", "tpot_ms", "e2e_ms", "baseline_tpot_ms", "speedup"}),
        "prefix": (["bench", "prefix", "--prefix-len", "64", "--num-prompts", "2"], {"ttft_cold_ms", "ttft_warm_ms"}),
    }
    for name, (argv, keys) in runs.items():
        assert main(argv + common) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert keys <= set(result), name
    assert result["ttft_warm_ms"] > 0 and result["warm_cached_tokens"] == 64  # the whole 64-token prefix
