"""Students in the runtime's batches: the executor side of serving a tenant by its students.

``StudentExecutor`` wraps the runtime's executor for the scheduler (as runtime.level.executor
does). An item whose ``tag`` is a ``StudentTag`` with ``students`` set (the scheduler's decider
or the client chose k) is answered by the first k students of its tenant's group: the PLOT
inputs of each tenant's items (runtime.plot.retrieve, as the teacher reads them), then every
such tenant's students in ONE virtually stacked step (runtime.student.stack.ensembles; one
step per student depth when groups of 1- and 2-layer students meet) and the pruning head. The
batch's other items, and student-capable items the decider gave to the teacher, go to the
wrapped executor (the latter with their ``teacher`` tag: under policy auto, Tabi's level-1 tag),
so a batch may mix both; the logits come back in item order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from runtime.exec.plan import Prepared
from runtime.plot.retrieve import retrieve
from runtime.student import model, stack
from runtime.student.model import Group


@dataclass
class StudentTag:
    group: Group
    best: int  # the most students the policy gives this tenant (best_k, chosen on dev)
    asked: int | None = None  # the client's pin: 0 the teacher, k the first k students; None: the policy's
    students: int | None = None  # how many students answer (decided per batch); None: the teacher
    teacher: object = None  # the item's tag when the teacher answers it (policy auto: a runtime.level LevelTag)


def _as_teacher(item):
    """The item as the wrapped executor serves it: with its teacher's tag (the same object, so
    what the wrapped executor records on it, e.g. a level-1 item's attention, reaches the caller)."""
    if isinstance(item.tag, StudentTag) and item.tag.teacher is not None:
        return replace(item, tag=item.tag.teacher)
    return item


@dataclass
class _Split:
    rows: list  # item indices the students answer
    rest: list  # item indices the wrapped executor answers
    inner: Prepared | None
    inputs: list  # per tenant: (group, k, version, row indices, x, mask)


class StudentExecutor:
    def __init__(self, inner):
        self.inner = inner
        self.device = None  # runtime.student.device_stack.DeviceStudents under the GPU executor
        base = getattr(inner, "inner", inner)  # (through runtime.level's LevelExecutor)
        if hasattr(base, "cp"):
            from runtime.student.device_stack import DeviceStudents

            self.device = DeviceStudents(base)

    def __getattr__(self, name):  # load_pet, plan, stats, lower, profile, ...
        return getattr(self.inner, name)

    def close(self):
        self.inner.close()

    def prepare(self, snapshot, items) -> Prepared:
        rows = [b for b, it in enumerate(items) if isinstance(it.tag, StudentTag) and it.tag.students]
        if not rows:
            return self.inner.prepare(snapshot, [_as_teacher(it) for it in items])
        taken = set(rows)
        rest = [b for b in range(len(items)) if b not in taken]
        inner = self.inner.prepare(snapshot, [_as_teacher(items[b]) for b in rest]) if rest else None
        t0 = time.perf_counter()
        by_tenant: dict = {}
        for b in rows:
            tag = items[b].tag
            by_tenant.setdefault((id(tag.group), tag.students), []).append(b)
        inputs = []
        for idx in by_tenant.values():
            tag = items[idx[0]].tag
            version = tag.group.meta["version"]
            x, mask, _ = retrieve(snapshot, version, [items[b].ids for b in idx])
            inputs.append((tag.group, tag.students, version, idx, x, mask))
        timings = dict(inner.timings) if inner is not None else {"transfer": 0.0}
        timings["retrieval"] = timings.get("retrieval", 0.0) + time.perf_counter() - t0
        served = [None] * len(items)
        for b, s in zip(rest, (inner.served or [None] * len(rest)) if inner is not None else ()):
            served[b] = s
        return Prepared(items, timings, _Split(rows, rest, inner, inputs), served)

    @torch.no_grad()
    def compute(self, prepared: Prepared) -> list:
        split = prepared.payload
        if not isinstance(split, _Split):
            return self.inner.compute(prepared)
        out = [None] * len(prepared.items)
        if split.inner is not None:
            for b, logits in zip(split.rest, self.inner.compute(split.inner)):
                out[b] = logits
        if self.device is not None:  # on the device: one batched computation per tenant's k students
            for group, k, _, idx, x, mask in split.inputs:
                logits = self.device.logits(group, k, x.numpy(), mask.numpy())
                for j, b in enumerate(idx):
                    out[b] = logits[j] if group.meta["task"] == "classification" else \
                        logits[j, :int(mask[j].sum())]
            return out
        sums = stack.ensembles([(g, k, x, mask) for g, k, _, _, x, mask in split.inputs])
        for (group, _, _, idx, _, mask), h in zip(split.inputs, sums):
            logits = model.head(group, h)
            for j, b in enumerate(idx):
                row = logits[j] if group.meta["task"] == "classification" else logits[j, :int(mask[j].sum())]
                out[b] = row.numpy()
        return out
