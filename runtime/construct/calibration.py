"""A tenant's temperatures fitted when it is created or updated (Tabi §4.1, Eq. 3): a share of
its training examples is held out of training, both levels score them with the trained PET,
and each level's temperature minimizes the NLL there (runtime.model.calibrate). No retraining.

    train, held = holdout(len(ids), share=0.1, seed=0)
    rec = calibrate_pet(store, encoder, version, pet, [ids[i] for i in held], [targets[i] for i in held])
    # {"temperature": {"1": T1, "2": T2}, "ece": {"1": {"before", "after"}, ...}, "examples": k,
    #  "metric": "accuracy", "score": {"1": s1, "2": s2}, ...}

Level 1 scores the held-out text as served (the version's PLOT inputs); level 2 with the lower
layers in full context (runtime.model.stored.context_encoder, what runtime.level serves as
level 2), the PET unchanged. Each level's score there (accuracy, or entity F1 for tagging) is
kept too: the tenant's held-out scores (`hkstore tenant info`). The record is stored in the PET
meta under ``calibration``
(FORMAT.md §5); runtime.level.serve reads its temperatures until `hkstore levels profile`
writes a levels record.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_HELD = 8  # fewer held-out examples than this fit no temperature worth storing


def holdout(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held) indices of n examples: a seeded random `share` held out (at least
    MIN_HELD, and at least one example left to train on); ValueError if n is too small."""
    if not 0 < share < 1:
        raise ValueError(f"the calibration share must be in (0, 1), got {share}")
    k = max(MIN_HELD, round(share * n))
    if k >= n:
        raise ValueError(f"{n} training examples are too few to hold out {k} for calibration "
                         f"(at least {MIN_HELD}, and some left to train on)")
    held = np.sort(np.random.default_rng(seed + 1).choice(n, size=k, replace=False))
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).tolist(), held.tolist()


@torch.no_grad()
def level_logits(store, encoder, version, pet, ids, batch: int = 32) -> tuple[list, list]:
    """Per example the logits of level 1 (PLOT inputs) and level 2 (full-context lower
    layers): (labels,) for classification, (tokens, labels) for tagging."""
    from runtime.model import pet as petlib
    from runtime.model.stored import context_encoder
    from runtime.plot.retrieve import retrieve

    snap = store.snapshot()
    full = context_encoder(store, version, encoder)
    one, two = [], []
    for start in range(0, len(ids), batch):
        seqs = ids[start:start + batch]
        h, mask, _ = retrieve(snap, version, seqs)
        x, real = encoder.pad(seqs)
        for out, inputs, m in ((one, h, mask), (two, full.lower(x, real), real)):
            logits = petlib.head(pet, encoder.upper(inputs, m, pet))
            for b, s in enumerate(seqs):
                out.append((logits[b] if pet.meta["task"] == "classification" else logits[b, :len(s)]).numpy())
    return one, two


def calibrate_pet(store, encoder, version, pet, ids, targets, share: float | None = None) -> dict:
    """The calibration record of a trained PET from its held-out examples (see the module doc)."""
    from runtime.model import calibrate as cal

    task, labels = pet.meta["task"], list(pet.meta["labels"])
    record = {"temperature": {}, "ece": {}, "examples": len(ids), "share": share,
              "metric": metric_name(task), "score": {}}
    for level, logits in zip(("1", "2"), level_logits(store, encoder, version, pet, ids)):
        record["score"][level] = round(held_score(logits, targets, task, labels), 6)
        z, y = cal.samples(logits, targets)
        if not len(y):
            raise ValueError("the held-out examples have no scored label to calibrate on")
        T = cal.fit_temperature(z, y)
        record["temperature"][level] = round(float(T), 6)
        record["ece"][level] = {"before": round(float(cal.reliability(cal.softmax(z), y)["ece"]), 6),
                                "after": round(float(cal.reliability(cal.softmax(z, T), y)["ece"]), 6)}
    return record


def metric_name(task: str) -> str:
    return "accuracy" if task == "classification" else "entity_f1"


def held_score(logits, targets, task: str, labels: list[str]) -> float:
    """The score of per-example logits on encoded targets: accuracy, or entity F1 over the words
    the targets kept (a word's first sub-token carries its tag; truncated words are lost)."""
    from runtime.construct.data import IGNORE, accuracy, entity_f1, word_tags

    predicted = [np.asarray(z).argmax(-1).tolist() for z in logits]
    if task == "classification":
        return accuracy(list(targets), predicted)
    gold = [[labels[y] for y in t if y != IGNORE] for t in targets]
    return entity_f1(gold, [word_tags(p, t, labels, len(g)) for p, t, g in zip(predicted, targets, gold)])
