"""Our compiled CPU kernels (cpu/: one source per op family, shared helpers in vec.h, the op registration in
register.cpp), built on first use and cached by torch's extension builder.

`cpu_ops()` returns torch.ops.qwenserve once the library is loaded. Where no C++ compiler is found it returns
None, with a warning, and callers take the PyTorch path, which computes the same thing with more, smaller ops
(several times slower). A build that fails with a compiler present raises KernelBuildError: serving on, silently
that much slower, would hide the failure. The setting cpu_kernels (QWENSERVE_CPU_KERNELS=0, --no-cpu-kernels)
chooses the PyTorch path on purpose; whoever builds a model from a config applies it with `use_cpu_kernels`.
The build takes ~20 s once per source version; later runs load the cached library (TORCH_EXTENSIONS_DIR moves
the cache). Layers pick the library once, when they are built, with `cpu_ops_for(device)`.
"""
from __future__ import annotations

import hashlib
import logging
import platform
import shutil
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("cpu")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """A short hash of this CPU's instruction-set flags. The library is built with -march=native, so a cache
    shared between different machines (a network home directory) must not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags or platform.processor()).encode()).hexdigest()[:8]


def _source_files() -> list[Path]:
    """Every source and header under cpu/, its subdirectories (ggml/, arch/<family>/) included. The extension
    builder names each object file after its source's file name alone, so two .cpp files may not share one."""
    files = sorted(p for p in _SOURCE_DIR.rglob("*") if p.suffix in (".cpp", ".h"))
    by_name: dict[str, Path] = {}
    for p in files:
        if p.suffix == ".cpp" and by_name.setdefault(p.name, p) is not p:
            raise RuntimeError(f"kernel sources {by_name[p.name].relative_to(_SOURCE_DIR)} and "
                               f"{p.relative_to(_SOURCE_DIR)} share a file name; the builder needs them distinct")
    return files


# -fno-trapping-math: without it GCC keeps float comparisons (clamps, selects) as branches, which stops it from
# vectorising loops such as silu_and_mul's exp (measured 2-3x slower); results are the same, we never read FP
# exception flags.
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp"]


def _source_tag() -> str:
    """A short hash of every source and header under cpu/ and of the compiler flags. torch rebuilds when a .cpp
    changes but does not look at headers, so the hash goes into the library's name: any edit builds afresh."""
    h = hashlib.sha1(" ".join(_CFLAGS).encode())
    for p in _source_files():
        h.update(p.relative_to(_SOURCE_DIR).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:8]


# a build takes under a minute; a lock this old was left by a build that was killed (torch would wait forever)
_STALE_LOCK_SECONDS = 600


def _remove_stale_lock(name: str) -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        lock = Path(_get_build_directory(name, False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except (ImportError, OSError):  # no lock (or a torch without this helper): nothing to do
        return
    if age > _STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _build():
    from torch.utils.cpp_extension import load

    logger.info("loading the CPU kernels (compiled on first use, about 20 s)")
    sources = [str(p) for p in _source_files() if p.suffix == ".cpp"]
    name = f"qwenserve_cpu_ops_{_cpu_tag()}_{_source_tag()}"
    _remove_stale_lock(name)
    load(name=name, sources=sources,
         extra_include_paths=[str(_SOURCE_DIR)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return torch.ops.qwenserve


class KernelBuildError(RuntimeError):
    """The CPU kernels did not build although a C++ compiler is there."""


_ERROR_TAIL_LINES = 12


def _compiler() -> str | None:
    """The path of the C++ compiler torch's extension builder runs (CXX, else c++), or None if there is none."""
    from torch.utils.cpp_extension import get_cxx_compiler
    return shutil.which(get_cxx_compiler())


def _error_tail(text: str) -> str:
    """The compiler's diagnostics ("file:line:col: error: ...") from a build log, or its last lines where it has
    none, for one message."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    return "\n".join((errors or lines)[-_ERROR_TAIL_LINES:])


def cpu_ops():
    """torch.ops.qwenserve, building the library the first time; None where there is no C++ compiler. Raises
    KernelBuildError, now and at every later call, where the build fails with a compiler present."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state and "error" not in _state:
            compiler = _compiler()
            if compiler is None:
                logger.warning("no C++ compiler found, so qwenserve's CPU kernels cannot be built: running on "
                               "PyTorch ops, several times slower (install g++, or choose this path with "
                               "QWENSERVE_CPU_KERNELS=0 or --no-cpu-kernels)")
                _state["ops"] = None
            else:
                try:
                    _state["ops"] = _build()
                except Exception as e:  # noqa: BLE001 - whatever the builder raised, the message carries its log
                    _state["error"] = KernelBuildError(
                        f"qwenserve's CPU kernels failed to build with {compiler}:\n{_error_tail(str(e))}\n"
                        "Without them serving runs several times slower. Fix the compiler set-up, or choose the "
                        "PyTorch ops on purpose with QWENSERVE_CPU_KERNELS=0 or --no-cpu-kernels.")
        if "error" in _state:
            raise _state["error"]
    return _state["ops"]


def cpu_ops_for(device: torch.device | str):
    """The kernel library for work on `device`: torch.ops.qwenserve on the CPU unless the kernels are switched
    off (a `disabled()` block, the setting cpu_kernels off) or there is no compiler; else None. Layers call it
    once, when they are built, and keep the answer."""
    if torch.device(device).type != "cpu" or _state.get("disabled"):
        return None
    return cpu_ops()


@contextmanager
def disabled():
    """PyTorch ops only for what is built inside the block (layers and runners choose when they are built),
    for comparing the two paths. Blocks may nest."""
    outer = _state.get("disabled", False)
    _state["disabled"] = True
    try:
        yield
    finally:
        _state["disabled"] = outer


def use_cpu_kernels(enabled: bool):
    """A block in which models and runners are built as the setting cpu_kernels says: with the kernels, or
    (off) on PyTorch ops only."""
    return nullcontext() if enabled else disabled()
