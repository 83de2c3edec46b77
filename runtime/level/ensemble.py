"""The weighted ensemble of re-routed queries (Tabi §4.3, Eq. 6).

A re-routed query is answered by w * p1 + (1 - w) * p2 of the levels' calibrated
probabilities; Tabi weighs each level by its accuracy on re-routed data
(``accuracy_weight``), and profiling may pick another w on held-out data
(runtime.level.profile). w = 0 is level 2 alone.
"""

from __future__ import annotations

import numpy as np


def combine(p1, p2, w: float) -> np.ndarray:
    return w * np.asarray(p1, dtype=np.float64) + (1.0 - w) * np.asarray(p2, dtype=np.float64)


def accuracy_weight(acc1: float, acc2: float) -> float:
    """Level 1's weight from the levels' accuracies on re-routed queries."""
    total = acc1 + acc2
    return float(acc1 / total) if total > 0 else 0.5


def tagging(p1_words, p2_words, kept_words, w: float) -> np.ndarray:
    """Word probabilities of a re-routed tagging query: the ensemble on the words level 2 saw
    (p2_words, one row per kept word, in order), level 1's own on the words pruning dropped."""
    out = np.array(p1_words, dtype=np.float64, copy=True)
    if len(kept_words):
        out[kept_words] = combine(out[kept_words], p2_words, w)
    return out
