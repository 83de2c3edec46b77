"""Windows as a version serves text it has never seen.

A tenant is trained on the PLOT inputs of its training text, and the version it is trained on
was built from that same text, so every training window is served exactly. Text from outside the
corpus is not: on the task suite's dev text a third of the windows back off to a bi-gram and a
third to a uni-gram (BENCHMARKS, coverage). A PET that never saw a backed-off input then meets
them all at once in serving. `unseen_windows` draws, for each window, how many steps of the
FORMAT.md §4 backoff chain it skips before its lookup: each further step with probability
`rate` (so with rate r a window keeps its full order with probability 1 - r, and reaches a
uni-gram with probability r ** (order - 1)). The lookup then serves what the store holds for the
shortened key, exactly what it would serve a window whose longer keys were missing.
"""

from __future__ import annotations

import numpy as np

from formats.backoff import backoff, key_order


def unseen_windows(wins: np.ndarray, rate: float, rng: np.random.Generator, kind: str, pad_id: int) -> np.ndarray:
    """wins (W, n) uint32 with each row moved down its backoff chain a random number of steps."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"unseen rate {rate} is not in [0, 1]")
    wins = np.array(wins, dtype=np.uint32, copy=True)
    step = rng.random(len(wins)) < rate
    while True:
        step &= key_order(wins, kind, pad_id) > 1  # a uni-gram is the chain's end
        if not step.any():
            return wins
        wins[step] = backoff(wins[step], kind, pad_id)
        step[step] = rng.random(int(step.sum())) < rate
