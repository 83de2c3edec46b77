"""Online adaptive student pruning: how a batch is served under the current load.

Levels run from most to least accurate: the teacher (when the policy may use it), then the
group with k = M, M-1, ..., 1 students. For each level the policy keeps what a batch costs as a
fixed part plus a part per padded token, fitted to what batches actually took (a least-squares
line through EWMAs of their sizes and times; while the sizes have not varied enough to tell the
parts apart, the last fixed part is kept). The split matters at low load: batches of 1-3
requests are mostly fixed cost, and pricing their tokens at the batch's average made the teacher
look 2-5x dearer than in a full batch, so it was refused at 0.3x its capacity (BENCHMARKS.md).
Arrivals and the queue are counted in their requests' tokens and converted to padded tokens by
the padding the batches have had (about 1.4-1.7x under a mixed burst: leaving it out made the
teacher look able to keep up with 1.5x what it could, BENCHMARKS, Student Parallelism).
A level is feasible when it can keep up with the arrivals (arrival rate of tokens x the cost of
a token in a full batch, the largest the level has served, its share of the fixed part
included, below `headroom`) and would drain what is queued (a fixed part per full batch of it
plus its tokens) before the oldest waiting request exceeds the latency target. The most
accurate feasible level serves the batch, else the cheapest; a level that is less accurate and
no cheaper in a full batch than one above it is never chosen. Under a burst the last-trained
students are dropped, and as soon as the queue drains and arrivals slow down the full group
(or the teacher) is feasible again, with no hysteresis to wait out.
That rule reads estimates, and a level it passes over is never observed again, so one slow
batch (a pause of the whole process) could shut it out for good, leaving the teacher to answer
a burst (BENCHMARKS, One engine). So a batch counts at most `outlier` times what its level's
estimate predicts for it, and a level the rule would pass over whose estimate no batch has
refreshed for `stale_s` serves the batch instead, which measures it again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class PruningPolicy:
    levels: list  # most accurate first, e.g. ["teacher", 4, 3, 2, 1]
    target_s: float  # latency target (seconds) for the oldest waiting request
    headroom: float = 0.8
    alpha: float = 0.3  # EWMA weight of a new observation
    cost: dict = field(default_factory=dict)  # level -> seconds per padded token, at the margin
    fixed: dict = field(default_factory=dict)  # level -> seconds a batch costs whatever its size
    rate_window_s: float = 1.0
    stale_s: float = 1.0  # an estimate older than this is measured again before the rule skips it
    outlier: float = 3.0  # a batch counts at most this many times its predicted seconds
    _seen: dict = field(default_factory=dict)  # level -> perf_counter of its last observation
    _arrivals: list = field(default_factory=list)  # (time, tokens)
    _moments: dict = field(default_factory=dict)  # level -> EWMAs of (n, t, n*n, n*t) per batch
    _largest: dict = field(default_factory=dict)  # level -> the most padded tokens a batch had: a full batch
    padding: float = 1.0  # padded tokens a batch computes per token its requests hold (EWMA)

    def arrived(self, tokens: int, now: float | None = None) -> None:
        self._arrivals.append((time.perf_counter() if now is None else now, tokens))

    def arrival_rate(self, now: float | None = None) -> float:
        """Tokens per second over the last rate_window_s."""
        now = time.perf_counter() if now is None else now
        cut = now - self.rate_window_s
        while self._arrivals and self._arrivals[0][0] < cut:
            self._arrivals.pop(0)
        return sum(t for _, t in self._arrivals) / self.rate_window_s

    def observe(self, level, padded_tokens: int, seconds: float, tokens: int | None = None,
                now: float | None = None) -> None:
        """A batch of `level` computed padded_tokens (its requests held `tokens`) in seconds."""
        self._seen[level] = time.perf_counter() if now is None else now
        n = max(padded_tokens, 1)
        if level in self.cost:
            seconds = min(seconds, self.outlier * (self.fixed.get(level, 0.0) + self.cost[level] * n))
        if tokens:
            self.padding = (1 - self.alpha) * self.padding + self.alpha * n / tokens
        self._largest[level] = max(self._largest.get(level, 0), n)
        new = (n, seconds, n * n, n * seconds)
        old = self._moments.get(level)
        mn, mt, mnn, mnt = self._moments[level] = new if old is None else tuple(
            (1 - self.alpha) * a + self.alpha * b for a, b in zip(old, new))
        var = mnn - mn * mn
        if var > (0.1 * mn) ** 2:  # sizes varied by 10% or more: the line's intercept is the fixed part
            slope = (mnt - mn * mt) / var
            if 0 < slope < mt / mn:
                self.fixed[level] = mt - slope * mn
        fixed = min(self.fixed.get(level, 0.0), mt)
        self.cost[level] = (mt - fixed) / mn

    def choose(self, queued_tokens: int, oldest_wait_s: float, now: float | None = None, rate: float | None = None):
        """The level for the next batch; rate: arrivals in tokens/s when the caller measures
        them (runtime.sched.load), else those recorded by `arrived`."""
        # arrivals and the queue count their requests' tokens, the costs are per padded token
        now = time.perf_counter() if now is None else now
        rate = self.arrival_rate(now) * self.padding if rate is None else rate * self.padding
        queued_tokens *= self.padding
        cheapest, cheapest_cost = self.levels[-1], math.inf
        for level in self.levels:
            c = self.cost.get(level)
            if c is None:
                return level  # not measured yet: measure it
            f, full = self.fixed.get(level, 0.0), self._largest.get(level, 1)
            per_token = c + f / full
            if per_token >= cheapest_cost:
                if now - self._seen.get(level, now) > self.stale_s:
                    return level  # skipped on an old estimate: measure it again
                # less accurate and no cheaper in a full batch than a level above it (e.g. two 2-layer
                # students against a 3-layer teacher): under load it only adds to the queue
                continue
            cheapest, cheapest_cost = level, per_token
            # keeping up: full batches at best, each paying its fixed part; draining: a batch per full batch queued
            batches = max(1, math.ceil(queued_tokens / full))
            if rate * per_token < self.headroom and oldest_wait_s + batches * f + queued_tokens * c <= self.target_s:
                return level
        return cheapest
