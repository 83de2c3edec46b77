"""The policies behind runtime.Runtime.infer: ``fast`` (level 1 only), ``auto`` (Tabi's
dispatcher with the tenant's profiled policy), ``exact`` (level 2 only).

Level 2 is the tenant's *top*: its current full-depth PET (``full``) when it has one, else
the full-context lower layers with its PET (``exact``); exact costs about what full-depth
costs and is less accurate, so a full-depth tenant's cascade leaves it out. Functions that
depend on the top take ``full``: the tenant's current full-depth ServingPet, None for exact.
An answer names the level that answered (``NAMES``: students, plot, exact or full).

The engine (runtime.engine) routes and steps; these are the decisions and answers it asks
for: ``policy_of`` (which policy a request is served at), ``single`` (an answer from one
level's logits, calibrated), ``send_up`` (Tabi's dispatcher on a level-1 answer,
runtime.level.dispatch, and the words level 2 reads, runtime.level.prune) and ``rerouted``
(level 2's answer ensembled with level 1's, runtime.level.ensemble).

A tenant's levels record (its PET meta ``levels``, FORMAT.md §5; runtime.level.profile
writes it) gives the temperatures and the policy; a tenant without one is served with
T = 1 and ``auto`` means ``fast`` for it (there is no profiled policy to follow). A record
profiled against another top than the tenant's current one (``profile.top``, exact when
absent; for full, also the full-depth PET's ``created``) is not followed: its policy and
level-2 temperature were measured on other outputs.

Level 1 is what the record's ``policy.level1`` says (``level1``): ``plot`` (absent, in every
older record: the PLOT row) or ``students`` (the tenant's first ``policy.students`` students,
answering at T = 1 as they always do; the dispatcher re-routes their unsure answers to the top).
A students-first policy is followed only with the students it was profiled on (``follow``):
with none servable (unfinished, stale, removed) or other ones, the record's ``policy.plot``,
the best PLOT-first policy of the same profile, is followed instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.errors import BadRequest
from runtime.level import dispatch, ensemble
from runtime.level.prune import prune, word_spans
from runtime.model.calibrate import softmax

POLICIES = ("fast", "auto", "exact")
NAMES = {"students": "students", "plot": "plot", "context": "exact", "full": "full"}  # a row's source -> its level


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
    level_name: str = "plot"  # the level that answered last: students, plot, exact or full (NAMES)


def current(meta: dict):
    """The levels record of a stored PET meta, None when absent or stale: profiled for an
    earlier PET of the tenant (tenant update retrains it and keeps the rest of the meta)."""
    record = meta.get("levels")
    if not record or record.get("pet_created") != meta.get("created"):
        return None
    return record


def top_of(full) -> str:
    """The name of the top level for a tenant's full-depth ServingPet (None: exact)."""
    return "exact" if full is None else "full"


def profiled_against(record: dict) -> tuple:
    """(top name, the full-depth PET's created or None) a levels record was profiled against."""
    profile = record.get("profile") or {}
    return profile.get("top", "exact"), profile.get("full_created")


def levels(pet, full=None) -> dict:
    """The tenant's levels record when it was profiled against its current top, else {}."""
    record = pet.meta.get("levels") or {}
    top, created = profiled_against(record)
    if not record or top != top_of(full) or (full is not None and created != full.meta.get("created")):
        return {}
    return record


def temperature(pet, level: int, full=None) -> float:
    """The level's temperature: the levels record's (hkstore levels profile), else the one
    fitted when the tenant was created or updated (the meta's current ``calibration``: level
    1's, and level 2's when the top is exact, the level it was fitted on), else 1."""
    fitted = levels(pet, full).get("temperature")
    if not fitted and (level == 1 or full is None):
        fitted = (pet.meta.get("calibration") or {}).get("temperature")
    return float((fitted or {}).get(str(level), 1.0))


def calibration(meta: dict):
    """The calibration record fitted at tenant create / update (runtime.construct.calibration),
    None when absent or made for an earlier training round of the PET."""
    record = meta.get("calibration")
    if not record or record.get("updates") != (meta.get("train") or {}).get("updates", 0):
        return None
    return record


def policy_of(pet, asked, full=None):
    """(policy name, profiled parameters or None) for a request that asked `asked` (None:
    the default, auto once the tenant is profiled against its current top, else fast)."""
    chosen = levels(pet, full).get("policy")
    if asked is None:
        asked = "auto" if chosen else "fast"
    if asked not in POLICIES:
        raise BadRequest(f"policy must be one of {', '.join(POLICIES)}, got {asked!r}")
    if asked == "auto" and not chosen:
        return "fast", None
    return asked, chosen


def level1(chosen) -> str:
    """The level 1 a profiled policy starts from: plot (absent: every older record) or students."""
    return (chosen or {}).get("level1", "plot")


def follow(chosen, students):
    """The policy an auto request follows, given its runtime.student.serve.Students record (None:
    no servable students, or the request asked for the teacher): a students-first policy only
    with the students it was profiled on, else its PLOT-first fallback (None when it has none)."""
    if level1(chosen) != "students":
        return chosen
    if students is not None and students.group.meta.get("created") == chosen.get("students_created"):
        return chosen
    return chosen.get("plot")


def send_up(tenant, ids, positions, first: Answer, chosen: dict, received) -> tuple | None:
    """Tabi's dispatcher on a level-1 answer of an ``auto`` request: None keeps it; else (the
    token positions level 2 reads, words pruned): the words by the attention level 1 gave
    them (received: per token, None when level 1 did not report it)."""
    if not dispatch.reroute(tenant, ids, first.confidence, float(chosen["c"]), float(chosen["k"])):
        return None
    spans = word_spans(_firsts(positions, len(ids)), len(ids))
    received = received if received is not None else np.zeros(len(ids))
    kept, dropped = prune(received, spans, float(chosen.get("alpha", 0.0)))
    return kept, len(dropped)


def _firsts(positions, length):
    """First sub-token positions of a tagging request's words (None: ids or classification)."""
    if positions is None or (len(positions) == length and positions[0] == 0):
        return None
    return list(positions)


def level_of(source: str) -> int:
    """The cascade level of a row's input source: 2 for the top (exact or full), else 1."""
    return 2 if NAMES[source] in ("exact", "full") else 1


def single(pet, out, positions, students: int = 0, full=None) -> Answer:
    """The answer of one level's output (logits, timings, batch_size, source): probabilities
    calibrated at the level's temperature, the reported positions'."""
    logits = np.asarray(out.logits, dtype=np.float32)
    level = level_of(out.source)
    # the temperatures were calibrated on the teacher's logits, not on the students' head
    probs = softmax(logits, 1.0 if students else temperature(pet, level, full))
    if positions is not None:
        probs = probs[positions]
    return Answer(probs, logits, level, dispatch.confidence(probs, pet.task), 0, dict(out.timings), out.batch_size,
                  students, NAMES[out.source])


def rerouted(first: Answer, pet, positions, out, kept, n_dropped, w, full=None) -> Answer:
    """A re-routed request's answer: the top's output on the kept tokens ensembled with level 1's."""
    logits = np.asarray(out.logits, dtype=np.float32)
    p2 = softmax(logits, temperature(pet, 2, full))
    if positions is None:
        probs = ensemble.combine(first.probs, p2, w)
    else:
        where = np.searchsorted(kept, positions)
        seen = [j for j, p in enumerate(positions) if where[j] < len(kept) and kept[where[j]] == p]
        probs = ensemble.tagging(first.probs, p2[where[seen]], seen, w)
    timings = dict(first.timings, level2=out.timings.get("total", 0.0))
    timings["total"] = first.timings.get("total", 0.0) + timings["level2"]
    return Answer(probs, logits, 2, dispatch.confidence(probs, pet.task), n_dropped, timings, out.batch_size,
                  level_name=NAMES[out.source])
