"""Word pruning for level 2 (Tabi §4.2, Eq. 5).

Importance of a token = the attention it receives in level 1's upper layers, summed over
query positions and averaged over heads and layers (the executor accumulates it while it
computes attention: runtime.exec.cpu_batched.attention). A word is dropped before level 2
runs when every one of its sub-word tokens is below alpha times the mean importance of the
words' tokens. The mean leaves out the special tokens: [CLS] and [SEP] soak up much of a
layer's attention (Clark et al. 2019, "What does BERT look at?"), and counting them would
raise the bar for every word. Special tokens are never dropped. alpha = 0 prunes nothing.

For tagging, a pruned word keeps level 1's probabilities (runtime.level.serve).
"""

from __future__ import annotations

import numpy as np


def word_spans(firsts, length: int) -> list:
    """[a, b) token spans of the words whose first sub-tokens are at `firsts` (ascending) in
    a sequence of `length` tokens that ends with [SEP]; with firsts None every token between
    [CLS] and [SEP] is a word (an ids request)."""
    if firsts is None:
        return [(j, j + 1) for j in range(1, length - 1)]
    ends = list(firsts[1:]) + [length - 1]
    return [(int(a), int(b)) for a, b in zip(firsts, ends)]


def prune(importance, spans: list, alpha: float) -> tuple[np.ndarray, list]:
    """(kept token positions, indices of the dropped words) for one request."""
    imp = np.asarray(importance, dtype=np.float64)
    length = len(imp)
    keep = np.ones(length, dtype=bool)
    if alpha <= 0 or not spans:
        return np.arange(length), []
    inside = np.concatenate([np.arange(a, b) for a, b in spans])
    bar = alpha * imp[inside].mean()
    dropped = [w for w, (a, b) in enumerate(spans) if (imp[a:b] < bar).all()]
    if len(dropped) == len(spans):  # keep the most important word: level 2 needs some text
        dropped.remove(int(np.argmax([imp[a:b].max() for a, b in spans])))
    for w in dropped:
        a, b = spans[w]
        keep[a:b] = False
    return np.flatnonzero(keep), dropped
