"""Right bi-grams in the root: the backoff step that keeps the center's right neighbour (issue 21).

    stats = add_right_bigrams(store)     # value the root's missing right bi-grams, set the flag

FORMAT.md section 4's chain drops the right neighbour first, so a centered window [a b c] whose
left bi-gram [a b _] is unknown falls to the uni-gram [_ b _] even when [_ b c] is common. On the
suite's dev text that is a third of all windows, and a chain that also tries the right bi-gram
halves the uni-gram share (BENCHMARKS, coverage). A store whose meta says `right_bigram` looks
them up (hkstore.lookup); this adds the keys its root needs: the right bi-gram of every interior
window the root holds, valued by the root's own lower layers, as one segment, then the flag.
"""

from __future__ import annotations

import time

import numpy as np

from formats.backoff import right_bigram
from hkstore.errors import StoreError
from runtime.build.plot import compute_values, unique_keys
from runtime.model.stored import version_encoder


def missing_right_bigrams(snapshot) -> np.ndarray:
    """Right bi-grams of the root's windows that the root does not hold (distinct)."""
    meta = snapshot.meta
    root = snapshot.version_names[0]
    held = [np.asarray(seg.keys) for seg in snapshot.version_segments(0)]
    keys = unique_keys(np.concatenate(held)) if held else np.zeros((0, meta["n"]), dtype=np.uint32)
    rb, has = right_bigram(keys, meta["window"], meta["pad_id"])
    wanted = unique_keys(rb[has]) if has.any() else rb[:0]
    if not len(wanted):
        return wanted
    served = snapshot.lookup(root, wanted).order
    return wanted[served < 2]


def add_right_bigrams(store, *, batch_size: int = 2048) -> dict:
    """Give `store` the right bi-gram step: the root's missing right bi-grams as one segment,
    then meta right_bigram (the answers of windows that back off to a uni-gram change)."""
    if not store.writable:
        raise StoreError("adding right bi-grams writes a segment: open the store with writable=True")
    sealed = [v["name"] for v in store.versions if v.get("sealed")]
    if sealed:
        raise StoreError(f"version {sealed[0]!r} is sealed: the right bi-gram step would change its answers")
    meta = store.meta
    if meta["window"] != "centered" or meta["n"] < 3:
        raise StoreError(f"right bi-grams need centered windows of n >= 3 (this store: {meta['window']}, n={meta['n']})")
    t0 = time.perf_counter()
    keys = missing_right_bigrams(store.snapshot())
    root = store.snapshot().version_names[0]
    segment = None
    if len(keys):
        segment = store.add_segment(root, keys, compute_values(version_encoder(store, root), keys, batch_size))
    store.set_right_bigram()
    return {"keys": len(keys), "segment": segment, "seconds": round(time.perf_counter() - t0, 3)}
