"""The engine: one queue, one loop. Each step *schedules*, *routes*, *executes* and *updates*.

* **schedule**: which waiting work forms the next batch (at most ``max_batch``), by the
  configured batching: ``fifo`` (first come, first served), ``length`` (Student Parallelism's
  length-aware buffer, runtime.student.buffer: the oldest request's length bin first) or
  ``coordinated`` (PetS's coordinated batching, runtime.sched.coordinated: the queue, up to a
  window, cut into planned batches that run in order); ``tenant`` batches one tenant at a time
  (the dedicated-model baseline of hkstore serve). With ``max_wait_s`` a batch waits for
  company until it is full or its oldest request has waited that long. Cancelled work leaves
  the queue at once; work whose deadline its batch could not meet is answered ``Expired``.
* **route**: each request's row of the batch plan (runtime.exec.rows.Row), decided as data
  from the tenant's records, the request's policy and the load (runtime.sched.load): policy
  exact reads the tenant's *top* (level 2): its current full-depth PET (``full``) when it has
  one, else the full-context lower layers (``context``); a tenant with students is answered
  by the first k of them when the request pins k or the students' pruning policy
  (runtime.student.serve) picks k for the batch under the load (``students``); else, under
  policy auto, the level 1 of the tenant's profiled policy (runtime.level.serve.level1): its
  first k students for a students-first policy (no gate: they read no coverage; no attention),
  or the PLOT (``plot``) with Tabi's coverage gate and the attention word pruning needs; else
  the PLOT. Between gathering the PLOT inputs and computing, the engine applies the gate: a plot
  row whose coverage (runtime.level.dispatch.coverage) is under its gate becomes its top's row
  (``Step.tops``) in the same batch.
* **bursts** move work down the cascade: the pruning policy hands a batch to students, and
  while a batch is *overloaded* (the pruning policy chose students for it, or its oldest
  request has waited longer than ``overload_s``, the students' latency target by default,
  past the ``max_wait_s`` it may wait for company by design)
  its ``auto`` requests are answered at level 1: no coverage gate, no re-route to the top.
  The rule is read per batch, with no hysteresis: the first batch after the burst re-routes
  again.
* **execute**: the executor (runtime.exec.cpu / gpu) runs the plan in three calls,
  ``gather`` -> ``prepare`` -> ``compute``; it computes what the rows say and decides nothing.
* **update**: each row's logits become an answer (runtime.level.serve: calibrated, at the
  level that computed it); Tabi's dispatcher may send an ``auto`` answer of the policy's level 1
  up (students the pruning policy or the request chose are never sent up: re-routing them would
  add the work they save): its pruned tokens
  go back to the queue as a row of its top (full or context), new work of a next step (no
  second call), and ensemble with level 1's answer when they come back; the rest are answered.

With ``pipeline=True`` a preparation thread schedules, routes, gathers and prepares batch i+1
(the GPU executor stages its inputs to the device then) while a compute thread computes and
updates batch i; ``pipeline=False`` does both in turn on one thread.

Calls from ``runtime.infer`` to the executor's compute: four, and one queue. On the caller's
thread ``runtime.infer`` -> ``Runtime.infer`` (1) -> ``Engine.serve`` (2) -> ``Engine.submit``
(3), which puts the requests on the queue (the serving and the answers wait on futures); on the
engine's compute thread ``Engine._compute_loop`` -> ``executor.compute`` (4). Counted as the
calls between functions of runtime/ on the two stacks, read off them by a spy executor and a
spy load meter (tests/test_engine.py); the queue hop between the stacks is no call, the thread's
start is not counted. ``Runtime.infer``'s helpers that return before the queue (validation,
tokenization, the asks) are not on the path. The wrapped path this replaces took nine:
runtime.infer -> Runtime.infer -> answer -> Scheduler.run -> submit | _compute_loop ->
_compute_one -> _finish -> StudentExecutor.compute -> LevelExecutor.compute -> compute. The
queue is the engine's: ``hkstore serve`` submits to it directly (Runtime.submit).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from runtime.errors import Expired
from runtime.exec.rows import Row
from runtime.exec.threads import helper_thread_setup
from runtime.level import dispatch
from runtime.level.serve import level1, rerouted, send_up, single
from runtime.sched.load import LoadMeter

BATCHING = ("fifo", "length", "coordinated", "tenant")
log = logging.getLogger("hkstore.engine")


LEVEL_ONE = ("plot", "students")  # the input sources of the pruning policy's levels


@dataclass
class Ask:
    """A request as the engine routes it (runtime.serving fills it in)."""

    tenant: str
    ids: list  # token ids, [CLS] .. [SEP]
    positions: list | None  # tagging: the token positions it reports; None: classification
    pet: object  # the tenant's ServingPet
    policy: str  # fast | auto | exact (runtime.level.serve.policy_of)
    chosen: dict | None = None  # auto: the tenant's profiled Tabi policy (c, k, alpha, w, gate)
    students: object = None  # runtime.student.serve.Students when students may answer it
    full: object = None  # the tenant's current full-depth ServingPet: its top; None: exact (context)
    pin: str | None = None  # a pinned level's input source (plot, context or full); None: the policy's


@dataclass
class Output:
    """A preset row's result (Engine.run)."""

    logits: np.ndarray  # (labels,) or (length, labels)
    timings: dict
    served: tuple | None = None  # (versions (length,), orders (length,)) of a row that read the PLOT
    batch_size: int = 0
    received: np.ndarray | None = None  # a row that asked: the attention each token received
    source: str = "plot"  # the input source that computed it (a gated plot row may have become context)


@dataclass
class Work:
    """An entry of the queue: an ask to route and answer, or a row routed already."""

    ask: Ask | None
    row: Row | None
    future: Future
    submitted: float
    deadline: float = math.inf
    first: object = None  # a re-routed ask: level 1's Answer
    kept: list | None = None  # and the token positions level 2 reads
    dropped: int = 0

    @property
    def ids(self) -> list:
        return self.row.ids if self.row is not None else self.ask.ids

    @property
    def pet(self):
        return self.row.pet if self.row is not None else self.ask.pet


@dataclass
class Step:
    """A step's decisions, as data: the batch's work, its rows, the students' level for it."""

    works: list
    rows: list
    level: object = None  # the pruning policy's choice ("teacher" or k); None: nothing to choose
    started: float = 0.0  # perf_counter when the batch left the queue
    overloaded: bool = False  # auto requests stay at level 1 (the module doc's bursts)
    tops: list | None = None  # per row, the top's row the coverage gate turns it into (None: no gate)


class Engine:
    def __init__(self, executor, snapshot_fn, *, max_batch: int = 64, pipeline: bool = True,
                 batching: str | None = "length", batcher=None, students=None, window: int | None = None,
                 max_wait_s: float = 0.0, overload_s: float | None = None, name: str = "hkstore"):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if batching is not None and batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        self.executor = executor
        self.snapshot_fn = snapshot_fn
        self.max_batch = int(max_batch)
        self.pipeline = bool(pipeline)
        self.students = students
        if overload_s is None:  # the students' latency target: past it the pruning policy would prune too
            policy = getattr(students, "policy", None)
            overload_s = getattr(policy, "target_s", math.inf)
        self.overload_s = float(overload_s)
        self.window = int(window or 4 * max_batch)
        self.max_wait_s = float(max_wait_s)
        self.batching = batching or "fifo"
        self.batcher = batcher  # coordinated: a runtime.sched.coordinated.CoordinatedBatcher
        if self.batching == "coordinated" and batcher is None:
            from runtime.sched.coordinated import CoordinatedBatcher

            self.batcher = CoordinatedBatcher(max_batch=self.max_batch)
        self.load = LoadMeter()
        self.batch_seconds = 0.0  # EWMA of a batch's preparation + compute: the deadline check's
        # hkstore serve's: f(step) before a batch computes (the dedicated baseline's model swaps),
        # f(step, seconds) after it ran or failed (its metrics), both on the compute thread
        self.before: list = []
        self.observers: list = []
        # OpenMP thread counts are per thread and new threads start from the default: the
        # compute thread takes the caller's setting (e.g. a server's torch.set_num_threads).
        self.torch_threads = torch.get_num_threads()
        self._queue: collections.deque = collections.deque()
        self._planned: list = []  # coordinated: the batches cut from the queue that have not run
        # one lock, two conditions: the preparing side waits on _cond (work, room ahead), the
        # compute thread on _readied (a prepared batch), so neither wakes the other for nothing
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._readied = threading.Condition(lock)
        self._ready: collections.deque = collections.deque()  # prepared batches for the compute thread
        self._inflight = 0  # batches scheduled and not yet updated
        self._closed = False
        self.batches = self.items = 0
        self.tokens = self.padded_tokens = 0  # the requests' tokens, and the slots their batches computed
        self._threads = [threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True)]
        if self.pipeline:
            self._threads.append(threading.Thread(target=self._prepare_loop, name=f"{name}-prepare", daemon=True))
        for t in self._threads:
            t.start()

    # -- the queue --------------------------------------------------------------------------

    def serve(self, asks: list) -> list:
        """Answers (runtime.level.serve.Answer) of asks, in order (raises the first failure)."""
        return [f.result() for f in self.submit(asks)]

    def run(self, rows: list) -> list:
        """Outputs of rows routed by the caller (profiling, benchmarks), in order."""
        return [f.result() for f in self.submit(rows=rows)]

    def submit(self, asks=(), deadline: float = math.inf, rows=()) -> list:
        """Queue asks (each answered with an Answer) and routed rows (each with an Output); one
        Future per entry, asks first. A cancelled future leaves the queue; one whose batch could
        not finish by `deadline` (perf_counter) fails with Expired."""
        now = time.perf_counter()
        works = [Work(a, None, Future(), now, deadline) for a in asks] + \
            [Work(None, r, Future(), now, deadline) for r in rows]
        with self._cond:
            if self._closed:
                raise RuntimeError("the runtime is closed")
            if works:  # all of one call at once: a waiting step sees them together
                self.load.arrived([len(w.ids) for w in works], now)
                self._queue.extend(works)
                self._cond.notify_all()
        for w in works:
            w.future.add_done_callback(lambda f, w=w: f.cancelled() and self._forget(w))
        return [w.future for w in works]

    def _forget(self, work):
        """A cancelled request leaves the queue at once (a server's queue depth and limit see it)."""
        with self._cond:
            try:
                self._queue.remove(work)
            except ValueError:  # taken into a batch meanwhile: the schedule drops it
                return
            self.load.left([len(work.ids)])
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        """Requests waiting in the queue (not yet in a batch)."""
        return len(self._queue) + sum(len(b) for b in self._planned)

    def close(self, timeout: float = 10.0):
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._wake()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> list | None:
        """The next batch's work, removed from the queue; None once closed and drained."""
        with self._cond:
            while True:
                if self._queue or self._planned:
                    wait = self._company()
                    if wait > 0:
                        self._cond.wait(wait)
                        continue
                    batch = self._take()
                    if batch:
                        self._inflight += 1
                        return batch
                    continue
                if self._closed and not self._inflight and not self._queue:
                    self._wake()
                    return None
                self._cond.wait()

    def _company(self) -> float:
        """Seconds the next batch still waits for company (max_wait_s): 0 once it is full, its
        oldest request waited long enough, the engine closes, or Tabi's level 2 is waiting."""
        if self.max_wait_s <= 0 or self._closed or self._planned or len(self._queue) >= self.max_batch:
            return 0.0
        if any(w.first is not None for w in self._queue):
            return 0.0
        return self._queue[0].submitted + self.max_wait_s - time.perf_counter()

    def _take(self) -> list:
        if self.batching == "coordinated":
            if not self._planned and self._queue:
                window = [self._queue.popleft() for _ in range(min(self.window, len(self._queue)))]
                try:
                    cuts = self.batcher(window)
                    if sorted(k for c in cuts for k in c) != list(range(len(window))) or \
                            any(len(c) > self.max_batch for c in cuts):
                        raise RuntimeError("the batcher must cut the queue into batches of at most max_batch, "
                                           "each once")
                except Exception as exc:  # noqa: BLE001 - the window's callers see it
                    for w in window:
                        if w.future.running() or w.future.set_running_or_notify_cancel():
                            w.future.set_exception(exc)
                    self.load.left([len(w.ids) for w in window])
                    return []
                self._planned = [[window[k] for k in c] for c in cuts if c]
            batch = self._planned.pop(0) if self._planned else []
        elif self.batching == "length" and len(self._queue) > self.max_batch:
            from runtime.student.buffer import LengthBuffer

            buffer = LengthBuffer()
            for j in range(min(self.window, len(self._queue))):
                buffer.add(len(self._queue[j].ids), j)
            chosen = set(buffer.pop(self.max_batch))
            batch = [w for j, w in enumerate(self._queue) if j in chosen]
            self._queue = collections.deque(w for j, w in enumerate(self._queue) if j not in chosen)
        elif self.batching == "tenant":
            key = self._queue[0].pet.key
            batch = [w for w in self._queue if w.pet.key == key][:self.max_batch]
            taken = set(map(id, batch))
            self._queue = collections.deque(w for w in self._queue if id(w) not in taken)
        else:
            batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
        return self._live(batch)

    def _live(self, batch) -> list:
        """The batch without the work nobody waits for: cancelled, or past its deadline."""
        now, live, gone = time.perf_counter(), [], []
        for w in batch:
            if not (w.future.running() or w.future.set_running_or_notify_cancel()):
                gone.append(w)
            elif now + self.batch_seconds > w.deadline:
                w.future.set_exception(Expired("no answer before the request's deadline"))
                gone.append(w)
            else:
                live.append(w)
        if gone:
            self.load.left([len(w.ids) for w in gone])
        return live

    # -- route --------------------------------------------------------------------------------

    def route(self, works) -> Step:
        now = time.perf_counter()
        load = self.load.take([len(w.ids) for w in works], min(w.submitted for w in works), now)
        level = None
        if self.students is not None and any(w.row is None and w.ask.students is not None
                                             and w.ask.students.asked is None for w in works):
            level = self.students.choose(load)
        overloaded = self.overloaded(load, level)
        rows = [w.row if w.row is not None else _row(w.ask, level, overloaded) for w in works]
        tops = [_top(w.ask, r.ids) if r.gate > 0 and w.ask is not None else None for w, r in zip(works, rows)]
        return Step(works, rows, level, now, overloaded, tops)

    def overloaded(self, load, level) -> bool:
        """Whether a batch is served under a burst (the module doc): the pruning policy chose
        students for it, or its oldest request waited past overload_s (beyond max_wait_s)."""
        return level not in (None, "teacher") or load.oldest_wait_s > self.overload_s + self.max_wait_s

    @staticmethod
    def gate(rows, served, n: int, tops=None) -> list:
        """Tabi's coverage gate: a plot row whose lookup served too little of its windows at full
        order goes to level 2 in this same batch: its top's row (tops[b]), else a context row."""
        def up(b, r):
            if tops is not None and tops[b] is not None:
                return tops[b]
            return dataclasses.replace(r, source="context", gate=0.0, attention=False)

        return [up(b, r) if r.source == "plot" and r.gate > 0 and dispatch.coverage(served[b][1], n) < r.gate else r
                for b, r in enumerate(rows)]

    # -- execute -------------------------------------------------------------------------------

    def prepare(self, step: Step):
        snapshot = self.snapshot_fn()
        gathered = self.executor.gather(snapshot, step.rows)
        if any(r.gate > 0 for r in step.rows):
            step.rows = self.gate(step.rows, gathered.served, snapshot.meta["n"], step.tops)
        return self.executor.prepare(gathered, step.rows)

    def _prepared(self):
        """The next batch, scheduled, routed and prepared: (step, prepared); (None, None) when its
        preparation failed (its callers have the error); None once closed and drained."""
        works = self.schedule()
        if works is None:
            return None
        t0 = time.perf_counter()
        try:
            step = self.route(works)
            prepared = self.prepare(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the callers
            self._fail(works, exc)
            return None, None
        prepared.timings.setdefault("retrieval", time.perf_counter() - t0)
        prepared.timings.setdefault("transfer", 0.0)
        return step, prepared

    def _prepare_loop(self):
        """Pipelining: prepares batch i+1 while the compute thread computes batch i."""
        helper_thread_setup()
        while (got := self._prepared()) is not None:
            if got[0] is None:
                continue
            with self._cond:
                self._ready.append(got)
                self._readied.notify_all()
                while len(self._ready) > 1 and not self._closed:  # one batch ahead of the compute thread
                    self._cond.wait()

    def _ready_batch(self):
        with self._readied:
            while not self._ready:
                if self._closed and not self._inflight and not self._queue:
                    return None
                self._readied.wait()
            got = self._ready.popleft()
            self._cond.notify_all()
            return got

    def _compute_loop(self):
        """Computes and updates each batch; without pipelining it prepares them too."""
        torch.set_num_threads(self.torch_threads)
        while (got := self._ready_batch() if self.pipeline else self._prepared()) is not None:
            step, prepared = got
            if step is None:
                continue
            try:
                for f in self.before:
                    f(step)
                t0 = time.perf_counter()
                logits = self.executor.compute(prepared)
                self.update(step, prepared, logits, time.perf_counter() - t0)
            except BaseException as exc:  # noqa: BLE001
                self._fail(step.works, exc)
            for f in self.observers:
                try:
                    f(step, time.perf_counter() - step.started)
                except Exception:  # noqa: BLE001 - a broken metric must not stop the serving
                    log.exception("an engine observer failed")

    def _fail(self, works, exc):
        for w in works:
            if not w.future.done():
                w.future.set_exception(exc)
        with self._cond:
            self._inflight -= 1
            self._wake()

    def _wake(self):
        """Under the lock: both sides re-check (the queue, the ready batches, closing)."""
        self._cond.notify_all()
        self._readied.notify_all()

    # -- update --------------------------------------------------------------------------------

    def update(self, step: Step, prepared, logits: list, compute: float):
        seconds = prepared.timings["retrieval"] + compute
        self.batch_seconds += 0.2 * (seconds - self.batch_seconds)
        lengths = [len(r.ids) for r in step.rows]
        if self.students is not None and all(r.source in LEVEL_ONE for r in step.rows):
            # the pruning policy prices its own levels (the teacher's PLOT rows, students): a
            # batch with rows at a tenant's top costs what none of them does, and counted as
            # the teacher's it made a half-idle server look too slow for the teacher
            self.students.observe(step.level, lengths, seconds)
        timings = dict(prepared.timings)
        timings.setdefault("compute", compute)
        end = time.perf_counter()
        self.batches += 1
        self.items += len(step.rows)
        self.tokens += sum(lengths)
        self.padded_tokens += len(lengths) * max(lengths)
        again = []
        for b, (w, row) in enumerate(zip(step.works, step.rows)):
            received = prepared.received[b] if prepared.received else None
            out = Output(logits[b], dict(timings, total=end - w.submitted),
                         prepared.served[b] if prepared.served else None, len(step.rows), received, row.source)
            if w.ask is None:
                w.future.set_result(out)
                continue
            if w.first is not None:  # level 2 of a re-routed ask
                w.future.set_result(rerouted(w.first, w.ask.pet, w.ask.positions, out, w.kept, w.dropped,
                                             float(w.ask.chosen.get("w", 0.0)), w.ask.full))
                continue
            students = row.k if row.source == "students" else 0
            answer = single(w.ask.pet, out, w.ask.positions, students, w.ask.full)
            up = None
            if w.ask.policy == "auto" and not step.overloaded and _first(w.ask, row):
                up = send_up(w.ask.tenant, w.ask.ids, w.ask.positions, answer, w.ask.chosen, received)
            if up is None:
                w.future.set_result(answer)
                continue
            kept, dropped = up
            row2 = _top(w.ask, [w.ask.ids[j] for j in kept])
            again.append(Work(w.ask, row2, w.future, end, w.deadline, answer, kept, dropped))
        with self._cond:
            if again:  # Tabi's level 2: new work of the next step, ahead of what arrived since
                self.load.arrived([len(w.ids) for w in again], end)
                self._queue.extendleft(reversed(again))
            self._inflight -= 1
            self._wake()


def _top(ask: Ask, ids) -> Row:
    """The row of the ask's top level on ids: its full-depth PET, else the full-context lower layers."""
    if ask.full is not None:
        return Row(ids, ask.full, ask.pet.version, "full")
    return Row(ids, ask.pet, ask.pet.version, "context")


def _first(ask: Ask, row: Row) -> bool:
    """Whether row is the level 1 of the ask's profiled policy, whose answers Tabi's dispatcher
    may send up: the PLOT row, or a students-first policy's students. Students the pruning
    policy or the request chose are not: re-routing them would add the work they save."""
    if row.source != level1(ask.chosen):
        return False
    return row.source == "plot" or ask.students.asked is None


def _row(ask: Ask, level, overloaded: bool = False) -> Row:
    """An ask's row (see the module doc): its input source, PET and what Tabi's gate needs."""
    if ask.pin is not None:
        return Row(ask.ids, ask.full if ask.pin == "full" else ask.pet, ask.pet.version, ask.pin)
    if ask.policy == "exact":
        return _top(ask, ask.ids)
    k = ask.students.k(level) if ask.students is not None else 0
    if not k and ask.policy == "auto" and level1(ask.chosen) == "students" and ask.students is not None:
        k = min(int(ask.chosen["students"]), ask.students.group.size)  # level 1 of a students-first policy
    if k:
        group = ask.students.group
        return Row(ask.ids, ask.pet, group.meta["version"], "students", group=group, k=k)
    if ask.policy == "auto" and not overloaded:
        gate = float(ask.chosen.get("gate", 0.0))
        if gate > 1:  # every request to level 2: no lookup to measure coverage
            return _top(ask, ask.ids)
        return Row(ask.ids, ask.pet, ask.pet.version, "plot", gate=gate,
                   attention=float(ask.chosen.get("alpha", 0)) > 0)
    return Row(ask.ids, ask.pet, ask.pet.version, "plot")
