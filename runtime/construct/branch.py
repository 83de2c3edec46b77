"""A domain branch's last step, the same for encoder and decoder stores (runtime.construct.manager,
runtime.construct.decoder_domain): the checks a new version passes (and what an update starts from),
then the branch valued by its lower layers and its position table."""

from __future__ import annotations

import hkstore
from runtime.model.stored import ManagerError, save_lower


def new_version_checks(store, name, parent):
    hkstore.store.check_name("version", name)
    snap = store.snapshot()
    if name in snap.version_names:
        raise ManagerError(f"version {name!r} already exists")
    snap.version_index(parent)  # UnknownVersion
    if not snap.versions[0]["segments"]:
        raise ManagerError(f"{store.path}: the root PLOT is empty; run build first")


def update_plan(store, name, new_name, alpha, max_len, include_old, distill_steps):
    """What `domain update` of version name into sibling new_name starts from, checked:
    (parent, alpha, max_len, old corpus paths, distill steps); None values fall back
    to what name was made with."""
    import os

    snap = store.snapshot()
    old = snap.versions[snap.version_index(name)]
    if old["parent"] is None:
        raise ManagerError(f"{name!r} is the root; domain update works on domain versions")
    if not old["info"].get("lower_weights"):
        raise ManagerError(f"version {name!r} has no saved lower-layer weights: it was not made by domain create")
    new_version_checks(store, new_name, old["parent"])
    alpha = old["info"].get("alpha", 50) if alpha is None else alpha
    if not 0 <= alpha <= 100:
        raise ValueError(f"alpha must be a percentage between 0 and 100, got {alpha}")
    old_paths = list(old["info"].get("corpus", [])) if include_old else []
    for p in old_paths:
        if not os.path.isfile(p):
            raise ManagerError(f"{p}: corpus of version {name!r} is gone; pass it again or use include_old=False")
    if distill_steps is None:
        distill_steps = (old["info"].get("distill") or {}).get("steps", 0)
    return old["parent"], alpha, max_len or old["info"].get("max_len", 128), old_paths, distill_steps


def branch_from(store, name, parent, teacher, student, count_seqs, alpha, info):
    """The branch valued by the student (the teacher if not distilled), then its position
    table: the teacher's full-context outputs are the target, through the branch's own lookups
    (a second commit; until it lands the branch serves with its parent's table)."""
    from runtime.construct.plot import build_branch, fit_position

    encoder = student if student is not None else teacher
    info = dict(info, lower_weights=save_lower(store.path, name, encoder))
    if student is not None:
        info["context_weights"] = save_lower(store.path, name, teacher, "context")
    out = build_branch(store, name, parent, encoder, count_seqs, alpha, info)
    out["position"] = fit_position(store, name, teacher, count_seqs)
    store.set_version_info(name, position=out["position"])
    return out
