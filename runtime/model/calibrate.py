"""Temperature scaling (Tabi §4.1, Eq. 3; Guo et al. 2017) and expected calibration error.

A level's logits z become softmax(z / T); T is the one scalar per tenant and level that
minimizes the negative log-likelihood on held-out labelled data (no retraining). For
tagging every scored token is one sample.
"""

from __future__ import annotations

import numpy as np


def softmax(z: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64) / float(temperature)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def nll(logits: np.ndarray, targets: np.ndarray, temperature: float) -> float:
    """Mean negative log-likelihood of targets (N,) under softmax(logits (N, C) / T)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def fit_temperature(logits: np.ndarray, targets, lo: float = 0.05, hi: float = 20.0) -> float:
    """The T in [lo, hi] minimizing nll: a log-spaced grid, then golden-section search
    around its best point (NLL is unimodal in log T for a fixed set of logits)."""
    logits = np.asarray(logits, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.int64)
    if not len(targets):
        return 1.0
    grid = np.geomspace(lo, hi, 41)
    j = int(np.argmin([nll(logits, targets, t) for t in grid]))
    a, b = np.log(grid[max(j - 1, 0)]), np.log(grid[min(j + 1, len(grid) - 1)])
    g = (np.sqrt(5) - 1) / 2
    for _ in range(40):
        c, d = b - g * (b - a), a + g * (b - a)
        if nll(logits, targets, np.exp(c)) < nll(logits, targets, np.exp(d)):
            b = d
        else:
            a = c
    return float(np.exp((a + b) / 2))


def reliability(probs: np.ndarray, targets, bins: int = 10) -> dict:
    """Reliability diagram data and ECE of probabilities (N, C) against targets (N,):
    per equal-width confidence bin its count, mean confidence and accuracy; ece = the
    count-weighted mean |accuracy - confidence|."""
    probs = np.asarray(probs, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.int64)
    conf = probs.max(-1)
    correct = probs.argmax(-1) == targets
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    mean_conf = np.bincount(which, conf, minlength=bins) / np.maximum(count, 1)
    acc = np.bincount(which, correct, minlength=bins) / np.maximum(count, 1)
    ece = float((count * np.abs(acc - mean_conf)).sum() / max(len(conf), 1))
    return {"edges": edges.tolist(), "count": count.tolist(), "confidence": mean_conf.tolist(),
            "accuracy": acc.tolist(), "ece": ece}


def samples(logits, targets) -> tuple[np.ndarray, np.ndarray]:
    """(z (N, labels), y (N,)) to fit and score on: one sample per example (classification:
    targets one label each) or per scored token (tagging: a label list per example; labels
    below 0, the sub-tokens the loss skips, left out)."""
    if np.ndim(targets[0]) == 0:
        return np.stack(logits), np.asarray(targets)
    z = np.concatenate(logits)
    y = np.concatenate([np.asarray(t) for t in targets])
    return z[y >= 0], y[y >= 0]
