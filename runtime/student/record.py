"""A tenant's stored students record as a servable group (FORMAT.md section 5, Students).

A group is servable when it is complete (construction finished) and fresh: distilled from the
tenant's current PET. `tenant update` re-trains the teacher and stores a new PET record (a
new `created`), so the students' `teacher_created` no longer names it: the group is stale,
the teacher serves the tenant until `hkstore students create` distills it again.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.model.student import Group, check_group


def load_group(snap, tenant, d: int) -> Group:
    """A tenant's complete students record as a model.Group (ValueError if unfinished or malformed)."""
    record = snap.read_students(tenant)
    if not record.meta.get("complete"):
        raise ValueError(f"tenant {tenant!r}'s students are unfinished; run hkstore students create again")
    check_group(record.tensors, record.meta, d)
    return Group({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in record.tensors.items()},
                 dict(record.meta))


def stale(students_meta: dict, pet_meta: dict) -> bool:
    """Distilled from another PET than the tenant's current one (module doc)."""
    return students_meta.get("teacher_created") != pet_meta.get("created")


def state(students_meta: dict, pet_meta: dict) -> str:
    """What `pack ls` and `students ls` say of a students record: ready, unfinished or stale."""
    if not students_meta.get("complete"):
        return "unfinished"
    return "stale" if stale(students_meta, pet_meta) else "ready"
