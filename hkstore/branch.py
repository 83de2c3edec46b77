"""Domain branches by HMI's frequency rule (§5.1, Table 5)."""

import numpy as np

from hkstore.compact import void_keys
from hkstore.errors import StoreError


def select_by_frequency(keys, counts, alpha):
    """The most frequent keys that together cover `alpha` percent of all occurrences.

    Ties in count are broken by key bytes, so the choice is deterministic. alpha = 0 keeps
    nothing, alpha = 100 keeps every key. Returns (kept keys, their counts).
    """
    keys = np.asarray(keys, dtype=np.uint32)
    counts = np.asarray(counts, dtype=np.int64)
    if not 0 <= alpha <= 100:
        raise StoreError(f"alpha must be a percentage between 0 and 100, got {alpha}")
    if len(keys) != len(counts):
        raise StoreError("keys and counts differ in length")
    if not len(keys) or alpha == 0:
        return keys[:0], counts[:0]
    order = np.lexsort((void_keys(keys), -counts))
    cover = np.cumsum(counts[order])
    # The smallest prefix whose occurrences reach alpha% of the total.
    k = int(np.searchsorted(cover, alpha / 100.0 * cover[-1] - 1e-9, side="left")) + 1
    kept = order[:min(k, len(order))]
    return keys[kept], counts[kept]


def create_branch(store, name, parent, keys, counts, alpha, compute_values, info=None):
    """Create version `name` under `parent` holding the top-alpha% n-grams, with vectors from
    `compute_values(keys) -> (m, n, d)` (the domain's lower layers)."""
    kept, kept_counts = select_by_frequency(keys, counts, alpha)
    total = int(np.asarray(counts).sum())
    meta = dict(info or {}, alpha=alpha, ngrams_seen=int(len(keys)), ngrams_kept=int(len(kept)),
                occurrences=total, occurrences_covered=int(kept_counts.sum()))
    # Values first, then the branch and its entries in one commit.
    values = compute_values(kept) if len(kept) else None
    store.create_version(name, parent, meta, kept if len(kept) else None, values)
    return meta
