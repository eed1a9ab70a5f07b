"""Builds the CPU kernel library once per CPU variant of this machine's architecture (x86_64: x86_64, avx2,
avx_vnni, avx512, avx512_vnni, avx512_bf16; aarch64: armv8, armv8_dotprod, armv8_i8mm) into
qwenserve/kernels/_prebuilt/, so an installed qwenserve runs on any CPU of the architecture and its first start
compiles nothing. Everything else about the package is in pyproject.toml.

torch comes from the environment being installed into, never from an isolated build environment (that would pull
a multi-GB CUDA build): install with `pip install --no-build-isolation`. Where torch cannot be imported the package
is built without prebuilt kernels, and the first start compiles the variant it runs (qwenserve/kernels/__init__.py).
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "qwenserve" / "kernels"


def _load_alone(path: Path):
    """A module of the package by its file, without importing qwenserve (whose dependencies may not be installed
    yet). The module imports only the standard library."""
    spec = importlib.util.spec_from_file_location(f"_qwenserve_build_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _kernel_build() -> dict:
    """setup()'s ext_modules and cmdclass for the kernel variants, or nothing where they cannot be built here."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("qwenserve: torch is not importable in this build environment, so the CPU kernels are not prebuilt "
              "(the first start compiles them); install with --no-build-isolation into an environment with torch "
              "to prebuild them", file=sys.stderr)
        return {}
    cpu_variants = _load_alone(ROOT / "qwenserve" / "config" / "cpu_variants.py")
    sources = _load_alone(KERNELS / "sources.py")
    variants = cpu_variants.variants_for(cpu_variants.machine_arch())
    if not variants:
        print(f"qwenserve: no CPU kernel variants for {cpu_variants.machine_arch()}: none prebuilt", file=sys.stderr)
        return {}
    if shutil.which("c++") is None and shutil.which("g++") is None:
        print("qwenserve: no C++ compiler found, so the CPU kernels are not prebuilt", file=sys.stderr)
        return {}
    cpp = sorted(p.relative_to(ROOT).as_posix() for p in sources.source_files() if p.suffix == ".cpp")
    prebuilt_package = sources.PREBUILT_DIR.relative_to(ROOT).as_posix().replace("/", ".")
    extensions = []
    for variant in variants:
        cflags = sources.library_cflags(variant.cflags, variant.namespace)
        name = sources.library_name(variant.name, cflags)
        extensions.append(CppExtension(
            name=f"{prebuilt_package}.lib{name}", sources=cpp, include_dirs=[str(sources.SOURCE_DIR)],
            extra_compile_args=cflags, extra_link_args=sources.LDFLAGS))

    class BuildKernelVariants(BuildExtension):
        """Each variant compiles the same sources with other flags: its objects go to a directory of their own.
        Libraries of earlier sources left in an editable install's _prebuilt/ are removed."""

        def build_extension(self, ext):
            shared_temp = self.build_temp
            self.build_temp = str(Path(shared_temp) / ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared_temp

        def run(self):
            # an editable install copies the libraries into the source tree, where a fresh clone has no _prebuilt/
            sources.PREBUILT_DIR.mkdir(exist_ok=True)
            if self.inplace or getattr(self, "editable_mode", False):
                keep = {f"{ext.name.rsplit('.', 1)[-1]}.so" for ext in self.extensions}
                for old in sources.PREBUILT_DIR.glob("libqwenserve_cpu_*.so"):
                    if old.name not in keep:
                        old.unlink()
            super().run()

    build_ext = BuildKernelVariants.with_options(no_python_abi_suffix=True)
    return {"ext_modules": extensions, "cmdclass": {"build_ext": build_ext}}


setup(**_kernel_build())
