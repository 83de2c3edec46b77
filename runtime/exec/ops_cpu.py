"""PyTorch CPU reference of the runtime's custom operations (the reference for everything).

`runtime.exec.ops_gpu` has one function per function here, same name, same signature, taking
CuPy arrays; its tests compare the two.  Conventions shared by every operation:

* Rows are the tokens of a batch.  A *segment table* is ``seg_starts`` (S+1,) int and
  ``seg_ids`` (S,) int: segment s covers rows ``seg_starts[s] .. seg_starts[s+1]`` and uses
  entry ``seg_ids[s]`` of the stacked per-tenant weights; a negative id means "no PET on this
  segment" (skipped).  Starts are nondecreasing (empty segments allowed, segments never
  overlap); rows no segment covers are left alone.  *Per-row* variants take ``row_ids``
  (rows,) int instead, negative = skip.
* Activations and weights of one call share a dtype, fp32 or fp16; accumulation is fp32 and
  the result is rounded once to the output dtype.  Intermediates (LoRA's ``v``, the adapter's
  hidden) are fp32.
* Functions that take ``y`` update it in place and return it.  Functions that allocate take
  ``out=None``: when given, it is written (see each function for which rows) and returned.
* Malformed input (shapes, dtypes, a segment table out of range, a tenant id >= T) raises
  ValueError here; the GPU kernels skip such segments instead of checking on the host.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from formats.segment import build_index
from formats.xxh64 import hash_keys

__all__ = [
    "WINDOW_KINDS",
    "aggregate",
    "bgmv",
    "bgmv_expand",
    "bgmv_shrink",
    "bias_gather",
    "bias_gelu",
    "build_hot_table",
    "hot_gather",
    "hot_probe",
    "residual_layernorm",
    "segmented_adapter",
    "segmented_layernorm",
    "sgmv",
    "sgmv_expand",
    "sgmv_shrink",
    "sparse_add",
    "window_left",
    "xxh64_keys",
]

WINDOW_KINDS = ("centered", "causal")
_FLOATS = (torch.float16, torch.float32)


# -- validation helpers ---------------------------------------------------------------------------


def window_left(n: int, window: str) -> int:
    """l, the number of slots left of the center (FORMAT.md section 4)."""
    if n < 1:
        raise ValueError(f"window size n={n} must be at least 1")
    if window == "centered":
        return (n - 1) // 2
    if window == "causal":
        return n - 1
    raise ValueError(f"unknown window kind {window!r}; expected one of {WINDOW_KINDS}")


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    if dtype not in _FLOATS:
        raise ValueError(f"expected float16 or float32, got {dtype}")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise ValueError(f"dtype mismatch: {t.dtype} vs {dtype}")
    return dtype


def _shape(t: torch.Tensor, shape: tuple, name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _ints(t, name: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer array")
    return t.to(torch.int64)


def _segments(seg_starts, seg_ids, rows: int, num_tenants: int) -> list[tuple[int, int, int]]:
    """[(start, end, tenant)] of the active segments (tenant >= 0, start < end)."""
    starts = _ints(seg_starts, "seg_starts")
    ids = _ints(seg_ids, "seg_ids")
    if starts.numel() != ids.numel() + 1:
        raise ValueError(f"seg_starts needs S+1 = {ids.numel() + 1} entries, has {starts.numel()}")
    if ids.numel() == 0:
        return []
    if starts[0] < 0 or starts[-1] > rows or bool((starts[1:] < starts[:-1]).any()):
        raise ValueError(f"seg_starts must be nondecreasing within [0, {rows}]")
    if bool((ids >= num_tenants).any()):
        raise ValueError(f"seg_ids must be < T = {num_tenants}")
    return [(a, b, t) for a, b, t in zip(starts[:-1].tolist(), starts[1:].tolist(), ids.tolist()) if t >= 0 and a < b]


def _row_groups(row_ids, rows: int, num_tenants: int) -> list[tuple[int, torch.Tensor]]:
    """[(tenant, row indices)] for the rows with a valid tenant."""
    ids = _ints(row_ids, "row_ids")
    _shape(ids, (rows,), "row_ids")
    if bool((ids >= num_tenants).any()):
        raise ValueError(f"row_ids must be < T = {num_tenants}")
    return [(int(t), torch.nonzero(ids == t).flatten()) for t in torch.unique(ids[ids >= 0]).tolist()]


def _scale(scales, t: int) -> float:
    return 1.0 if scales is None else float(scales[t])


def _out(out, shape: tuple, dtype: torch.dtype, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.zeros(shape, dtype=dtype)
    _shape(out, shape, name)
    if out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {out.dtype}")
    return out


# -- 1. aggregation -------------------------------------------------------------------------------


def aggregate(values, lengths, window: str = "centered", slot_mask=None, out=None) -> torch.Tensor:
    """Upper-layer inputs (B, L, d) fp32 from gathered window values (FORMAT.md section 4).

    values (B*L, n, d) fp16/fp32: row b*L + j holds the n slot vectors of the window at
    position j of sequence b; lengths (B,): windows j >= lengths[b] are padding.
    out[b, i] = mean over the windows j < lengths[b] covering i (i - j + l in [0, n)) of
    values[b*L + j, i - j + l]; positions i >= lengths[b] are 0.  Optional slot_mask
    (B*L, n) bool: slots with False do not count (e.g. slots a backed-off key padded);
    a token no counted slot covers is 0.  Every element of out is written.
    """
    values = torch.as_tensor(values)
    if values.dim() != 3:
        raise ValueError("values must be (B*L, n, d)")
    _float_dtype(values)
    m, n, d = values.shape
    lengths = _ints(lengths, "lengths")
    B = lengths.numel()
    if B == 0 or m % B:
        raise ValueError(f"values rows ({m}) must be B*L with B = len(lengths) = {B} >= 1")
    L = m // B
    left = window_left(n, window)
    res = _out(out, (B, L, d), torch.float32)
    V = values.reshape(B, L, n, d).float()
    pos = torch.arange(L)
    real = pos[None, :] < lengths.clamp(0, L)[:, None]                 # (B, L)
    counted = real[:, :, None].expand(B, L, n)                         # (B, L(window), n)
    if slot_mask is not None:
        slot_mask = torch.as_tensor(slot_mask)
        _shape(slot_mask, (m, n), "slot_mask")
        counted = counted & slot_mask.reshape(B, L, n).bool()
    total = torch.zeros(B, L, d)
    count = torch.zeros(B, L)
    for k in range(n):                      # token i sits in slot k of window j = i - (k - l)
        shift = k - left
        i0, i1 = max(0, shift), L + min(0, shift)
        if i1 <= i0:
            continue
        j0, j1 = i0 - shift, i1 - shift
        c = counted[:, j0:j1, k]
        total[:, i0:i1] += torch.where(c[..., None], V[:, j0:j1, k], 0.0)
        count[:, i0:i1] += c
    keep = real & (count > 0)
    res.copy_(torch.where(keep[..., None], total / count.clamp(min=1)[..., None], 0.0))
    return res


# -- 2. SGMV --------------------------------------------------------------------------------------


def sgmv_shrink(x, A, seg_starts, seg_ids, out=None) -> torch.Tensor:
    """v[rows of s] = x[rows of s] @ A[seg_ids[s]].T, fp32 (rows, r).

    x (rows, d_in), A (T, r, d_in).  Only rows of active segments are written (the rest of a
    fresh out is 0).
    """
    _float_dtype(x, A)
    rows, d_in = x.shape
    T, r, _ = A.shape
    _shape(A, (T, r, d_in), "A")
    v = _out(out, (rows, r), torch.float32)
    for a, b, t in _segments(seg_starts, seg_ids, rows, T):
        v[a:b] = x[a:b].float() @ A[t].float().T
    return v


def _check_expand(y, v, B, scales):
    """Shapes shared by SGMV and BGMV expand; returns (rows, T)."""
    _float_dtype(y, B)
    rows, d_out = y.shape
    T, _, r = B.shape
    _shape(B, (T, d_out, r), "B")
    _shape(v, (rows, r), "v")
    if scales is not None:
        _shape(torch.as_tensor(scales), (T,), "scales")
    return rows, T


def sgmv_expand(y, v, B, seg_starts, seg_ids, scales=None) -> torch.Tensor:
    """y[rows of s] += scales[t] * v[rows of s] @ B[t].T, t = seg_ids[s]; in place.

    y (rows, d_out), v (rows, r) fp32, B (T, d_out, r), scales (T,) or None (= 1).
    """
    rows, T = _check_expand(y, v, B, scales)
    for a, b, t in _segments(seg_starts, seg_ids, rows, T):
        y[a:b] = (y[a:b].float() + _scale(scales, t) * (v[a:b].float() @ B[t].float().T)).to(y.dtype)
    return y


def sgmv(y, x, A, B, seg_starts, seg_ids, scales=None) -> torch.Tensor:
    """LoRA on segments: y[rows of s] += scale_t * (x @ A[t].T) @ B[t].T; in place."""
    v = sgmv_shrink(x, A, seg_starts, seg_ids)
    return sgmv_expand(y, v, B, seg_starts, seg_ids, scales)


# -- 3. BGMV --------------------------------------------------------------------------------------


def bgmv_shrink(x, A, row_ids, out=None) -> torch.Tensor:
    """v[row] = A[row_ids[row]] @ x[row], fp32 (rows, r); rows with a negative id not written."""
    _float_dtype(x, A)
    rows, d_in = x.shape
    T, r, _ = A.shape
    _shape(A, (T, r, d_in), "A")
    v = _out(out, (rows, r), torch.float32)
    for t, sel in _row_groups(row_ids, rows, T):
        v[sel] = x[sel].float() @ A[t].float().T
    return v


def bgmv_expand(y, v, B, row_ids, scales=None) -> torch.Tensor:
    """y[row] += scales[t] * B[t] @ v[row], t = row_ids[row] >= 0; in place."""
    rows, T = _check_expand(y, v, B, scales)
    for t, sel in _row_groups(row_ids, rows, T):
        y[sel] = (y[sel].float() + _scale(scales, t) * (v[sel].float() @ B[t].float().T)).to(y.dtype)
    return y


def bgmv(y, x, A, B, row_ids, scales=None) -> torch.Tensor:
    """LoRA per row: y[row] += scale_t * B[t] @ (A[t] @ x[row]); in place."""
    v = bgmv_shrink(x, A, row_ids)
    return bgmv_expand(y, v, B, row_ids, scales)


# -- 4. segmented adapter -------------------------------------------------------------------------


def segmented_adapter(x, down, down_bias, up, up_bias, seg_starts, seg_ids, out=None) -> torch.Tensor:
    """y = x + up(relu(down(x))) per segment (Houlsby bottleneck), y = x elsewhere.

    x (rows, d); down (T, b, d), down_bias (T, b), up (T, d, b), up_bias (T, d).
    Every row of out is written; out may be x itself.
    """
    _float_dtype(x, down, down_bias, up, up_bias)
    rows, d = x.shape
    T, bn, _ = down.shape
    _shape(down, (T, bn, d), "down")
    _shape(down_bias, (T, bn), "down_bias")
    _shape(up, (T, d, bn), "up")
    _shape(up_bias, (T, d), "up_bias")
    segs = _segments(seg_starts, seg_ids, rows, T)
    y = _out(out, (rows, d), x.dtype)
    if y is not x:
        y.copy_(x)
    for a, b, t in segs:
        xs = x[a:b].float()
        h = torch.relu(xs @ down[t].float().T + down_bias[t].float())
        y[a:b] = (xs + h @ up[t].float().T + up_bias[t].float()).to(y.dtype)
    return y


# -- 5. bias gather (BitFit) ----------------------------------------------------------------------


def bias_gather(y, bias_delta, seg_starts, seg_ids) -> torch.Tensor:
    """y[rows of s] += bias_delta[seg_ids[s]]; y (rows, d_out), bias_delta (T, d_out); in place."""
    _float_dtype(y, bias_delta)
    rows, d_out = y.shape
    T = bias_delta.shape[0]
    _shape(bias_delta, (T, d_out), "bias_delta")
    for a, b, t in _segments(seg_starts, seg_ids, rows, T):
        y[a:b] = (y[a:b].float() + bias_delta[t].float()).to(y.dtype)
    return y


# -- 6. sparse add (diff pruning) -----------------------------------------------------------------


def _check_delta(delta_idx, delta_vals, delta_offsets, d_out: int, d_in: int):
    idx = _ints(delta_idx, "delta_idx")
    offs = _ints(delta_offsets, "delta_offsets")
    nnz = idx.numel()
    _shape(delta_vals, (nnz,), "delta_vals")
    if offs.numel() < 1 or offs[0] != 0 or offs[-1] != nnz or bool((offs[1:] < offs[:-1]).any()):
        raise ValueError(f"delta_offsets must be nondecreasing from 0 to nnz = {nnz}")
    if nnz and (idx.min() < 0 or idx.max() >= d_out * d_in):
        raise ValueError(f"delta_idx must lie in [0, d_out*d_in = {d_out * d_in})")
    if d_out * d_in >= 2**31:
        raise ValueError("d_out*d_in must be < 2^31 (int32 flat indices)")
    # The GPU kernel relies on row-major order within each tenant: a decrease is only
    # allowed where a new tenant's entries start.
    drops = torch.nonzero(idx[1:] < idx[:-1]).flatten() + 1
    if not bool(torch.isin(drops, offs).all()):
        raise ValueError("delta_idx must be nondecreasing within each tenant")
    return idx, offs


def sparse_add(y, x, delta_idx, delta_vals, delta_offsets, seg_starts, seg_ids) -> torch.Tensor:
    """y[rows of s] += x[rows of s] @ Delta_t.T, t = seg_ids[s]; in place.

    Delta_t (d_out, d_in) is sparse: entries delta_offsets[t] .. delta_offsets[t+1] of
    delta_idx (flat row-major indices o*d_in + i, nondecreasing within a tenant; repeats add)
    and delta_vals.  y (rows, d_out), x (rows, d_in); delta_vals has x's dtype;
    delta_offsets (T+1,).
    """
    _float_dtype(y, x, delta_vals)
    rows, d_out = y.shape
    d_in = x.shape[1]
    _shape(x, (rows, d_in), "x")
    idx, offs = _check_delta(delta_idx, delta_vals, delta_offsets, d_out, d_in)
    for a, b, t in _segments(seg_starts, seg_ids, rows, offs.numel() - 1):
        lo, hi = int(offs[t]), int(offs[t + 1])
        if lo == hi:
            continue
        f = idx[lo:hi]
        delta = torch.sparse_coo_tensor(
            torch.stack([f // d_in, f % d_in]), delta_vals[lo:hi].float(), (d_out, d_in), check_invariants=False
        )
        y[a:b] = (y[a:b].float() + torch.sparse.mm(delta, x[a:b].float().T).T).to(y.dtype)
    return y


# -- 7. hot tier ----------------------------------------------------------------------------------

MAX_KEY_IDS = 7  # 4n < 32 bytes: XXH64's short-input path, the one the kernel implements


def _np(a) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _keys(keys, name: str = "keys") -> np.ndarray:
    k = _np(keys)
    if k.ndim != 2 or not 1 <= k.shape[1] <= MAX_KEY_IDS:
        raise ValueError(f"{name} must be (m, n) with 1 <= n <= {MAX_KEY_IDS}")
    if k.dtype != np.uint32:
        if k.size and (k.min() < 0 or k.max() > 0xFFFFFFFF):
            raise ValueError(f"{name} must hold uint32 ids")
        k = k.astype(np.uint32)
    return np.ascontiguousarray(k)


def xxh64_keys(keys) -> np.ndarray:
    """XXH64 (seed 0) of each row's 4n little-endian key bytes: the store's key hash."""
    return hash_keys(_keys(keys))


def build_hot_table(keys, rows=None, capacity: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(table_keys (capacity, n) uint32, table_rows (capacity,) int32, max_probe) for keys (m, n).

    The store's own index layout (FORMAT.md section 3, formats.segment.build_index) with the
    keys and answers laid out per slot, so the device probe reads one place per slot.
    rows[e] (default e) is what a probe for key e answers. Duplicate keys are rejected.
    """
    k = _keys(keys)
    m, n = k.shape
    rows = np.arange(m, dtype=np.int64) if rows is None else _np(rows).astype(np.int64)
    if rows.shape != (m,) or (m and (rows.min() < 0 or rows.max() >= 2**31)):
        raise ValueError("rows must be (m,) with values in [0, 2^31)")
    if capacity is None:
        capacity = max(8, 1 << max(0, (2 * m - 1).bit_length()))
    if capacity < 1 or capacity & (capacity - 1) or capacity < m or capacity > 2**30:
        raise ValueError(f"capacity {capacity} must be a power of two in [m, 2^30]")
    if m and len(np.unique(k, axis=0)) != m:
        raise ValueError("duplicate keys")
    slots, max_probe = build_index(hash_keys(k), capacity)
    occupied = slots != 0
    entry = slots[occupied].astype(np.int64) - 1
    table_keys = np.zeros((capacity, n), dtype=np.uint32)
    table_rows = np.full(capacity, -1, dtype=np.int32)
    table_keys[occupied] = k[entry]
    table_rows[occupied] = rows[entry]
    return table_keys, table_rows, max_probe


def hot_probe(table_keys, table_rows, queries, max_probe: int, hashes=None) -> torch.Tensor:
    """Row index of each query window in the hot table, or -1: (m,) int32.

    Linear probing from XXH64(key) & (capacity-1) over at most max_probe + 1 slots; an empty
    slot (table_rows -1) ends the probe; a hit needs all n ids equal.  hashes (m,) uint64
    optionally replaces the computed XXH64 of the queries.
    """
    tk, tr = _keys(table_keys, "table_keys"), _np(table_rows).astype(np.int64)
    q = _keys(queries, "queries")
    capacity, n = tk.shape
    if tr.shape != (capacity,) or capacity & (capacity - 1) or capacity > 2**30:
        raise ValueError("table_rows must be (capacity,), capacity a power of two <= 2^30")
    if q.shape[1] != n:
        raise ValueError(f"queries have {q.shape[1]} ids, table keys {n}")
    m = q.shape[0]
    h = xxh64_keys(q) if hashes is None else _np(hashes).astype(np.uint64)
    if h.shape != (m,):
        raise ValueError("hashes must be (m,)")
    result = np.full(m, -1, dtype=np.int32)
    home = (h & np.uint64(capacity - 1)).astype(np.int64)
    live = np.arange(m)
    for p in range(min(int(max_probe), capacity - 1) + 1):
        if not live.size:
            break
        slot = (home[live] + p) & (capacity - 1)
        r = tr[slot]
        hit = (r >= 0) & (tk[slot] == q[live]).all(axis=1)
        result[live[hit]] = r[hit]
        live = live[(r >= 0) & ~hit]
    return torch.from_numpy(result)


def hot_gather(values, rows, out) -> torch.Tensor:
    """out[i] = values[rows[i]] where rows[i] >= 0 (hits); misses keep what out holds.

    values (rows_total, n*d) (or (rows_total, n, d)), out (m, ...) with the same trailing
    shape and dtype; rows (m,) int.
    """
    values, out = torch.as_tensor(values), torch.as_tensor(out)
    r = _ints(rows, "rows")
    if out.shape[0] != r.numel() or out.shape[1:] != values.shape[1:] or out.dtype != values.dtype:
        raise ValueError("out must be (m, *values.shape[1:]) with values' dtype")
    if r.numel() and r.max() >= values.shape[0]:
        raise ValueError("rows out of range")
    hit = torch.nonzero(r >= 0).flatten()
    out[hit] = values[r[hit]]
    return out


# -- 8. fused element-wise ------------------------------------------------------------------------

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def bias_gelu(x, bias, out=None) -> torch.Tensor:
    """gelu(x + bias), erf form, fp32 math; x (..., d), bias (d,); out may be x.

    1 + erf(z) is computed as erfc(-z): for v below about -4, 1 + erf(v/sqrt 2) cancels to a
    few ulps in fp32 and the relative error of the (tiny) result reaches 10%."""
    _float_dtype(x, bias)
    _shape(bias, (x.shape[-1],), "bias")
    y = _out(out, tuple(x.shape), x.dtype)
    v = x.float() + bias.float()
    y.copy_((0.5 * v * torch.erfc(-v * _INV_SQRT2)).to(x.dtype))
    return y


def _normalized(x, residual, eps: float) -> torch.Tensor:
    """v = x + residual normalized over the last dim (biased variance), in fp32."""
    v = x.float() + residual.float()
    centered = v - v.mean(dim=-1, keepdim=True)
    return centered * torch.rsqrt((centered ** 2).mean(dim=-1, keepdim=True) + eps)


def residual_layernorm(x, residual, gamma, beta, eps: float = 1e-12, out=None) -> torch.Tensor:
    """LayerNorm(x + residual) * gamma + beta over the last dim, fp32 accumulate (biased var)."""
    _float_dtype(x, residual, gamma, beta)
    _shape(residual, tuple(x.shape), "residual")
    d = x.shape[-1]
    _shape(gamma, (d,), "gamma")
    _shape(beta, (d,), "beta")
    y = _out(out, tuple(x.shape), x.dtype)
    y.copy_((_normalized(x, residual, eps) * gamma.float() + beta.float()).to(x.dtype))
    return y


def segmented_layernorm(x, residual, gamma, beta, gamma_delta, beta_delta, seg_starts, seg_ids,
                        eps: float = 1e-12, out=None) -> torch.Tensor:
    """residual_layernorm with per-tenant gain and shift deltas (PET LayerNorm edits): the rows
    of segment s use gamma + gamma_delta[t], beta + beta_delta[t], t = seg_ids[s]; x (rows, d),
    gamma_delta and beta_delta (T, d). Rows of no segment, or of t = -1, use gamma and beta.
    out may be x or residual."""
    _float_dtype(x, residual, gamma, beta, gamma_delta, beta_delta)
    rows, d = x.shape
    T = gamma_delta.shape[0]
    for name, t, shape in (("residual", residual, (rows, d)), ("gamma", gamma, (d,)), ("beta", beta, (d,)),
                           ("gamma_delta", gamma_delta, (T, d)), ("beta_delta", beta_delta, (T, d))):
        _shape(t, shape, name)
    n = _normalized(x, residual, eps)
    z = n * gamma.float() + beta.float()
    for start, end, t in _segments(seg_starts, seg_ids, rows, T):
        z[start:end] += n[start:end] * gamma_delta[t].float() + beta_delta[t].float()
    y = _out(out, (rows, d), x.dtype)
    y.copy_(z.to(x.dtype))
    return y
