"""Grow a version with the windows its traffic missed: the PLOT as a cache.

    keys = missed_windows(snapshot, "biology", seqs)     # windows served below their own order
    stats = grow(store, "biology", seqs)                 # value them, add them as one segment

On text outside every PLOT corpus most windows back off (a third served exactly on the suite's
dev text), and a backed-off window is a worse stand-in for the lower layers than the window
itself. The remedy HMI's design allows without retraining anything: compute the missed windows
with the lower layers that value the version (runtime.model.stored.version_encoder, so a grown
entry equals what construction would have stored had the corpus held that text) and write them
back. The next request with those windows is served exactly; the table grows with traffic.
No labels are involved: only token windows of text a tenant was asked about.
"""

from __future__ import annotations

import time

import numpy as np

from formats.backoff import key_order
from hkstore.errors import StoreError
from runtime.construct.plot import compute_values, unique_keys
from runtime.model.stored import check_encoder, version_encoder
from runtime.plot.window import corpus_windows


def missed_windows(snapshot, version, seqs) -> tuple[np.ndarray, dict]:
    """Distinct windows of `seqs` that `version` serves below their own order (a backoff or a
    miss), and {windows, missed, distinct_missed}."""
    meta = snapshot.meta
    wins, _ = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
    if not len(wins):
        return wins.reshape(0, meta["n"]), {"windows": 0, "missed": 0, "distinct_missed": 0}
    served = snapshot.lookup(version, wins).order.astype(np.int64)
    missed = wins[served < key_order(wins, meta["window"], meta["pad_id"])]
    keys = unique_keys(missed)
    return keys, {"windows": len(wins), "missed": len(missed), "distinct_missed": len(keys)}


def grow(store, version, seqs, *, encoder=None, batch_size: int = 2048) -> dict:
    """Add the windows of token id lists `seqs` that `version` misses, valued by the version's
    own lower layers (or `encoder`), to `version` as one segment. Returns the counts, the
    seconds spent valuing and the new segment's name (None when nothing was missed)."""
    if not store.writable:  # fail before minutes of valuing, not at the commit
        raise StoreError("grow writes a segment: open the store with writable=True")
    encoder = encoder if encoder is not None else version_encoder(store, version)
    check_encoder(store.meta, encoder)
    keys, stats = missed_windows(store.snapshot(), version, seqs)
    t0 = time.perf_counter()
    segment = None
    if len(keys):
        values = compute_values(encoder, keys, batch_size)
        stats["value_seconds"] = round(time.perf_counter() - t0, 3)
        segment = store.add_segment(version, keys, values)
    else:
        stats["value_seconds"] = 0.0
    return dict(stats, version=version, segment=segment, seconds=round(time.perf_counter() - t0, 3))
