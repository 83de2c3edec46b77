"""The load the engine sees: what is queued and how fast requests arrive.

The engine's routing (e.g. runtime.student.serve's pruning policy) reads a ``Load`` as a
batch leaves the queue: the requests still waiting (this batch's included), their tokens, how
long the oldest of them has waited, and the arrival rate in tokens per second over the last
``window_s`` seconds. Every request, the HTTP server's included, waits in the engine's one
queue, so this is all the load there is.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    queued: int  # requests submitted and not yet run, this batch's included
    queued_tokens: int
    oldest_wait_s: float  # of this batch's oldest request
    arrival_rate: float  # tokens per second over the last window
    now: float  # time.perf_counter() when it was read


class LoadMeter:
    def __init__(self, window_s: float = 1.0):
        self.window_s = float(window_s)
        self._arrivals: collections.deque = collections.deque()  # (time, tokens)
        self._queued = 0
        self._tokens = 0
        self._lock = threading.Lock()

    def arrived(self, tokens: list[int], now: float) -> None:
        with self._lock:
            self._arrivals.append((now, sum(tokens)))
            self._queued += len(tokens)
            self._tokens += sum(tokens)

    def take(self, tokens: list[int], oldest: float, now: float) -> Load:
        """The load as a batch of requests with these token counts starts; they leave the queue."""
        with self._lock:
            while self._arrivals and self._arrivals[0][0] < now - self.window_s:
                self._arrivals.popleft()
            rate = sum(t for _, t in self._arrivals) / self.window_s
            load = Load(self._queued, self._tokens, now - oldest, rate, now)
            self._queued -= len(tokens)
            self._tokens -= sum(tokens)
        return load

    def left(self, tokens: list[int]) -> None:
        """Requests that left the queue without running (cancelled, expired)."""
        with self._lock:
            self._queued -= len(tokens)
            self._tokens -= sum(tokens)
