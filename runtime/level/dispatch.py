"""The dispatcher (Tabi §4.1, Eq. 4) and the coverage gate (beyond Tabi).

Confidence of a level-1 answer, from its calibrated probabilities:

* classification: the top probability;
* tagging: the minimum over the scored tokens (one per word) of each token's top
  probability. A sentence is as sure as its least sure word: one wrong tag breaks an entity,
  and the mean would let many easy "O" words hide it.

Eq. 4: a query with confidence s is re-routed with probability 1 below the cut-off c and
2 * (1 - sigmoid(k * (s - c))) above it (1 at s = c, falling to 0; k -> inf is a hard
threshold at c). The draw is a hash of the query (its tenant and token ids), so the same
request is always answered the same way.

Coverage gate: the share of a request's windows the PLOT served at full order n (no
back-off). Below the gate g the level-1 answer is known to rest on backed-off windows, so the
request goes straight to level 2 without running level 1 (g = 0: confidence alone).
"""

from __future__ import annotations

import numpy as np
import xxhash


def confidence(probs: np.ndarray, task: str) -> float:
    """Sequence-level confidence of calibrated probabilities: (C,) or (words, C)."""
    probs = np.asarray(probs)
    if task == "classification":
        return float(probs.max())
    return float(probs.max(-1).min()) if len(probs) else 1.0


def reroute_probability(s, c: float, k: float):
    """Eq. 4 for confidence s (scalar or array)."""
    s = np.asarray(s, dtype=np.float64)
    above = 2.0 * (1.0 - 1.0 / (1.0 + np.exp(-np.clip(k * (s - c), -50, 50))))
    out = np.where(s < c, 1.0, above)
    return float(out) if out.ndim == 0 else out


def draw(tenant: str, ids) -> float:
    """A uniform number in [0, 1) fixed by the request (tenant, token ids)."""
    h = xxhash.xxh64(tenant.encode())
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.intdigest() / 2.0 ** 64


def coverage(orders, n: int) -> float:
    """Share of a request's windows served at full order n (runtime.plot.retrieve.Served.order)."""
    orders = np.asarray(orders)
    return float((orders >= n).mean()) if orders.size else 1.0


def reroute(tenant: str, ids, s: float, c: float, k: float) -> bool:
    return draw(tenant, ids) < reroute_probability(s, c, k)
