"""The CPU kernel library's variants: one build of every kernel source per CPU family, each with its compiler flags
and the CPU flags it needs, and the choice of the variant a process runs (the setting cpu_isa).

Each variant's compiler flags are a list of instruction-set extensions, every one paired with the name Linux gives
it in /proc/cpuinfo (the `flags` line on x86, `Features` on ARM; both say what CPUID reports and the OS enabled),
so the CPU flags a variant needs follow from how it is compiled and cannot drift apart. A CPU runs a variant when
it has every flag the variant needs; `auto` takes the best one it runs (the last runnable one in VARIANTS).

setup.py reads this file on its own, before qwenserve's dependencies are installed: it imports nothing outside
the standard library at module level."""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True)
class Extension:
    """An instruction-set extension: the compiler flag that lets the compiler use it, and the CPU flag that says a
    CPU has it."""
    compiler_flag: str
    cpu_flag: str


@dataclass(frozen=True)
class KernelVariant:
    name: str
    arch: str  # platform.machine() of the CPUs it is for: x86_64 or aarch64
    base_flags: tuple[str, ...]  # -march / -mtune: the instruction set every CPU of the arch has
    extensions: tuple[Extension, ...] = ()
    extra_flags: tuple[str, ...] = ()  # code-generation choices that need no CPU flag

    @property
    def cflags(self) -> list[str]:
        """The compiler flags: ARM extensions (`+dotprod`) are suffixes of -march, x86 ones flags of their own."""
        march, *rest = self.base_flags
        suffixes = "".join(e.compiler_flag for e in self.extensions if e.compiler_flag.startswith("+"))
        flags = [e.compiler_flag for e in self.extensions if not e.compiler_flag.startswith("+")]
        return [march + suffixes, *rest, *flags, *self.extra_flags]

    @property
    def needs(self) -> frozenset[str]:
        """The /proc/cpuinfo flags a CPU must have to run this build."""
        return frozenset(e.cpu_flag for e in self.extensions)

    @property
    def namespace(self) -> str:
        """The torch.ops namespace its library registers its ops under: distinct per variant, so several load in
        one process without colliding."""
        return f"qwenserve_{self.name}"


# -mtune=generic: one build runs on every CPU of a family, so it is tuned for none in particular
_X86 = ("-march=x86-64", "-mtune=generic")
# AVX2 with FMA and F16C (every AVX2 CPU has them, and cpu_features.h's AVX2 class assumes all three), BMI1/2
_AVX2 = (Extension("-mavx2", "avx2"), Extension("-mfma", "fma"), Extension("-mf16c", "f16c"),
         Extension("-mbmi", "bmi1"), Extension("-mbmi2", "bmi2"))
# the AVX-512 subset every AVX-512 CPU since Skylake-X has (x86-64-v4)
_AVX512 = _AVX2 + (Extension("-mavx512f", "avx512f"), Extension("-mavx512bw", "avx512bw"),
                   Extension("-mavx512vl", "avx512vl"), Extension("-mavx512dq", "avx512dq"),
                   Extension("-mavx512cd", "avx512cd"))
_AVX512_VNNI = _AVX512 + (Extension("-mavx512vnni", "avx512_vnni"),)
# the auto-vectorised loops (norms, activations) take whole 512-bit registers where the CPU has them
_WIDE = ("-mprefer-vector-width=512",)
_DOTPROD = Extension("+dotprod", "asimddp")
_I8MM = Extension("+i8mm", "i8mm")

# worst to best within each architecture: `auto` takes the last one the CPU runs
VARIANTS: tuple[KernelVariant, ...] = (
    KernelVariant("x86_64", "x86_64", _X86),  # SSE2 only: the scalar reference's build, runs everywhere
    KernelVariant("avx2", "x86_64", _X86, _AVX2),
    # Alder Lake and later clients: VNNI dot products on 256-bit vectors, without AVX-512
    KernelVariant("avx_vnni", "x86_64", _X86, _AVX2 + (Extension("-mavxvnni", "avx_vnni"),)),
    KernelVariant("avx512", "x86_64", _X86, _AVX512, _WIDE),
    KernelVariant("avx512_vnni", "x86_64", _X86, _AVX512_VNNI, _WIDE),
    KernelVariant("avx512_bf16", "x86_64", _X86, _AVX512_VNNI + (Extension("-mavx512bf16", "avx512_bf16"),),
                  _WIDE),
    KernelVariant("armv8", "aarch64", ("-march=armv8-a",)),  # NEON (ASIMD) is part of every AArch64 CPU
    # armv8.2-a, the oldest level dotprod exists at, for both: no later level's instructions reach CPUs that have
    # i8mm without that level (Graviton 3 is v8.4)
    KernelVariant("armv8_dotprod", "aarch64", ("-march=armv8.2-a",), (_DOTPROD,)),
    KernelVariant("armv8_i8mm", "aarch64", ("-march=armv8.2-a",), (_DOTPROD, _I8MM)),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}


def machine_arch() -> str:
    """x86_64 or aarch64 (or whatever else this machine calls itself: then no variant fits it)."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def variants_for(arch: str) -> list[KernelVariant]:
    """The variants built for CPUs of `arch`, worst to best."""
    return [v for v in VARIANTS if v.arch == arch]


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags in /proc/cpuinfo's text: the first `flags` (x86) or `Features` (ARM) line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def this_cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (empty where /proc/cpuinfo cannot be read: then only the baseline variant
    fits)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def missing_flags(variant: KernelVariant, flags: frozenset[str]) -> list[str]:
    return sorted(variant.needs - flags)


def best_variant(flags: frozenset[str], arch: str) -> KernelVariant | None:
    """The best variant of `arch` a CPU with `flags` runs; None for an architecture without variants."""
    runnable = [v for v in variants_for(arch) if not missing_flags(v, flags)]
    return runnable[-1] if runnable else None


def choose_variant(cpu_isa: str, flags: frozenset[str] | None = None, arch: str | None = None) -> KernelVariant | None:
    """The variant the setting cpu_isa names on a CPU with `flags` of `arch` (default: this one's): `auto`, the
    best it runs (None where the architecture has no variants); a name, that variant, which the CPU must run.
    A name it cannot run, or one that is not a variant of this architecture, is a ConfigError."""
    from qwenserve.config.errors import ConfigError  # here, not at the top: setup.py loads this file alone

    flags = this_cpu_flags() if flags is None else flags
    arch = machine_arch() if arch is None else arch
    if cpu_isa == AUTO:
        return best_variant(flags, arch)
    known = [v.name for v in variants_for(arch)]
    variant = VARIANT_BY_NAME.get(cpu_isa)
    if variant is None or variant.arch != arch:
        where = f" is a variant for {variant.arch} CPUs, and this one is {arch}" if variant else " is not a variant"
        raise ConfigError(f"cpu_isa {cpu_isa!r}{where}: choose auto or one of {', '.join(known) or '(none)'}")
    missing = missing_flags(variant, flags)
    if missing:
        raise ConfigError(f"cpu_isa {cpu_isa!r} needs CPU flags this CPU lacks: {', '.join(missing)} (choose auto, "
                          f"or one of the variants it runs: "
                          f"{', '.join(v.name for v in variants_for(arch) if not missing_flags(v, flags))})")
    return variant
