"""The full-depth level's answers on unlabeled domain text, as more training examples for the
PLOT level (self-training: the tenant's own top teaches its cheaper level).

The PLOT-level PET learns from a few hundred labeled texts, while the full-depth level trained on
the same texts answers about ten points better. Its answers on unlabeled text of the tenant's
domain are extra supervision the labels alone do not give (the students learn from the same kind
of text). The answers are hard labels, the top's argmax: one per text for classification, one
per word (its first sub-token, as encode_tagging places labels) for tagging, where a corpus line
is split into words on whitespace.
"""

from __future__ import annotations

import numpy as np

from runtime.construct.data import IGNORE, encode_tagging


def pseudo_examples(encoder, whole, full_pet, docs: list[str], task: str, labels: list[str],
                    max_len: int) -> tuple[list[list[int]], list]:
    """(ids, targets) of docs (non-empty texts) labeled by full_pet on whole (runtime.construct.full)."""
    from runtime.construct.full import full_logits

    if not docs:
        return [], []
    if task == "classification":
        ids = encoder.tokenize(docs, max_len)
        return ids, [int(np.argmax(z)) for z in full_logits(whole, full_pet, ids)]
    words = [d.split() for d in docs]
    ids, slots = encode_tagging(encoder, words, [[labels[0]] * len(w) for w in words], labels, max_len)
    targets = []
    for slot, z in zip(slots, full_logits(whole, full_pet, ids)):
        best = np.argmax(z, axis=-1)
        targets.append([IGNORE if t == IGNORE else int(best[j]) for j, t in enumerate(slot)])
    return ids, targets
