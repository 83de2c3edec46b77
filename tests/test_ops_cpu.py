"""Property tests: each runtime.exec.ops_cpu op equals a naive per-row / per-segment loop.

The naive references below are written straight from the definitions (float64, one row at
a time).  Sizes are drawn around the kernels' tiles (16, 32, 64: multiples and not), with
empty segments, segments without a PET (id -1), rows outside every segment and single rows.
The hot-tier probe is checked against a dict and its hash against xxhash.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import ops_cpu

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TILE_SIZES = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65]
dims = st.one_of(st.sampled_from(TILE_SIZES), st.integers(1, 80))
small = st.one_of(st.sampled_from([1, 2, 7, 15, 16, 17, 32, 33]), st.integers(1, 40))
dtypes = st.sampled_from([np.float32, np.float16])
seeds = st.integers(0, 2**32 - 1)
TOL = {np.float32: 1e-5, np.float16: 2e-3}


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def close(out, ref, dtype) -> None:
    out = out.numpy() if isinstance(out, torch.Tensor) else out
    assert np.isfinite(np.asarray(out, dtype=np.float64)).all()
    assert rel_err(out, ref) <= TOL[dtype]


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def f64(a):
    return np.asarray(a, dtype=np.float64)


def randn(g, shape, dtype, scale=1.0):
    return (g.standard_normal(shape) * scale).astype(dtype)


def segment_table(g, rows: int, T: int):
    S = int(g.integers(1, 7))
    cuts = np.sort(g.integers(0, rows + 1, size=S - 1))
    starts = np.concatenate([[0], cuts, [rows]])
    if S > 1 and g.random() < 0.3:
        starts[0] = starts[1] // 2
    if g.random() < 0.2:
        starts[-1] = max(starts[-2], rows - 1)   # the last row may be uncovered too
    return starts.astype(np.int32), g.integers(-1, T, size=S).astype(np.int32)


def naive_segments(starts, ids):
    """(row, tenant) for every row of every segment with a PET."""
    for s, tid in enumerate(ids):
        if tid >= 0:
            for row in range(starts[s], starts[s + 1]):
                yield row, tid


# -- 1. aggregation -------------------------------------------------------------------------------


def naive_aggregate(values, lengths, n, left, mask):
    B = len(lengths)
    L = values.shape[0] // B
    d = values.shape[2]
    out = np.zeros((B, L, d))
    for b in range(B):
        for i in range(min(lengths[b], L)):
            acc, cnt = np.zeros(d), 0
            for j in range(min(lengths[b], L)):           # windows in the sequence
                k = i - j + left                         # i's slot in window j
                if 0 <= k < n and (mask is None or mask[b * L + j, k]):
                    acc += values[b * L + j, k]
                    cnt += 1
            out[b, i] = acc / cnt if cnt else 0.0
    return out


@SETTINGS
@given(B=st.integers(1, 4), L=st.integers(1, 20), n=st.integers(1, 6), d=small, window=st.sampled_from(["centered", "causal"]),
       dtype=dtypes, masked=st.booleans(), seed=seeds)
def test_aggregate(B, L, n, d, window, dtype, masked, seed):
    g = np.random.default_rng(seed)
    values = randn(g, (B * L, n, d), dtype)
    lengths = g.integers(0, L + 3, size=B)
    mask = g.random((B * L, n)) < 0.6 if masked else None
    left = (n - 1) // 2 if window == "centered" else n - 1
    out = ops_cpu.aggregate(t(values), t(lengths), window, None if mask is None else t(mask))
    assert out.dtype == torch.float32 and out.shape == (B, L, d)
    close(out, naive_aggregate(f64(values), lengths, n, left, mask), np.float32)


def test_aggregate_matches_format_example():
    # n = 3 centered, one sequence of 3 tokens: token 0 is covered by windows 0 and 1.
    values = torch.arange(3 * 3 * 1, dtype=torch.float32).reshape(3, 3, 1)
    out = ops_cpu.aggregate(values, torch.tensor([3]), "centered")[0, :, 0]
    # window j slot k holds 3j + k; token i: windows j = i-1, i, i+1 (in-sequence) at slot i-j+1
    assert out.tolist() == [(1 + 3) / 2, (2 + 4 + 6) / 3, (5 + 7) / 2]


# -- 2. SGMV --------------------------------------------------------------------------------------


@SETTINGS
@given(rows=dims, d_in=dims, r=small, d_out=dims, T=st.integers(1, 4), dtype=dtypes, use_scales=st.booleans(), seed=seeds)
def test_sgmv(rows, d_in, r, d_out, T, dtype, use_scales, seed):
    g = np.random.default_rng(seed)
    x, A = randn(g, (rows, d_in), dtype), randn(g, (T, r, d_in), dtype, 0.2)
    B, y = randn(g, (T, d_out, r), dtype, 0.2), randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2, size=T).astype(np.float32) if use_scales else None
    starts, ids = segment_table(g, rows, T)

    v_ref = np.zeros((rows, r))
    y_ref = f64(y).copy()
    for row, tid in naive_segments(starts, ids):
        v_ref[row] = f64(A[tid]) @ f64(x[row])
        y_ref[row] += (1.0 if scales is None else scales[tid]) * (f64(B[tid]) @ v_ref[row])

    v = ops_cpu.sgmv_shrink(t(x), t(A), t(starts), t(ids))
    assert v.dtype == torch.float32
    close(v, v_ref, dtype)
    y_t = t(y.copy())
    out = ops_cpu.sgmv(y_t, t(x), t(A), t(B), t(starts), t(ids), None if scales is None else t(scales))
    assert out is y_t and out.dtype == y_t.dtype
    close(out, y_ref, dtype)


# -- 3. BGMV --------------------------------------------------------------------------------------


@SETTINGS
@given(rows=dims, d_in=dims, r=small, d_out=dims, T=st.integers(1, 4), dtype=dtypes, seed=seeds)
def test_bgmv(rows, d_in, r, d_out, T, dtype, seed):
    g = np.random.default_rng(seed)
    x, A = randn(g, (rows, d_in), dtype), randn(g, (T, r, d_in), dtype, 0.2)
    B, y = randn(g, (T, d_out, r), dtype, 0.2), randn(g, (rows, d_out), dtype)
    scales = g.uniform(0.5, 2, size=T).astype(np.float32)
    row_ids = g.integers(-1, T, size=rows).astype(np.int32)
    v_ref, y_ref = np.zeros((rows, r)), f64(y).copy()
    for row in range(rows):
        tid = row_ids[row]
        if tid >= 0:
            v_ref[row] = f64(A[tid]) @ f64(x[row])
            y_ref[row] += scales[tid] * (f64(B[tid]) @ v_ref[row])
    close(ops_cpu.bgmv_shrink(t(x), t(A), t(row_ids)), v_ref, dtype)
    y_t = t(y.copy())
    assert ops_cpu.bgmv(y_t, t(x), t(A), t(B), t(row_ids), t(scales)) is y_t
    close(y_t, y_ref, dtype)


# -- 4. segmented adapter -------------------------------------------------------------------------


@SETTINGS
@given(rows=dims, d=dims, bn=small, T=st.integers(1, 4), dtype=dtypes, seed=seeds)
def test_segmented_adapter(rows, d, bn, T, dtype, seed):
    g = np.random.default_rng(seed)
    x = randn(g, (rows, d), dtype)
    down, down_bias = randn(g, (T, bn, d), dtype, 0.2), randn(g, (T, bn), dtype, 0.2)
    up, up_bias = randn(g, (T, d, bn), dtype, 0.2), randn(g, (T, d), dtype, 0.2)
    starts, ids = segment_table(g, rows, T)
    ref = f64(x).copy()
    for row, tid in naive_segments(starts, ids):
        h = np.maximum(f64(down[tid]) @ f64(x[row]) + f64(down_bias[tid]), 0.0)
        ref[row] = f64(x[row]) + f64(up[tid]) @ h + f64(up_bias[tid])
    out = ops_cpu.segmented_adapter(t(x), t(down), t(down_bias), t(up), t(up_bias), t(starts), t(ids))
    close(out, ref, dtype)


# -- 5. bias gather -------------------------------------------------------------------------------


@SETTINGS
@given(rows=dims, d_out=dims, T=st.integers(1, 4), dtype=dtypes, seed=seeds)
def test_bias_gather(rows, d_out, T, dtype, seed):
    g = np.random.default_rng(seed)
    y, bias = randn(g, (rows, d_out), dtype), randn(g, (T, d_out), dtype)
    starts, ids = segment_table(g, rows, T)
    ref = f64(y).copy()
    for row, tid in naive_segments(starts, ids):
        ref[row] += f64(bias[tid])
    close(ops_cpu.bias_gather(t(y.copy()), t(bias), t(starts), t(ids)), ref, dtype)


# -- 6. sparse add --------------------------------------------------------------------------------


@SETTINGS
@given(rows=dims, d_in=dims, d_out=dims, T=st.integers(1, 4), density=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
       dtype=dtypes, seed=seeds)
def test_sparse_add(rows, d_in, d_out, T, density, dtype, seed):
    g = np.random.default_rng(seed)
    x, y = randn(g, (rows, d_in), dtype), randn(g, (rows, d_out), dtype)
    idx, vals, offs = [], [], [0]
    for _ in range(T):
        f = np.sort(g.choice(d_out * d_in, size=int(g.binomial(d_out * d_in, density)), replace=False))
        idx.append(f)
        vals.append(randn(g, f.shape, dtype))
        offs.append(offs[-1] + f.size)
    idx, vals, offs = np.concatenate(idx).astype(np.int32), np.concatenate(vals).astype(dtype), np.array(offs)
    starts, ids = segment_table(g, rows, T)
    ref = f64(y).copy()
    for row, tid in naive_segments(starts, ids):
        for e in range(offs[tid], offs[tid + 1]):
            ref[row, idx[e] // d_in] += float(vals[e]) * float(x[row, idx[e] % d_in])
    out = ops_cpu.sparse_add(t(y.copy()), t(x), t(idx), t(vals), t(offs), t(starts), t(ids))
    close(out, ref, dtype)


def test_sparse_add_rejects_unsorted_tenant():
    y, x = torch.zeros(2, 4), torch.ones(2, 4)
    idx = torch.tensor([5, 3, 1, 2], dtype=torch.int32)       # tenant 0: [5, 3] unsorted
    with pytest.raises(ValueError, match="nondecreasing"):
        ops_cpu.sparse_add(y, x, idx, torch.ones(4), torch.tensor([0, 2, 4]), torch.tensor([0, 2]), torch.tensor([0]))
    idx = torch.tensor([3, 5, 1, 2], dtype=torch.int32)       # a drop only at the tenant boundary: fine
    ops_cpu.sparse_add(y, x, idx, torch.ones(4), torch.tensor([0, 2, 4]), torch.tensor([0, 2]), torch.tensor([1]))
    assert y[:, 0].tolist() == [2.0, 2.0] and y[:, 1:].abs().sum() == 0   # tenant 1: (0,1) + (0,2)


# -- segment table validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "starts,ids",
    [([0, 3, 2], [0, 0]), ([0, 5], [0]), ([-1, 2], [0]), ([0, 2], [3]), ([0, 1, 2], [0])],
)
def test_bad_segment_tables_raise(starts, ids):
    with pytest.raises(ValueError):
        ops_cpu.bias_gather(torch.zeros(4, 2), torch.zeros(3, 2), torch.tensor(starts), torch.tensor(ids))


def test_empty_batch_and_single_row():
    x = torch.zeros(0, 8)
    v = ops_cpu.sgmv_shrink(x, torch.ones(2, 4, 8), torch.tensor([0, 0]), torch.tensor([1]))
    assert v.shape == (0, 4)
    y = ops_cpu.sgmv(torch.zeros(1, 3), torch.ones(1, 8), torch.ones(2, 4, 8), torch.ones(2, 3, 4),
                     torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1.0, 0.5]))
    assert y.tolist() == [[16.0, 16.0, 16.0]]


# -- 7. hot tier ----------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 7), m=st.integers(0, 50), seed=seeds)
def test_xxh64_keys_equals_xxhash(n, m, seed):
    keys = np.random.default_rng(seed).integers(0, 2**32, size=(m, n), dtype=np.uint32)
    got = ops_cpu.xxh64_keys(keys)
    assert got.dtype == np.uint64 and got.shape == (m,)
    assert [int(h) for h in got] == [xxhash.xxh64_intdigest(k.tobytes()) for k in keys]


@SETTINGS
@given(n=st.integers(2, 5), count=st.integers(0, 400), vocab=st.integers(2, 30), extra=st.integers(0, 64),
       seed=seeds, fixed_capacity=st.booleans())
def test_hot_probe_equals_dict(n, count, vocab, extra, seed, fixed_capacity):
    g = np.random.default_rng(seed)
    keys = np.unique(g.integers(0, vocab, size=(count, n), dtype=np.uint32), axis=0)
    g.shuffle(keys)
    m = len(keys)
    value_rows = g.permutation(m).astype(np.int32)
    capacity = max(8, 1 << (m - 1).bit_length()) if fixed_capacity and m else None   # load up to 1
    tk, tr, max_probe = ops_cpu.build_hot_table(keys, value_rows, capacity)
    cap = tk.shape[0]
    assert cap & (cap - 1) == 0 and cap >= m and (tr >= 0).sum() == m
    if capacity is None:
        assert cap == max(8, 1 << max(0, (2 * m - 1).bit_length()))
    # layout invariant: no empty slot between an entry's home and its slot, within max_probe
    homes = ops_cpu.xxh64_keys(tk[tr >= 0]) & np.uint64(cap - 1)
    for slot, home in zip(np.nonzero(tr >= 0)[0], homes.astype(np.int64)):
        dist = (slot - home) % cap
        assert dist <= max_probe
        assert all(tr[(home + p) % cap] >= 0 for p in range(dist))
    table = {tuple(k): int(r) for k, r in zip(keys.tolist(), value_rows)}
    queries = np.concatenate([keys, g.integers(0, vocab + 2, size=(extra, n), dtype=np.uint32)])
    got = ops_cpu.hot_probe(tk, tr, queries, max_probe)
    assert got.dtype == torch.int32
    assert got.tolist() == [table.get(tuple(q), -1) for q in queries.tolist()]
    # torch inputs and precomputed hashes give the same answer
    again = ops_cpu.hot_probe(torch.from_numpy(tk), torch.from_numpy(tr), torch.from_numpy(queries), max_probe,
                              hashes=ops_cpu.xxh64_keys(queries))
    assert again.tolist() == got.tolist()


def test_hot_probe_stops_at_empty_slot_and_budget():
    keys = np.array([[1, 2], [3, 4]], dtype=np.uint32)
    tk, tr, max_probe = ops_cpu.build_hot_table(keys)
    q = np.array([[1, 2], [3, 4], [9, 9]], dtype=np.uint32)
    assert ops_cpu.hot_probe(tk, tr, q, max_probe).tolist() == [0, 1, -1]
    # a colliding table: every entry homes to slot 0 when hashes are forced to 0
    h0 = np.zeros(3, dtype=np.uint64)
    tk2 = np.zeros((8, 2), dtype=np.uint32)
    tr2 = np.full(8, -1, dtype=np.int32)
    tk2[:2], tr2[:2] = keys, [10, 11]
    assert ops_cpu.hot_probe(tk2, tr2, q, 1, hashes=h0).tolist() == [10, 11, -1]
    assert ops_cpu.hot_probe(tk2, tr2, q, 0, hashes=h0).tolist() == [10, -1, -1]


def test_build_hot_table_rejects_duplicates():
    with pytest.raises(ValueError):
        ops_cpu.build_hot_table(np.array([[1, 2], [1, 2]], dtype=np.uint32))


@SETTINGS
@given(m=st.integers(0, 40), rows_total=st.integers(1, 30), width=dims, dtype=dtypes, seed=seeds)
def test_hot_gather(m, rows_total, width, dtype, seed):
    g = np.random.default_rng(seed)
    values = randn(g, (rows_total, width), dtype)
    rows = g.integers(-1, rows_total, size=m).astype(np.int32)
    out = np.full((m, width), 7.0, dtype=dtype)
    ref = out.copy()
    for i in range(m):
        if rows[i] >= 0:
            ref[i] = values[rows[i]]
    got = ops_cpu.hot_gather(t(values), t(rows), t(out))
    np.testing.assert_array_equal(got.numpy(), ref)


# -- 8. fused element-wise ------------------------------------------------------------------------


@SETTINGS
@given(rows=st.integers(1, 9), d=dims, dtype=dtypes, seed=seeds)
def test_bias_gelu(rows, d, dtype, seed):
    g = np.random.default_rng(seed)
    x, bias = randn(g, (rows, d), dtype, 2.0), randn(g, (d,), dtype)
    ref = np.zeros((rows, d))
    for i in range(rows):
        for c in range(d):
            v = float(x[i, c]) + float(bias[c])
            ref[i, c] = 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))
    # Rounded to the output dtype first: a tiny result (the GELU tail) is an fp16 subnormal.
    close(ops_cpu.bias_gelu(t(x), t(bias)), ref.astype(dtype).astype(np.float64), dtype)


@SETTINGS
@given(rows=st.integers(1, 9), d=dims, dtype=dtypes, seed=seeds)
def test_residual_layernorm(rows, d, dtype, seed):
    g = np.random.default_rng(seed)
    x, res = randn(g, (rows, d), dtype), randn(g, (rows, d), dtype)
    gamma, beta = randn(g, (d,), dtype), randn(g, (d,), dtype)
    eps = 1e-5
    ref = np.zeros((rows, d))
    for i in range(rows):
        v = f64(x[i]) + f64(res[i])
        mean = v.sum() / d
        var = ((v - mean) ** 2).sum() / d
        ref[i] = (v - mean) / math.sqrt(var + eps) * f64(gamma) + f64(beta)
    close(ops_cpu.residual_layernorm(t(x), t(res), t(gamma), t(beta), eps), ref, dtype)


@SETTINGS
@given(rows=dims, d=dims, T=st.integers(1, 4), dtype=dtypes, seed=seeds)
def test_segmented_layernorm(rows, d, T, dtype, seed):
    g = np.random.default_rng(seed)
    x, res = randn(g, (rows, d), dtype), randn(g, (rows, d), dtype)
    gamma, beta = randn(g, (d,), dtype), randn(g, (d,), dtype)
    gamma_delta, beta_delta = randn(g, (T, d), dtype), randn(g, (T, d), dtype)
    starts, ids = segment_table(g, rows, T)
    eps = 1e-5
    tenant = dict(naive_segments(starts, ids))  # rows of no tenant keep the shared gain and shift
    ref = np.zeros((rows, d))
    for i in range(rows):
        v = f64(x[i]) + f64(res[i])
        mean = v.sum() / d
        var = ((v - mean) ** 2).sum() / d
        gain, shift = f64(gamma), f64(beta)
        if i in tenant:
            gain, shift = gain + f64(gamma_delta[tenant[i]]), shift + f64(beta_delta[tenant[i]])
        ref[i] = (v - mean) / math.sqrt(var + eps) * gain + shift
    args = [t(a) for a in (x, res, gamma, beta, gamma_delta, beta_delta, starts, ids)]
    close(ops_cpu.segmented_layernorm(*args, eps), ref, dtype)
    x_t = args[0]
    assert ops_cpu.segmented_layernorm(*args, eps, out=x_t) is x_t  # in place, as the executor calls it
    close(x_t, ref, dtype)


def test_fused_out_in_place():
    x = torch.randn(3, 5)
    ref = ops_cpu.bias_gelu(x, torch.zeros(5))
    assert ops_cpu.bias_gelu(x, torch.zeros(5), out=x) is x
    assert torch.equal(x, ref)
