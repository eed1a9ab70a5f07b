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

from qwenserve import kernels  # noqa: E402  (after sys.path and the environment are set)


@pytest.fixture(scope="session")
def ops():
    """Our compiled CPU kernels (torch.ops.qwenserve); a test that needs them skips, with the reason, only where
    they are switched off or there is no C++ compiler. A failed build with a compiler present fails."""
    if os.environ.get("QWENSERVE_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by QWENSERVE_CPU_KERNELS=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here: the engine runs on the PyTorch path, which the other tests cover")
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build here (see the warning logged by qwenserve.kernels)"
    return ops
