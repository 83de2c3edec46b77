"""Builds the optional C extensions; pyproject.toml holds all the metadata.

`pip install -e .` (or a wheel build) compiles them with the platform's C compiler:
formats/_probe.c (segment lookups; else the NumPy code, formats/accel.py),
runtime/exec/_fused.c (the bf16 layers' residual + LayerNorm pass; else ATen's ops,
runtime/exec/cpu_batched.py) and runtime/gen/_decode.c (a decode step's paged attention, per-row
LoRA and greedy choice; else the array ops in runtime/gen/kv_pool.py, lora_batch.py and
sampling.py). All are optional: if one cannot be built (no compiler, no Python headers),
installation still succeeds with a warning and hkstore runs on the reference code.
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
    def _skip(err, name="the C extensions"):
        sys.stderr.write(f"WARNING: could not build the optional {name} ({type(err).__name__}: {err}); "
                         "hkstore will use its reference code path instead.\n")


setup(
    ext_modules=[
        Extension("formats._probe", ["formats/_probe.c"], extra_compile_args=["-O3"], optional=True),
        Extension("runtime.exec._fused", ["runtime/exec/_fused.c"], extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
                  extra_link_args=["-pthread"], optional=True),
        Extension("runtime.gen._decode", ["runtime/gen/_decode.c"], extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
                  extra_link_args=["-pthread"], optional=True),
    ],
    cmdclass={"build_ext": optional_build_ext},
)
