"""The scheduler: submission queue -> preparation (retrieval, plan, staging) -> compute.

Callers ``submit`` items from any thread; a preparation thread drains the submission queue into
batches of at most ``max_batch`` items and runs the executor's ``prepare`` (retrieval + plan +
host-to-device staging) while a compute thread runs ``compute`` on the previous batch
(``pipeline=True``). With ``pipeline=False`` one thread does both in turn. Each item's future
receives an ``Output``: its logits and the timings. The compute thread takes the torch thread
count of the thread that made the scheduler; helper threads run single-threaded
(runtime.exec.threads). The scheduler decides what runs together; the executor computes.

By default a batch is what arrived first (FIFO, at most ``max_batch`` items). With a
``batcher`` (e.g. runtime.sched.coordinated.CoordinatedBatcher, PetS's coordinated batching)
the preparation thread takes everything queued, up to ``window`` items, asks the batcher how
to cut it (lists of indices, each at most ``max_batch`` long), and runs those batches in
order before it looks at the queue again.

With a ``decider`` the scheduler also decides how each batch is served: as a batch is about to
run it reads the load (runtime.sched.load: requests queued, their tokens, the oldest one's
wait, the arrival rate) and calls ``decider.decide(items, load)``, which may set the items'
tags and returns what it chose (anything); after the batch ran, ``decider.observe(chosen,
items, seconds)`` hears what the batch cost (preparation + compute). runtime.student.serve's
pruning policy is one: teacher or k students per batch, under the load.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from runtime.exec.plan import ServingPet
from runtime.exec.threads import helper_thread_setup
from runtime.sched.load import LoadMeter


@dataclass
class Item:
    """One request as the scheduler sees it (the runtime fills it in)."""

    ids: list  # token ids, [CLS] .. [SEP]
    pet: ServingPet
    version: str  # PLOT version name to serve it from
    tag: object = None  # whatever the caller wants back


@dataclass
class Output:
    logits: np.ndarray  # (labels,) or (length, labels)
    timings: dict
    served: tuple | None = None  # (versions (length,), orders (length,))
    batch_size: int = 0


_STOP = object()


class Scheduler:
    """Submission queue -> preparation (retrieval, plan, staging) -> compute, see module doc."""

    def __init__(self, executor, snapshot_fn, *, max_batch: int = 64, pipeline: bool = True, name: str = "hkstore",
                 batcher=None, window: int | None = None, decider=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.batcher = batcher
        self.decider = decider
        self.load = LoadMeter()
        self.window = int(window or 4 * max_batch)
        self._planned: list = []  # batches the batcher cut that have not run yet
        self.executor = executor
        self.snapshot_fn = snapshot_fn
        self.max_batch = int(max_batch)
        self.pipeline = bool(pipeline)
        # OpenMP thread counts are per thread and new threads start from the default: the
        # compute thread takes the caller's setting (e.g. a server's torch.set_num_threads).
        self.torch_threads = torch.get_num_threads()
        # One inbox entry per submit (a list of items), so the items of one call cannot be
        # split across batches by a worker that wakes up between two of them.
        self._inbox: queue.Queue = queue.Queue()
        self._carry: list = []  # entries of a submit that did not fit the previous batch
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._closed = False
        self._lock = threading.Lock()
        self.batches = 0
        self.items = 0
        self.tokens = 0  # the requests' tokens, and the token slots their batches computed
        self.padded_tokens = 0
        self._threads = [threading.Thread(target=self._prepare_loop, name=f"{name}-prepare", daemon=True)]
        if self.pipeline:
            self._threads.append(threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, items: list) -> list:
        """Queue items; returns one Future per item (resolves to an Output). Thread-safe."""
        futures = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the runtime is closed")
            now = time.perf_counter()
            entries = []
            for item in items:
                f: Future = Future()
                futures.append(f)
                entries.append((item, f, now))
            if entries:
                self.load.arrived([_tokens(item) for item in items], now)
                self._inbox.put(entries)
        return futures

    def run(self, items: list) -> list:
        """submit + wait: Outputs in item order (raises the first failure)."""
        return [f.result() for f in self.submit(items)]

    def close(self, timeout: float = 10.0):
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- worker loops --------------------------------------------------------------------

    def _next_batch(self):
        if self.batcher is not None:
            return self._next_planned()
        batch, self._carry = self._carry, []
        if not batch:
            batch = self._inbox.get()
            if batch is _STOP:
                return None
        while len(batch) < self.max_batch:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                self._inbox.put(_STOP)  # seen again after this batch
                break
            batch = batch + nxt
        batch, self._carry = batch[: self.max_batch], batch[self.max_batch:]
        return batch

    def _next_planned(self):
        if self._planned:
            return self._planned.pop(0)
        entries, self._carry = self._carry, []
        if not entries:
            entries = self._inbox.get()
            if entries is _STOP:
                return None
        while len(entries) < self.window:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                self._inbox.put(_STOP)
                break
            entries = entries + nxt
        entries, self._carry = entries[: self.window], entries[self.window:]
        cuts = self.batcher([item for item, _, _ in entries])
        if sorted(k for c in cuts for k in c) != list(range(len(entries))) or any(len(c) > self.max_batch for c in cuts):
            raise RuntimeError("the batcher must cut the queue into batches of at most max_batch, each item once")
        self._planned = [[entries[k] for k in c] for c in cuts if c]
        return self._planned.pop(0)

    def _prepare(self, batch):
        t0 = time.perf_counter()
        prepared = self.executor.prepare(self.snapshot_fn(), [item for item, _, _ in batch])
        prepared.timings.setdefault("retrieval", time.perf_counter() - t0)
        prepared.timings.setdefault("transfer", 0.0)
        return prepared

    def _decide(self, batch):
        """The load as the batch starts (it leaves the queue), and the decider's choice for it."""
        items = [item for item, _, _ in batch]
        now = time.perf_counter()
        load = self.load.take([_tokens(item) for item in items], min(s for _, _, s in batch), now)
        return None if self.decider is None else self.decider.decide(items, load)

    def _finish(self, batch, prepared, chosen=None):
        t0 = time.perf_counter()
        logits = self.executor.compute(prepared)
        compute = time.perf_counter() - t0
        if self.decider is not None:
            self.decider.observe(chosen, [item for item, _, _ in batch], prepared.timings["retrieval"] + compute)
        timings = dict(prepared.timings)
        timings.setdefault("compute", compute)
        end = time.perf_counter()
        self.batches += 1
        self.items += len(batch)
        lengths = [_tokens(item) for item, _, _ in batch]
        self.tokens += sum(lengths)
        self.padded_tokens += len(lengths) * max(lengths)
        for j, (_, f, submitted) in enumerate(batch):
            served = prepared.served[j] if prepared.served else None
            out = Output(logits[j], dict(timings, total=end - submitted), served, len(batch))
            f.set_result(out)

    @staticmethod
    def _fail(batch, exc):
        for _, f, _ in batch:
            if not f.done():
                f.set_exception(exc)

    def _prepare_loop(self):
        if self.pipeline:
            helper_thread_setup()
        else:  # this thread computes too
            torch.set_num_threads(self.torch_threads)
        while True:
            batch = self._next_batch()
            if batch is None:
                if self.pipeline:
                    self._ready.put(_STOP)
                return
            try:
                chosen = self._decide(batch)
                prepared = self._prepare(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the callers
                self._fail(batch, exc)
                continue
            if self.pipeline:
                self._ready.put((batch, prepared, chosen))
            else:
                self._compute_one(batch, prepared, chosen)

    def _compute_loop(self):
        torch.set_num_threads(self.torch_threads)
        while True:
            got = self._ready.get()
            if got is _STOP:
                return
            self._compute_one(*got)

    def _compute_one(self, batch, prepared, chosen=None):
        try:
            self._finish(batch, prepared, chosen)
        except BaseException as exc:  # noqa: BLE001
            self._fail(batch, exc)


__all__ = ["Group", "BatchPlan", "Item", "KINDS", "Output", "PetCache", "Prepared", "Scheduler", "ServingPet",
           "pad_ids", "plan_batch", "prepare_pet", "retrieve_mixed", "stack_group"]


def _tokens(item) -> int:
    ids = getattr(item, "ids", None)
    return len(ids) if ids is not None else 1
