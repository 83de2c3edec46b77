"""Students in runtime.Runtime: which requests may be answered by students, and per batch how.

A request of a tenant with a servable group (complete and fresh, runtime.student.record) that
is served at the PLOT level (policy fast, or auto: Tabi's dispatcher when the teacher answers,
runtime.level.serve) gets a ``Students`` record; the request's `students` field pins the
answer: 0 the teacher, k the first k students (1 <= k <= M); None (the default) leaves it to
the pruning policy. The engine calls ``choose`` as it routes a batch, with the load it
measured (runtime.sched.load): the policy (runtime.student.policy) picks the most accurate
level that holds the latency target, the teacher or k students (``k`` caps it at each tenant's
best, chosen on dev), for every unpinned request of the batch; ``observe`` then learns what
the level cost per padded token. The engine routes, runtime.exec.students computes.

The policy may hand an unpinned request to students only where they are not worse than the
PLOT level they stand in for: a tenant whose profile (runtime.level.profile, FORMAT.md §5)
measured its students more than its target below its PLOT level on dev keeps the PLOT level
under bursts (on the tagging tasks the students scored 11-30 F1 under a burst where the PLOT
level scores 22-54: BENCHMARKS, Student Parallelism: bursts).

A request that asks for students (k >= 1) of a tenant without a servable group, more than its
group holds, or at policy exact is a BadRequest with the reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from runtime.errors import BadRequest
from runtime.student.policy import PruningPolicy
from runtime.student.record import load_group, stale


@dataclass(frozen=True)
class Students:
    """A request students may answer: its tenant's group, the most the policy gives it, its pin."""

    group: object  # runtime.model.student.Group
    best: int  # the most students the policy gives this tenant (best_k, chosen on dev)
    asked: int | None = None  # the client's pin: k the first k students; None: the policy's

    def k(self, level) -> int:
        """How many students answer under the policy's level for the batch (0: the teacher)."""
        if self.asked is not None:
            return self.asked
        return 0 if level in (None, "teacher") else min(level, self.best)


def below_plot(pet_meta) -> bool:
    """Whether the tenant's profile measured its students more than its target below its PLOT
    level (never for a students-first cascade: its students are its level 1)."""
    levels = pet_meta.get("levels") or {}
    if (levels.get("policy") or {}).get("level1") == "students":
        return False
    profile = levels.get("profile") or {}
    students, plot = profile.get("students_metric"), profile.get("level1_metric")
    return students is not None and plot is not None and students < plot - profile.get("target", 0.0)


class StudentServing:
    def __init__(self, d: int, target_s: float = 0.5):
        self.d = d
        self.policy = PruningPolicy(["teacher"], target_s)
        self._groups: dict = {}  # tenant -> (key, Group or None, why not)
        self._lock = threading.Lock()

    def group(self, snap, tenant, pet_meta):
        """(the tenant's servable Group or None, the reason when None); loaded once per record."""
        loc = snap.students.get(tenant)
        if loc is None:
            return None, "has no students"
        key = (loc["file"], loc["offset"], pet_meta.get("created"))
        with self._lock:
            got = self._groups.get(tenant)
            if got is None or got[0] != key:
                got = (key, *self._load(snap, tenant, pet_meta))
                self._groups[tenant] = got
        return got[1], got[2]

    def _load(self, snap, tenant, pet_meta):
        meta = snap.read_students(tenant).meta
        if not meta.get("complete"):
            return None, "has unfinished students (run hkstore students create)"
        if stale(meta, pet_meta):
            return None, "has stale students, distilled from an earlier PET (run hkstore students create)"
        group = load_group(snap, tenant, self.d)
        best = int(group.meta.get("best_k") or group.size)
        levels = ["teacher", *range(max(best, len(self.policy.levels) - 1), 0, -1)]
        if len(levels) > len(self.policy.levels):
            self.policy.levels = levels  # a deeper group than any before: the policy may give it more
        return group, None

    def ask(self, snap, tenant, pet_meta, asked, policy: str):
        """The request's Students record (None: the teacher answers it), see the module doc."""
        if asked == 0 or (asked is None and tenant not in snap.students):
            return None
        group, why = self.group(snap, tenant, pet_meta)
        if asked is not None:
            if group is None:
                raise BadRequest(f"tenant {tenant!r} {why}: it cannot be answered by {asked} students")
            if asked > group.size:
                raise BadRequest(f"tenant {tenant!r} has {group.size} students, {asked} were asked for")
            if policy == "exact":
                raise BadRequest("students answer at the PLOT level (policy fast or auto), not at policy exact")
        if group is None or policy == "exact" or (asked is None and below_plot(pet_meta)):
            return None
        return Students(group, int(group.meta.get("best_k") or group.size), asked)

    # -- the engine's per-batch decision -----------------------------------------------------

    def choose(self, load):
        """The level for a batch with unpinned requests: "teacher" or k, under the load."""
        return self.policy.choose(load.queued_tokens, load.oldest_wait_s, load.now, rate=load.arrival_rate)

    def observe(self, level, lengths: list, seconds: float) -> None:
        """A batch served at `level` (its requests' token counts) took `seconds`."""
        if level is not None:
            self.policy.observe(level, len(lengths) * max(lengths), seconds, tokens=sum(lengths))
