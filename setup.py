"""Builds the optional C accelerator formats._probe; pyproject.toml holds all the metadata.

`pip install -e .` (or a wheel build) compiles formats/_probe.c with the platform's C compiler.
The extension is optional: if it cannot be built (no compiler, no Python headers), installation
still succeeds with a warning and hkstore runs on its NumPy code (formats/accel.py).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class optional_build_ext(build_ext):
    """build_ext that warns instead of failing: the NumPy path is always there."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any build failure leaves the pure-Python install
            self._skip(e)

    def build_extension(self, ext):
        if self.compiler.compiler_type == "msvc":  # -O3 is a gcc/clang flag
            ext.extra_compile_args = ["/O2"]
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self._skip(e, ext.name)

    @staticmethod
    def _skip(err, name="formats._probe"):
        sys.stderr.write(f"WARNING: could not build the optional C extension {name} ({type(err).__name__}: {err}); "
                         "hkstore will use its NumPy code path instead.\n")


setup(
    ext_modules=[
        Extension("formats._probe", ["formats/_probe.c"], extra_compile_args=["-O3"], optional=True),
    ],
    cmdclass={"build_ext": optional_build_ext},
)
