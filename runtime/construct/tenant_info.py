"""What each tenant of a store can be served by: `hkstore tenant ls` and `hkstore tenant info`.

A tenant's levels: `plot` and `exact` (its PET, over the PLOT inputs of its version and over
full-context lower layers), `full` (its full-depth PET, when stored), `students` (when stored).
A full-depth or students record trained with an earlier PET of the tenant is *stale*: listed,
never served (FORMAT.md section 5's rules, as the serving rooms apply them). `cascade` says
whether a profiled Tabi policy (the PET meta's `levels`, runtime.level.profile) exists and is
current (profiled for the PET stored now). Held-out scores
are those recorded when training held out a calibration share (`tenant create
--calibration-share`): the PET's calibration record scores plot and exact, the full-depth
record its own `held_out`; without a held-out share none is recorded (null). Each level's
`precision` is what it serves at under a runtime at precision auto (the record's, chosen by
runtime.construct.precision; a record from before precisions were measured: fp32), with
`precision_check`, what was asked and the two scores it was chosen on (null when none).
"""

from __future__ import annotations

import hkstore
from hkstore.errors import UnknownTenant


def tenant_ls(store_path) -> dict:
    """Every tenant's served levels (as tenant_info's, without details) and the bytes of all
    its records."""
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        rows = [_info(snap, t) for t in sorted(snap.pets)]
    return {"tenants": [{"tenant": r["tenant"], "version": r["version"], "pet_type": r["pet_type"],
                         "task": r["task"], "levels": r["served"], "cascade": r["cascade"]["state"],
                         "bytes": r["bytes"], "metric": r["metric"], "held_out": r["levels"]["plot"]["held_out"],
                         "precision": {name: r["levels"][name]["precision"] for name in r["served"]
                                       if "precision" in r["levels"][name]}}
                        for r in rows]}


def tenant_info(store_path, tenant) -> dict:
    """One tenant's levels with their record bytes, held-out scores and staleness."""
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.pets:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return _info(snap, tenant)


def _info(snap, tenant) -> dict:
    meta = snap.read_pet(tenant).meta
    loc = snap.pets[tenant]
    scores = _pet_scores(meta)
    levels = {name: {"pet_type": meta["pet_type"], "layers": meta.get("layers"), "bytes": int(loc["length"]),
                     "held_out": scores.get(key), **_precision(meta)} for name, key in (("plot", "1"), ("exact", "2"))}
    if tenant in snap.full:
        levels["full"] = _full_level(snap, tenant, meta)
    if tenant in snap.students:
        levels["students"] = _students_level(snap, tenant, meta)
    return {"tenant": tenant, "version": meta.get("version"), "pet_type": meta["pet_type"], "task": meta["task"],
            "labels": meta.get("labels"), "created": meta.get("created"),
            "metric": scores.get("metric"), "levels": levels,
            "served": [name for name, level in levels.items() if not level.get("stale")],
            "bytes": sum(int(where[tenant]["length"]) for where in (snap.pets, snap.full, snap.students)
                         if tenant in where),  # plot and exact share one record
            "cascade": _cascade(meta)}


def _pet_scores(meta: dict) -> dict:
    """The calibration record's per-level scores when current (fitted in this PET's round)."""
    calibration = meta.get("calibration") or {}
    if calibration.get("updates") != (meta.get("train") or {}).get("updates", 0):
        return {}
    return dict(calibration.get("score") or {}, metric=calibration.get("metric"))


def _precision(meta: dict) -> dict:
    """A record's precision (fp32 when it records none: what an executor serves it at) and
    the check it was chosen by."""
    return {"precision": meta.get("precision", "fp32"), "precision_check": meta.get("precision_check")}


def _full_level(snap, tenant, pet_meta) -> dict:
    from runtime.construct.full import is_stale

    meta = snap.read_full(tenant).meta
    held = meta.get("held_out") or {}
    return {"pet_type": meta.get("pet_type"), "layers": meta.get("layers"),
            "bytes": int(snap.full[tenant]["length"]),
            "held_out": held.get("score"), "stale": is_stale(meta, pet_meta), "pet_created": meta.get("pet_created"),
            **_precision(meta)}


def _students_level(snap, tenant, pet_meta) -> dict:
    meta = snap.read_students(tenant).meta
    k, scores = meta.get("best_k"), meta.get("scores") or []
    return {"students": meta.get("students"), "best_k": k, "complete": bool(meta.get("complete")),
            "bytes": int(snap.students[tenant]["length"]),
            "held_out": scores[k - 1] if k and len(scores) >= k else None,  # its validation data's
            "stale": meta.get("teacher_created") != pet_meta.get("created") or not meta.get("complete")}


def _cascade(meta: dict) -> dict:
    record = meta.get("levels")
    state = "none" if not record else "current" if record.get("pet_created") == meta.get("created") else "stale"
    return {"state": state, "policy": (record or {}).get("policy") if state == "current" else None}
