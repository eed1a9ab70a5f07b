import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from qwenserve import LLM, kernels  # noqa: E402  (after sys.path and the environment are set)

from helpers import PROMPTS, assert_hf_greedy, greedy_tokens, save_hf_dir, tiny_hf_model  # noqa: E402


# the markers (declared in pyproject.toml) of the tests the quick loop leaves out
NOT_QUICK = ("slow", "browser", "ray", "multiproc", "kernels", "cuda", "prometheus", "container")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config, items):
    """Mark `quick` every test that carries none of NOT_QUICK: `./test.sh -m quick` runs them."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in NOT_QUICK):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def ops():
    """Our compiled CPU kernels (the best variant this CPU runs); a test that needs them skips, with the reason,
    only where they are switched off, or neither prebuilt nor buildable (no C++ compiler). A failed build with a
    compiler present fails."""
    if os.environ.get("QWENSERVE_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by QWENSERVE_CPU_KERNELS=0")
    ops = kernels.cpu_ops()
    if ops is None and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no prebuilt CPU kernels and no C++ compiler here: the engine runs on the PyTorch path, which "
                    "the other tests cover")
    assert ops is not None, "the CPU kernels are unavailable although a compiler exists (qwenserve.kernels logs why)"
    return ops


@pytest.fixture(scope="session")
def parallel_tiny(tmp_path_factory):
    """(HF model, its checkpoint directory): a tiny model whose 4 heads and 2 kv heads split over 2 ranks."""
    hf = tiny_hf_model(seed=61, num_attention_heads=4, num_key_value_heads=2)
    return hf, save_hf_dir(hf, str(tmp_path_factory.mktemp("dist")))


@pytest.fixture(scope="session")
def single_process_tokens(parallel_tiny):
    """parallel_tiny's greedy tokens for helpers.PROMPTS in one process, checked against HF: what every layout must give."""
    hf, path = parallel_tiny
    tokens = greedy_tokens(LLM(path, dtype="float32"))
    assert_hf_greedy(hf, PROMPTS, tokens)
    return tokens
