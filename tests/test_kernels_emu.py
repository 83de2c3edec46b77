"""The CUDA kernels on the CPU emulation (runtime.exec.emu): properties, block order, and proof
that the harness fails when a kernel is wrong.

* every launcher of runtime.exec.ops_gpu (so every kernel of runtime/exec/kernels) against
  runtime.exec.ops_cpu on random shapes that are and are not multiples of the 16-wide tiles,
  fp32 and fp16 (hypothesis); each example runs with the blocks in forward, reverse and
  seeded random order, and the three results must be bit-identical (a cross-block write
  conflict would show);
* injected bugs, each a modified copy of a source built the same way: a removed
  ``__syncthreads()`` (in the tiled GEMM, and between warps in the block reduction), a
  divergent barrier, a shuffle half a warp skips, an off-by-one bounds check (read and
  write), overlapping segments - each must be caught (wrong result, barrier/shuffle error,
  guard/poison check, or the order test: the block order also picks the thread schedule);
* malformed inputs (segment tables, tenant ids, offsets, table rows) through every launcher:
  whatever they say, the kernels must stay in bounds (guards intact, no poison read) - and
  under ``HKSTORE_EMU_SANITIZE=1`` AddressSanitizer watches every access;
* the launch checks: C signature, CUDA's limits, ``__launch_bounds__``.

Skipped (with the reason) when no g++ >= 12 is available.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import ops_cpu, ops_gpu
from runtime.exec.emu import module as emu
from runtime.exec.kernels import ENTRY_POINTS, kernel_sources

_reason = emu.compiler_missing_reason()
if _reason:
    pytest.skip(f"the CUDA emulation cannot run here: {_reason}", allow_module_level=True)

from runtime.exec.emu import cupy_standin as cp

SETTINGS = settings(max_examples=10, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TOL = {np.float32: 1e-5, np.float16: 1e-2}
DTYPES = [np.float32, np.float16]
DIMS = st.sampled_from([1, 3, 15, 16, 17, 32, 33, 48])
ROWS = st.integers(1, 40)
SEEDS = st.integers(0, 2**32 - 1)


@pytest.fixture(autouse=True)
def standin():
    with ops_gpu.use_cupy(cp):
        yield cp


def t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def randn(g, shape, dtype, scale=1.0):
    return (g.standard_normal(shape) * scale).astype(dtype)


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite output (poison read, or an element left unwritten)"
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def check(out, ref, dtype):
    ref = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def segment_table(g, rows, T, max_segments=5):
    S = int(g.integers(1, max_segments + 1))
    starts = np.concatenate([[0], np.sort(g.integers(0, rows + 1, size=S - 1)), [rows]])
    if S > 1 and g.random() < 0.3:
        starts[0] = starts[1] // 2
    return starts.astype(np.int32), g.integers(-1, T, size=S).astype(np.int32)


def in_orders(fn, seed: int):
    """fn() -> device arrays; run with the blocks forward, reverse, random(seed): the three
    results must be bit-identical.  Returns the forward result as host arrays."""
    results = []
    for order in ("forward", "reverse", "random"):
        with emu.block_order(order, seed):
            out = fn()
        results.append([cp.asnumpy(o) for o in (out if isinstance(out, (list, tuple)) else [out])])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b, err_msg="the result depends on the block order")
    return results[0]


# -- every kernel against ops_cpu, in every block order --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(B=st.integers(1, 3), L=st.integers(1, 20), n=st.integers(1, 5), d=DIMS, window=st.sampled_from(["centered", "causal"]),
       masked=st.booleans(), seed=SEEDS)
def test_aggregate(dtype, B, L, n, d, window, masked, seed):
    g = np.random.default_rng(seed)
    values = randn(g, (B * L, n, d), dtype)
    lengths = g.integers(0, L + 1, size=B).astype(np.int32)
    mask = (g.random((B * L, n)) < 0.7) if masked else None
    ref = ops_cpu.aggregate(t(values), t(lengths), window, None if mask is None else t(mask))
    (got,) = in_orders(lambda: ops_gpu.aggregate(cp.asarray(values), cp.asarray(lengths), window,
                                                 None if mask is None else cp.asarray(mask)), seed)
    check(got, ref, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=ROWS, d_in=DIMS, r=DIMS, d_out=DIMS, seed=SEEDS)
def test_sgmv(dtype, rows, d_in, r, d_out, seed):
    g = np.random.default_rng(seed)
    T = 3
    x, A = randn(g, (rows, d_in), dtype), randn(g, (T, r, d_in), dtype, 0.2)
    B, y = randn(g, (T, d_out, r), dtype, 0.2), randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2.0, size=T).astype(np.float32)
    starts, ids = segment_table(g, rows, T)
    v_ref = ops_cpu.sgmv_shrink(t(x), t(A), t(starts), t(ids))
    covered = np.zeros(rows, bool)
    for s, tid in enumerate(ids):
        covered[starts[s]:starts[s + 1]] |= tid >= 0
    (v,) = in_orders(lambda: ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), starts, ids,
                                                 out=cp.full((rows, r), np.nan, np.float32)), seed)
    assert np.isnan(v[~covered]).all()
    if covered.any():
        check(v[covered], v_ref.numpy()[covered], dtype)
    ref = ops_cpu.sgmv(t(y.copy()), t(x), t(A), t(B), t(starts), t(ids), t(scales))
    (got,) = in_orders(lambda: ops_gpu.sgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B),
                                            cp.asarray(starts), cp.asarray(ids), cp.asarray(scales)), seed)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=ROWS, d_in=DIMS, r=DIMS, d_out=DIMS, seed=SEEDS)
def test_bgmv(dtype, rows, d_in, r, d_out, seed):
    g = np.random.default_rng(seed)
    T = 4
    x, A = randn(g, (rows, d_in), dtype), randn(g, (T, r, d_in), dtype, 0.2)
    B, y = randn(g, (T, d_out, r), dtype, 0.2), randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2.0, size=T).astype(np.float32)
    row_ids = g.integers(-1, T, size=rows).astype(np.int32)
    ref = ops_cpu.bgmv(t(y.copy()), t(x), t(A), t(B), t(row_ids), t(scales))
    (got,) = in_orders(lambda: ops_gpu.bgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B),
                                            cp.asarray(row_ids), cp.asarray(scales)), seed)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=ROWS, d=DIMS, bn=DIMS, seed=SEEDS, in_place=st.booleans())
def test_segmented_adapter(dtype, rows, d, bn, seed, in_place):
    g = np.random.default_rng(seed)
    T = 3
    x = randn(g, (rows, d), dtype)
    down, down_bias = randn(g, (T, bn, d), dtype, 0.2), randn(g, (T, bn), dtype, 0.2)
    up, up_bias = randn(g, (T, d, bn), dtype, 0.2), randn(g, (T, d), dtype, 0.2)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.segmented_adapter(t(x), t(down), t(down_bias), t(up), t(up_bias), t(starts), t(ids))

    def run():
        args = [cp.asarray(a) for a in (x, down, down_bias, up, up_bias, starts, ids)]
        return ops_gpu.segmented_adapter(*args, out=args[0] if in_place else None)

    (got,) = in_orders(run, seed)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=ROWS, d_out=st.sampled_from([1, 31, 32, 33, 256, 257]), seed=SEEDS)
def test_bias_gather(dtype, rows, d_out, seed):
    g = np.random.default_rng(seed)
    T = 4
    y, bias = randn(g, (rows, d_out), dtype), randn(g, (T, d_out), dtype)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.bias_gather(t(y.copy()), t(bias), t(starts), t(ids))
    (got,) = in_orders(lambda: ops_gpu.bias_gather(cp.asarray(y), cp.asarray(bias), cp.asarray(starts),
                                                   cp.asarray(ids)), seed)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=ROWS, d_in=DIMS, d_out=st.sampled_from([1, 16, 17, 127, 128, 129]), density=st.sampled_from([0.0, 0.05, 0.3]),
       seed=SEEDS)
def test_sparse_add(dtype, rows, d_in, d_out, density, seed):
    g = np.random.default_rng(seed)
    T = 3
    x, y = randn(g, (rows, d_in), dtype), randn(g, (rows, d_out), dtype)
    idx, vals, offs = [], [], [0]
    for _ in range(T):
        k = int(g.binomial(d_out * d_in, density))
        idx.append(np.sort(g.choice(d_out * d_in, size=k, replace=False)))
        vals.append(randn(g, (k,), dtype))
        offs.append(offs[-1] + k)
    idx, vals, offs = np.concatenate(idx).astype(np.int32), np.concatenate(vals).astype(dtype), np.asarray(offs, np.int32)
    starts, ids = segment_table(g, rows, T)
    ref = ops_cpu.sparse_add(t(y.copy()), t(x), t(idx), t(vals), t(offs), t(starts), t(ids))
    (got,) = in_orders(lambda: ops_gpu.sparse_add(cp.asarray(y), cp.asarray(x), cp.asarray(idx), cp.asarray(vals),
                                                  cp.asarray(offs), cp.asarray(starts), cp.asarray(ids)), seed)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(n=st.integers(1, 7), count=st.integers(0, 300), d=st.integers(1, 40), seed=SEEDS)
def test_hot_tier(dtype, n, count, d, seed):
    g = np.random.default_rng(seed)
    keys = np.unique(g.integers(0, 6, size=(count, n), dtype=np.uint32), axis=0)
    m = len(keys)
    np.testing.assert_array_equal(in_orders(lambda: ops_gpu.xxh64_keys(cp.asarray(keys)), seed)[0] if m else
                                  np.zeros(0, np.uint64), ops_cpu.xxh64_keys(keys))
    tk, tr, max_probe = ops_cpu.build_hot_table(keys, g.permutation(m).astype(np.int32))
    queries = np.concatenate([keys, g.integers(0, 8, size=(17, n), dtype=np.uint32)])
    ref = ops_cpu.hot_probe(tk, tr, queries, max_probe).numpy()
    (got,) = in_orders(lambda: ops_gpu.hot_probe(cp.asarray(tk), cp.asarray(tr), cp.asarray(queries), max_probe), seed)
    np.testing.assert_array_equal(got, ref)
    values = randn(g, (max(m, 1), n * d), dtype)
    out_ref = t(np.zeros((len(queries), n * d), dtype))
    ops_cpu.hot_gather(t(values), torch.from_numpy(ref), out_ref)
    (got,) = in_orders(lambda: ops_gpu.hot_gather(cp.asarray(values), cp.asarray(ref),
                                                  cp.zeros((len(queries), n * d), dtype)), seed)
    np.testing.assert_array_equal(got, out_ref.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(rows=st.integers(1, 12), d=st.sampled_from([1, 16, 31, 32, 33, 255, 256, 257, 700]), seed=SEEDS)
def test_fused(dtype, rows, d, seed):
    g = np.random.default_rng(seed)
    T = 3
    x, res = randn(g, (rows, d), dtype, 2.0), randn(g, (rows, d), dtype)
    bias, gamma, beta = randn(g, (d,), dtype), randn(g, (d,), dtype), randn(g, (d,), dtype)
    gd, bd = randn(g, (T, d), dtype), randn(g, (T, d), dtype)
    starts, ids = segment_table(g, rows, T)
    (got,) = in_orders(lambda: ops_gpu.bias_gelu(cp.asarray(x), cp.asarray(bias)), seed)
    check(got, ops_cpu.bias_gelu(t(x), t(bias)), dtype)
    (got,) = in_orders(lambda: ops_gpu.residual_layernorm(cp.asarray(x), cp.asarray(res), cp.asarray(gamma),
                                                          cp.asarray(beta), 1e-5), seed)
    check(got, ops_cpu.residual_layernorm(t(x), t(res), t(gamma), t(beta), 1e-5), dtype)
    ref = ops_cpu.segmented_layernorm(*(t(a) for a in (x, res, gamma, beta, gd, bd, starts, ids)), 1e-5)
    (got,) = in_orders(lambda: ops_gpu.segmented_layernorm(*(cp.asarray(a) for a in (x, res, gamma, beta, gd, bd)),
                                                           starts, ids, 1e-5), seed)
    check(got, ref, dtype)


def test_bias_gelu_rejects_0d_input():
    """A 0-d x used to launch one element with d = 0 (the kernel's e % d divides by zero and
    reads the empty bias); the launcher now refuses it, as ops_cpu does."""
    with pytest.raises(ValueError, match="at least one dimension"):
        ops_gpu.bias_gelu(cp.asarray(np.float32(1.0)), cp.zeros(0, np.float32))
    with pytest.raises((ValueError, IndexError)):
        ops_cpu.bias_gelu(torch.tensor(1.0), torch.zeros(0))
    empty = ops_gpu.bias_gelu(cp.zeros((3, 0), np.float32), cp.zeros(0, np.float32))
    assert empty.shape == (3, 0)


# -- injected bugs: the harness must fail ------------------------------------------------------------


def _patched(monkeypatch, source: str, old: str, new: str, count: int = 1, occurrence: int | None = None):
    """ops_gpu builds a copy of kernel source `source` with `old` replaced by `new`."""
    sources = dict(kernel_sources())
    text = sources[source]
    assert text.count(old) >= 1, f"{old!r} not in {source}"
    if occurrence is None:
        text = text.replace(old, new, count)
    else:
        starts = [m.start() for m in re.finditer(re.escape(old), text)]
        k = starts[occurrence]
        text = text[:k] + new + text[k + len(old):]
    sources[source] = text
    monkeypatch.setattr(ops_gpu, "kernel_sources", lambda: sources)
    monkeypatch.setattr(ops_gpu, "_functions", {})


def _sgmv_case(seed=1, rows=37, d_in=50, r=20):
    g = np.random.default_rng(seed)
    x, A = randn(g, (rows, d_in), np.float32), randn(g, (2, r, d_in), np.float32)
    starts = np.array([0, 20, rows], np.int32)
    ids = np.array([0, 1], np.int32)
    return x, A, starts, ids, ops_cpu.sgmv_shrink(t(x), t(A), t(starts), t(ids)).numpy()


def _detected(run, ref, tol=1e-5) -> str:
    try:
        got = cp.asnumpy(run())
    except emu.EmuError as exc:
        return f"launch error: {exc}"
    if not np.isfinite(got).all():
        return "non-finite output (poison)"
    err = rel_err(got, ref)
    return f"relative error {err:.3g}" if err > tol else ""


@pytest.mark.parametrize("which", [0, 1])
def test_injected_missing_syncthreads_is_caught(monkeypatch, which):
    """hk_seg_gemm (the SGMV/adapter main loop) without its first or second __syncthreads():
    threads read shared tiles other threads have not staged yet (poison) or already replaced."""
    _patched(monkeypatch, "sgmv", "__syncthreads();", ";", occurrence=which)
    x, A, starts, ids, ref = _sgmv_case()
    found = _detected(lambda: ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), starts, ids), ref)
    assert found, "a kernel without its barrier passed"


def test_injected_missing_barrier_between_warps_is_caught_by_the_order_test(monkeypatch):
    """hk_block_sum without its last __syncthreads(): warp 0 may overwrite the shared total
    (with the next reduction's partial) before another warp has read it.  Round robin over
    all threads hides it; the warp-by-warp schedules of the reverse and random orders show it."""
    _patched(monkeypatch, "fused", "    const float total = shm[0];\n    __syncthreads();", "    const float total = shm[0];\n")
    g = np.random.default_rng(0)
    x, res = randn(g, (4, 300), np.float32), randn(g, (4, 300), np.float32)
    with pytest.raises(AssertionError, match="block order"):
        in_orders(lambda: ops_gpu.residual_layernorm(cp.asarray(x), cp.asarray(res), cp.ones(300, np.float32),
                                                     cp.zeros(300, np.float32), 1e-5), 0)


def test_injected_divergent_barrier_is_reported(monkeypatch):
    """A __syncthreads() only some threads of a block reach is reported as divergence."""
    _patched(monkeypatch, "fused", "    const float total = shm[0];\n    __syncthreads();",
             "    const float total = shm[0];\n    if (threadIdx.x & 1) __syncthreads();")
    x = np.ones((2, 64), np.float32)
    with pytest.raises(emu.EmuError, match="barrier divergence|waits at a __syncthreads"):
        ops_gpu.residual_layernorm(cp.asarray(x), cp.asarray(x), cp.ones(64, np.float32), cp.zeros(64, np.float32))


def test_injected_shuffle_with_missing_lanes_is_reported(monkeypatch):
    """A full-mask __shfl_xor_sync that half the warp skips is reported."""
    _patched(monkeypatch, "bgmv", "    acc = hk_warp_sum(acc);", "    if (lane < 16) acc = hk_warp_sum(acc);")
    g = np.random.default_rng(0)
    x, A = randn(g, (3, 40), np.float32), randn(g, (2, 4, 40), np.float32)
    with pytest.raises(emu.EmuError, match="shfl_xor_sync|shuffle"):
        ops_gpu.bgmv_shrink(cp.asarray(x), cp.asarray(A), np.array([0, 1, 0], np.int32))


@pytest.mark.skipif(emu.sanitize_enabled(), reason="under ASan the out-of-bounds read aborts the process (by design)")
def test_injected_off_by_one_read_is_caught(monkeypatch):
    """hot_gather with `r > rows_total` instead of `r >= rows_total`: a row id equal to the
    number of rows reads one row past the values - poison, seen in the output."""
    _patched(monkeypatch, "hot_tier", "if (r < 0 || r >= rows_total) return;", "if (r < 0 || r > rows_total) return;")
    g = np.random.default_rng(0)
    values = randn(g, (5, 24), np.float32)
    rows = np.array([0, 4, 5, -1], np.int32)       # 5 == rows_total: a malformed id, must be a miss
    ref = np.zeros((4, 24), np.float32)
    ref[0], ref[1] = values[0], values[4]
    found = _detected(lambda: ops_gpu.hot_gather(cp.asarray(values), rows, cp.zeros((4, 24), np.float32)), ref, 0)
    assert found, "a read past the end of `values` went unnoticed"
    monkeypatch.undo()                              # the real source: the same input is fine
    monkeypatch.setattr(ops_gpu, "_functions", {})
    assert not _detected(lambda: ops_gpu.hot_gather(cp.asarray(values), rows, cp.zeros((4, 24), np.float32)), ref, 0)


@pytest.mark.skipif(emu.sanitize_enabled(), reason="under ASan the out-of-bounds write aborts the process (by design)")
def test_injected_off_by_one_write_is_caught(monkeypatch):
    """hot_gather with `c > width`: the last thread of a row writes one element past it; for the
    last row that is past the end of `out`, which the guard zone reports."""
    _patched(monkeypatch, "hot_tier", "if (i >= m || c >= width) return;", "if (i >= m || c > width) return;")
    values = np.ones((3, 20), np.float32)
    with pytest.raises(emu.EmuError, match="out-of-bounds write"):
        ops_gpu.hot_gather(cp.asarray(values), np.array([0, 1, 2], np.int32), cp.zeros((3, 20), np.float32))


def test_overlapping_segments_are_caught_by_the_order_test():
    """Overlapping segments break the one-writer-per-element contract: the rows [5, 10) are
    written by the blocks of two tenants, and the result depends on which block runs last."""
    g = np.random.default_rng(3)
    x, A = randn(g, (15, 20), np.float32), randn(g, (2, 8, 20), np.float32)
    starts = np.array([0, 10, 5, 15], np.int32)   # segments [0, 10), [10, 5) (empty), [5, 15)
    ids = np.array([0, 1, 1], np.int32)
    with pytest.raises(AssertionError, match="block order"):
        in_orders(lambda: ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), starts, ids), 0)
    disjoint = np.array([0, 10, 10, 15], np.int32)
    in_orders(lambda: ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), disjoint, ids), 0)


# -- malformed inputs stay in bounds ----------------------------------------------------------------

_INTS = st.integers(-(2**31), 2**31 - 1)
_SMALL = st.integers(-5, 45)


def _finite(*arrays):
    for a in arrays:
        a = cp.asnumpy(a)
        if a.dtype.kind == "f":
            assert np.isfinite(a).all(), "a kernel read poison: an out-of-bounds or uninitialised read"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_malformed_tables_stay_in_bounds(data, dtype):
    """Random segment tables (unsorted, negative, past the rows, huge), tenant ids out of range,
    delta offsets and indices past the deltas, hot-table rows past the values, lengths past L:
    every launcher must run without an out-of-bounds access (guards intact, no poison read;
    ASan in a sanitizer run) and leave finite numbers."""
    rows, T, d = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 16, 17, 33]))
    S = data.draw(st.integers(1, 5))
    val = st.one_of(_SMALL, _INTS)
    starts = np.array(data.draw(st.lists(val, min_size=S + 1, max_size=S + 1)), np.int32)
    ids = np.array(data.draw(st.lists(st.one_of(st.integers(-2, T + 2), _INTS), min_size=S, max_size=S)), np.int32)
    g = np.random.default_rng(data.draw(SEEDS))
    x, y = randn(g, (rows, d), dtype), randn(g, (rows, d), dtype)
    A, B = randn(g, (T, 5, d), dtype), randn(g, (T, d, 5), dtype)

    v = ops_gpu.sgmv_shrink(cp.asarray(x), cp.asarray(A), starts, ids)
    yy = ops_gpu.sgmv_expand(cp.asarray(y), v, cp.asarray(B), starts, ids)
    _finite(v, yy)
    row_ids = np.array(data.draw(st.lists(st.one_of(st.integers(-2, T + 2), _INTS), min_size=rows, max_size=rows)),
                       np.int32)
    _finite(ops_gpu.bgmv(cp.asarray(y), cp.asarray(x), cp.asarray(A), cp.asarray(B), row_ids))
    down, up = randn(g, (T, 7, d), dtype), randn(g, (T, d, 7), dtype)
    _finite(ops_gpu.segmented_adapter(cp.asarray(x), cp.asarray(down), cp.zeros((T, 7), dtype), cp.asarray(up),
                                      cp.zeros((T, d), dtype), starts, ids))
    _finite(ops_gpu.bias_gather(cp.asarray(y), cp.asarray(randn(g, (T, d), dtype)), starts, ids))
    nnz = data.draw(st.integers(0, 12))
    delta_idx = np.array(data.draw(st.lists(st.one_of(st.integers(-3, d * d + 3), _INTS), min_size=nnz, max_size=nnz)),
                         np.int32)
    offsets = np.array(data.draw(st.lists(val, min_size=T + 1, max_size=T + 1)), np.int32)
    _finite(ops_gpu.sparse_add(cp.asarray(y), cp.asarray(x), delta_idx, cp.asarray(randn(g, (nnz,), dtype)), offsets,
                               starts, ids))
    gamma = cp.ones(d, dtype)
    _finite(ops_gpu.segmented_layernorm(cp.asarray(x), cp.asarray(y), gamma, cp.zeros(d, dtype),
                                        cp.asarray(randn(g, (T, d), dtype)), cp.asarray(randn(g, (T, d), dtype)),
                                        starts, ids, 1e-5))
    L = max(1, rows // 2)
    lengths = np.array(data.draw(st.lists(val, min_size=2, max_size=2)), np.int32)
    _finite(ops_gpu.aggregate(cp.asarray(randn(g, (2 * L, 3, d), dtype)), lengths, "centered",
                              cp.asarray(g.random((2 * L, 3)) < 0.5)))
    hot_rows = np.array(data.draw(st.lists(st.one_of(st.integers(-2, 6), _INTS), min_size=4, max_size=4)), np.int32)
    _finite(ops_gpu.hot_gather(cp.asarray(randn(g, (4, d), dtype)), hot_rows, cp.zeros((4, d), dtype)))
    table_rows = np.array(data.draw(st.lists(st.one_of(st.integers(-1, 3), _INTS), min_size=8, max_size=8)), np.int32)
    keys = g.integers(0, 4, size=(8, 2), dtype=np.uint32)
    got = cp.asnumpy(ops_gpu.hot_probe(cp.asarray(keys), table_rows, cp.asarray(keys[:5]),
                                       data.draw(st.one_of(_SMALL, _INTS))))
    assert set(got.tolist()) <= set(table_rows.tolist()) | {-1}


# -- the launch checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bitfit():
    return emu.EmuModule(kernel_sources()["bitfit"])


def test_signatures_are_parsed_from_the_sources():
    for name, text in kernel_sources().items():
        sigs = emu.parse_kernels(text)
        assert sorted(s.name for s in sigs) == sorted(ENTRY_POINTS[name])
    (gelu,) = [s for s in emu.parse_kernels(kernel_sources()["fused"]) if s.name == "hk_bias_gelu_f16"]
    assert [(p.name, p.pointer, p.const, p.dtype) for p in gelu.params] == [
        ("y", True, False, np.dtype(np.uint16)), ("x", True, True, np.dtype(np.uint16)),
        ("bias", True, True, np.dtype(np.uint16)), ("total", False, False, np.dtype(np.int64)),
        ("d", False, False, np.dtype(np.int32))]
    assert gelu.launch_bounds == "256"


def test_launch_checks(bitfit):
    fn = bitfit.get_function("hk_bias_gather_f32")
    assert bitfit.launch_bounds["hk_bias_gather_f32"] == 256
    y, bias = cp.zeros((2, 8), np.float32), cp.ones((1, 8), np.float32)
    starts, ids = cp.asarray(np.array([0, 2], np.int32)), cp.asarray(np.array([0], np.int32))
    good = (y, bias, starts, ids, np.int32(1), np.int32(2), np.int32(1), np.int32(8))
    fn((2, 1, 1), (32, 1, 1), good)
    assert (cp.asnumpy(y) == 1).all()
    cases = [
        (((2, 1, 1), (32, 1, 1), good[:-1]), "7 arguments for 8"),
        (((2, 1, 1), (32, 1, 1), good[:4] + (1,) + good[5:]), "NumPy scalar"),
        (((2, 1, 1), (32, 1, 1), good[:4] + (np.int64(1),) + good[5:]), "int32 scalar"),
        (((2, 1, 1), (32, 1, 1), (cp.zeros((2, 8), np.float16),) + good[1:]), "float32 data"),
        (((2, 1, 1), (32, 1, 1), (y[:, ::2],) + good[1:]), "not C-contiguous"),
        (((0, 1, 1), (32, 1, 1), good), ">= 1"),
        (((2**31, 1, 1), (32, 1, 1), good), "limits"),
        (((1, 65536, 1), (32, 1, 1), good), "limits"),
        (((2, 1, 1), (512, 1, 1), good), "__launch_bounds__"),
        (((2, 1, 1), (2048, 1, 1), good), "per-dimension"),
        (((2, 1, 1), (32, 32, 2), good), "1024"),
        (((2, 1, 1), (1, 1, 65), good), "per-dimension"),
        (((2, 1, 1), (32, 1, 1), good), None),
    ]
    for (grid, block, args), message in cases:
        if message is None:
            fn(grid, block, args, shared_mem=0)
            with pytest.raises(emu.EmuError, match="dynamic shared memory"):
                fn(grid, block, args, shared_mem=16)
            continue
        with pytest.raises(emu.EmuError, match=re.escape(message)):
            fn(grid, block, args)
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        cp.RawModule(code=kernel_sources()["bitfit"]).get_function("hk_bias_gather_f32")(
            (2, 1, 1), (32, 1, 1), (np.zeros((2, 8), np.float32),) + good[1:])


def test_static_shared_memory_is_found_and_poisoned():
    sgmv = emu.EmuModule(kernel_sources()["sgmv"])
    assert sgmv.static_shared_bytes == 4 * 2 * 16 * 17 * 4         # xs, ws of 4 instantiations
    assert all("xs" in n or "ws" in n for n in sgmv.shared_variables)
    fused = emu.EmuModule(kernel_sources()["fused"])
    assert fused.static_shared_bytes == 2 * 32 * 4                 # shm of 2 instantiations


def test_unsupported_asm_fails_the_build():
    text = kernel_sources()["bitfit"].replace('asm("cvt.rn.f16.f32 %0, %1;"', 'asm("cvt.rz.f16.f32 %0, %1;"')
    with pytest.raises(emu.EmuError, match="unsupported inline asm"):
        emu.EmuModule(text)


def test_missing_compiler_is_a_skip_reason(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert "no C++ compiler" in emu.compiler_missing_reason()


def test_the_standin_is_not_cupy():
    """The stand-in is handed over explicitly; `import cupy` never finds it, so runtime.open's
    device="auto" cannot take it for a GPU."""
    import sys

    import runtime

    assert sys.modules.get("cupy") is not cp
    with ops_gpu.use_cupy(cp):
        assert ops_gpu._cupy() is cp
        if "cupy" not in sys.modules:
            assert not runtime._cuda_available()
    assert ops_gpu._cupy_module is None or ops_gpu._cupy_module is cp   # restored after the block
