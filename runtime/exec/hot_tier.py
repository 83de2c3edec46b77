"""The GPU-resident PLOT hot tier: served values of the most frequent (window, version) keys in a
FORMAT.md §3 hash table on the device, probed by the device-side XXH64 probe."""

from __future__ import annotations

import time

import numpy as np


class HotTier:
    """The GPU-resident PLOT hot tier (see the module doc).

    Keys are the n window ids plus the served version's index (n + 1 <= 7 ids: the probe's
    limit); a row's value is exactly what the host lookup serves for that window at that
    version (backoff included), so a hit and a miss give the same inputs.
    """

    def __init__(self, executor, rows: int, rebuild_every: int = 32):
        self.ex = executor
        self.capacity = int(rows)
        self.rebuild_every = max(1, int(rebuild_every))
        self.table = None  # (table_keys, table_rows, max_probe) on the device
        self.values = None  # (rows, n, d) float16 on the device
        self.row_version = self.row_order = None  # host, per row: served version, order
        self.row_of: dict = {}  # host: key bytes -> row, for the rows on the device
        self.looked_up = 0  # keys looked up on the host by rebuilds
        self.generation = None
        self.counts: dict = {}
        self.batches_since = 0
        self.hits = self.misses = self.rebuilds = 0
        self.probe_seconds = self.lookup_seconds = 0.0

    @property
    def rows(self) -> int:
        return 0 if self.values is None else int(self.values.shape[0])

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"rows": self.rows, "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else 0.0, "rebuilds": self.rebuilds, "rebuild_lookups": self.looked_up,
                "bytes": 0 if self.values is None else int(self.values.nbytes)}

    def _check_generation(self, snapshot):
        generation = snapshot.manifest.get("generation")
        if generation != self.generation:
            self.table = self.values = None  # values may have changed: rebuild from the counts
            self.generation = generation

    def probe(self, snapshot, qkeys, stream, keep):
        """Hit rows (device (m,) int32 and host copy) of query keys (m, n + 1) uint32."""
        ex = self.ex
        self._check_generation(snapshot)
        m = len(qkeys)
        if self.table is None or not m:
            return None, np.full(m, -1, dtype=np.int32)
        t0 = time.perf_counter()
        q = ex.upload(np.ascontiguousarray(qkeys, dtype=np.uint32), stream, keep)
        tk, tr, max_probe = self.table
        rows = ex.ops.hot_probe(tk, tr, q, max_probe)
        host = ex.to_host(rows, stream)
        self.probe_seconds += time.perf_counter() - t0
        return rows, host

    def observe(self, qkeys):
        """Count the batch's (window, version) keys; prune the rarest when the map grows."""
        if not len(qkeys):
            return
        keys = np.ascontiguousarray(qkeys, dtype=np.uint32)
        void = keys.view(np.dtype((np.void, keys.shape[1] * 4))).ravel()
        uniq, counts = np.unique(void, return_counts=True)
        c = self.counts
        for k, n in zip(uniq.tolist(), counts.tolist()):
            c[k] = c.get(k, 0) + n
        limit = 8 * max(self.capacity, 1024)
        if len(c) > limit:
            keep = sorted(c.items(), key=lambda kv: -kv[1])[: limit // 2]
            self.counts = dict(keep)
        self.batches_since += 1

    def due(self) -> bool:
        return self.capacity > 0 and (self.table is None and self.counts or self.batches_since >= self.rebuild_every)

    def rebuild(self, snapshot, stream, keep):
        """Put the most frequent observed keys on the device. Keys already resident keep their
        values (copied on the device: the store has not changed since, or _check_generation
        would have dropped them); only new keys cost a host lookup and an upload."""
        ex = self.ex
        self._check_generation(snapshot)
        self.batches_since = 0
        if not self.counts:
            return
        width = len(next(iter(self.counts)))
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[: self.capacity]
        keys = np.frombuffer(b"".join(k for k, _ in top), dtype=np.uint32).reshape(len(top), width // 4)
        resident = self.row_of if self.values is not None else {}
        old_row = np.array([resident.get(k, -1) for k, _ in top], dtype=np.int64)
        new, kept = np.flatnonzero(old_row < 0), np.flatnonzero(old_row >= 0)
        values, version, order = self.lookup(snapshot, keys[new, :-1], keys[new, -1])
        n, d = snapshot.meta["n"], snapshot.meta["d"]
        with stream:
            rows = ex.cp.empty((len(top), n, d), dtype=np.float16)
        if len(kept):
            rows[ex.upload(kept, stream, keep)] = self.values[ex.upload(old_row[kept], stream, keep)]
        if len(new):
            rows[ex.upload(new, stream, keep)] = ex.upload(values, stream, keep)
        row_version = np.empty(len(top), dtype=np.int16)
        row_order = np.empty(len(top), dtype=np.int8)
        row_version[new], row_order[new] = version, order
        if len(kept):
            row_version[kept], row_order[kept] = self.row_version[old_row[kept]], self.row_order[old_row[kept]]
        tk, tr, max_probe = ex.ops.build_hot_table(keys)
        if self.values is not None:
            keep.append(self.values)  # the old rows are read on `stream`: hold them until it passes
        self.table = (tk, tr, max_probe)
        self.values = rows
        self.row_version, self.row_order = row_version, row_order
        self.row_of = {k: i for i, (k, _) in enumerate(top)}
        self.looked_up += len(new)
        self.rebuilds += 1

    @staticmethod
    def lookup(snapshot, windows, version_index):
        """Host lookup of windows, each at its own version: (values fp16, versions, orders)."""
        m = len(windows)
        n, d = snapshot.meta["n"], snapshot.meta["d"]
        versions = np.unique(version_index)
        if len(versions) == 1:  # the common case: no scatter, no second copy
            res = snapshot.lookup(int(versions[0]), windows)
            return (res.values.astype(np.float16, copy=False), res.version.astype(np.int16, copy=False),
                    res.order.astype(np.int8, copy=False))
        values = np.zeros((m, n, d), dtype=np.float16)
        version = np.full(m, -1, dtype=np.int16)
        order = np.zeros(m, dtype=np.int8)
        for v in np.unique(version_index).tolist():
            sel = np.flatnonzero(version_index == v)
            res = snapshot.lookup(int(v), windows[sel])
            values[sel], version[sel], order[sel] = res.values, res.version, res.order
        return values, version, order
