"""Online adaptive student pruning: how a batch is served under the current load.

Levels run from most to least accurate: the teacher (when the policy may use it), then the
group with k = M, M-1, ..., 1 students. For each level the policy keeps the cost of a padded
token (an EWMA of what batches actually took). A level is feasible when it can keep up with the
arrivals (utilization = arrival rate of tokens x cost per token below `headroom`) and would
drain what is queued before the oldest waiting request exceeds the latency target. The most
accurate feasible level serves the batch, else the cheapest: under a burst the last-trained
students are dropped, and as soon as the queue drains and arrivals slow down the full group
(or the teacher) is feasible again, with no hysteresis to wait out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PruningPolicy:
    levels: list  # most accurate first, e.g. ["teacher", 4, 3, 2, 1]
    target_s: float  # latency target (seconds) for the oldest waiting request
    headroom: float = 0.8
    alpha: float = 0.3  # EWMA weight of a new observation
    cost: dict = field(default_factory=dict)  # level -> seconds per padded token
    rate_window_s: float = 1.0
    _arrivals: list = field(default_factory=list)  # (time, tokens)

    def arrived(self, tokens: int, now: float | None = None) -> None:
        self._arrivals.append((time.perf_counter() if now is None else now, tokens))

    def arrival_rate(self, now: float | None = None) -> float:
        """Tokens per second over the last rate_window_s."""
        now = time.perf_counter() if now is None else now
        cut = now - self.rate_window_s
        while self._arrivals and self._arrivals[0][0] < cut:
            self._arrivals.pop(0)
        return sum(t for _, t in self._arrivals) / self.rate_window_s

    def observe(self, level, padded_tokens: int, seconds: float) -> None:
        per = seconds / max(padded_tokens, 1)
        old = self.cost.get(level)
        self.cost[level] = per if old is None else (1 - self.alpha) * old + self.alpha * per

    def choose(self, queued_tokens: int, oldest_wait_s: float, now: float | None = None, rate: float | None = None):
        """The level for the next batch; rate: arrivals in tokens/s when the caller measures
        them (runtime.sched.load), else those recorded by `arrived`."""
        rate = self.arrival_rate(now) if rate is None else rate
        for level in self.levels:
            c = self.cost.get(level)
            if c is None:
                return level  # not measured yet: measure it
            if rate * c < self.headroom and oldest_wait_s + queued_tokens * c <= self.target_s:
                return level
        return self.levels[-1]
