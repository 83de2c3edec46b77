"""Batched PLOT lookup over one snapshot: version fallback and n-gram backoff (FORMAT.md §4).

Two implementations of one rule. `formats._probe.resolve` (C, formats/accel.py) runs the whole
rule for every window in one call without the GIL, then one gather per serving segment copies
the rows. The NumPy code below (`_lookup_numpy`, find_in_version, find_exact) is the reference
and the fallback when the extension is not built or HKSTORE_NO_ACCEL=1; tests/test_accel.py
checks that both give identical answers.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from formats import accel
from formats.backoff import backoff, key_order, left, ranked_slots
from formats.errors import CorruptError
from formats.manifest import value_slots
from formats.xxh64 import hash_keys


@dataclass
class LookupResult:
    values: np.ndarray  # (m, slots, d): float16 (fp16 store) or float32 (int8 store); zeros where order == 0
    # (slots: formats.manifest.value_slots, n or 1 = each key's last slot: a decoder store)
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
        whole = len(undecided) == m
        entries = segments[s].probe(keys if whole else keys[undecided], hashes if whole else hashes[undecided])
        found = entries >= 0
        rows, entries = undecided[found], entries[found]
        if segments[s].has_tombstones:  # set by probe's first-use check
            tomb = segments[s].tombstoned(entries)
            dead[rows[tomb]] = True
            rows, entries = rows[~tomb], entries[~tomb]
        seg_of[rows] = s
        entry_of[rows] = entries
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
        whole = len(todo) == m
        s, e, _ = find_in_version(segments, keys if whole else keys[todo], hashes if whole else hashes[todo])
        hit = s >= 0
        pos[todo[hit]], seg[todo[hit]], ent[todo[hit]] = p, s[hit], e[hit]
        todo = todo[~hit]
    return pos, seg, ent


def lookup(snapshot, version, windows):
    """Serve every window from `version` (see FORMAT.md §4 for the exact rule)."""
    meta = snapshot.meta
    n = meta["n"]
    windows = np.ascontiguousarray(windows, dtype=np.uint32)
    if windows.ndim != 2 or windows.shape[1] != n:
        raise ValueError(f"windows must have shape (m, {n}), got {windows.shape}")
    ext = accel.ext
    if ext is not None:
        return _lookup_c(ext, snapshot, version, windows)
    return _lookup_numpy(snapshot, version, windows)


@lru_cache(maxsize=64)
def _chain_rule(n, kind):
    """(center slot, slots in the order the backoff replaces them with pad)."""
    return left(n, kind), tuple(reversed(ranked_slots(n, kind)[1:]))


def _search_item(seg):
    """What resolve needs of a segment: its index arrays once they are checked, else None
    (resolve then asks for the check when its search reaches the segment)."""
    if not seg._checked:
        return None
    return seg.index, seg.keys, seg.flags if seg.has_tombstones else None, seg.max_probe


def _lookup_c(ext, snapshot, version, windows):
    meta = snapshot.meta
    n, d = meta["n"], meta["d"]
    m = len(windows)
    ancestry = snapshot.ancestry(version)
    # Search order: each version's segments newest first, the version's ancestors after it.
    search, seg_version, seg_group = [], [], []
    for p, v in enumerate(ancestry):
        segments = snapshot.version_segments(v)
        search.extend(reversed(segments))
        seg_version.extend([v] * len(segments))
        seg_group.extend([p] * len(segments))
    for seg in search:
        if seg.capacity <= 0 or seg.capacity & (seg.capacity - 1):
            return _lookup_numpy(snapshot, version, windows)  # not a valid index: the reference decides
    items = [_search_item(seg) for seg in search]
    center, drop = _chain_rule(n, meta["window"])
    served_seg = np.empty(m, dtype=np.int64)
    served_entry = np.empty(m, dtype=np.int64)
    served_hash = np.empty(m, dtype=np.uint64)
    version_out = np.empty(m, dtype=np.int16)
    order_out = np.empty(m, dtype=np.int8)
    while True:
        try:
            need, misses, used = ext.resolve(windows, n, items, seg_version, seg_group, center, drop, meta["pad_id"],
                                             served_seg, served_entry, served_hash, version_out, order_out)
        except ext.CorruptIndex as e:
            s, entry, count = e.args
            raise CorruptError(f"segment {search[s].name}: index names entry {entry}, past its {count} entries") from None
        if need < 0:
            break
        # The search reached a segment this process has not looked up in yet: check its index,
        # keys and flags (FORMAT.md §3, first use) and start over; this happens once a segment.
        search[need]._check_once()
        items[need] = _search_item(search[need])

    if len(used) == 1 and not misses:
        # The common case: one segment serves every window; gather straight into the result.
        values = search[used[0]].read_values(served_entry, served_hash)
    else:
        values = np.empty((m, value_slots(meta), d), dtype=np.float16 if meta["dtype"] == "fp16" else np.float32)
        if misses:
            values[order_out == 0] = 0
        for s in used:
            rows = np.flatnonzero(served_seg == s)
            search[s].read_values(served_entry[rows], served_hash[rows], out=values, out_rows=rows)
    return LookupResult(values, version_out, order_out, snapshot.version_names)


def _lookup_numpy(snapshot, version, windows):
    """The reference: one round per key order, each a vectorized search of every version."""
    meta = snapshot.meta
    n, d, kind, pad = meta["n"], meta["d"], meta["window"], meta["pad_id"]
    m = len(windows)
    ancestry = snapshot.ancestry(version)
    chain = [snapshot.version_segments(v) for v in ancestry]
    flat = [seg for segments in chain for seg in segments]
    seg_base = np.cumsum([0] + [len(segments) for segments in chain])
    versions = np.asarray(ancestry, dtype=np.int16)

    served_seg = np.full(m, -1, dtype=np.int64)
    served_entry = np.full(m, -1, dtype=np.int64)
    served_hash = np.zeros(m, dtype=np.uint64)
    version_out = np.full(m, -1, dtype=np.int16)
    order_out = np.zeros(m, dtype=np.int8)

    pending = np.arange(m)
    keys = windows
    order = key_order(keys, kind, pad)  # each backoff step lowers it by exactly one
    while len(pending):
        hashes = hash_keys(keys)
        pos, seg, ent = find_exact(chain, keys, hashes)
        hit = pos >= 0
        rows = pending[hit]
        served_seg[rows] = seg_base[pos[hit]] + seg[hit]
        served_entry[rows] = ent[hit]
        served_hash[rows] = hashes[hit]
        version_out[rows] = versions[pos[hit]]
        order_out[rows] = order[hit]
        # Unserved uni-grams have nowhere left to go: they stay misses (order 0).
        more = ~hit & (order > 1)
        pending, keys, order = pending[more], backoff(keys[more], kind, pad), order[more] - 1

    used = np.flatnonzero(np.bincount(served_seg[served_seg >= 0], minlength=len(flat)))
    if len(used) == 1 and order_out.all():
        # The common case: one segment serves every window; gather straight into the result.
        values = flat[used[0]].read_values(served_entry, served_hash)
    else:
        dtype = np.float16 if meta["dtype"] == "fp16" else np.float32
        values = np.zeros((m, value_slots(meta), d), dtype=dtype)
        for s in used:
            rows = np.flatnonzero(served_seg == s)
            values[rows] = flat[s].read_values(served_entry[rows], served_hash[rows])
    return LookupResult(values, version_out, order_out, snapshot.version_names)
