"""A batch plan's rows: what the executor runs, each row naming its input source and its PET.

The engine (runtime.engine) decides every row; the executor only computes them. A row is
served from one of four input sources:

* ``plot``: the upper-layer inputs are PLOT lookups of the row's version (HMI; level 1 of
  Tabi), then the shared upper layers with the row's PET and head;
* ``context``: the inputs are the full-context lower layers of the encoder the version stands
  for (Tabi's level 2, runtime.exec.context), then the same upper layers, PET and head;
* ``full``: the row's PET is the tenant's full-depth PET (runtime.model.pet.is_full); the
  inputs are the base encoder's embeddings of its ids (``full_inputs``), the executor runs the
  lower layers with that PET for the batch's full rows, and they join the other rows (plot,
  context: together the *teacher* rows) at the first upper layer;
* ``students``: the PLOT inputs go through the first ``k`` boosted students of the tenant's
  group in one stacked step (Student Parallelism, runtime.exec.students) and their head.

An executor runs a plan in three calls, so that the engine can route between them:
``gather(snapshot, rows)`` looks up the PLOT for every row that reads it and reports what
each lookup served (the engine measures Tabi's coverage from it and may turn a gated plot row
into a context row), ``prepare(gathered, rows)`` builds the remaining inputs and the PET
plan (and stages them to the device), ``compute(prepared)`` returns the logits per row in
row order (and, for rows that asked, the attention each token received, ``Prepared.received``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.model.pet import is_full
from runtime.plot.mixed import retrieve_mixed

SOURCES = ("plot", "context", "full", "students")
TEACHER = ("plot", "context", "full")  # the sources whose rows run the upper layers and a PET head


@dataclass(frozen=True)
class Row:
    ids: list  # token ids, [CLS] .. [SEP]
    pet: object  # the tenant's ServingPet (its upper-layer edits and head; full: its full-depth PET)
    version: str  # the PLOT version its inputs come from
    source: str = "plot"  # plot | context | full | students
    group: object = None  # students: the tenant's runtime.model.student.Group
    k: int = 0  # students: how many of the group answer
    gate: float = 0.0  # plot: the engine re-routes it to context when its coverage is below this
    attention: bool = False  # plot: report the attention each token received (Tabi's word pruning)

    def reads_plot(self) -> bool:
        return self.source in ("plot", "students")


@dataclass
class Gathered:
    """The PLOT lookups of a plan: inputs (B_plot, L, d) in the order of ``plot``, and what was
    served for each row (version and order per window; None for rows that do not read the PLOT)."""

    plot: list  # row indices looked up, in the order of inputs' rows
    inputs: object  # host torch (B_plot, L, d), or an executor's device payload
    served: list
    timings: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """What an executor's prepare hands to its compute."""

    rows: list
    timings: dict = field(default_factory=dict)
    payload: object = None
    served: list | None = None
    received: list | None = None  # set by compute: per row, (length,) attention received, or None


def gather_host(snapshot, rows) -> Gathered:
    """One host lookup (runtime.plot.mixed) for every row that reads the PLOT."""
    t0 = time.perf_counter()
    plot = [b for b, r in enumerate(rows) if r.reads_plot()]
    served = [None] * len(rows)
    inputs = None
    if plot:
        inputs, _, info = retrieve_mixed(snapshot, [rows[b].ids for b in plot], [rows[b].version for b in plot])
        for j, b in enumerate(plot):
            served[b] = info[j]
    return Gathered(plot, inputs, served, {"retrieval": time.perf_counter() - t0})


def teacher_rows(rows) -> list:
    return [b for b, r in enumerate(rows) if r.source in TEACHER]


def assemble(gathered: Gathered, rows, context, d: int):
    """Host inputs of the plan: (teacher row indices, inputs (T, L, d), lengths (T,), student
    parts [(group, k, row indices, x, mask)], seconds spent on level 2's lower layers). A full
    row's inputs are left zero: the executor writes its lower layers' output there
    (full_inputs gives what they start from)."""
    where = {b: j for j, b in enumerate(gathered.plot)}
    teacher = teacher_rows(rows)
    lengths = np.array([len(rows[b].ids) for b in teacher], dtype=np.int64)
    by_version: dict = {}
    if teacher == gathered.plot and all(rows[b].source == "plot" for b in teacher):
        # every row a plot row still (the common plan; the gate may have made some context): the lookup's inputs
        inputs = gathered.inputs
    else:
        inputs = torch.zeros(len(teacher), int(lengths.max()) if len(teacher) else 0, d)
        for t, b in enumerate(teacher):
            if rows[b].source == "plot":
                inputs[t, :lengths[t]] = gathered.inputs[where[b], :lengths[t]]
            elif rows[b].source == "context":
                by_version.setdefault(rows[b].version, []).append(t)
    t0 = time.perf_counter()
    for version, ts in by_version.items():
        if context is None:
            raise RuntimeError("a context row, and this executor has no level-2 input source")
        hidden = context.inputs(version, [rows[teacher[t]].ids for t in ts])
        for j, t in enumerate(ts):
            inputs[t, :lengths[t]] = hidden[j, :lengths[t]]
    lower = time.perf_counter() - t0
    groups: dict = {}
    for b, r in enumerate(rows):
        if r.source == "students":
            groups.setdefault((id(r.group), r.k), []).append(b)
    parts = []
    for idx in groups.values():
        n = [len(rows[b].ids) for b in idx]
        x = torch.zeros(len(idx), max(n), d)
        for j, b in enumerate(idx):
            x[j, :n[j]] = gathered.inputs[where[b], :n[j]]
        mask = torch.from_numpy(np.arange(max(n))[None, :] < np.array(n)[:, None])
        parts.append((rows[idx[0]].group, rows[idx[0]].k, idx, x, mask))
    return teacher, inputs, lengths, parts, lower


@dataclass
class FullInputs:
    """The full rows of a plan, what the executor's lower layers start from."""

    at: list  # their positions among the teacher rows (rows of assemble's inputs)
    embeddings: torch.Tensor  # (F, L_full, d): the base encoder's embeddings of their ids, right-padded
    lengths: np.ndarray  # (F,)
    pets: list  # their full-depth ServingPets


@torch.no_grad()
def full_inputs(rows, teacher, encoder) -> FullInputs | None:
    """The full rows among the teacher rows (None if there are none): their embeddings by
    `encoder` (the base model: a full-depth PET was trained on its embeddings). A full row
    must carry a full-depth PET and no other row may (its lower-layer edits would be lost)."""
    for b in teacher:
        if (rows[b].source == "full") != is_full(rows[b].pet.meta):
            raise ValueError(f"a {rows[b].source} row carries a {'full-depth' if is_full(rows[b].pet.meta) else 'upper-only'}"
                             " PET: full rows, and only they, carry a tenant's full-depth PET")
    at = [t for t, b in enumerate(teacher) if rows[b].source == "full"]
    if not at:
        return None
    seqs = [rows[teacher[t]].ids for t in at]
    ids, mask = encoder.pad(seqs)
    lengths = mask.sum(1).numpy()
    return FullInputs(at, encoder.embed(ids).float(), lengths, [rows[teacher[t]].pet for t in at])


def attention_rows(rows, teacher) -> bool:
    return any(rows[b].source == "plot" and rows[b].attention for b in teacher)


def student_logits(group, logits, mask, j):
    """Row j's logits of a students part: classification's row, or tagging's real tokens."""
    return logits[j] if group.meta["task"] == "classification" else logits[j, :int(mask[j].sum())]


def received_rows(rows, teacher, plan, layers: int) -> list:
    """Per row, the attention each token received (averaged over the upper layers), for the plot
    rows that asked; None for the others. plan.received is in the plan's executed order."""
    received = plan.received.numpy() / max(layers, 1)
    out = [None] * len(rows)
    for j, t in enumerate(plan.perm.tolist()):
        b = teacher[t]
        if rows[b].source == "plot" and rows[b].attention:
            out[b] = received[j, :len(rows[b].ids)].copy()
    return out
