"""Compaction: merge a version's segments into one, keeping only what changes an answer."""

import os
import time

import numpy as np

from formats.segment import write_segment
from formats.xxh64 import hash_keys
from hkstore.errors import StoreError
from hkstore.lookup import find_exact


def void_keys(keys):
    """One sortable, comparable scalar per key."""
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    return keys.view(np.dtype((np.void, 4 * keys.shape[1]))).ravel()


def own_entries(snapshot, version):
    """The entries `version` itself holds, newest segment winning, tombstones included.

    Returns (keys, segment number per key, entry per key, tombstoned per key).
    """
    segments = snapshot.version_segments(version)
    n = snapshot.meta["n"]
    if not segments:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros((0, n), dtype=np.uint32), empty, empty, np.zeros(0, dtype=bool)
    newest_first = list(range(len(segments) - 1, -1, -1))
    keys = np.concatenate([np.asarray(segments[s].keys) for s in newest_first])
    seg = np.concatenate([np.full(segments[s].count, s) for s in newest_first])
    ent = np.concatenate([np.arange(segments[s].count) for s in newest_first])
    _, first = np.unique(void_keys(keys), return_index=True)
    keys, seg, ent = keys[first], seg[first], ent[first]
    tomb = np.zeros(len(keys), dtype=bool)
    for s in np.unique(seg):
        rows = seg == s
        tomb[rows] = segments[s].tombstoned(ent[rows])
    return keys, seg, ent, tomb


def read_entries(segments, keys, seg, ent):
    """Values of the given entries as float32 (m, slots, d)."""
    d, slots = (segments[0].d, segments[0].slots) if segments else (0, keys.shape[1])
    values = np.zeros((len(keys), slots, d), dtype=np.float32)
    hashes = hash_keys(keys)
    for s in np.unique(seg):
        rows = np.flatnonzero(seg == s)
        values[rows] = segments[s].read_values(ent[rows], hashes[rows])
    return values


def compact(store, version, tolerance=0.0):
    """Rewrite `version` as one segment without shadowed entries and tombstones. Atomic:
    readers see the old or the new version, and every answer stays the same.

    In a branch, an entry whose vectors equal (within `tolerance`, max abs difference) what an
    ancestor serves for the same key is dropped only if that ancestor and every version between
    it and the branch are sealed (Store.seal): otherwise a later update of the ancestor would
    change the branch's answer (FORMAT.md section 2, "Compaction")."""
    started = time.perf_counter()
    snap = store.snapshot()
    vi = snap.version_index(version)
    name = snap.version_names[vi]
    ancestors = snap.ancestry(vi)[1:]
    sealed = 0  # ancestors, nearest first, whose answers can no longer change
    while sealed < len(ancestors) and snap.versions[ancestors[sealed]].get("sealed"):
        sealed += 1
    if tolerance > 0 and not sealed:
        # Asked for, it would do nothing: say so rather than compact as if it were 0.
        parent = snap.versions[vi]["parent"]
        raise StoreError(f"a tolerance drops entries equal to what a sealed parent serves, and version {name!r} "
                         + ("has no parent" if parent is None else
                            f"has an unsealed parent {parent!r}: seal it first (hkstore seal STORE {parent}; "
                            "irreversible) or compact without a tolerance"))
    old = list(snap.versions[vi]["segments"])
    segments = snap.version_segments(vi)
    bytes_before = sum(os.path.getsize(s.path) for s in segments)
    keys, seg, ent, tomb = own_entries(snap, vi)
    entries_before = sum(s.count for s in segments)
    keys, seg, ent = keys[~tomb], seg[~tomb], ent[~tomb]
    values = read_entries(segments, keys, seg, ent)
    dropped_equal = 0
    parent_chain = [snap.version_segments(v) for v in ancestors[:sealed]]
    if parent_chain and len(keys) and tolerance >= 0:
        pos, pseg, pent = find_exact(parent_chain, keys, hash_keys(keys))
        same = np.zeros(len(keys), dtype=bool)
        for p in np.unique(pos[pos >= 0]):
            rows = np.flatnonzero(pos == p)
            parent_values = read_entries(parent_chain[p], keys[rows], pseg[rows], pent[rows])
            same[rows] = np.abs(parent_values - values[rows]).max(axis=(1, 2)) <= tolerance
        dropped_equal = int(same.sum())
        keys, values = keys[~same], values[~same]
    if len(old) == 1 and len(keys) == entries_before:
        # One segment, nothing shadowed, tombstoned or equal to the parent: a rewrite would
        # copy the segment as it is.
        seconds = time.perf_counter() - started
        return {"version": name, "skipped": "one segment with nothing to drop", "segments_before": 1,
                "entries_before": entries_before, "entries_after": entries_before, "dropped_equal_to_parent": 0,
                "bytes_before": bytes_before, "bytes_after": bytes_before, "bytes_reclaimed": 0,
                "seconds": seconds, "mb_per_s": 0.0}
    new_name = None
    if len(keys):
        new_name = store.reserve_file(".seg")
        write_segment(os.path.join(store.path, "segments", new_name), keys, values, dtype=snap.meta["dtype"])
    store.replace_segments(name, old, new_name)
    bytes_after = os.path.getsize(os.path.join(store.path, "segments", new_name)) if new_name else 0
    seconds = time.perf_counter() - started
    return {"version": name, "segments_before": len(old), "entries_before": entries_before,
            "entries_after": int(len(keys)), "dropped_equal_to_parent": dropped_equal,
            "bytes_before": bytes_before, "bytes_after": bytes_after,
            "bytes_reclaimed": bytes_before - bytes_after, "seconds": seconds,
            "mb_per_s": bytes_before / 1e6 / seconds if seconds > 0 else 0.0}
