"""Batched PLOT lookup over one snapshot: version fallback and n-gram backoff (FORMAT.md §4)."""

from dataclasses import dataclass

import numpy as np

from formats.backoff import backoff, key_order
from formats.xxh64 import hash_keys


@dataclass
class LookupResult:
    values: np.ndarray  # (m, n, d): float16 (fp16 store) or float32 (int8 store); zeros where order == 0
    version: np.ndarray  # (m,) int16: index of the served version in snapshot.version_names, -1 on a miss
    order: np.ndarray  # (m,) int8: order of the served key, 0 on a miss
    version_names: list


def find_in_version(segments, keys, hashes):
    """Search one version's segments, newest first.

    Returns (segment number or -1, entry, tombstoned) per key; a tombstone ends the search in
    this version, so the caller moves on to the parent.
    """
    m = len(keys)
    seg_of = np.full(m, -1, dtype=np.int64)
    entry_of = np.full(m, -1, dtype=np.int64)
    dead = np.zeros(m, dtype=bool)
    undecided = np.arange(m)
    for s in range(len(segments) - 1, -1, -1):
        if not len(undecided):
            break
        entries = segments[s].probe(keys[undecided], hashes[undecided])
        found = entries >= 0
        rows, entries = undecided[found], entries[found]
        tomb = segments[s].tombstoned(entries)
        seg_of[rows[~tomb]] = s
        entry_of[rows[~tomb]] = entries[~tomb]
        dead[rows[tomb]] = True
        undecided = undecided[~found]
    return seg_of, entry_of, dead


def find_exact(chain, keys, hashes):
    """First live entry of each exact key along a chain of versions (lists of segments).

    Returns (chain position, segment number, entry), each -1 where no version holds the key.
    """
    m = len(keys)
    pos = np.full(m, -1, dtype=np.int64)
    seg = np.full(m, -1, dtype=np.int64)
    ent = np.full(m, -1, dtype=np.int64)
    todo = np.arange(m)
    for p, segments in enumerate(chain):
        if not len(todo):
            break
        s, e, _ = find_in_version(segments, keys[todo], hashes[todo])
        hit = s >= 0
        pos[todo[hit]], seg[todo[hit]], ent[todo[hit]] = p, s[hit], e[hit]
        todo = todo[~hit]
    return pos, seg, ent


def lookup(snapshot, version, windows):
    """Serve every window from `version` (see FORMAT.md §4 for the exact rule)."""
    meta = snapshot.meta
    n, d, kind, pad = meta["n"], meta["d"], meta["window"], meta["pad_id"]
    windows = np.ascontiguousarray(windows, dtype=np.uint32)
    if windows.ndim != 2 or windows.shape[1] != n:
        raise ValueError(f"windows must have shape (m, {n}), got {windows.shape}")
    m = len(windows)
    ancestry = snapshot.ancestry(version)
    chain = [snapshot.version_segments(v) for v in ancestry]
    flat = [seg for segments in chain for seg in segments]
    seg_base = np.cumsum([0] + [len(segments) for segments in chain])

    served_seg = np.full(m, -1, dtype=np.int64)
    served_entry = np.full(m, -1, dtype=np.int64)
    served_hash = np.zeros(m, dtype=np.uint64)
    version_out = np.full(m, -1, dtype=np.int16)
    order_out = np.zeros(m, dtype=np.int8)

    pending = np.arange(m)
    keys = windows
    while len(pending):
        hashes = hash_keys(keys)
        pos, seg, ent = find_exact(chain, keys, hashes)
        hit = pos >= 0
        rows = pending[hit]
        served_seg[rows] = seg_base[pos[hit]] + seg[hit]
        served_entry[rows] = ent[hit]
        served_hash[rows] = hashes[hit]
        version_out[rows] = np.asarray(ancestry)[pos[hit]]
        order_out[rows] = key_order(keys[hit], kind, pad)
        # Unserved uni-grams have nowhere left to go: they stay misses (order 0).
        more = ~hit & (key_order(keys, kind, pad) > 1)
        pending, keys = pending[more], backoff(keys[more], kind, pad)

    used = np.flatnonzero(np.bincount(served_seg[served_seg >= 0], minlength=len(flat)))
    if len(used) == 1 and order_out.all():
        # The common case: one segment serves every window; gather straight into the result.
        values = flat[used[0]].read_values(served_entry, served_hash)
    else:
        dtype = np.float16 if meta["dtype"] == "fp16" else np.float32
        values = np.zeros((m, n, d), dtype=dtype)
        for s in used:
            rows = np.flatnonzero(served_seg == s)
            values[rows] = flat[s].read_values(served_entry[rows], served_hash[rows])
    return LookupResult(values, version_out, order_out, snapshot.version_names)
