"""The policies behind runtime.Runtime.infer: ``fast`` (level 1 only), ``auto`` (Tabi's
dispatcher with the tenant's profiled policy), ``exact`` (level 2 only).

The engine steps, the scheduler decides the batches, the executor computes: ``answer`` hands
every request of a call to the scheduler at once (level-1 and level-2 items of all tenants
batch together; runtime.level.executor), dispatches the level-1 answers of ``auto``
requests (runtime.level.dispatch), prunes the re-routed ones' words with the attention
level 1 returned (runtime.level.prune), sends all re-routed requests back as one more
submission at level 2, and ensembles (runtime.level.ensemble).

A tenant's levels record (its PET meta ``levels``, FORMAT.md §5; runtime.level.profile
writes it) gives the temperatures and the policy; a tenant without one is served with
T = 1 and ``auto`` means ``fast`` for it (there is no profiled policy to follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.errors import BadRequest
from runtime.level import dispatch, ensemble
from runtime.level.executor import LevelTag
from runtime.level.prune import prune, word_spans
from runtime.model.calibrate import softmax
from runtime.sched.scheduler import Item

POLICIES = ("fast", "auto", "exact")


@dataclass
class Answer:
    probs: np.ndarray  # calibrated: (labels,) or (reported positions, labels)
    logits: np.ndarray  # the raw head output of the level that answered last
    level: int  # 1 or 2 (2: level 2 alone or the ensemble of a re-routed request)
    confidence: float  # runtime.level.dispatch.confidence of probs
    pruned: int  # words level 2 did not see (pruning); their tags are level 1's
    timings: dict
    batch_size: int
    students: int = 0  # how many students answered (runtime.student); 0: the teacher


def current(meta: dict):
    """The levels record of a stored PET meta, None when absent or stale: profiled for an
    earlier PET of the tenant (tenant update retrains it and keeps the rest of the meta)."""
    record = meta.get("levels")
    if not record or record.get("pet_created") != meta.get("created"):
        return None
    return record


def levels(pet) -> dict:
    return pet.meta.get("levels") or {}


def temperature(pet, level: int) -> float:
    """The level's temperature: the levels record's (hkstore levels profile), else the one
    fitted when the tenant was created or updated (the meta's current ``calibration``), else 1."""
    fitted = levels(pet).get("temperature") or (pet.meta.get("calibration") or {}).get("temperature") or {}
    return float(fitted.get(str(level), 1.0))


def calibration(meta: dict):
    """The calibration record fitted at tenant create / update (runtime.construct.calibration),
    None when absent or made for an earlier training round of the PET."""
    record = meta.get("calibration")
    if not record or record.get("updates") != (meta.get("train") or {}).get("updates", 0):
        return None
    return record


def policy_of(pet, asked):
    """(policy name, profiled parameters or None) for a request that asked `asked` (None:
    the default, auto once the tenant is profiled, else fast)."""
    chosen = levels(pet).get("policy")
    if asked is None:
        asked = "auto" if chosen else "fast"
    if asked not in POLICIES:
        raise BadRequest(f"policy must be one of {', '.join(POLICIES)}, got {asked!r}")
    if asked == "auto" and not chosen:
        return "fast", None
    return asked, chosen


def answer(scheduler, requests, tags=None) -> list:
    """Answers of requests: (tenant, ids, positions, pet, version, asked policy) each;
    positions: the token positions a tagging request reports (None: classification).
    tags: per request, the tag of its item when it is served at policy fast or auto (e.g. a
    runtime.student StudentTag: students may answer it, its ``students`` says how many did; under
    auto its ``teacher`` is set to the level tag the dispatcher gives the request, and an answer
    by students is returned as it is, never re-routed)."""
    items, plans = [], []
    for i, (tenant, ids, positions, pet, version, asked) in enumerate(requests):
        name, chosen = policy_of(pet, asked)
        tag = tags[i] if tags is not None and name != "exact" else None
        if name == "exact":
            tag = LevelTag(level=2)
        elif name == "auto":
            gate = float(chosen.get("gate", 0.0))
            # a gate above 1 sends every request to level 2: no lookup to measure coverage
            level_tag = LevelTag(level=2) if gate > 1 else LevelTag(level=1, gate=gate,
                                                                      attention=float(chosen.get("alpha", 0)) > 0)
            if tag is None:
                tag = level_tag
            else:  # students may answer it (under load); the teacher serves it as Tabi's tag says
                tag.teacher = level_tag
        items.append(Item(list(ids), pet, version, tag))
        plans.append((name, chosen))
    outs = scheduler.run(items)
    answers, again, later = [], [], []
    for b, ((tenant, ids, positions, pet, version, _), (name, chosen), item, out) in enumerate(
            zip(requests, plans, items, outs)):
        students = getattr(item.tag, "students", None) or 0
        tag = getattr(item.tag, "teacher", None) or item.tag  # the level tag the teacher was served with
        level = 2 if not students and isinstance(tag, LevelTag) and tag.level == 2 else 1
        a = _single(pet, out, level, positions, students)
        answers.append(a)
        # students answer only under load: re-routing their answers would add the work they save
        if name != "auto" or level == 2 or students:
            continue
        if dispatch.reroute(tenant, ids, a.confidence, float(chosen["c"]), float(chosen["k"])):
            spans = word_spans(_firsts(positions, len(ids)), len(ids))
            received = tag.received if tag.received is not None else np.zeros(len(ids))
            kept, dropped = prune(received, spans, float(chosen.get("alpha", 0.0)))
            again.append(Item([ids[j] for j in kept], pet, version, LevelTag(level=2)))
            later.append((b, kept, len(dropped), float(chosen.get("w", 0.0))))
    if again:
        for (b, kept, n_dropped, w), out in zip(later, scheduler.run(again)):
            answers[b] = _rerouted(answers[b], requests[b], out, kept, n_dropped, w)
    return answers


def _firsts(positions, length):
    """First sub-token positions of a tagging request's words (None: ids or classification)."""
    if positions is None or (len(positions) == length and positions[0] == 0):
        return None
    return list(positions)


def _single(pet, out, level, positions, students: int = 0) -> Answer:
    logits = np.asarray(out.logits, dtype=np.float32)
    # the temperatures were calibrated on the teacher's logits, not on the students' head
    probs = softmax(logits, 1.0 if students else temperature(pet, level))
    if positions is not None:
        probs = probs[positions]
    return Answer(probs, logits, level, dispatch.confidence(probs, pet.task), 0, dict(out.timings), out.batch_size,
                  students)


def _rerouted(first: Answer, request, out, kept, n_dropped, w) -> Answer:
    _, _, positions, pet, _, _ = request
    logits = np.asarray(out.logits, dtype=np.float32)
    p2 = softmax(logits, temperature(pet, 2))
    if positions is None:
        probs = ensemble.combine(first.probs, p2, w)
    else:
        where = np.searchsorted(kept, positions)
        seen = [j for j, p in enumerate(positions) if where[j] < len(kept) and kept[where[j]] == p]
        probs = ensemble.tagging(first.probs, p2[where[seen]], seen, w)
    timings = dict(first.timings, level2=out.timings.get("total", 0.0))
    timings["total"] = first.timings.get("total", 0.0) + timings["level2"]
    return Answer(probs, logits, 2, dispatch.confidence(probs, pet.task), n_dropped, timings, out.batch_size)
