"""Build of gefen's native CPU kernels (everything else is declared in pyproject.toml).

The kernels are a plain C shared library (``gefen/kernels/libgefen_kernels.so``): no Python C-API and no torch C++
ABI, loaded at run time through ctypes, so one binary serves every Python and torch version and the wheel is tagged
``py3-none-<platform>``. It is compiled with the system C compiler by ``pip install .`` / ``pip install -e .`` /
``python -m build``. Where no compiler works the build warns and goes on without it: the package still installs,
and ``backend="auto"`` falls back to the eager step with one warning (``backend="native"`` raises).

Reproducible: fixed flags, no debug information, ``-ffile-prefix-map`` for the build folder, so two builds of the
same source with the same compiler give byte-identical libraries.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - older setuptools
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

SOURCE = "src/gefen/kernels/_native/gefen_kernels.c"
#: Files SOURCE includes (one translation unit): a change to them rebuilds the library too.
DEPENDS = [
    "src/gefen/kernels/_native/gefen_codebook.c",
    "src/gefen/kernels/_native/gefen_period.c",
    "src/gefen/kernels/_native/gefen_period_simd.c",
    "src/gefen/kernels/_native/gefen_stats.c",
    "src/gefen/kernels/_native/gefen_step_x86.c",
    "src/gefen/kernels/_native/gefen_threads.c",
]
#: Flags of every build: -ffp-contract=off keeps each rounding as written (the kernels spell out every fma).
CFLAGS = ["-O2", "-std=c11", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=default"]


def library_name() -> str:
    if sys.platform == "win32":
        return "gefen_kernels.dll"
    return "libgefen_kernels.dylib" if sys.platform == "darwin" else "libgefen_kernels.so"


def compile_library(source: Path, output: Path, extra: list[str] | None = None) -> None:
    """Compile ``source`` into the shared library ``output`` with the system C compiler (``$CC``, else cc/gcc)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    root = str(Path(__file__).resolve().parent)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")  # then renamed: a loaded library is never overwritten
    flags = CFLAGS + [f"-ffile-prefix-map={root}=.", "-shared", "-o", str(partial), str(source), "-lm"]
    subprocess.run([compiler, *flags, *(extra or [])], check=True, capture_output=True, text=True)
    os.replace(partial, output)


class BuildNative(build_ext):
    """Builds the kernel library as a plain shared object instead of a Python extension module."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split(".")[:-1]) / library_name())

    def build_extension(self, ext: Extension) -> None:
        output = Path(self.get_ext_fullpath(ext.name))
        try:
            compile_library(Path(ext.sources[0]), output)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            self.warn(
                f"gefen: the native CPU kernels were not built ({detail.strip()[:500]}); gefen will use its eager "
                "step on the CPU (backend='auto' warns once; backend='native' raises)."
            )


    def _built(self, paths: list[str]) -> list[str]:
        return [p for p in paths if not p.endswith(library_name()) or Path(p).is_file()]

    def get_outputs(self) -> list[str]:  # a library that could not be built is not an output
        return self._built(super().get_outputs())

    def get_output_mapping(self) -> dict[str, str]:
        return {k: v for k, v in super().get_output_mapping().items() if Path(v).is_file() or Path(k).is_file()}


class PlatformWheel(bdist_wheel):
    """``py3-none-<platform>``: the library depends on the platform, not on the Python ABI (``py3-none-any`` when
    it could not be built)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        built = any(Path(self.bdist_dir).rglob(library_name())) if self.bdist_dir else True
        return ("py3", "none", plat) if built else ("py3", "none", "any")


setup(
    ext_modules=[Extension("gefen.kernels._native_library", sources=[SOURCE], depends=DEPENDS, optional=True)],
    cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel},
)
