"""A domain branch's last step, the same for encoder and decoder stores (runtime.build.manager,
runtime.build.decoder_domain): the checks a new version passes, then the branch valued by its
lower layers and its position table."""

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


def branch_from(store, name, parent, teacher, student, count_seqs, alpha, info):
    """The branch valued by the student (the teacher if not distilled), then its position
    table: the teacher's full-context outputs are the target, through the branch's own lookups
    (a second commit; until it lands the branch serves with its parent's table)."""
    from runtime.build.plot import build_branch, fit_position

    encoder = student if student is not None else teacher
    info = dict(info, lower_weights=save_lower(store.path, name, encoder))
    if student is not None:
        info["context_weights"] = save_lower(store.path, name, teacher, "context")
    out = build_branch(store, name, parent, encoder, count_seqs, alpha, info)
    out["position"] = fit_position(store, name, teacher, count_seqs)
    store.set_version_info(name, position=out["position"])
    return out
