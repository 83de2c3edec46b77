"""Windows as a version serves text it has never seen (issue 21).

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
from formats.backoff import right_bigram as right_bigram_of


def unseen_windows(wins: np.ndarray, rate: float, rng: np.random.Generator, kind: str, pad_id: int,
                   right_bigram: bool = False) -> np.ndarray:
    """wins (W, n) uint32 with each row moved down its backoff chain a random number of steps.

    right_bigram (the store's meta flag): the chain's order-1 step first passes through the
    window's right bi-gram, as the lookup does."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"unseen rate {rate} is not in [0, 1]")
    wins = np.array(wins, dtype=np.uint32, copy=True)
    rb, detour = right_bigram_of(wins, kind, pad_id)
    detour &= right_bigram
    step = rng.random(len(wins)) < rate
    while True:
        order = key_order(wins, kind, pad_id)
        step &= order > 1  # a uni-gram is the chain's end
        if not step.any():
            return wins
        turn = step & detour & (order == 2)
        wins[turn] = rb[turn]
        detour &= ~turn
        plain = step & ~turn
        wins[plain] = backoff(wins[plain], kind, pad_id)
        step[step] = rng.random(int(step.sum())) < rate
