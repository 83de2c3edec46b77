"""Students in runtime.Runtime: which requests may be answered by students, and per batch how.

A request of a tenant with a servable group (complete and fresh, runtime.student.record) that
is served at the PLOT level (policy fast, or auto: Tabi's dispatcher when the teacher answers,
runtime.level.serve) gets a StudentTag; its `students` field (the
request's) pins the answer: 0 the teacher, k the first k students (1 <= k <= M); None (the
default) leaves it to the pruning policy. The scheduler calls ``decide`` as each batch is
about to run, with the load it measured (runtime.sched.load): the policy
(runtime.student.policy) picks the most accurate level that holds the latency target, the
teacher or k students (at most each tenant's best k, chosen on dev), for every undecided
tagged item of the batch; ``observe`` then learns what the level cost per padded token. The
scheduler decides, runtime.student.executor computes.

A request that asks for students (k >= 1) of a tenant without a servable group, more than its
group holds, or at policy exact is a BadRequest with the reason.
"""

from __future__ import annotations

import threading

from runtime.errors import BadRequest
from runtime.student.executor import StudentTag
from runtime.student.policy import PruningPolicy
from runtime.student.record import load_group, stale


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

    def tag(self, snap, tenant, pet_meta, asked, policy: str):
        """The StudentTag of a request (None: the teacher answers it), see the module doc."""
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
        if group is None or policy == "exact":
            return None
        best = int(group.meta.get("best_k") or group.size)
        return StudentTag(group, best, asked, asked)

    # -- the scheduler's decider -------------------------------------------------------------

    def decide(self, items, load):
        open_tags = [it.tag for it in items if isinstance(it.tag, StudentTag) and it.tag.asked is None]
        if not open_tags:
            return None
        level = self.policy.choose(load.queued_tokens, load.oldest_wait_s, load.now, rate=load.arrival_rate)
        for tag in open_tags:
            tag.students = None if level == "teacher" else min(level, tag.best)
        return level

    def observe(self, level, items, seconds: float) -> None:
        if level is not None:
            self.policy.observe(level, len(items) * max(len(it.ids) for it in items), seconds,
                                tokens=sum(len(it.ids) for it in items))
