"""The infer side of the HTTP server: texts go straight onto the runtime's engine queue.

There is one queue, the engine's (runtime.engine): ``offer`` validates and submits a request's
texts there (``Runtime.submit``, on a worker thread: tokenizing and a PET's first load take
time), the engine batches them with everything else that waits (the server's ``--max-batch``
and ``--max-wait-ms`` are its batch size and its wait for company) and answers each text's
future. So the load the students' pruning policy reads is the real queue, a full queue answers
429 here before anything is submitted, a text whose deadline its batch could not meet is
answered ``Expired`` (504) by the engine, and a caller who gives up takes its texts off the
queue (``drop``). The metrics of the queue and the batches come from the engine's observers.

The dedicated-model baseline (``mode="dedicated"``) batches one tenant at a time (the engine's
``tenant`` batching), serves every text at the exact level (all layers on the text's own
context, no PLOT lookup: a dedicated model's forward pass) and, before each batch computes,
swaps that tenant's full model in when it is not among the ``dedicated_resident`` most recent
ones. A dedicated model has one level, so a request there that asks for a policy, a level or
students is refused (422, as any request the runtime refuses).
"""

import asyncio
import collections
from concurrent.futures import Future

from runtime.errors import Expired
from runtime.pool import Pool, submit_each

__all__ = ["Dispatcher", "Expired", "PoolDispatcher"]


class _Entry:
    __slots__ = ("future", "inner")

    def __init__(self, future, inner):
        self.future, self.inner = future, inner  # the caller's asyncio future, the runtime's


class Dispatcher:
    """The server's door to the engine's queue: limits, submission, cancellation, metrics."""

    def __init__(self, rt, metrics, *, queue_limit, mode="shared", dedicated_resident=4):
        self.rt, self.m = rt, metrics
        self.queue_limit = int(queue_limit)
        self.mode = mode
        self._reserved = 0  # texts being submitted: counted against the limit until they are queued
        self._entries = set()
        self._dedicated = None
        # a runtime without the engine (a decoder store's) answers infer at once, with its reason
        self.engine = getattr(rt, "engine", None)
        if self.engine is not None:
            self.engine.observers.append(self._observe)
            if mode == "dedicated":
                self._dedicated = _DedicatedModels(rt, dedicated_resident, metrics.swaps)
                self.engine.before.append(self._dedicated.step)

    @property
    def depth(self) -> int:
        """Texts waiting in the engine's queue."""
        return 0 if self.engine is None else self.engine.depth

    def start(self):
        pass

    def refresh(self):
        """After this process's runtime took a new snapshot: nothing else computes here."""

    def runtime_stats(self) -> dict:
        return self.rt.stats()

    def workers(self):
        """The worker processes' state for /healthz (None: the engine is in this process)."""
        return None

    async def stop(self):
        for e in list(self._entries):
            e.inner.cancel()
            if not e.future.done():
                e.future.set_exception(RuntimeError("the server is shutting down"))
        if self.engine is not None:
            self.engine.observers.remove(self._observe)
        if self._dedicated is not None:
            self.engine.before.remove(self._dedicated.step)

    async def offer(self, tenant, texts, deadline=float("inf"), truncate=None, policy=None, students=None, level=None):
        """Queue texts of one request (answer by `deadline`, perf_counter time); None when the
        queue has no room for them."""
        if self.depth + self._reserved + len(texts) > self.queue_limit:
            return None
        options = {k: v for k, v in (("truncate", truncate), ("policy", policy), ("students", students),
                                     ("level", level)) if v is not None}
        requests = [{"tenant": tenant, "text": t, **options} for t in texts]
        self._reserved += len(texts)
        try:
            inner = await asyncio.to_thread(self._submit, requests, deadline)
        finally:
            self._reserved -= len(texts)
        entries = []
        for f in inner:
            f.add_done_callback(self._expired)
            e = _Entry(asyncio.wrap_future(f), f)
            self._entries.add(e)
            e.future.add_done_callback(lambda _, e=e: self._entries.discard(e))
            entries.append(e)
        self.m.queue_depth.set(self.depth)
        return entries

    def _submit(self, requests, deadline):
        """Futures of the requests' results (a request error is its future's). The runtime checks
        every request of a submission before it queues any: one bad text (or one tenant's damaged
        PET) fails them all. Then each is submitted alone to find the culprits; the others are
        answered."""
        def submit(batch):
            if self._dedicated is not None:
                batch = [self._dedicated.pin(r) for r in batch]
            if self.engine is None:
                return [_answered(r) for r in self.rt.infer(batch)]
            return self.rt.submit(batch, deadline)

        return submit_each(submit, requests)

    def drop(self, entries):
        """Forget entries whose caller gave up; those not yet in a batch leave the queue."""
        for e in entries:
            e.inner.cancel()
            if not e.future.done():
                e.future.cancel()
        self.m.queue_depth.set(self.depth)

    def _expired(self, f):
        if not f.cancelled() and isinstance(f.exception(), Expired):
            self.m.rejected.labels("expired").inc()

    def _observe(self, step, seconds):
        """A batch ran (on the engine's compute thread)."""
        self.m.batch_size.observe(len(step.works))
        self.m.batch_seconds.observe(seconds)
        for w in step.works:
            self.m.queue_wait.observe(max(step.started - w.submitted, 0.0))
        self.m.queue_depth.set(self.depth)


def _answered(result) -> Future:
    f = Future()
    f.set_result(result)
    return f


class PoolDispatcher(Dispatcher):
    """The door to N worker processes (runtime.pool, ``hkstore serve --workers N``): the same
    limits, cancellation and metrics as one engine's, over the texts the workers hold. Each
    worker validates and queues its texts itself (the split on a bad text included), so the
    server's process only routes them."""

    def __init__(self, store_path, metrics, *, workers, queue_limit, device="cpu", torch_threads=1, **options):
        self.m = metrics
        self.queue_limit = int(queue_limit)
        self.mode = "shared"
        self._reserved = 0
        self._entries = set()
        self._dedicated = None
        self.engine = None
        self.pool = Pool(store_path, workers, device, torch_threads=torch_threads, observe=self._observe_batch,
                         **options)
        self.rt = self.pool
        from prometheus_client import Gauge

        alive = Gauge("hkstore_workers_alive", "Worker processes serving (hkstore serve --workers)",
                      registry=metrics.registry)
        alive.set_function(lambda: self.pool.alive)
        restarts = Gauge("hkstore_worker_restarts", "Worker processes started again after they died",
                         registry=metrics.registry)
        restarts.set_function(lambda: sum(w.restarts for w in self.pool.workers))

    @property
    def depth(self) -> int:
        return self.pool.depth

    async def stop(self):
        await super().stop()
        await asyncio.to_thread(self.pool.close)

    def _submit(self, requests, deadline):
        return self.pool.submit(requests, deadline)

    def refresh(self):
        self.pool.refresh()

    def runtime_stats(self) -> dict:
        return dict(self.pool.runtime_stats(), device=self.pool.device)

    def workers(self):
        return self.pool.stats()

    def _observe_batch(self, n, seconds, waits):
        """A batch ran in a worker (called on the pool's reader thread)."""
        self.m.batch_size.observe(n)
        self.m.batch_seconds.observe(seconds)
        for w in waits:
            self.m.queue_wait.observe(w)
        self.m.queue_depth.set(self.depth)


class _DedicatedModels:
    """The dedicated baseline's per-tenant model emulation (see the module doc)."""

    def __init__(self, rt, resident, swaps_metric):
        import torch

        self.rt = rt
        self.swaps_metric = swaps_metric
        self.resident = max(1, int(resident))
        count = sum(p.numel() for p in rt.encoder.parameters())
        self._host = torch.zeros(count)  # a tenant's full weights as loaded from its checkpoint
        self._device = torch.empty(count)  # the slot the serving model computes with
        self._lru = collections.OrderedDict()
        self.swaps = 0

    @staticmethod
    def pin(request: dict) -> dict:
        """The request at the exact level; BadRequest where it asks for another way to be served."""
        import runtime

        if asked := sorted(k for k in ("policy", "level", "students") if request.get(k) is not None):
            raise runtime.BadRequest(f"{', '.join(asked)}: this server emulates dedicated models (--mode dedicated), "
                                     "which answer every text with the whole model on its own context")
        return dict(request, level="exact")

    def step(self, step):
        """Before a batch (one tenant's) computes: its model swapped in."""
        if self.swap(step.works[0].pet.key):
            self.swaps_metric.inc()

    def swap(self, tenant) -> bool:
        if tenant in self._lru:
            self._lru.move_to_end(tenant)
            return False
        self._device.copy_(self._host)
        self._lru[tenant] = True
        while len(self._lru) > self.resident:
            self._lru.popitem(last=False)
        self.swaps += 1
        return True

