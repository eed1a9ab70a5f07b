"""Our compiled CPU kernels (cpu/: one source per op family, shared helpers in vec.h, the op registration in
register.cpp), one library per CPU variant (config/cpu_variants.py: x86_64, avx2, avx512_vnni, armv8_dotprod, ...),
each registering its ops under a torch.ops namespace of its own.

A process runs the variant the setting cpu_isa names: `auto`, the best one this CPU runs, chosen once. `pip install`
builds every variant of the machine's architecture into _prebuilt/ (setup.py); the loader takes a prebuilt library
only when its name carries the hash of the sources and flags shipped beside it (sources.py), and otherwise builds
that variant on first use with torch's extension builder (~20 s, cached under TORCH_EXTENSIONS_DIR), as it does
for an edited source in an editable install.

`cpu_ops()` returns the chosen variant's torch.ops namespace. Where a build is needed and no C++ compiler is found
it returns None, with a warning, and callers take the PyTorch path, which computes the same thing with more,
smaller ops (several times slower). A build that fails with a compiler present raises KernelBuildError: serving
on, silently that much slower, would hide the failure. The setting cpu_kernels (QWENSERVE_CPU_KERNELS=0,
--no-cpu-kernels) chooses the PyTorch path on purpose; whoever builds a model from a config applies both settings
with `use_cpu_kernels`. Layers pick the library once, when they are built, with `cpu_ops_for(device)`.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from qwenserve.config.cpu_variants import AUTO, KernelVariant, choose_variant, machine_arch, variants_for
from qwenserve.kernels import sources

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# the choice of the enclosing use_cpu_kernels / disabled / eager blocks: "disabled" and "eager" (bools), "cpu_isa" (a
# setting's value)
_state: dict[str, object] = {}
# variant name -> its ops namespace, None (no compiler to build it) or the KernelBuildError its build raised
_loaded: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The CPU kernels did not build although a C++ compiler is there."""


def library_flags(variant: KernelVariant) -> list[str]:
    """Every compiler flag of the variant's library (the same at install and at first use)."""
    return sources.library_cflags(variant.cflags, variant.namespace)


def library_name(variant: KernelVariant) -> str:
    """The variant's library name for the sources shipped with this package: variant and hash of what it is built
    from."""
    return sources.library_name(variant.name, library_flags(variant))


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


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def _build(variant: KernelVariant) -> None:
    """Compile the variant's library with torch's extension builder (cached by name) and load it."""
    from torch.utils.cpp_extension import load

    name = library_name(variant)
    _remove_stale_lock(name)
    load(name=name, sources=[str(p) for p in sources.source_files() if p.suffix == ".cpp"],
         extra_include_paths=[str(sources.SOURCE_DIR)], extra_cflags=library_flags(variant),
         extra_ldflags=sources.LDFLAGS, is_python_module=False, verbose=False)


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


def _stale_prebuilt(variant: KernelVariant) -> list[Path]:
    """Prebuilt libraries of this variant made from other sources or flags than those shipped now."""
    if not sources.PREBUILT_DIR.is_dir():
        return []
    return sorted(sources.PREBUILT_DIR.glob(f"libqwenserve_cpu_{variant.name}_*.so"))


def _load_variant(variant: KernelVariant, how: str):
    """The variant's ops namespace from its prebuilt library, else from a build; None where a build is needed and
    there is no compiler; the KernelBuildError of a failed build."""
    name = library_name(variant)
    prebuilt = sources.prebuilt_library(name)
    if prebuilt.is_file():
        _load_library(prebuilt)
        logger.info("CPU kernels: the %s variant (%s), prebuilt", variant.name, how)
        return getattr(torch.ops, variant.namespace)
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found, and no prebuilt library of qwenserve's CPU kernels (%s variant) "
                       "matches these sources: running on PyTorch ops, several times slower (install g++, "
                       "reinstall qwenserve, or choose this path with QWENSERVE_CPU_KERNELS=0 or "
                       "--no-cpu-kernels)", variant.name)
        return None
    stale = _stale_prebuilt(variant)
    reason = (f"its prebuilt library {stale[0].name} was built from other sources" if stale
              else "no prebuilt library of it (a source checkout, or a package built without torch)")
    logger.info("CPU kernels: the %s variant (%s); %s, so compiling it once (about 20 s)", variant.name, how, reason)
    try:
        _build(variant)
    except Exception as e:  # noqa: BLE001 - whatever the builder raised, the message carries its log
        return KernelBuildError(
            f"qwenserve's CPU kernels ({variant.name} variant) failed to build with {compiler}:\n"
            f"{_error_tail(str(e))}\nWithout them serving runs several times slower. Fix the compiler set-up, "
            "or choose the PyTorch ops on purpose with QWENSERVE_CPU_KERNELS=0 or --no-cpu-kernels.")
    return getattr(torch.ops, variant.namespace)


def variant_ops(variant: KernelVariant, how: str = "named"):
    """The ops namespace of one variant's library, loading or building it the first time in this process (a
    variant the CPU cannot run loads, but its ops may crash it). None where there is no compiler to build it;
    raises KernelBuildError, now and at every later call, where its build failed with a compiler present."""
    if variant.name not in _loaded:
        with _lock:
            if variant.name not in _loaded:
                _loaded[variant.name] = _load_variant(variant, how)
    result = _loaded[variant.name]
    if isinstance(result, KernelBuildError):
        raise result
    return result


def _requested(cpu_isa: str | None) -> str:
    """cpu_isa, else the enclosing use_cpu_kernels block's choice, else auto."""
    return cpu_isa or _state.get("cpu_isa") or AUTO


def chosen_variant(cpu_isa: str | None = None) -> KernelVariant | None:
    """The variant cpu_isa names (default: the enclosing use_cpu_kernels block's choice, else auto); None on an
    architecture without variants. A name this CPU cannot run is a ConfigError."""
    return choose_variant(_requested(cpu_isa))


def cpu_ops(cpu_isa: str | None = None):
    """The chosen variant's ops namespace (torch.ops.qwenserve_<variant>), loading it the first time; None where
    there is no C++ compiler to build it, or no variant for this architecture. Raises KernelBuildError where the
    build fails with a compiler present, and ConfigError for a cpu_isa this CPU cannot run."""
    name = _requested(cpu_isa)
    variant = choose_variant(name)
    if variant is None:
        if "no variant" not in _state:
            _state["no variant"] = True
            logger.warning("qwenserve's CPU kernels have no build for %s CPUs: running on PyTorch ops, several "
                           "times slower", machine_arch())
        return None
    how = (f"the best of {', '.join(v.name for v in variants_for(variant.arch))} this CPU runs" if name == AUTO
           else f"cpu_isa={name}")
    return variant_ops(variant, how)


def cpu_ops_for(device: torch.device | str):
    """The kernel library for work on `device`: the chosen variant's ops on the CPU unless the kernels are
    switched off (a `disabled()` block, the setting cpu_kernels off) or cannot be had; else None. Layers call it
    once, when they are built, and keep the answer."""
    if torch.device(device).type != "cpu" or _state.get("disabled"):
        return None
    return cpu_ops()


@contextmanager
def _choice(**choice):
    outer = {key: _state.get(key) for key in choice}
    _state.update(choice)
    try:
        yield
    finally:
        _state.update(outer)


def disabled():
    """PyTorch ops only for what is built inside the block (layers and runners choose when they are built),
    for comparing the two paths. Blocks may nest."""
    return _choice(disabled=True)


def eager():
    """Models built inside the block run every decoder layer's modules one by one at decode, never one DecodeLayers
    call for them all (model/layers/decode_layers.py), for comparing the two. Blocks may nest."""
    return _choice(eager=True)


def fused_decode_allowed() -> bool:
    """Whether a model built now may run its decode steps' layers as one call (not inside an eager block)."""
    return not _state.get("eager")


def use_cpu_kernels(enabled: bool, cpu_isa: str | None = None, enforce_eager: bool = False):
    """A block in which models and runners are built as the settings cpu_kernels, cpu_isa and enforce_eager say:
    with the kernels of the variant cpu_isa names (None: as the enclosing block chose, else auto), or (off) on
    PyTorch ops only; with enforce_eager, layer by layer at decode too. Switching them on inside a disabled block
    leaves them off."""
    choice: dict[str, object] = {} if enabled else {"disabled": True}
    if cpu_isa is not None:
        choice["cpu_isa"] = cpu_isa
    if enforce_eager:
        choice["eager"] = True
    return _choice(**choice)
