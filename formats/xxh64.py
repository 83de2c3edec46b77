"""XXH64, vectorized over many equal-length rows, in NumPy.

Lookups hash thousands of short keys per batch; a Python loop over xxhash.xxh64 would cost
~1 us a key, more than the rest of a lookup. Each row is hashed independently, so every step
of the algorithm is one NumPy operation over all rows at once. uint64 array arithmetic wraps
modulo 2**64, which is what XXH64 wants.

Whole-section checksums (one long buffer, inherently sequential) use the xxhash C library.
"""

import numpy as np
import xxhash

_P1 = np.uint64(11400714785074694791)
_P2 = np.uint64(14029467366897019727)
_P3 = np.uint64(1609587929392839161)
_P4 = np.uint64(9650029242287828579)
_P5 = np.uint64(2870177450012600261)
_MASK = (1 << 64) - 1


def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(acc, lane):
    return _rotl(acc + lane * _P2, 31) * _P1


def _lanes(data, start, width, dtype):
    """Column block [start, start+width) of every row, read as one little-endian integer."""
    return np.ascontiguousarray(data[:, start:start + width]).view(dtype).ravel().astype(np.uint64)


def xxh64_rows(data, seeds=0):
    """XXH64 of every row of a 2-D uint8 array; `seeds` is a scalar or one seed per row."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError("xxh64_rows takes a 2-D uint8 array")
    rows, length = data.shape
    seeds = np.broadcast_to(np.asarray(seeds, dtype=np.uint64), (rows,)).copy()
    with np.errstate(over="ignore"):
        pos = 0
        if length >= 32:
            v1 = seeds + _P1 + _P2
            v2 = seeds + _P2
            v3 = seeds.copy()
            v4 = seeds - _P1
            while pos + 32 <= length:
                v1 = _round(v1, _lanes(data, pos, 8, "<u8"))
                v2 = _round(v2, _lanes(data, pos + 8, 8, "<u8"))
                v3 = _round(v3, _lanes(data, pos + 16, 8, "<u8"))
                v4 = _round(v4, _lanes(data, pos + 24, 8, "<u8"))
                pos += 32
            h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
            for v in (v1, v2, v3, v4):
                h = (h ^ _round(np.zeros_like(v), v)) * _P1 + _P4
        else:
            h = seeds + _P5
        h = h + np.uint64(length & _MASK)
        while pos + 8 <= length:
            h = _rotl(h ^ _round(np.zeros_like(h), _lanes(data, pos, 8, "<u8")), 27) * _P1 + _P4
            pos += 8
        if pos + 4 <= length:
            h = _rotl(h ^ (_lanes(data, pos, 4, "<u4") * _P1), 23) * _P2 + _P3
            pos += 4
        while pos < length:
            h = _rotl(h ^ (data[:, pos].astype(np.uint64) * _P5), 11) * _P1
            pos += 1
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    return h


def hash_keys(keys):
    """The key hash of FORMAT.md section 3: XXH64 of each key's little-endian uint32 ids."""
    keys = np.ascontiguousarray(keys, dtype="<u4")
    return xxh64_rows(keys.view(np.uint8).reshape(len(keys), 4 * keys.shape[1]))


def checksum(buffer) -> int:
    """XXH64 (seed 0) of one whole buffer, for section and manifest checksums."""
    return xxhash.xxh64_intdigest(buffer)
