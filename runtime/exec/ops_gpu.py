"""CuPy launchers of the CUDA kernels in runtime/exec/kernels (the GPU executor's custom ops).

One function per function of `runtime.exec.ops_cpu` (the reference), same name and signature,
taking and returning CuPy arrays (index arrays may also be host arrays; they are uploaded
as int32).  Semantics, shapes and dtypes are those documented in ops_cpu, with one
difference: to avoid a device->host synchronisation per call, the segment table, tenant ids
and sparse-delta contract are not validated here.  The kernels bounds-check every access and
skip what is malformed (a segment is clamped to [0, rows), a tenant id outside [0, T) skips
its rows), so bad input gives wrong numbers, never out-of-bounds memory traffic.  Shapes
and dtypes are validated (host-only metadata).

CuPy is imported lazily: importing this module never needs it.  ``use_cupy(module)`` swaps in
another module with CuPy's interface for a block: the tests pass runtime.exec.emu.cupy_standin,
which runs these launchers and the unchanged kernels on the CPU emulation (kernels/NOTES.md).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from runtime.exec import ops_cpu
from runtime.exec.kernels import ENTRY_POINTS, kernel_sources

__all__ = list(ops_cpu.__all__)

WINDOW_KINDS = ops_cpu.WINDOW_KINDS
window_left = ops_cpu.window_left

_CUPY_MISSING = "the GPU executor needs CuPy: pip install 'hkstore[gpu]'"
_TILE = 16              # HK_TILE in _common.cu: SGMV/adapter blocks are (16, 16)
_BGMV_WARPS = 4         # HK_BGMV_WARPS in bgmv.cu: BGMV shrink blocks are 32 * 4
_TARGET_BLOCKS = 2048   # segmented GEMMs: aim for ~2 waves of 256-thread blocks on 132 SMs
_MAX_GRID_YZ = 65535
_INT32_MAX = 2**31 - 1

_functions: dict[tuple[str, str, int, int], object] = {}
_cupy_module = None   # set by use_cupy(): a module with CuPy's interface used instead of cupy


def _cupy():
    if _cupy_module is not None:
        return _cupy_module
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(_CUPY_MISSING) from exc
    return cupy


@contextlib.contextmanager
def use_cupy(module):
    """Run the launchers on `module` instead of ``import cupy`` while the block lasts: tests
    pass runtime.exec.emu.cupy_standin (the kernels on the CPU emulation).  Nothing global
    outside this module changes; ``runtime.open`` never sees it."""
    global _cupy_module
    previous, _cupy_module = _cupy_module, module
    try:
        yield module
    finally:
        _cupy_module = previous


def _function(source: str, entry: str):
    """The RawModule function `entry` of kernel source `source`, compiled once per device."""
    cp = _cupy()
    if entry not in ENTRY_POINTS[source]:
        raise KeyError(f"{entry} is not an entry point of {source}.cu")
    key = (source, entry, id(cp), int(cp.cuda.runtime.getDevice()))
    fn = _functions.get(key)
    if fn is None:
        module = cp.RawModule(code=kernel_sources()[source])
        for name in ENTRY_POINTS[source]:
            _functions[(source, name, *key[2:])] = module.get_function(name)
        fn = _functions[key]
    return fn


def _launch(source: str, entry: str, grid: tuple[int, int, int], block: tuple[int, int, int], args) -> None:
    grid = tuple(int(g) for g in grid)
    if min(grid) <= 0:
        return  # nothing to do (an empty extent): a zero-sized grid is an invalid launch
    if grid[0] > _INT32_MAX or grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"grid {grid} exceeds CUDA limits")
    _function(source, entry)(grid, tuple(int(b) for b in block), tuple(args))


# -- argument helpers -----------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v <= _INT32_MAX:
        raise ValueError(f"{v} does not fit in int32")
    return np.int32(v)


def _suffix(*arrays) -> str:
    dtype = arrays[0].dtype
    for a in arrays[1:]:
        if a.dtype != dtype:
            raise ValueError(f"dtype mismatch: {a.dtype} vs {dtype}")
    if dtype == np.float32:
        return "f32"
    if dtype == np.float16:
        return "f16"
    raise ValueError(f"expected float16 or float32, got {dtype}")


def _arr(a, dtype=None):
    """A C-contiguous device array (copied/uploaded/cast only when needed)."""
    cp = _cupy()
    a = cp.asarray(a) if dtype is None else cp.asarray(a, dtype=dtype)
    return cp.ascontiguousarray(a)


def _index(a, name: str, size: int | None = None):
    a = _arr(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array")
    if size is not None and a.size != size:
        raise ValueError(f"{name} has {a.size} entries, expected {size}")
    return _arr(a, np.int32)


def _inplace(y, name: str = "y"):
    cp = _cupy()
    if not isinstance(y, cp.ndarray) or not y.flags.c_contiguous:
        raise ValueError(f"{name} is updated in place: it must be a C-contiguous CuPy array")
    return y


def _shape(a, shape: tuple, name: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _out(out, shape: tuple, dtype, zero: bool = False):
    cp = _cupy()
    if out is None:
        return cp.zeros(shape, dtype=dtype) if zero else cp.empty(shape, dtype=dtype)
    _inplace(out, "out")
    _shape(out, shape, "out")
    if out.dtype != dtype:
        raise ValueError(f"out must be {np.dtype(dtype)}, got {out.dtype}")
    return out


def _segments(seg_starts, seg_ids):
    ids = _index(seg_ids, "seg_ids")
    starts = _index(seg_starts, "seg_starts", ids.size + 1)
    return starts, ids


def _segment_chunks(S: int):
    """[c0, c1) chunks of at most 65535 segments (grid.z limit)."""
    return [(c0, min(S, c0 + _MAX_GRID_YZ)) for c0 in range(0, S, _MAX_GRID_YZ)]


def _row_groups(rows: int, segments: int, col_tiles: int) -> int:
    """grid.y of a segmented GEMM: how many blocks share one segment's row tiles.

    No host sync, so segment lengths are unknown: a segment has at most ceil(rows / 16) row
    tiles; beyond that, enough groups to reach ~_TARGET_BLOCKS blocks in all (extra blocks
    find no row tile and exit at once).
    """
    tiles = max(1, _cdiv(rows, _TILE))
    want = max(1, _cdiv(_TARGET_BLOCKS, max(1, segments * col_tiles)))
    return min(tiles, want, _MAX_GRID_YZ)


def _threads(width: int, cap: int = 256) -> int:
    """1-D block size: width rounded up to a warp multiple, at most cap."""
    return min(cap, max(32, _cdiv(width, 32) * 32))


def _seg_gemm(source: str, entry: str, N: int, rows: int, starts, ids, head_args, tail_args) -> None:
    """Launch a segmented-GEMM kernel over all segment chunks: grid (ceil(N/16), G, S)."""
    col_tiles = _cdiv(N, _TILE)
    for c0, c1 in _segment_chunks(ids.size):
        S = c1 - c0
        grid = (col_tiles, _row_groups(rows, S, col_tiles), S)
        args = (*head_args, starts[c0 : c1 + 1], ids[c0:c1], _i32(S), *tail_args)
        _launch(source, entry, grid, (_TILE, _TILE, 1), args)


# -- 1. aggregation -------------------------------------------------------------------------------


def aggregate(values, lengths, window: str = "centered", slot_mask=None, out=None):
    cp = _cupy()
    values = _arr(values)
    if values.ndim != 3:
        raise ValueError("values must be (B*L, n, d)")
    sfx = _suffix(values)
    m, n, d = values.shape
    lengths = _index(lengths, "lengths")
    B = lengths.size
    if B == 0 or m % B:
        raise ValueError(f"values rows ({m}) must be B*L with B = len(lengths) = {B} >= 1")
    L = m // B
    left = window_left(n, window)
    if slot_mask is None:
        mask, has_mask = cp.zeros(1, dtype=np.uint8), 0
    else:
        mask, has_mask = _arr(cp.asarray(slot_mask) != 0, np.uint8), 1
        _shape(mask, (m, n), "slot_mask")
    res = _out(out, (B, L, d), np.float32)
    block = _threads(d)
    _launch(
        "aggregate", f"hk_aggregate_{sfx}", (m, _cdiv(d, block), 1), (block, 1, 1),
        (res, values, lengths, mask, _i32(has_mask), _i32(B), _i32(L), _i32(n), _i32(d), _i32(left)),
    )
    return res


# -- 2. SGMV --------------------------------------------------------------------------------------


def sgmv_shrink(x, A, seg_starts, seg_ids, out=None):
    x, A = _arr(x), _arr(A)
    sfx = _suffix(x, A)
    rows, d_in = x.shape
    T, r, _ = A.shape
    _shape(A, (T, r, d_in), "A")
    starts, ids = _segments(seg_starts, seg_ids)
    v = _out(out, (rows, r), np.float32, zero=True)
    _seg_gemm("sgmv", f"hk_sgmv_shrink_{sfx}", r, rows, starts, ids,
              (v, x, A), (_i32(rows), _i32(T), _i32(d_in), _i32(r)))
    return v


def _scales(scales, T: int):
    cp = _cupy()
    if scales is None:
        return cp.ones(T, dtype=np.float32)
    s = _arr(scales, np.float32)
    _shape(s, (T,), "scales")
    return s


def sgmv_expand(y, v, B, seg_starts, seg_ids, scales=None):
    y, B = _inplace(y), _arr(B)
    sfx = _suffix(y, B)
    rows, d_out = y.shape
    T, _, r = B.shape
    _shape(B, (T, d_out, r), "B")
    v = _arr(v, np.float32)
    _shape(v, (rows, r), "v")
    starts, ids = _segments(seg_starts, seg_ids)
    _seg_gemm("sgmv", f"hk_sgmv_expand_{sfx}", d_out, rows, starts, ids,
              (y, v, B, _scales(scales, T)), (_i32(rows), _i32(T), _i32(r), _i32(d_out)))
    return y


def sgmv(y, x, A, B, seg_starts, seg_ids, scales=None):
    starts, ids = _segments(seg_starts, seg_ids)     # upload once for both kernels
    v = sgmv_shrink(x, A, starts, ids)
    return sgmv_expand(y, v, B, starts, ids, scales)


# -- 3. BGMV --------------------------------------------------------------------------------------


def bgmv_shrink(x, A, row_ids, out=None):
    x, A = _arr(x), _arr(A)
    sfx = _suffix(x, A)
    rows, d_in = x.shape
    T, r, _ = A.shape
    _shape(A, (T, r, d_in), "A")
    ids = _index(row_ids, "row_ids", rows)
    v = _out(out, (rows, r), np.float32, zero=True)
    _launch("bgmv", f"hk_bgmv_shrink_{sfx}", (rows, _cdiv(r, _BGMV_WARPS), 1), (32 * _BGMV_WARPS, 1, 1),
            (v, x, A, ids, _i32(rows), _i32(T), _i32(d_in), _i32(r)))
    return v


def bgmv_expand(y, v, B, row_ids, scales=None):
    y, B = _inplace(y), _arr(B)
    sfx = _suffix(y, B)
    rows, d_out = y.shape
    T, _, r = B.shape
    _shape(B, (T, d_out, r), "B")
    v = _arr(v, np.float32)
    _shape(v, (rows, r), "v")
    ids = _index(row_ids, "row_ids", rows)
    block = _threads(d_out)
    _launch("bgmv", f"hk_bgmv_expand_{sfx}", (rows, _cdiv(d_out, block), 1), (block, 1, 1),
            (y, v, B, _scales(scales, T), ids, _i32(rows), _i32(T), _i32(r), _i32(d_out)))
    return y


def bgmv(y, x, A, B, row_ids, scales=None):
    ids = _index(row_ids, "row_ids")
    v = bgmv_shrink(x, A, ids)
    return bgmv_expand(y, v, B, ids, scales)


# -- 4. segmented adapter -------------------------------------------------------------------------


def segmented_adapter(x, down, down_bias, up, up_bias, seg_starts, seg_ids, out=None):
    cp = _cupy()
    x, down, down_bias, up, up_bias = (_arr(a) for a in (x, down, down_bias, up, up_bias))
    sfx = _suffix(x, down, down_bias, up, up_bias)
    rows, d = x.shape
    T, bn, _ = down.shape
    _shape(down, (T, bn, d), "down")
    _shape(down_bias, (T, bn), "down_bias")
    _shape(up, (T, d, bn), "up")
    _shape(up_bias, (T, d), "up_bias")
    starts, ids = _segments(seg_starts, seg_ids)
    y = _out(out, (rows, d), x.dtype)
    if y is not x:
        cp.copyto(y, x)
    h = cp.empty((rows, bn), dtype=np.float32)   # only rows of active segments are used
    tail = (_i32(rows), _i32(T), _i32(d), _i32(bn))
    _seg_gemm("adapter", f"hk_adapter_down_{sfx}", bn, rows, starts, ids, (h, x, down, down_bias), tail)
    _seg_gemm("adapter", f"hk_adapter_up_{sfx}", d, rows, starts, ids, (y, x, h, up, up_bias), tail)
    return y


# -- 5. bias gather -------------------------------------------------------------------------------


def bias_gather(y, bias_delta, seg_starts, seg_ids):
    y, bias_delta = _inplace(y), _arr(bias_delta)
    sfx = _suffix(y, bias_delta)
    rows, d_out = y.shape
    T = bias_delta.shape[0]
    _shape(bias_delta, (T, d_out), "bias_delta")
    starts, ids = _segments(seg_starts, seg_ids)
    block = _threads(d_out)
    _launch("bitfit", f"hk_bias_gather_{sfx}", (rows, _cdiv(d_out, block), 1), (block, 1, 1),
            (y, bias_delta, starts, ids, _i32(ids.size), _i32(rows), _i32(T), _i32(d_out)))
    return y


# -- 6. sparse add --------------------------------------------------------------------------------


def sparse_add(y, x, delta_idx, delta_vals, delta_offsets, seg_starts, seg_ids):
    y, x, vals = _inplace(y), _arr(x), _arr(delta_vals)
    sfx = _suffix(y, x, vals)
    rows, d_out = y.shape
    d_in = x.shape[1]
    _shape(x, (rows, d_in), "x")
    if d_out * d_in > _INT32_MAX:
        raise ValueError("d_out*d_in must be < 2^31 (int32 flat indices)")
    idx = _index(delta_idx, "delta_idx", vals.size)
    offs = _index(delta_offsets, "delta_offsets")
    if offs.size < 1:
        raise ValueError("delta_offsets must have T+1 >= 1 entries")
    starts, ids = _segments(seg_starts, seg_ids)
    block = _threads(d_out, 128)
    _launch("sparse", f"hk_sparse_add_{sfx}", (rows, _cdiv(d_out, block), 1), (block, 1, 1),
            (y, x, idx, vals, offs, starts, ids, _i32(ids.size), _i32(rows), _i32(offs.size - 1),
             _i32(idx.size), _i32(d_in), _i32(d_out)))
    return y


# -- 7. hot tier ----------------------------------------------------------------------------------


def _key_array(keys, name: str):
    k = _arr(keys, np.uint32)
    if k.ndim != 2 or not 1 <= k.shape[1] <= ops_cpu.MAX_KEY_IDS:
        raise ValueError(f"{name} must be (m, n) with 1 <= n <= {ops_cpu.MAX_KEY_IDS}")
    return k


def xxh64_keys(keys):
    """XXH64 (seed 0) of each key row, computed on the device: (m,) uint64."""
    cp = _cupy()
    k = _key_array(keys, "keys")
    m, n = k.shape
    h = cp.empty(m, dtype=np.uint64)
    _launch("hot_tier", "hk_xxh64_keys", (_cdiv(m, 256), 1, 1), (256, 1, 1), (h, k, _i32(m), _i32(n)))
    return h


def build_hot_table(keys, rows=None, capacity: int | None = None):
    """ops_cpu.build_hot_table on the host, uploaded: (table_keys, table_rows, max_probe)."""
    cp = _cupy()
    to_host = lambda a: None if a is None else (cp.asnumpy(a) if isinstance(a, cp.ndarray) else a)  # noqa: E731
    tk, tr, max_probe = ops_cpu.build_hot_table(to_host(keys), to_host(rows), capacity)
    return cp.asarray(tk), cp.asarray(tr), max_probe


def hot_probe(table_keys, table_rows, queries, max_probe: int, hashes=None):
    cp = _cupy()
    tk, q = _key_array(table_keys, "table_keys"), _key_array(queries, "queries")
    capacity, n = tk.shape
    tr = _index(table_rows, "table_rows", capacity)
    if capacity & (capacity - 1) or capacity > 2**30:
        raise ValueError("capacity must be a power of two <= 2^30")
    if q.shape[1] != n:
        raise ValueError(f"queries have {q.shape[1]} ids, table keys {n}")
    m = q.shape[0]
    if hashes is None:
        h, use = cp.zeros(1, dtype=np.uint64), 0
    else:
        h, use = _arr(hashes, np.uint64), 1
        _shape(h, (m,), "hashes")
    result = cp.empty(m, dtype=np.int32)
    _launch("hot_tier", "hk_hot_probe", (_cdiv(m, 256), 1, 1), (256, 1, 1),
            (result, q, h, _i32(use), _i32(m), _i32(n), tk, tr, _i32(capacity),
             _i32(max(-1, min(int(max_probe), _INT32_MAX)))))
    return result


def hot_gather(values, rows, out):
    values = _arr(values)
    out = _inplace(out, "out")
    sfx = _suffix(values, out)
    r = _index(rows, "rows")
    m = r.size
    if out.shape[0] != m or tuple(out.shape[1:]) != tuple(values.shape[1:]):
        raise ValueError("out must be (m, *values.shape[1:]) with values' dtype")
    width = math.prod(values.shape[1:])
    block = _threads(width)
    _launch("hot_tier", f"hk_hot_gather_{sfx}", (m, _cdiv(width, block), 1), (block, 1, 1),
            (out, values, r, _i32(m), _i32(width), _i32(values.shape[0])))
    return out


# -- 8. fused element-wise ------------------------------------------------------------------------


def bias_gelu(x, bias, out=None):
    x, bias = _arr(x), _arr(bias)
    sfx = _suffix(x, bias)
    if x.ndim == 0:   # as ops_cpu: x is (..., d); a 0-d x would launch one element with d = 0
        raise ValueError("x must have at least one dimension (..., d)")
    d = x.shape[-1]
    _shape(bias, (d,), "bias")
    y = _out(out, tuple(x.shape), x.dtype)
    total = x.size
    _launch("fused", f"hk_bias_gelu_{sfx}", (min(_cdiv(total, 256), 65536), 1, 1), (256, 1, 1),
            (y, x, bias, np.int64(total), _i32(d)))
    return y


def residual_layernorm(x, residual, gamma, beta, eps: float = 1e-12, out=None):
    x, residual, gamma, beta = (_arr(a) for a in (x, residual, gamma, beta))
    sfx = _suffix(x, residual, gamma, beta)
    _shape(residual, tuple(x.shape), "residual")
    d = x.shape[-1] if x.ndim else 0
    _shape(gamma, (d,), "gamma")
    _shape(beta, (d,), "beta")
    y = _out(out, tuple(x.shape), x.dtype)
    rows = x.size // d if d else 0
    _launch("fused", f"hk_residual_layernorm_{sfx}", (rows, 1, 1), (_threads(d), 1, 1),
            (y, x, residual, gamma, beta, _i32(rows), _i32(d), np.float32(eps)))
    return y


def segmented_layernorm(x, residual, gamma, beta, gamma_delta, beta_delta, seg_starts, seg_ids,
                        eps: float = 1e-12, out=None):
    x, residual, gamma, beta, gd, bd = (_arr(a) for a in (x, residual, gamma, beta, gamma_delta, beta_delta))
    sfx = _suffix(x, residual, gamma, beta, gd, bd)
    rows, d = x.shape
    T = gd.shape[0]
    _shape(residual, (rows, d), "residual")
    _shape(gamma, (d,), "gamma")
    _shape(beta, (d,), "beta")
    _shape(gd, (T, d), "gamma_delta")
    _shape(bd, (T, d), "beta_delta")
    starts, ids = _segments(seg_starts, seg_ids)
    y = _out(out, (rows, d), x.dtype)
    if rows:
        _launch("fused", f"hk_segmented_layernorm_{sfx}", (rows, 1, 1), (_threads(d), 1, 1),
                (y, x, residual, gamma, beta, gd, bd, starts, ids, _i32(ids.size), _i32(T), _i32(rows), _i32(d),
                 np.float32(eps)))
    return y
