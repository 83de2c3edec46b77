"""GPU executor ops (CuPy + CUDA kernels) against the CPU reference (runtime.exec.ops_cpu).

Runs on a CUDA GPU when CuPy finds one (marker ``gpu``); everywhere else on the CPU emulation
of the kernels (runtime.exec.emu: the unchanged .cu sources built with g++, launched through
the CuPy stand-in), so these cases run in every default ``pytest -q``.  ``HKSTORE_EMU=1``
forces the emulation on a GPU machine too.  Skipped only when neither is possible (no GPU and
no g++ >= 12).

Every case draws fresh random inputs, covers extents that are and are not multiples of the
kernels' tiles (16 for the segmented GEMMs, 32/128/256 for the 1-D blocks), empty segments,
segments without a PET (id -1) and rows no segment covers, and fills every output buffer with
NaN before the launch, so an element a kernel forgets to write (or writes out of place) shows
up.  Criterion: ||out - ref|| / ||ref|| <= 1e-5 for fp32 and 1e-2 for fp16; hashing, probing
and gathering must match exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from runtime.exec import ops_cpu, ops_gpu


def _real_cupy():
    if os.environ.get("HKSTORE_EMU", "") not in ("", "0"):
        return None
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no CuPy, no driver, no device
        return None


cp = _real_cupy()
BACKEND = "cuda" if cp is not None else "emu"
if cp is None:
    from runtime.exec.emu.module import compiler_missing_reason

    _reason = compiler_missing_reason()
    if _reason:
        pytest.skip(f"no CUDA GPU, and the CPU emulation cannot run: {_reason}", allow_module_level=True)
    from runtime.exec.emu import cupy_standin as cp
else:
    pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _backend():
    """ops_gpu launches on the CuPy stand-in (the emulation) for the duration of each test."""
    if BACKEND == "emu":
        with ops_gpu.use_cupy(cp):
            yield
    else:
        yield


TOL = {np.float32: 1e-5, np.float16: 1e-2}
DTYPES = [np.float32, np.float16]
# (rows, d_in, r, d_out): tile multiples, off-by-one around them, a single row.
SHAPES = [(1, 16, 16, 16), (16, 32, 16, 64), (17, 33, 7, 65), (64, 64, 32, 48), (130, 100, 17, 31)]

_seed = np.random.SeedSequence(20240611)


def rng() -> np.random.Generator:
    return np.random.default_rng(_seed.spawn(1)[0])


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def check(out, ref, dtype) -> None:
    out = cp.asnumpy(out) if isinstance(out, cp.ndarray) else np.asarray(out)
    ref = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def poison(shape, dtype):
    return cp.full(shape, np.nan, dtype=dtype)


def randn(g, shape, dtype, scale=1.0) -> np.ndarray:
    return (g.standard_normal(shape) * scale).astype(dtype)


def segment_table(g, rows: int, T: int, max_segments: int = 6):
    """Random segments: empty ones, id -1 ones, and sometimes rows before the first segment."""
    S = int(g.integers(1, max_segments + 1))
    cuts = np.sort(g.integers(0, rows + 1, size=S - 1))
    starts = np.concatenate([[0], cuts, [rows]])
    if S > 1 and g.random() < 0.3:
        starts[0] = starts[1] // 2           # rows [0, starts[0]) belong to no segment
    ids = g.integers(-1, T, size=S)
    return starts.astype(np.int32), ids.astype(np.int32)


def active_rows(rows: int, starts, ids) -> np.ndarray:
    covered = np.zeros(rows, dtype=bool)
    for s, tid in enumerate(ids):
        if tid >= 0:
            covered[starts[s] : starts[s + 1]] = True
    return covered


# -- 1. aggregation -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", ["centered", "causal"])
@pytest.mark.parametrize("B,L,n,d", [(1, 1, 3, 16), (3, 17, 3, 33), (2, 32, 5, 64), (4, 9, 2, 300), (2, 6, 4, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_aggregate(dtype, window, B, L, n, d, masked):
    g = rng()
    values = randn(g, (B * L, n, d), dtype)
    lengths = g.integers(0, L + 1, size=B).astype(np.int32)
    lengths[0] = L
    mask = (g.random((B * L, n)) < 0.7) if masked else None
    ref = ops_cpu.aggregate(t(values), t(lengths), window, None if mask is None else t(mask))
    out = poison((B, L, d), np.float32)
    got = ops_gpu.aggregate(cp.asarray(values), cp.asarray(lengths), window,
                            None if mask is None else cp.asarray(mask), out=out)
    assert got is out
    check(got, ref, np.float32)   # fp32 output from identical inputs and order


# -- 2. SGMV --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d_in,r,d_out", SHAPES)
def test_sgmv_shrink_expand(dtype, rows, d_in, r, d_out):
    g = rng()
    T = 3
    x = randn(g, (rows, d_in), dtype)
    A = randn(g, (T, r, d_in), dtype, 0.1)
    B = randn(g, (T, d_out, r), dtype, 0.1)
    y = randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2.0, size=T).astype(np.float32)
    starts, ids = segment_table(g, rows, T)

    v_ref = ops_cpu.sgmv_shrink(t(x), t(A), t(starts), t(ids))
    v = ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), cp.asarray(starts), cp.asarray(ids),
                            out=poison((rows, r), np.float32))
    covered = active_rows(rows, starts, ids)
    v_host = cp.asnumpy(v)
    assert np.isnan(v_host[~covered]).all(), "shrink wrote rows outside the active segments"
    if covered.any():
        check(v_host[covered], v_ref.numpy()[covered], dtype)

    y_ref = ops_cpu.sgmv_expand(t(y.copy()), v_ref, t(B), t(starts), t(ids), t(scales))
    y_dev = cp.asarray(y)
    got = ops_gpu.sgmv_expand(y_dev, cp.asarray(v_ref.numpy()), cp.asarray(B), cp.asarray(starts),
                              cp.asarray(ids), cp.asarray(scales))
    assert got is y_dev
    check(got, y_ref, dtype)

    y_ref = ops_cpu.sgmv(t(y.copy()), t(x), t(A), t(B), t(starts), t(ids), t(scales))
    got = ops_gpu.sgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B), cp.asarray(starts),
                       cp.asarray(ids), cp.asarray(scales))
    check(got, y_ref, dtype)


def test_sgmv_many_segments():
    """More segments than grid rows, many of one row, default scales."""
    g = rng()
    rows, T = 300, 5
    x, A = randn(g, (rows, 40), np.float32), randn(g, (T, 8, 40), np.float32)
    B, y = randn(g, (T, 24, 8), np.float32), randn(g, (rows, 24), np.float32)
    starts = np.concatenate([np.arange(0, 200), np.arange(200, rows + 1, 25)]).astype(np.int32)
    ids = g.integers(-1, T, size=starts.size - 1).astype(np.int32)
    ref = ops_cpu.sgmv(t(y.copy()), t(x), t(A), t(B), t(starts), t(ids))
    got = ops_gpu.sgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B), starts, ids)
    check(got, ref, np.float32)


# -- 3. BGMV --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d_in,r,d_out", SHAPES)
def test_bgmv(dtype, rows, d_in, r, d_out):
    g = rng()
    T = 4
    x = randn(g, (rows, d_in), dtype)
    A = randn(g, (T, r, d_in), dtype, 0.1)
    B = randn(g, (T, d_out, r), dtype, 0.1)
    y = randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2.0, size=T).astype(np.float32)
    row_ids = g.integers(-1, T, size=rows).astype(np.int32)

    v_ref = ops_cpu.bgmv_shrink(t(x), t(A), t(row_ids))
    v = cp.asnumpy(ops_gpu.bgmv_shrink(cp.asarray(x), cp.asarray(A), cp.asarray(row_ids),
                                       out=poison((rows, r), np.float32)))
    live = row_ids >= 0
    assert np.isnan(v[~live]).all(), "shrink wrote rows without a tenant"
    if live.any():
        check(v[live], v_ref.numpy()[live], dtype)

    y_ref = ops_cpu.bgmv_expand(t(y.copy()), v_ref, t(B), t(row_ids), t(scales))
    got = ops_gpu.bgmv_expand(cp.asarray(y), cp.asarray(v_ref.numpy()), cp.asarray(B),
                              cp.asarray(row_ids), cp.asarray(scales))
    check(got, y_ref, dtype)

    y_ref = ops_cpu.bgmv(t(y.copy()), t(x), t(A), t(B), t(row_ids), t(scales))
    got = ops_gpu.bgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B), cp.asarray(row_ids),
                       cp.asarray(scales))
    check(got, y_ref, dtype)


# -- 4. segmented adapter -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,bn", [(1, 16, 16), (17, 33, 7), (64, 64, 32), (100, 48, 65)])
def test_segmented_adapter(dtype, rows, d, bn):
    g = rng()
    T = 3
    x = randn(g, (rows, d), dtype)
    down, down_bias = randn(g, (T, bn, d), dtype, 0.2), randn(g, (T, bn), dtype, 0.2)
    up, up_bias = randn(g, (T, d, bn), dtype, 0.2), randn(g, (T, d), dtype, 0.2)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.segmented_adapter(t(x), t(down), t(down_bias), t(up), t(up_bias), t(starts), t(ids))
    args = [cp.asarray(a) for a in (x, down, down_bias, up, up_bias, starts, ids)]
    got = ops_gpu.segmented_adapter(*args, out=poison((rows, d), dtype))
    check(got, ref, dtype)
    x_dev = args[0]
    got = ops_gpu.segmented_adapter(*args, out=x_dev)            # in place
    assert got is x_dev
    check(got, ref, dtype)


# -- 5. bias gather -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d_out", [(1, 1), (16, 256), (17, 33), (130, 300)])
def test_bias_gather(dtype, rows, d_out):
    g = rng()
    T = 4
    y, bias = randn(g, (rows, d_out), dtype), randn(g, (T, d_out), dtype)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.bias_gather(t(y.copy()), t(bias), t(starts), t(ids))
    got = ops_gpu.bias_gather(cp.asarray(y), cp.asarray(bias), cp.asarray(starts), cp.asarray(ids))
    check(got, ref, dtype)


# -- 6. sparse add --------------------------------------------------------------------------------


def sparse_deltas(g, T: int, d_out: int, d_in: int, dtype, density: float):
    idx, vals, offs = [], [], [0]
    for _ in range(T):
        k = int(g.binomial(d_out * d_in, density))
        f = np.sort(g.choice(d_out * d_in, size=k, replace=False))
        idx.append(f)
        vals.append(randn(g, (k,), dtype))
        offs.append(offs[-1] + k)
    return (np.concatenate(idx).astype(np.int32), np.concatenate(vals).astype(dtype),
            np.asarray(offs, dtype=np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d_in,d_out,density", [(1, 16, 16, 0.2), (17, 33, 65, 0.05), (64, 64, 128, 0.01), (40, 100, 31, 0.0)])
def test_sparse_add(dtype, rows, d_in, d_out, density):
    g = rng()
    T = 3
    x, y = randn(g, (rows, d_in), dtype), randn(g, (rows, d_out), dtype)
    idx, vals, offs = sparse_deltas(g, T, d_out, d_in, dtype, density)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.sparse_add(t(y.copy()), t(x), t(idx), t(vals), t(offs), t(starts), t(ids))
    got = ops_gpu.sparse_add(cp.asarray(y), cp.asarray(x), cp.asarray(idx), cp.asarray(vals),
                             cp.asarray(offs), cp.asarray(starts), cp.asarray(ids))
    check(got, ref, dtype)


# -- 7. hot tier ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_xxh64_keys(n):
    g = rng()
    keys = g.integers(0, 2**32, size=(1000, n), dtype=np.uint32)
    got = cp.asnumpy(ops_gpu.xxh64_keys(cp.asarray(keys)))
    np.testing.assert_array_equal(got, ops_cpu.xxh64_keys(keys))


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 100, 3000])
def test_hot_probe_and_gather(n, count):
    g = rng()
    keys = np.unique(g.integers(0, 40, size=(count, n), dtype=np.uint32), axis=0)
    g.shuffle(keys)
    m = len(keys)
    value_rows = g.permutation(m).astype(np.int32)          # table row -> value row
    tk, tr, max_probe = ops_cpu.build_hot_table(keys, value_rows)
    misses = g.integers(0, 50, size=(257, n), dtype=np.uint32)
    queries = np.concatenate([keys[: m // 2], misses, keys[m // 2 :]])
    ref = ops_cpu.hot_probe(tk, tr, queries, max_probe).numpy()
    got = cp.asnumpy(ops_gpu.hot_probe(cp.asarray(tk), cp.asarray(tr), cp.asarray(queries), max_probe))
    np.testing.assert_array_equal(got, ref)
    hashes = ops_cpu.xxh64_keys(queries)
    got = cp.asnumpy(ops_gpu.hot_probe(cp.asarray(tk), cp.asarray(tr), cp.asarray(queries), max_probe,
                                       hashes=cp.asarray(hashes)))
    np.testing.assert_array_equal(got, ref)
    # a truncated probe budget must agree too
    ref0 = ops_cpu.hot_probe(tk, tr, queries, 0).numpy()
    got0 = cp.asnumpy(ops_gpu.hot_probe(cp.asarray(tk), cp.asarray(tr), cp.asarray(queries), 0))
    np.testing.assert_array_equal(got0, ref0)

    d = 19
    for dtype in (np.float16, np.float32):
        values = randn(g, (max(m, 1), n * d), dtype)
        out_ref = t(np.full((len(queries), n * d), np.nan, dtype=dtype))
        ops_cpu.hot_gather(t(values), torch.from_numpy(ref), out_ref)
        out = poison((len(queries), n * d), dtype)
        got = ops_gpu.hot_gather(cp.asarray(values), cp.asarray(ref), out)
        assert got is out
        np.testing.assert_array_equal(cp.asnumpy(got), out_ref.numpy())   # NaN == NaN here


# -- 8. fused element-wise ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 16), (17, 33), (2, 5, 768), (64, 257)])
def test_bias_gelu(dtype, shape):
    g = rng()
    x, bias = randn(g, shape, dtype, 2.0), randn(g, shape[-1:], dtype)
    ref = ops_cpu.bias_gelu(t(x), t(bias))
    got = ops_gpu.bias_gelu(cp.asarray(x), cp.asarray(bias), out=poison(shape, dtype))
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 16), (17, 33), (2, 5, 768), (4, 1000)])
def test_residual_layernorm(dtype, shape):
    g = rng()
    x, res = randn(g, shape, dtype), randn(g, shape, dtype)
    gamma, beta = randn(g, shape[-1:], dtype), randn(g, shape[-1:], dtype)
    ref = ops_cpu.residual_layernorm(t(x), t(res), t(gamma), t(beta), 1e-5)
    got = ops_gpu.residual_layernorm(cp.asarray(x), cp.asarray(res), cp.asarray(gamma), cp.asarray(beta),
                                     1e-5, out=poison(shape, dtype))
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1), (17, 33), (64, 384), (100, 1000)])
def test_segmented_layernorm(dtype, rows, d):
    g = rng()
    T = 3
    x, res = randn(g, (rows, d), dtype), randn(g, (rows, d), dtype)
    gamma, beta = randn(g, (d,), dtype), randn(g, (d,), dtype)
    gamma_delta, beta_delta = randn(g, (T, d), dtype), randn(g, (T, d), dtype)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.segmented_layernorm(*(t(a) for a in (x, res, gamma, beta, gamma_delta, beta_delta, starts, ids)), 1e-5)
    args = [cp.asarray(a) for a in (x, res, gamma, beta, gamma_delta, beta_delta, starts, ids)]
    check(ops_gpu.segmented_layernorm(*args, 1e-5, out=poison((rows, d), dtype)), ref, dtype)
    x_dev = args[0]
    got = ops_gpu.segmented_layernorm(*args, 1e-5, out=x_dev)  # in place
    assert got is x_dev
    check(got, ref, dtype)
