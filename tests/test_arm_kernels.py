"""The ARM ggml kernels (kernels/cpu/arch/arm/) against the scalar reference, on any machine: tests/arm/
kernel_check.cpp built for each aarch64 feature set the kernels have (plain Armv8 NEON, dotprod, dotprod + i8mm)
and run under qemu-user, or natively on an aarch64 host. The harness checks every block type: dot products with
1-4 activation rows, the 8-row decode layout, the i8mm tile kernel for 1-33 rows, dequantizing and the activation
quantizers. The cross-compiler and qemu come from scripts/ensure_arm_tools.sh."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from qwenserve.kernels import sources
from qwenserve.config.cpu_variants import VARIANTS

pytestmark = pytest.mark.kernels

ROOT = Path(__file__).resolve().parent.parent
CPU = sources.SOURCE_DIR
HARNESS = ROOT / "tests" / "arm"
NATIVE = platform.machine() in ("aarch64", "arm64")
CXX = "g++" if NATIVE else "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's aarch64 runtime, where qemu finds the loader and libraries
MISSING_TOOL = "{} not found: scripts/ensure_arm_tools.sh installs g++-aarch64-linux-gnu and qemu-user"

OBJDUMP = "objdump" if NATIVE else "aarch64-linux-gnu-objdump"

# name: (compiler flags; the emulated CPU: one without the features the build leaves out, so an instruction the
# flags do not allow stops the run; the host's /proc/cpuinfo features the build needs when native; the
# instructions its kernels must contain)
# instruction flags, for each of them, as the ARM kernel variants are built (config/cpu_variants.py)
MARCH = {v.name: v.cflags[0] for v in VARIANTS if v.arch == "aarch64"}
FEATURE_SETS = {
    "armv8": (MARCH["armv8"], "cortex-a53", set(), []),
    "armv8_dotprod": (MARCH["armv8_dotprod"], "cortex-a76", {"asimddp"}, ["sdot"]),
    "armv8_i8mm": (MARCH["armv8_i8mm"], "max", {"asimddp", "i8mm"}, ["sdot", "smmla"]),
}


def _require_tools() -> None:
    if shutil.which(CXX) is None:
        pytest.skip(MISSING_TOOL.format(CXX))
    if not NATIVE and shutil.which(QEMU) is None:
        pytest.skip(MISSING_TOOL.format(QEMU))


def _sources_tag(*extra: str) -> str:
    """A hash of every source the builds read and of how they are built: a build is reused only while they stay
    the same."""
    return sources.source_hash([*extra, sources.source_hash([], HARNESS)], CPU)


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "qwenserve_arm_kernels"
    path.mkdir(exist_ok=True)
    return path


def _build(name: str, flags: str) -> Path:
    """kernel_check.cpp and the reference built with flags, once per version of the sources."""
    binary = _cache_dir() / f"kernel_check_{name}_{_sources_tag(CXX, flags)}"
    if binary.exists():
        return binary
    partial = binary.with_name(binary.name + f".{os.getpid()}")  # renamed when complete: runs may overlap
    cmd = [CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", *flags.split(), f"-I{HARNESS / 'stub'}", f"-I{CPU}",
           str(HARNESS / "kernel_check.cpp"), str(CPU / "ggml" / "quants_ref.cpp"), "-o", str(partial)]
    if not NATIVE:
        cmd.insert(1, "-static")  # no aarch64 shared libraries to find at run time
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"building the ARM kernel check ({flags}) failed:\n{proc.stderr[-6000:]}"
    partial.rename(binary)
    for stale in _cache_dir().glob(f"kernel_check_{name}_*"):  # builds of earlier sources
        if stale != binary and "." not in stale.name:
            stale.unlink(missing_ok=True)
    return binary


@pytest.mark.parametrize("name", list(FEATURE_SETS))
def test_arm_kernels_match_the_reference(name):
    """Every ARM kernel this feature set builds gives the reference's results: bit for bit where the float sums
    are exact by construction, within the float summation's rounding bound otherwise (kernel_check.cpp says
    why). An emulated CPU without the instructions the flags leave out runs the build, and the build contains
    the instructions they allow (sdot, smmla)."""
    _require_tools()
    flags, emulated_cpu, host_features, instructions = FEATURE_SETS[name]
    if NATIVE:
        cpuinfo = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
        missing = host_features - set(cpuinfo)
        if missing:
            pytest.skip(f"this aarch64 CPU lacks {', '.join(sorted(missing))}")
    binary = _build(name, flags)
    cmd = [str(binary)] if NATIVE else [QEMU, "-cpu", emulated_cpu, "-L", SYSROOT, str(binary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}: the ARM kernels disagree with the reference:\n{proc.stderr[-6000:]}"
    assert "agree with the reference" in proc.stdout
    if shutil.which(OBJDUMP) is not None:  # the feature macros chose the kernels the flags allow
        listing = subprocess.run([OBJDUMP, "-d", str(binary)], capture_output=True, text=True, timeout=300).stdout
        words = set(listing.split())
        for instruction in instructions:
            assert instruction in words, f"{name}: the build has no {instruction} instruction"


def test_dispatch_compiles_for_arm():
    """ggml/dispatch.cpp, with PyTorch's headers, compiles for aarch64 with every ARM kernel branch in (the
    i8mm feature set includes the NEON and dotprod ones): the entry points call the kernels the harness checks.
    PyTorch's headers are the same on every CPU, so the ones installed here serve."""
    _require_tools()
    from torch.utils.cpp_extension import include_paths

    flags = FEATURE_SETS["armv8_i8mm"][0]
    stamp = _cache_dir() / f"dispatch_{_sources_tag(CXX, flags, *include_paths())}.ok"
    if stamp.exists():
        return
    cmd = [CXX, "-std=c++17", "-fsyntax-only", "-w", flags, *(f"-I{p}" for p in include_paths()), f"-I{CPU}",
           str(CPU / "ggml" / "dispatch.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"dispatch.cpp does not compile for aarch64 ({flags}):\n{proc.stderr[-6000:]}"
    for stale in _cache_dir().glob("dispatch_*.ok"):
        stale.unlink(missing_ok=True)
    stamp.touch()


# the instructions each feature set's int8 roof loop (roof.cpp) must run: those of its int8 tile kernel
ROOF_INSTRUCTIONS = {"armv8": ["smull", "smull2", "sadalp"], "armv8_dotprod": ["sdot"], "armv8_i8mm": ["smmla"]}


@pytest.mark.parametrize("name", sorted(FEATURE_SETS))
def test_int8_roof_compiles_for_arm(name):
    """roof.cpp, with PyTorch's headers, compiles for aarch64 with the library's optimization, and its loop runs
    the feature set's own int8 instructions (the assembly names them; no ARM CPU here to time them on)."""
    _require_tools()
    from torch.utils.cpp_extension import include_paths

    flags = FEATURE_SETS[name][0]
    stamp = _cache_dir() / f"roof_{name}_{_sources_tag(CXX, flags, *include_paths())}.ok"
    if stamp.exists():
        return
    cmd = [CXX, "-std=c++17", *sources.COMMON_CFLAGS, "-S", "-o", "-", "-w", flags,
           *(f"-I{p}" for p in include_paths()), f"-I{CPU}", "-DQS_OPS_NAMESPACE=qwenserve_arm_check",
           str(CPU / "roof.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"roof.cpp does not compile for aarch64 ({flags}):\n{proc.stderr[-6000:]}"
    words = set(proc.stdout.split())
    for instruction in ROOF_INSTRUCTIONS[name]:
        assert instruction in words, f"{name}: the int8 roof loop has no {instruction} instruction"
    for stale in _cache_dir().glob(f"roof_{name}_*.ok"):
        stale.unlink(missing_ok=True)
    stamp.touch()
