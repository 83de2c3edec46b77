"""Worker processes over one store: every core serves, one engine per worker.

    pool = runtime.pool.Pool("STORE", workers=4)      # or runtime.open("STORE", workers=4)
    futures = pool.submit([{"tenant": "t", "text": "..."}, ...])
    results = pool.infer(requests)                     # the same answers as one Runtime
    pool.close()

A Runtime computes with one torch thread: more threads inside one engine leave its Python
(preparation, lookups, per-row PET work) on one core, so a second core adds little. Processes
scale where threads do not. The store is memory-mapped and read-only between commits, so the
workers share one copy of its pages in the page cache; each keeps its own engine and PET cache.

**Dispatch.** A tenant's texts go to its home worker (a stable hash of its name) while that
worker keeps up, so its PET stays warm in one cache; a worker holding ``slack`` texts more than
the least loaded one does not keep up, and the texts go to the least loaded. One hot tenant so
spreads over every core, and many tenants keep their homes.

**Commits.** Before it queues anything a worker looks at the store's CURRENT (a stat) and
serves the newest manifest when it moved, so a request that arrives after a commit is
acknowledged is never answered with the old PET, whichever worker takes it; ``refresh()``
makes every worker do so now and waits for them.

**Faults.** A worker that dies (killed, out of memory) fails its texts with ``Unavailable``
(the server answers 503 with Retry-After) and is started again; nothing waits forever. Workers
exit when the parent does (their pipe closes).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import Future
from multiprocessing.connection import Connection

from runtime.errors import Unavailable

log = logging.getLogger("hkstore.pool")

START_TIMEOUT_S = 300.0
RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest pause before starting a worker that keeps dying


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_workers(workers, cores=None) -> tuple[int, str | None]:
    """(the number of workers, a warning or None) for ``auto`` or a count; ValueError below 1."""
    cores = usable_cores() if cores is None else cores
    if workers in (None, "auto"):
        return max(1, cores), None
    try:
        n = int(workers)
    except (TypeError, ValueError):
        raise ValueError(f"workers must be a positive number or 'auto', got {workers!r}") from None
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    if n > cores:
        return n, f"{n} workers on {cores} usable cores: they will share cores (auto gives one per core)"
    return n, None


def is_decoder_store(path) -> bool:
    """Whether the store at path holds a decoder (served by one generation engine, not workers)."""
    from runtime.gen.api import is_decoder_store_path

    return is_decoder_store_path(path)


def submit_each(submit, requests) -> list:
    """``submit(requests)``'s futures; where it raises a request error (it checks every request
    before it queues any), each request alone, so one bad text fails only its own future."""
    import runtime
    from hkstore.errors import CorruptError, StoreError

    errors = (runtime.BadRequest, StoreError, CorruptError)
    try:
        return submit(requests)
    except errors as e:
        if len(requests) == 1:
            return [failed(e)]
    out = []
    for r in requests:
        try:
            out += submit([r])
        except errors as e:
            out.append(failed(e))
    return out


def failed(exc) -> Future:
    f = Future()
    f.set_exception(exc)
    return f


# -- the worker process -------------------------------------------------------------------------


def _portable(exc):
    """exc if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may be unpicklable
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _current_stamp(path):
    try:
        st = os.stat(os.path.join(path, "CURRENT"))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _end_with_parent():
    """In a worker (Linux): SIGKILL when the parent dies, even if the worker is busy computing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn):
    store_path, device, options, torch_threads, observe = conn.recv()
    import torch

    import runtime

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    send_lock = threading.Lock()

    def send(msg):
        with send_lock:
            try:
                conn.send(msg)
            except (OSError, EOFError):  # the parent is gone: the main loop ends on its next recv
                pass

    try:
        rt = runtime.open(store_path, device, **options)
    except BaseException as e:  # noqa: BLE001 - the parent reports why the worker could not start
        send(("failed", _portable(e)))
        return
    stamp = _current_stamp(rt.store.path)
    engine = getattr(rt, "engine", None)
    if observe and engine is not None:
        engine.observers.append(lambda step, seconds: send(
            ("batch", len(step.works), seconds, [max(step.started - w.submitted, 0.0) for w in step.works])))
    send(("ready", os.getpid()))
    running = {}  # (batch id, index) -> the runtime's future
    scrubbed = time.monotonic()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "submit":
                _, bid, requests, seconds = msg
                now = _current_stamp(rt.store.path)
                if now != stamp:  # a commit since: serve it before this request (see the module doc)
                    stamp = now
                    _quietly(rt.refresh, "refreshing the store snapshot")
                if time.monotonic() - scrubbed > 1.0:  # a segment rewritten in place is checked again
                    scrubbed = time.monotonic()
                    _quietly(rt.store.scrub, "checking the segments")
                deadline = time.perf_counter() + seconds if seconds is not None else math.inf

                def queue(rs, deadline=deadline):
                    if engine is None:  # a runtime without the engine answers at once
                        return [_done(r) for r in rt.infer(rs)]
                    return rt.submit(rs, deadline)

                futures = submit_each(queue, requests)
                for i, f in enumerate(futures):
                    running[(bid, i)] = f
                    f.add_done_callback(lambda f, key=(bid, i): _answer(send, running, key, f))
            elif kind == "cancel":
                f = running.get((msg[1], msg[2]))
                if f is not None:
                    f.cancel()
            elif kind == "refresh":
                try:
                    rt.refresh()
                    stamp = _current_stamp(rt.store.path)
                    send(("reply", msg[1], None))
                except Exception as e:  # noqa: BLE001 - the parent decides what a failed refresh means
                    send(("reply", msg[1], _portable(e)))
            elif kind == "stats":
                try:
                    send(("reply", msg[1], rt.stats()))
                except Exception as e:  # noqa: BLE001 - stats never stop serving
                    send(("reply", msg[1], _portable(e)))
            elif kind == "stop":
                break
    finally:
        rt.close()


def _quietly(fn, what):
    """fn(); a damaged store keeps the snapshot held (its requests meet the damage and get 503,
    as in one engine) rather than ending the worker."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - logged; the worker goes on serving what it holds
        log.error("%s failed: %s", what, e)


def _add(a: dict, b: dict) -> dict:
    """Numbers added key by key (nested dicts too); other values kept from a, else b."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _add(out[k], v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out[k], (int, float)):
            out[k] = out[k] + v
    return out


def _done(result) -> Future:
    f = Future()
    f.set_result(result)
    return f


def _answer(send, running, key, f):
    running.pop(key, None)
    if f.cancelled():
        send(("answer", key[0], key[1], False, None))
        return
    exc = f.exception()
    if exc is not None:
        send(("answer", key[0], key[1], False, _portable(exc)))
    else:
        send(("answer", key[0], key[1], True, f.result()))


# -- the parent's side ----------------------------------------------------------------------------


class _Worker:
    def __init__(self, index):
        self.index = index
        self.process = None
        self.conn = None
        self.alive = False
        self.outstanding = 0  # texts sent and not yet answered
        self.batches = {}  # batch id -> list of (future or None)
        self.restarts = 0
        self.failures = 0  # deaths in a row (the restart pause grows with them)
        self.started = 0.0
        self.send_lock = threading.Lock()


class Pool:
    """N worker processes, each a Runtime over the same store (see the module doc).

    workers: a count or ``auto`` (one per usable core). torch_threads: each worker's torch
    threads. options: runtime.open's. slack: texts a tenant's home worker may hold beyond the
    least loaded one before its texts spill (default: max_batch // 2). observe(n, seconds,
    waits) is called for every batch a worker runs (the server's metrics)."""

    def __init__(self, store_path, workers="auto", device: str = "cpu", *, torch_threads: int = 1,
                 slack: int | None = None, observe=None, **options):
        self.n, warning = check_workers(workers)
        if warning:
            log.warning(warning)
        if device not in ("cpu", "auto"):
            raise ValueError(f"worker processes serve on the CPU, not {device!r}: one GPU takes one engine")
        self.store_path = os.path.abspath(store_path)
        self.device = "cpu"
        self.options = dict(options)
        self.torch_threads = int(torch_threads)
        self.slack = max(1, int(options.get("max_batch", 64)) // 2) if slack is None else max(0, int(slack))
        self.observe = observe
        self._lock = threading.Lock()
        self._next_bid = 0
        self._replies = {}  # (worker, seq) -> a Future of its reply to refresh or stats
        self._closing = False
        self.workers = [_Worker(i) for i in range(self.n)]
        # One keeper thread a worker starts it, reads its answers and starts it again: the
        # thread that starts a process must outlive it (a worker gets SIGKILL when it ends).
        first = [Future() for _ in self.workers]
        for w, f in zip(self.workers, first):
            threading.Thread(target=self._keep, args=(w, f), name=f"hkstore-pool-{w.index}", daemon=True).start()
        try:
            for f in first:
                f.result()
        except BaseException:
            self.close()
            raise

    # -- processes --

    def _spawn(self, w):
        # A fresh interpreter (python -m runtime.pool), not multiprocessing's spawn: that one
        # re-imports the caller's __main__, which breaks scripts without a __main__ guard.
        parent, child = socket.socketpair()
        # the worker imports this same runtime package, wherever the caller found it
        where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(self.torch_threads, 1)), PYTHONPATH=path)
        w.process = subprocess.Popen([sys.executable, "-m", "runtime.pool", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, preexec_fn=_end_with_parent)
        child.close()
        w.conn = Connection(parent.detach())
        w.conn.send((self.store_path, self.device, self.options, self.torch_threads, self.observe is not None))
        w.started = time.monotonic()

    def _wait_ready(self, w):
        if not w.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"worker {w.index} did not start within {START_TIMEOUT_S:g} s")
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"worker {w.index} exited while starting (exit code "
                               f"{w.process.wait(5)})") from None
        if msg[0] == "failed":
            raise msg[1]
        w.alive = True

    def _keep(self, w, first):
        while not self._closing:
            try:
                self._spawn(w)
                self._wait_ready(w)
            except Exception as e:  # noqa: BLE001 - reported at the start, retried later
                if w.process is not None and w.process.poll() is None:
                    w.process.kill()
                if first is not None:
                    first.set_exception(e)
                    return
                log.error("worker %d did not start again: %s", w.index, e)
                w.failures += 1
                time.sleep(self._pause(w))
                continue
            if first is not None:
                first.set_result(None)
                first = None
            else:
                w.restarts += 1
                log.warning("worker %d started again (pid %d)", w.index, w.process.pid)
            self._read(w)
            if self._closing:
                return
            self._lost(w)
            time.sleep(self._pause(w))

    @staticmethod
    def _pause(w) -> float:
        return min(RESTART_BACKOFF_S[0] * 2 ** max(w.failures - 1, 0), RESTART_BACKOFF_S[1])

    def _read(self, w):
        """Answers from one worker, until its pipe closes."""
        while True:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "answer":
                self._settle(w, msg[1], msg[2], msg[3], msg[4])
            elif kind == "batch" and self.observe is not None:
                try:
                    self.observe(msg[1], msg[2], msg[3])
                except Exception:  # noqa: BLE001 - metrics never stop the answers
                    log.exception("observing a batch failed")
            elif kind == "reply":
                waiter = self._replies.get((w.index, msg[1]))
                if waiter is not None:
                    waiter.set_result(msg[2])

    def _lost(self, w):
        """The worker died: its texts fail with Unavailable (the server answers 503)."""
        with self._lock:
            w.alive = False
            batches, w.batches, w.outstanding = w.batches, {}, 0
        for (index, _), waiter in list(self._replies.items()):
            if index == w.index and not waiter.done():
                waiter.set_result(Unavailable(f"worker {w.index} exited"))
        code = None
        try:
            code = w.process.wait(5.0)
        except subprocess.TimeoutExpired:  # its pipe broke but it lives on: end it
            w.process.kill()
            code = w.process.wait()
        w.conn.close()
        log.error("worker %d (pid %s) exited (code %s); its %d texts get 503, starting it again", w.index,
                  w.process.pid, code, sum(len(b) for b in batches.values()))
        for futures in batches.values():
            for f in futures:
                if f is not None and not f.done():
                    f.set_exception(Unavailable("the worker serving this request exited; retry"))
        # a worker that dies soon after it started pauses longer before the next try
        w.failures = w.failures + 1 if time.monotonic() - w.started < 30 else 1

    # -- work --

    def home(self, tenant) -> int:
        return zlib.crc32(str(tenant).encode()) % self.n

    def _choose(self, tenant):
        alive = [w for w in self.workers if w.alive]
        if not alive:
            return None
        least = min(alive, key=lambda w: w.outstanding)
        home = self.workers[self.home(tenant)]
        return home if home.alive and home.outstanding <= least.outstanding + self.slack else least

    @property
    def depth(self) -> int:
        """Texts sent to workers and not yet answered."""
        return sum(w.outstanding for w in self.workers)

    @property
    def alive(self) -> int:
        return sum(w.alive for w in self.workers)

    def submit(self, requests, deadline: float = math.inf) -> list:
        """One Future per request (a Result, or the request's error); see the module doc. A
        cancelled future leaves its worker's queue. deadline: time.perf_counter time."""
        out = [None] * len(requests)
        groups = {}
        for j, r in enumerate(requests):
            tenant = r.get("tenant") if isinstance(r, dict) else getattr(r, "tenant", None)
            groups.setdefault(tenant, []).append(j)
        # in pieces of `slack` texts, so one tenant's large call still spreads as its home fills
        step = max(1, self.slack)
        for tenant, idx in groups.items():
            for a in range(0, len(idx), step):
                piece = idx[a:a + step]
                futures = [Future() for _ in piece]
                for j, f in zip(piece, futures):
                    out[j] = f
                self._send(tenant, [requests[j] for j in piece], futures, deadline)
        return out

    def _send(self, tenant, requests, futures, deadline):
        with self._lock:
            w = self._choose(tenant)
            if w is None:
                for f in futures:
                    f.set_exception(Unavailable("no worker is running (they are starting again); retry"))
                return
            bid = self._next_bid
            self._next_bid += 1
            w.batches[bid] = list(futures)
            w.outstanding += len(futures)
        seconds = None if math.isinf(deadline) else max(deadline - time.perf_counter(), 0.0)
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, w=w, bid=bid, i=i: f.cancelled() and self._cancel(w, bid, i))
        try:
            with w.send_lock:
                w.conn.send(("submit", bid, requests, seconds))
        except (OSError, ValueError, pickle.PicklingError) as e:
            if isinstance(e, pickle.PicklingError):
                self._forget(w, bid, e)
            # a dead pipe: the reader fails the batch with Unavailable

    def _forget(self, w, bid, exc):
        with self._lock:
            futures = w.batches.pop(bid, [])
            w.outstanding -= sum(f is not None for f in futures)
        for f in futures:
            if f is not None and not f.done():
                f.set_exception(exc)

    def _cancel(self, w, bid, i):
        with self._lock:  # it stops counting now; an answer that still comes is dropped
            futures = w.batches.get(bid)
            if futures is None or futures[i] is None:
                return
            futures[i] = None
            w.outstanding -= 1
            if all(x is None for x in futures):
                del w.batches[bid]
        try:
            with w.send_lock:
                w.conn.send(("cancel", bid, i))
        except (OSError, ValueError):
            pass

    def _settle(self, w, bid, i, ok, value):
        with self._lock:
            futures = w.batches.get(bid)
            if futures is None or futures[i] is None:
                return
            f, futures[i] = futures[i], None
            w.outstanding -= 1
            if all(x is None for x in futures):
                del w.batches[bid]
        if f.done():  # cancelled by its caller meanwhile
            return
        if ok:
            f.set_result(value)
        elif value is None:
            f.cancel()
        else:
            f.set_exception(value)

    def infer(self, requests) -> list:
        """Results of requests in order, spread over the workers; raises the first request
        error, as Runtime.infer does."""
        futures = self.submit(list(requests))
        return [f.result() for f in futures]

    def _ask(self, kind, timeout):
        """Send every live worker (kind, seq); {worker index: its reply} (Unavailable for one
        that died meanwhile)."""
        waiters = []
        with self._lock:
            seq = self._next_bid
            self._next_bid += 1
            for w in self.workers:
                if w.alive:
                    waiter = Future()
                    self._replies[(w.index, seq)] = waiter
                    waiters.append((w, waiter))
        try:
            for w, waiter in waiters:
                try:
                    with w.send_lock:
                        w.conn.send((kind, seq))
                except (OSError, ValueError):
                    waiter.set_result(Unavailable(f"worker {w.index} exited"))
            return {w.index: waiter.result(timeout) for w, waiter in waiters}
        finally:
            for w, _ in waiters:
                self._replies.pop((w.index, seq), None)

    def refresh(self, timeout: float = 60.0):
        """Every live worker serves the store's newest manifest when this returns (one that dies
        meanwhile starts again on it)."""
        for reply in self._ask("refresh", timeout).values():
            if isinstance(reply, Exception) and not isinstance(reply, Unavailable):
                raise reply

    def runtime_stats(self, timeout: float = 10.0) -> dict:
        """Runtime.stats() summed over the live workers (counters add up; the rest is the first's)."""
        out = {}
        for reply in self._ask("stats", timeout).values():
            if isinstance(reply, dict):
                out = _add(out, reply)
        return out

    def stats(self) -> dict:
        return {"workers": self.n, "alive": self.alive, "restarts": sum(w.restarts for w in self.workers),
                "depth": self.depth,
                "pids": [w.process.pid if w.process is not None and w.alive else None for w in self.workers]}

    def close(self):
        self._closing = True
        for w in self.workers:
            if w.conn is not None:
                try:
                    with w.send_lock:
                        w.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10.0
        for w in self.workers:
            if w.process is not None:
                try:
                    w.process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    w.process.kill()
                    w.process.wait(5.0)
            with self._lock:
                batches, w.batches, w.outstanding, w.alive = w.batches, {}, 0, False
            for futures in batches.values():
                for f in futures:
                    if f is not None and not f.done():
                        f.set_exception(Unavailable("the pool is closing"))
            if w.conn is not None:
                w.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
