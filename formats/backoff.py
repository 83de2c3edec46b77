"""Window slots, key orders and the backoff chain (FORMAT.md section 4)."""

import numpy as np

KINDS = ("centered", "causal")


def left(n, kind):
    """Number of slots before the center: the center's slot index."""
    if kind not in KINDS:
        raise ValueError(f"unknown window kind {kind!r} (expected centered or causal)")
    return (n - 1) // 2 if kind == "centered" else n - 1


def offsets(n, kind):
    lo = left(n, kind)
    return np.arange(-lo, n - lo)


def windows(ids, n, kind, pad_id):
    """The (L, n) uint32 keys of a sequence's L windows; row i is the window around position i."""
    ids = np.asarray(ids)
    at = np.arange(len(ids))[:, None] + offsets(n, kind)[None, :]
    inside = (at >= 0) & (at < len(ids))
    return np.where(inside, ids[np.clip(at, 0, max(len(ids) - 1, 0))], pad_id).astype(np.uint32)


def ranked_slots(n, kind):
    """Slot indices, center first, then nearer before farther, left before right."""
    off = offsets(n, kind)
    return sorted(range(n), key=lambda s: (abs(off[s]), off[s] > 0))


def key_order(keys, kind, pad_id):
    keys = np.asarray(keys)
    n = keys.shape[1]
    c = left(n, kind)
    real = keys != pad_id
    return 1 + real.sum(axis=1) - real[:, c]


def backoff(keys, kind, pad_id):
    """The next key of each row's chain: its lowest-ranked non-pad, non-center slot set to pad.

    Rows that are already uni-grams come back unchanged.
    """
    keys = np.array(keys, dtype=np.uint32, copy=True)
    n = keys.shape[1]
    done = np.zeros(len(keys), dtype=bool)
    for slot in reversed(ranked_slots(n, kind)[1:]):
        hit = ~done & (keys[:, slot] != pad_id)
        keys[hit, slot] = pad_id
        done |= hit
    return keys
