"""Every CUDA kernel source compiles with NVRTC to PTX, with the expected entry points.

Needs no GPU and no driver: NVRTC (cuda-bindings + nvidia-cuda-nvrtc-cu12) only.  When NVRTC
cannot be loaded the tests fail if the CI environment variable is set, and skip otherwise.
"""

from __future__ import annotations

import os
import re

import pytest

from runtime.exec import kernels

ARCHS = ["compute_80", "compute_90"]

# Written out here, independently of kernels.ENTRY_POINTS, which ops_gpu launches from.
EXPECTED = {
    "adapter": {"hk_adapter_down_f32", "hk_adapter_down_f16", "hk_adapter_up_f32", "hk_adapter_up_f16"},
    "aggregate": {"hk_aggregate_f32", "hk_aggregate_f16"},
    "bgmv": {"hk_bgmv_shrink_f32", "hk_bgmv_shrink_f16", "hk_bgmv_expand_f32", "hk_bgmv_expand_f16"},
    "bitfit": {"hk_bias_gather_f32", "hk_bias_gather_f16"},
    "fused": {"hk_bias_gelu_f32", "hk_bias_gelu_f16", "hk_residual_layernorm_f32", "hk_residual_layernorm_f16",
              "hk_segmented_layernorm_f32", "hk_segmented_layernorm_f16"},
    "hot_tier": {"hk_xxh64_keys", "hk_hot_probe", "hk_hot_gather_f16", "hk_hot_gather_f32"},
    "sgmv": {"hk_sgmv_shrink_f32", "hk_sgmv_shrink_f16", "hk_sgmv_expand_f32", "hk_sgmv_expand_f16"},
    "sparse": {"hk_sparse_add_f32", "hk_sparse_add_f16"},
}

_ENTRY = re.compile(r"^\.(?:visible\s+)?\.entry\s+(\w+)\s*\(", re.M)


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return kernels.load_nvrtc()
    except RuntimeError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"NVRTC must be available in CI: {exc}")
        pytest.skip(f"NVRTC not available: {exc}")


def test_every_source_is_checked():
    assert set(kernels.kernel_sources()) == set(EXPECTED)
    assert {k: set(v) for k, v in kernels.ENTRY_POINTS.items()} == EXPECTED


def test_sources_are_self_contained():
    for name, src in kernels.kernel_sources().items():
        assert not re.search(r"^\s*#\s*include", src, re.M), f"{name}.cu includes a header NVRTC may lack"
        assert src.count('#line 1 "_common.cu"') == 1, name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compiles_to_ptx(nvrtc, name, arch):
    ptx = kernels.compile_ptx(name, arch).decode()
    assert re.search(rf"^\.target\s+sm_{arch.split('_')[1]}\b", ptx, re.M), "wrong target"
    assert set(_ENTRY.findall(ptx)) == EXPECTED[name]


@pytest.mark.parametrize("std", ["c++11", "c++17"])
def test_compiles_under_other_standards(nvrtc, std):
    # CuPy (or anyone embedding the sources) may pass its own -std.
    for name in EXPECTED:
        ptx = kernels.compile_ptx(name, "compute_80", (f"-std={std}",)).decode()
        assert set(_ENTRY.findall(ptx)) == EXPECTED[name]


def test_compile_error_carries_the_log(nvrtc, monkeypatch):
    broken = 'extern "C" __global__ void hk_broken(float* y) { y[0] = not_declared_anywhere; }'
    monkeypatch.setattr(kernels, "kernel_sources", lambda: {"broken_for_test": broken})
    with pytest.raises(RuntimeError, match="not_declared_anywhere"):
        kernels.compile_ptx("broken_for_test", "compute_90")


def test_unknown_source(nvrtc):
    with pytest.raises(KeyError):
        kernels.compile_ptx("no_such_kernel")


def test_ops_gpu_without_cupy_says_how_to_install(monkeypatch):
    import sys

    from runtime.exec import ops_gpu

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'hkstore\[gpu\]'"):
        ops_gpu.bias_gelu([[1.0]], [0.0])
