"""The infer side of the HTTP server: the dispatcher that batches texts across tenants for the
runtime, and the dedicated-model baseline's weight swaps."""

import asyncio
import collections
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from hkstore.errors import CorruptError, StoreError

log = logging.getLogger("hkstore.serve")


class _Entry:
    __slots__ = ("tenant", "text", "future", "enqueued", "deadline", "state", "truncate", "policy", "students",
                 "tokens")

    def __init__(self, tenant, text, future, enqueued, deadline):
        self.tenant, self.text, self.future, self.enqueued, self.deadline = tenant, text, future, enqueued, deadline
        self.state = "queued"  # queued | taken | dropped
        self.tokens = 0


def _options(entry) -> dict:
    """The request fields an entry sets (truncate, policy, students); unset ones take the defaults."""
    names = ("truncate", "policy", "students")
    return {k: getattr(entry, k) for k in names if getattr(entry, k, None) is not None}


class Expired(Exception):
    """A queued text whose caller's deadline would pass before its batch could finish."""


class Dispatcher:
    """The input queue, batching, the worker threads that run the runtime, the output routing."""

    def __init__(self, rt, metrics, *, max_batch, max_wait_s, queue_limit, mode="shared", dedicated_resident=4):
        self.rt, self.m = rt, metrics
        self.max_batch, self.max_wait_s, self.queue_limit = int(max_batch), float(max_wait_s), int(queue_limit)
        self.mode = mode
        self.inflight_limit = 1 if mode == "dedicated" else 2  # 2: the runtime pipelines prepare and compute
        self.pending = collections.deque()
        self.depth = 0  # texts queued and not yet handed to the runtime
        self.depth_tokens = 0  # and their tokens: the runtime counts them as load (backlog)
        self.inflight = 0
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.inflight_limit)
        self._pool = ThreadPoolExecutor(self.inflight_limit, thread_name_prefix="hkstore-infer")
        self._tasks = set()
        self._task = None
        self.batches = 0
        self.batch_seconds = 0.0  # moving average of a batch's time in the runtime
        if mode == "dedicated":
            self._dedicated = _DedicatedModels(rt, dedicated_resident)
        self._count_tokens = None
        if hasattr(rt, "set_backlog") and hasattr(rt, "encoder"):
            self._count_tokens = lambda texts: [len(ids) for ids in rt.encoder.tokenize(texts, max_len=rt.max_len)]
            rt.set_backlog(self.backlog)

    def backlog(self):
        """(texts, tokens, enqueue time of the oldest) still queued here; read from the runtime's threads."""
        try:
            first = next((e.enqueued for e in self.pending if e.state == "queued"), None)
        except RuntimeError:  # the event loop changed the deque meanwhile: the counts still hold
            first = None
        return self.depth, self.depth_tokens, first

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for e in self.pending:
            if not e.future.done():
                e.future.set_exception(RuntimeError("the server is shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def offer(self, tenant, texts, deadline=math.inf, truncate=None, policy=None, students=None):
        """Queue texts of one request (answer by `deadline`, perf_counter time); None when the
        queue has no room for them."""
        if self.depth + len(texts) > self.queue_limit:
            return None
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        entries = [_Entry(tenant, t, loop.create_future(), now, deadline) for t in texts]
        for e, count in zip(entries, self._count_tokens(texts) if self._count_tokens else [0] * len(entries)):
            e.tokens = count
            e.truncate = truncate  # None: the runtime's default
            e.policy = policy  # None: the tenant's default (runtime.level.serve)
            e.students = students  # None: the pruning policy's choice (runtime.student.serve)
        self.pending.extend(entries)
        self.depth += len(entries)
        self.depth_tokens += sum(e.tokens for e in entries)
        self.m.queue_depth.set(self.depth)
        self._wake.set()
        return entries

    def drop(self, entries):
        """Forget entries whose caller gave up; those not yet started leave the queue."""
        for e in entries:
            if e.state == "queued":
                e.state = "dropped"
                self.depth -= 1
                self.depth_tokens -= e.tokens
            if not e.future.done():
                e.future.cancel()
        self.m.queue_depth.set(self.depth)

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            while not self.depth:
                self._wake.clear()
                await self._wake.wait()
            await self._slots.acquire()
            while True:  # fill the open batch until max_batch or its first text's max wait
                self._trim()
                if not self.depth:
                    break
                deadline = self.pending[0].enqueued + self.max_wait_s
                now = time.perf_counter()
                if self.depth >= self.max_batch or now >= deadline:
                    break
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), deadline - now)
            batch = self._take()
            if not batch:
                self._slots.release()
                continue
            task = loop.create_task(self._launch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _trim(self):
        while self.pending and self.pending[0].state != "queued":
            self.pending.popleft()

    def _take(self):
        batch = []
        if self.mode == "dedicated":  # one tenant per batch
            tenant, keep = None, collections.deque()
            while self.pending:
                e = self.pending.popleft()
                if e.state != "queued":
                    continue
                if tenant is None:
                    tenant = e.tenant
                if e.tenant == tenant and len(batch) < self.max_batch:
                    batch.append(e)
                else:
                    keep.append(e)
            self.pending = keep
        else:
            while self.pending and len(batch) < self.max_batch:
                e = self.pending.popleft()
                if e.state == "queued":
                    batch.append(e)
        self.depth -= len(batch)
        self.depth_tokens -= sum(e.tokens for e in batch)
        # Under overload the oldest texts may not make their deadline any more: answer them now
        # (504) instead of spending a batch slot on an answer nobody waits for.
        now, live = time.perf_counter(), []
        for e in batch:
            if now + self.batch_seconds > e.deadline:
                e.state = "dropped"
                if not e.future.done():
                    e.future.set_exception(Expired())
                self.m.rejected.labels("expired").inc()
            else:
                e.state = "taken"
                live.append(e)
        self.m.queue_depth.set(self.depth)
        return live

    async def _launch(self, batch):
        loop = asyncio.get_running_loop()
        self.inflight += 1
        self.m.inflight.set(self.inflight)
        started = time.perf_counter()
        for e in batch:
            self.m.queue_wait.observe(started - e.enqueued)
        try:
            outs = await loop.run_in_executor(self._pool, self._compute,
                                              [(e.tenant, e.text, _options(e)) for e in batch])
        except Exception as exc:  # noqa: BLE001 - handed to the callers
            outs = [exc] * len(batch)
        finally:
            self.inflight -= 1
            self.m.inflight.set(self.inflight)
            self._slots.release()
        self.batches += 1
        seconds = time.perf_counter() - started
        self.batch_seconds += 0.2 * (seconds - self.batch_seconds)  # EWMA: what the next batch will take
        self.m.batch_size.observe(len(batch))
        self.m.batch_seconds.observe(seconds)
        for e, out in zip(batch, outs):
            if e.future.done():
                continue
            if isinstance(out, BaseException):
                e.future.set_exception(out)
            else:
                e.future.set_result(out)

    def _compute(self, requests):
        """In a worker thread: results (or the exception of each request) of one batch."""
        if self.mode == "dedicated":
            if self._dedicated.swap(requests[0][0]):
                self.m.swaps.inc()
            self._dedicated.lower([t for _, t, _ in requests])
        return self._infer(requests)

    def _infer(self, requests):
        import runtime

        try:
            return self.rt.infer([{"tenant": t, "text": x, **options} for t, x, options in requests])
        except (runtime.BadRequest, StoreError, CorruptError) as e:
            # infer checks every request before it runs any: one bad request (or one tenant's
            # damaged PET) fails the whole batch. Split it to find the culprits; the others are
            # answered.
            if len(requests) == 1:
                return [e]
            half = len(requests) // 2
            return self._infer(requests[:half]) + self._infer(requests[half:])


class _DedicatedModels:
    """The dedicated baseline's per-tenant model emulation (see the module doc)."""

    def __init__(self, rt, resident):
        import torch

        self.rt = rt
        self.resident = max(1, int(resident))
        count = sum(p.numel() for p in rt.encoder.parameters())
        self._host = torch.zeros(count)  # a tenant's full weights as loaded from its checkpoint
        self._device = torch.empty(count)  # the slot the serving model computes with
        self._lru = collections.OrderedDict()
        self.swaps = 0

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

    def lower(self, texts):
        import torch

        enc = self.rt.encoder
        seqs = enc.tokenize(texts, max_len=self.rt.max_len)
        ids, mask = enc.pad(seqs)
        with torch.no_grad():
            enc.lower(ids, mask)
