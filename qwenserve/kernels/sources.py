"""What a kernel library variant is built from: the sources under cpu/, the compiler flags, and the hash of both
that names the library, so a build is only ever loaded for the exact sources and flags it was made from.

setup.py (which builds every variant of the machine's architecture into _prebuilt/ at install) and the loader
(which loads a prebuilt library, or builds one at first use) both name libraries here. setup.py reads this file on
its own, before qwenserve's dependencies are installed: it imports nothing outside the standard library."""
from __future__ import annotations

import hashlib
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("cpu")
PREBUILT_DIR = Path(__file__).with_name("_prebuilt")  # filled by setup.py; not in git

# -fno-trapping-math: without it GCC keeps float comparisons (clamps, selects) as branches, which stops it from
# vectorising loops such as silu_and_mul's exp (measured 2-3x slower); results are the same, we never read FP
# exception flags. Hidden visibility: each variant's library binds its own functions, never another variant's
# copy of the same name loaded in the same process.
COMMON_CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
LDFLAGS = ["-fopenmp"]


def source_files(source_dir: Path | None = None) -> list[Path]:
    """Every source and header under cpu/ (or source_dir), its subdirectories (ggml/, arch/<family>/) included.
    The extension builders name each object file after its source's file name alone, so two .cpp files may not
    share one."""
    source_dir = source_dir or SOURCE_DIR
    files = sorted(p for p in source_dir.rglob("*") if p.suffix in (".cpp", ".h"))
    by_name: dict[str, Path] = {}
    for p in files:
        if p.suffix == ".cpp" and by_name.setdefault(p.name, p) is not p:
            raise RuntimeError(f"kernel sources {by_name[p.name].relative_to(source_dir)} and "
                               f"{p.relative_to(source_dir)} share a file name; the builder needs them distinct")
    return files


def library_cflags(variant_cflags: list[str], namespace: str) -> list[str]:
    """Every compiler flag of a variant's library: the common ones, the variant's instruction set, and the torch.ops
    namespace register.cpp registers the ops under."""
    return [*COMMON_CFLAGS, *variant_cflags, f"-DQS_OPS_NAMESPACE={namespace}"]


def source_hash(cflags: list[str], source_dir: Path | None = None) -> str:
    """A short hash of every source and header under cpu/ (its path and bytes) and of the compiler flags. torch's
    builder rebuilds when a .cpp changes but does not look at headers, so the hash goes into the library's name:
    any edit builds afresh, and a prebuilt library of other sources is never loaded."""
    source_dir = source_dir or SOURCE_DIR
    h = hashlib.sha1(" ".join(cflags).encode())
    for p in source_files(source_dir):
        h.update(p.relative_to(source_dir).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:10]


def library_name(variant_name: str, cflags: list[str], source_dir: Path | None = None) -> str:
    """The library's name, which says its variant and the hash of what it is built from."""
    return f"qwenserve_cpu_{variant_name}_{source_hash(cflags, source_dir)}"


def prebuilt_library(name: str, prebuilt_dir: Path | None = None) -> Path:
    """Where setup.py puts the library of that name."""
    return (prebuilt_dir or PREBUILT_DIR) / f"lib{name}.so"
