"""The CPU kernel library's variants (config/cpu_variants.py, kernels/): which variant each CPU gets, forcing one
with the setting cpu_isa and its errors, which library the loader takes (a prebuilt one only for the sources
shipped beside it), and that setup.py builds every variant under the loader's names. That each variant computes
what the scalar reference does is tests/test_ggml_kernels.py's job (parametrized over the variants this CPU runs)."""
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

from qwenserve import LLM, kernels
from qwenserve.config import cpu_variants
from qwenserve.config.cpu_variants import VARIANT_BY_NAME, best_variant, choose_variant, parse_cpu_flags
from qwenserve.config.engine_config import EngineConfig, LoadConfig
from qwenserve.config.errors import ConfigError
from qwenserve.kernels import sources

from helpers import save_hf_dir, tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent

_X86_BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx xsave"
_AVX2 = "avx2 fma f16c bmi1 bmi2 movbe"
_AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# /proc/cpuinfo flags of real CPUs (abridged: the instruction-set flags that matter here, plus some that do not)
CPUS = {
    "Sandy Bridge (AVX, no AVX2)": ("x86_64", f"{_X86_BASE} aes pclmulqdq", "x86_64"),
    "EPYC Zen 3 (AVX2 only)": ("x86_64", f"{_X86_BASE} {_AVX2} sha_ni vaes", "avx2"),
    "Skylake-X (AVX-512 without VNNI)": ("x86_64", f"{_X86_BASE} {_AVX2} {_AVX512}", "avx512"),
    "Ice Lake": ("x86_64", f"{_X86_BASE} {_AVX2} {_AVX512} avx512ifma avx512vbmi avx512_vnni avx512_vpopcntdq",
                 "avx512_vnni"),
    "Zen 5": ("x86_64", f"{_X86_BASE} {_AVX2} {_AVX512} avx512_vnni avx512_bf16 avx_vnni avx512_vp2intersect",
              "avx512_bf16"),
    "Sapphire Rapids": ("x86_64", f"{_X86_BASE} {_AVX2} {_AVX512} avx512_vnni avx512_bf16 avx_vnni avx512_fp16 "
                                  "amx_bf16 amx_tile amx_int8", "avx512_bf16"),
    "Alder Lake (AVX-VNNI, no AVX-512)": ("x86_64", f"{_X86_BASE} {_AVX2} avx_vnni gfni vaes", "avx_vnni"),
    "Cortex-A72 (Raspberry Pi 4)": ("aarch64", "fp asimd evtstrm crc32 cpuid", "armv8"),
    "Graviton 2": ("aarch64", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                              "lrcpc dcpop asimddp ssbs", "armv8_dotprod"),
    "Graviton 3": ("aarch64", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
                              "fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs "
                              "paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng", "armv8_i8mm"),
}
ICE_LAKE = frozenset(CPUS["Ice Lake"][1].split())


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_each_cpu_gets_the_best_variant_it_runs(cpu):
    arch, flags, expected = CPUS[cpu]
    assert best_variant(frozenset(flags.split()), arch).name == expected
    assert choose_variant("auto", frozenset(flags.split()), arch).name == expected


def test_flags_come_from_cpuinfo_lines_of_either_architecture():
    x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: spectre_v1\n"
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd asimddp i8mm\nCPU implementer\t: 0x41\n"
    assert parse_cpu_flags(x86) == {"fpu", "sse2", "avx2", "fma"}
    assert parse_cpu_flags(arm) == {"fp", "asimd", "asimddp", "i8mm"}
    assert parse_cpu_flags("processor : 0\n") == frozenset()


def test_an_architecture_without_variants_gets_none():
    assert best_variant(frozenset({"altivec"}), "ppc64le") is None
    assert choose_variant("auto", frozenset(), "ppc64le") is None


def test_each_variant_needs_the_cpu_flags_of_what_it_is_compiled_with():
    """The CPU flags a variant needs follow from its compiler flags, and each variant builds on the one below."""
    avx2, avx512_vnni, i8mm = (VARIANT_BY_NAME[n] for n in ("avx2", "avx512_vnni", "armv8_i8mm"))
    assert avx2.cflags == ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]
    assert avx2.needs == {"avx2", "fma", "f16c", "bmi1", "bmi2"}
    assert "-mavx512vnni" in avx512_vnni.cflags and "-mprefer-vector-width=512" in avx512_vnni.cflags
    assert avx512_vnni.needs == avx2.needs | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                                              "avx512_vnni"}
    assert VARIANT_BY_NAME["avx512_bf16"].needs == avx512_vnni.needs | {"avx512_bf16"}
    assert VARIANT_BY_NAME["avx_vnni"].needs == avx2.needs | {"avx_vnni"}
    assert i8mm.cflags == ["-march=armv8.2-a+dotprod+i8mm"] and i8mm.needs == {"asimddp", "i8mm"}
    assert VARIANT_BY_NAME["x86_64"].needs == VARIANT_BY_NAME["armv8"].needs == frozenset()
    assert not any("native" in flag for v in cpu_variants.VARIANTS for flag in v.cflags)
    assert len({v.namespace for v in cpu_variants.VARIANTS}) == len(cpu_variants.VARIANTS)


@pytest.fixture
def ice_lake(monkeypatch):
    """This process's CPU, as the config and the loader see it, is an Ice Lake x86-64."""
    monkeypatch.setattr(cpu_variants, "this_cpu_flags", lambda: ICE_LAKE)
    monkeypatch.setattr(cpu_variants, "machine_arch", lambda: "x86_64")


def test_cpu_isa_forces_a_variant_the_cpu_runs(ice_lake, monkeypatch):
    assert LoadConfig().cpu_isa == "auto"
    assert choose_variant(LoadConfig(cpu_isa="avx2").cpu_isa).name == "avx2"
    assert choose_variant("x86_64").name == "x86_64"
    monkeypatch.setenv("QWENSERVE_CPU_ISA", "avx512")
    assert EngineConfig.from_user_settings().load.cpu_isa == "avx512"
    assert EngineConfig.from_user_settings(cpu_isa="avx2").load.cpu_isa == "avx2"  # an explicit value wins


@pytest.mark.parametrize("cpu_isa, pattern", [
    ("avx512_bf16", r"cpu_isa 'avx512_bf16' needs CPU flags this CPU lacks: avx512_bf16 \(choose auto, or one of "
                    r"the variants it runs: x86_64, avx2, avx512, avx512_vnni\)"),
    ("avx_vnni", r"cpu_isa 'avx_vnni' needs CPU flags this CPU lacks: avx_vnni"),
    ("sse9", r"cpu_isa 'sse9' is not a variant: choose auto or one of x86_64, avx2, avx_vnni, avx512, avx512_vnni, "
             r"avx512_bf16"),
    ("armv8_i8mm", r"cpu_isa 'armv8_i8mm' is a variant for aarch64 CPUs, and this one is x86_64: choose auto or "
                   r"one of x86_64"),
])
def test_a_variant_the_cpu_cannot_run_is_a_config_error(ice_lake, cpu_isa, pattern):
    with pytest.raises(ConfigError, match=pattern):
        LoadConfig(cpu_isa=cpu_isa)
    with pytest.raises(ConfigError, match=pattern):
        kernels.cpu_ops(cpu_isa)


def test_a_bad_cpu_isa_variable_names_itself(ice_lake, monkeypatch):
    monkeypatch.setenv("QWENSERVE_CPU_ISA", "avx512_bf16")
    with pytest.raises(ConfigError, match=r"lacks: avx512_bf16.*from the environment: QWENSERVE_CPU_ISA='avx512_bf16'"):
        EngineConfig.from_user_settings()


def test_the_cli_has_the_setting():
    from qwenserve.entrypoints.cli.engine_args import engine_config_from_args
    from qwenserve.entrypoints.cli.main import build_parser
    args = build_parser().parse_args(["serve", "--cpu-isa", "x86_64"])
    assert engine_config_from_args(args).load.cpu_isa == "x86_64"


# ---- which library the loader takes -----------------------------------------------------------------------------

@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """No compiler runs and nothing is loaded: the loader's builds and library loads are recorded instead; the
    prebuilt directory is an empty one of the test's."""
    calls = {"built": [], "loaded": []}
    monkeypatch.setattr(sources, "PREBUILT_DIR", tmp_path / "_prebuilt")
    (tmp_path / "_prebuilt").mkdir()
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(kernels, "_build", lambda variant: calls["built"].append(variant.name))
    monkeypatch.setattr(kernels, "_load_library", lambda path: calls["loaded"].append(path.name))
    return calls


def test_a_prebuilt_library_of_these_sources_loads_without_a_build(fake_builds, caplog):
    avx2 = VARIANT_BY_NAME["avx2"]
    name = kernels.library_name(avx2)
    sources.prebuilt_library(name).write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="qwenserve.kernels"):
        ops = kernels.variant_ops(avx2)
    assert ops is torch.ops.qwenserve_avx2
    assert fake_builds == {"built": [], "loaded": [f"lib{name}.so"]}
    assert "CPU kernels: the avx2 variant (named), prebuilt" in caplog.text
    assert kernels.variant_ops(avx2) is ops and len(fake_builds["loaded"]) == 1  # once per process


def test_a_prebuilt_library_of_other_sources_is_not_loaded_but_rebuilt(fake_builds, caplog, monkeypatch, tmp_path):
    """An edited source (an editable install) changes the hash in the library's name: the stale prebuilt library
    is left alone and the variant is compiled from the sources, with the variant's own flags."""
    avx2 = VARIANT_BY_NAME["avx2"]
    stale = sources.prebuilt_library(kernels.library_name(avx2))
    stale.write_bytes(b"")
    copy = tmp_path / "cpu"
    for path in sources.source_files():
        target = copy / path.relative_to(sources.SOURCE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    (copy / "vec.h").write_text((copy / "vec.h").read_text() + "\n// edited\n")  # a header: torch would not notice
    monkeypatch.setattr(sources, "SOURCE_DIR", copy)
    assert kernels.library_name(avx2) != stale.stem.removeprefix("lib")
    with caplog.at_level(logging.INFO, logger="qwenserve.kernels"):
        assert kernels.variant_ops(avx2) is torch.ops.qwenserve_avx2
    assert fake_builds == {"built": ["avx2"], "loaded": []}
    assert f"its prebuilt library {stale.name} was built from other sources" in caplog.text


def test_without_a_prebuilt_library_or_a_compiler_the_pytorch_path_runs(fake_builds, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="qwenserve.kernels"):
        assert kernels.variant_ops(VARIANT_BY_NAME["avx2"]) is None
    assert fake_builds == {"built": [], "loaded": []}
    assert "no C++ compiler found, and no prebuilt library" in caplog.text


def test_auto_and_forced_choices_reach_the_layers(fake_builds, ice_lake):
    """cpu_ops_for gives the variant the enclosing use_cpu_kernels block names, else the best this CPU runs."""
    assert kernels.cpu_ops_for("cpu") is torch.ops.qwenserve_avx512_vnni
    with kernels.use_cpu_kernels(True, "avx2"):
        assert kernels.cpu_ops_for("cpu") is torch.ops.qwenserve_avx2
        with kernels.use_cpu_kernels(True):  # no cpu_isa: the enclosing block's
            assert kernels.cpu_ops_for("cpu") is torch.ops.qwenserve_avx2
        with kernels.use_cpu_kernels(False, "x86_64"):
            assert kernels.cpu_ops_for("cpu") is None
    assert kernels.cpu_ops_for("cpu") is torch.ops.qwenserve_avx512_vnni
    assert fake_builds["built"] == ["avx512_vnni", "avx2"]


@pytest.mark.kernels
def test_an_engine_runs_the_variant_cpu_isa_names(tmp_path):
    """Every kernel-backed layer of an engine built with cpu_isa=x86_64 holds that variant's ops, and its greedy
    tokens are those of the best variant's engine (the tiny float32 model is far from near-ties)."""
    path = save_hf_dir(tiny_hf_model(seed=9), str(tmp_path))
    prompts = [{"prompt_token_ids": [3, 14, 15, 92, 65]}]

    def greedy(llm):
        from qwenserve import SamplingParams
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return out[0].outputs[0].token_ids

    forced = LLM(path, dtype="float32", kv_cache_memory="4MiB", cpu_isa="x86_64")
    holders = [m for m in forced.engine.executor.worker.model.modules() if getattr(m, "ops", None) is not None]
    assert holders and all(m.ops is torch.ops.qwenserve_x86_64 for m in holders)
    assert greedy(forced) == greedy(LLM(path, dtype="float32", kv_cache_memory="4MiB"))


# ---- setup.py -----------------------------------------------------------------------------------------------------

def test_setup_builds_every_variant_of_this_architecture_under_the_loaders_names(monkeypatch):
    """setup.py, read without running setup(): one extension per variant of this machine's architecture, named as
    the loader looks for it in _prebuilt/, compiled with the loader's flags."""
    spec = importlib.util.spec_from_file_location("qwenserve_setup_under_test", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    monkeypatch.setattr("setuptools.setup", lambda **kwargs: None)
    spec.loader.exec_module(setup_py)
    built = setup_py._kernel_build()
    if not cpu_variants.variants_for(cpu_variants.machine_arch()):
        assert built == {}
        return
    extensions = {ext.name: ext for ext in built["ext_modules"]}
    variants = cpu_variants.variants_for(cpu_variants.machine_arch())
    assert sorted(extensions) == sorted(f"qwenserve.kernels._prebuilt.lib{kernels.library_name(v)}"
                                        for v in variants)
    for v in variants:
        ext = extensions[f"qwenserve.kernels._prebuilt.lib{kernels.library_name(v)}"]
        assert ext.extra_compile_args == kernels.library_flags(v)
        assert sorted(ext.sources) == sorted(p.relative_to(ROOT).as_posix() for p in sources.source_files()
                                             if p.suffix == ".cpp")
    assert sys.modules.get("qwenserve_setup_under_test") is None  # nothing of setup.py stays imported
