"""The precision each level of a tenant serves at, chosen by measurement.

After a level is trained, its rows are scored through the CPU executor twice, in fp32 and with
the shared GEMMs in bf16 (runtime.exec.precision), on the same examples: the examples the
tenant held out of training when it has them, else a seeded sample of its training examples,
or a dev file (`hkstore levels profile --dev`). The level serves bf16 when bf16 scores no more
than the target below fp32 (0.3 points unless told), else fp32. A decoder tenant is measured by
its perplexity on a sample of its training text (runtime.construct.decoder_tenant): bf16 where
it is at most 0.3% above fp32's, the same fraction of its metric. On a few hundred examples one
answer is worth more than 0.3 points, so there bf16 is chosen only where it loses no answer on
balance: a wrong bf16 costs a tenant accuracy, a wrong fp32 only speed. The record's meta keeps the
choice, ``precision``, which an executor at precision "auto" serves each row at, and
``precision_check``: what was asked, and, when measured, both scores and on what.

    asked = check_asked("auto")      # bf16 on a CPU without it: PrecisionUnavailable, one line
    mark(snapshot, encoder, records, ids, targets, asked, on="held-out")   # records' metas gain both

Only the PET's PLOT rows are scored for the tenant's PET record (the exact level serves the
same record); a full-depth record is scored on its full rows. A CPU without native bf16 serves
fp32 whatever a record says, so auto records fp32 there without measuring.
"""

from __future__ import annotations

import time

import numpy as np

ASKED = ("auto", "fp32", "bf16")
TARGET = 0.003  # the most a level may lose at bf16, a fraction of its metric: 0.3 points, or 0.3% of a perplexity
TRAINING_ROWS = 256  # without held-out examples, at most this many training examples are scored
BATCH = 32


def check_asked(asked: str) -> str:
    """The asked precision, checked: bf16 on a CPU without native bf16 raises
    runtime.exec.precision.PrecisionUnavailable (a ValueError naming what it lacks)."""
    from runtime.exec.precision import resolve

    if asked not in ASKED:
        raise ValueError(f"precision must be one of {', '.join(ASKED)}, got {asked!r}")
    if asked == "bf16":
        resolve("bf16")
    return asked


def training_sample(ids, targets, seed: int = 0):
    """(ids, targets): at most TRAINING_ROWS of the training examples, a seeded sample."""
    if len(ids) <= TRAINING_ROWS:
        return list(ids), list(targets)
    pick = np.sort(np.random.default_rng(seed).choice(len(ids), size=TRAINING_ROWS, replace=False))
    return [ids[i] for i in pick], [targets[i] for i in pick]


def mark(snapshot, encoder, records, ids, targets, asked: str, on: str, target: float = TARGET) -> None:
    """Set ``precision`` and ``precision_check`` in the meta of each of a tenant's records (its
    PET record, then its full-depth record when it has one), scored on (ids, targets) when
    asked is auto; `on` says what those examples are (held-out, training, dev)."""
    from runtime.construct.calibration import metric_name

    for record in records:
        record.meta.update(checked(asked, lambda: score(snapshot, encoder, record, ids, targets),
                                   metric_name(record.meta["task"]), len(ids), on, target))


def checked(asked: str, scores_of, metric: str, examples: int, on: str, target: float = TARGET) -> dict:
    """A level's ``precision`` and ``precision_check``: as asked, or for auto on a CPU with native
    bf16, bf16 where scores_of() (({"fp32": s, "bf16": s}, CPU seconds), called only then) shows
    bf16 within the target on `examples` examples of `metric` (a perplexity: at most target
    higher, as a fraction of fp32's; a score: at most target lower)."""
    from runtime.exec.precision import resolve

    asked = check_asked(asked)
    measure = asked == "auto" and resolve("auto") == "bf16"  # resolve says once when the CPU lacks it
    check = {"asked": asked}
    if measure and examples:
        scores, seconds = scores_of()
        chosen = "bf16" if holds(scores, metric, target) else "fp32"
        check.update(scores=scores, metric=metric, examples=examples, on=on, target=target, seconds=round(seconds, 3))
    elif asked == "auto":
        chosen = "fp32"
        check["unmeasured"] = "no examples to score" if measure else "no native bf16 on the machine that trained it"
    else:
        chosen = asked
    return {"precision": chosen, "precision_check": check}


def holds(scores: dict, metric: str, target: float = TARGET) -> bool:
    """Whether bf16's score is within the target of fp32's."""
    if metric == "perplexity":
        return scores["bf16"] <= scores["fp32"] * (1 + target) + 1e-12
    return scores["bf16"] >= scores["fp32"] - target - 1e-12


def score(snapshot, encoder, record, ids, targets) -> tuple[dict, float]:
    """({"fp32": s, "bf16": s}, CPU seconds of both passes): the record's level scored through the
    CPU executor at each precision, one after the other (as the store serves it: a PET
    record on its version's PLOT inputs, a full-depth record on full rows)."""
    import torch

    from runtime.construct.calibration import held_score
    from runtime.exec.cpu import CpuExecutor
    from runtime.exec.rows import Row
    from runtime.model.pet import is_full, load_pet, pet_meta

    meta = record.meta
    source, version = ("full" if is_full(meta) else "plot"), meta["version"]
    logits = {"fp32": [], "bf16": []}
    t0 = time.process_time()
    # as a runtime loads it: its fp16 tensors kept fp16, computed in fp32
    pet = load_pet(encoder, record.tensors, pet_meta(meta), half=True)
    pet.meta.update(version=version, tenant=record.tenant, created=meta.get("created"))
    for precision in logits:
        executor = CpuExecutor(encoder, precision=precision, prefetch=False)
        try:
            served = executor.load_pet(pet)
            with torch.no_grad():
                for start in range(0, len(ids), BATCH):
                    rows = [Row(list(x), served, version, source) for x in ids[start:start + BATCH]]
                    logits[precision] += executor.compute(executor.prepare(executor.gather(snapshot, rows), rows))
        finally:
            executor.close()
    seconds = time.process_time() - t0
    labels = list(meta["labels"])
    return ({p: round(held_score(z, targets, meta["task"], labels), 6) for p, z in logits.items()}, seconds)


def words(precision: str, check: dict | None) -> str:
    """A level's precision as `hkstore tenant info` says it: the precision and why."""
    if not check:
        return f"{precision} (not measured)"
    if "scores" in check:
        s = check["scores"]
        bound = (f"bf16 may raise it {100 * check['target']:g}%" if check["metric"] == "perplexity"
                 else f"bf16 may lose {100 * check['target']:g} points")
        return (f"{precision} ({check['on']} {check['metric'].replace('_', ' ')} fp32 {s['fp32']:.3f}, "
                f"bf16 {s['bf16']:.3f} on {check['examples']} examples; {bound})")
    if "unmeasured" in check:
        return f"{precision} (not measured: {check['unmeasured']})"
    return f"{precision} (asked)"

