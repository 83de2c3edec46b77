"""CUDA C++ sources of the runtime's custom operations, and an NVRTC front end.

The ``.cu`` files of this package are the single source of the device code:

* ``runtime.exec.ops_gpu`` hands them to CuPy's ``RawModule`` (which compiles with NVRTC on the
  GPU machine);
* :func:`compile_ptx` compiles them with NVRTC from ``cuda-bindings`` to PTX, which needs no
  GPU and no driver, so CI checks every kernel compiles (``tests/test_kernels_nvrtc.py``).

``_common.cu`` is a prelude (fp16 conversion, segment lookup, the tiled segmented GEMM, block
reductions); :func:`kernel_sources` prepends it to every other file, so each value of that
dict is one self-contained translation unit.  The sources include no header at all: the NVRTC
in the ``nvidia-cuda-nvrtc`` wheels ships none (no ``cuda_fp16.h``), so fp16 is handled as raw
16-bit storage converted with the PTX ``cvt`` instructions.
"""

from __future__ import annotations

import functools
from importlib import resources
from types import ModuleType

__all__ = [
    "ENTRY_POINTS",
    "PRELUDE",
    "compile_ptx",
    "kernel_sources",
    "load_nvrtc",
    "nvrtc_version",
]

PRELUDE = "_common.cu"

# Every extern "C" kernel, per source.  ops_gpu launches exactly these names; the NVRTC test
# checks each appears as a PTX .entry.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "adapter": ("hk_adapter_down_f32", "hk_adapter_down_f16", "hk_adapter_up_f32", "hk_adapter_up_f16"),
    "aggregate": ("hk_aggregate_f32", "hk_aggregate_f16"),
    "bgmv": ("hk_bgmv_shrink_f32", "hk_bgmv_shrink_f16", "hk_bgmv_expand_f32", "hk_bgmv_expand_f16"),
    "bitfit": ("hk_bias_gather_f32", "hk_bias_gather_f16"),
    "fused": (
        "hk_bias_gelu_f32",
        "hk_bias_gelu_f16",
        "hk_residual_layernorm_f32",
        "hk_residual_layernorm_f16",
        "hk_segmented_layernorm_f32",
        "hk_segmented_layernorm_f16",
    ),
    "hot_tier": ("hk_xxh64_keys", "hk_hot_probe", "hk_hot_gather_f16", "hk_hot_gather_f32"),
    "sgmv": ("hk_sgmv_shrink_f32", "hk_sgmv_shrink_f16", "hk_sgmv_expand_f32", "hk_sgmv_expand_f16"),
    "sparse": ("hk_sparse_add_f32", "hk_sparse_add_f16"),
}


def _read(filename: str) -> str:
    return resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _sources() -> tuple[tuple[str, str], ...]:
    prelude = _read(PRELUDE)
    out = []
    for entry in sorted(resources.files(__name__).iterdir(), key=lambda p: p.name):
        name = entry.name
        if not name.endswith(".cu") or name.startswith("_"):
            continue
        body = entry.read_text(encoding="utf-8")
        # #line keeps compiler messages pointing at the real file and line.
        text = f'#line 1 "{PRELUDE}"\n{prelude}\n#line 1 "{name}"\n{body}'
        out.append((name[: -len(".cu")], text))
    return tuple(out)


def kernel_sources() -> dict[str, str]:
    """Name (file stem, e.g. ``"sgmv"``) -> complete CUDA source text (prelude included)."""
    return dict(_sources())


def load_nvrtc() -> ModuleType:
    """The NVRTC binding module, after checking the NVRTC shared library really loads.

    ``cuda.bindings.nvrtc`` (cuda-python >= 12.6, incl. 13.x); falls back to the older
    ``cuda.nvrtc``.  The binding finds ``libnvrtc`` through ``cuda-pathfinder``: the
    ``nvidia-cuda-nvrtc-cu12`` wheel in site-packages first, then CUDA_HOME/CUDA_PATH and
    the system loader path.  Raises RuntimeError when none of that works.
    """
    try:
        from cuda.bindings import nvrtc  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[import-not-found,no-redef]
        except ImportError as exc:
            raise RuntimeError(
                "NVRTC bindings not found: pip install cuda-bindings nvidia-cuda-nvrtc-cu12"
            ) from exc
    try:
        err, _major, _minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the binding raises when libnvrtc cannot be loaded
        raise RuntimeError(f"NVRTC library could not be loaded: {exc}") from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = load_nvrtc()
    _err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def _check(nvrtc: ModuleType, result, what: str):
    """Unpack a cuda-python call result ``(err, *values)``; raise on error."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _log(nvrtc: ModuleType, prog) -> str:
    try:
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * int(size)
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        return buf.rstrip(b"\x00").decode("utf-8", "replace")
    except RuntimeError as exc:  # pragma: no cover - log retrieval itself failed
        return f"(no log: {exc})"


@functools.lru_cache(maxsize=None)
def _compile(name: str, arch: str, options: tuple[str, ...]) -> bytes:
    sources = kernel_sources()
    if name not in sources:
        raise KeyError(f"no kernel source {name!r}; have {sorted(sources)}")
    nvrtc = load_nvrtc()
    prog = _check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(sources[name].encode("utf-8"), f"{name}.cu".encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err = result[0] if isinstance(result, tuple) else result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(
                f"NVRTC failed to compile {name}.cu for {arch} ({err}):\n{_log(nvrtc, prog)}"
            )
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * int(size)
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.rstrip(b"\x00")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_ptx(name: str, arch: str = "compute_90", options: tuple[str, ...] = ()) -> bytes:
    """Compile kernel source ``name`` with NVRTC to PTX text (bytes, no trailing NUL).

    ``arch`` is a virtual architecture (``compute_80``, ``compute_90``, ...); ``options`` are
    extra NVRTC options (e.g. ``("-std=c++11",)``).  Raises RuntimeError carrying the NVRTC
    log when compilation fails, or when NVRTC cannot be loaded.
    """
    return _compile(name, arch, tuple(options))
