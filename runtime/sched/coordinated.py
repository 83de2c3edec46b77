"""PET-aware batching (PetS §4.1, Alg. 1): which queued requests run together.

The cost of a batch on an executor is modelled by two latency tables, profiled per machine
and executor (``benchmarks/profile_latency.py`` writes them into a JSON file this module loads):

* ``alpha[N][L]``: the shared operators (upper layers, heads) for N requests padded to L;
* ``beta[type][n][l]``: the PET operators of one tenant of PET type ``type`` (adapter, lora,
  bitfit, diff; head-only tenants cost nothing) for n requests padded to l.

Policies (each maps a queue of requests ``(tenant key, pet type, length)`` to batches, lists of
queue indices, at most ``max_batch`` requests each):

* ``fixed``: first come first served, chunks of ``max_batch`` (the conventional server);
* ``alpha_only``: all requests sorted by length, cut by a DP over alpha (PetS's fallback);
* ``beta_only``: per tenant, mini-batches by a DP over beta, packed in arrival order;
* ``coordinated`` (Alg. 1): cluster by tenant, sort each cluster by length, cut it into
  mini-batches by a DP over beta (intra-task), sort the mini-batches by length and group them
  into macro-batches by a DP over alpha (inter-task). When the queue's length variance is
  high (coefficient of variation above ``cv_threshold``) it falls back to ``alpha_only``
  (PetS §6.4). One adaptation to this runtime's executors: a macro-batch pads every request to
  its longest, PET operators included, so the inter-task DP charges a macro-batch
  ``alpha(N, L) + sum over its mini-batches of beta(type, n, L)``. With ``compare`` (default)
  it also keeps the alpha-only cut when the model predicts that one cheaper (with batched PET
  operators, mixing tenants costs little and alpha-only's lower padding can win).

``dp_split`` is the DP both levels use: the optimal cut of a sequence sorted by length into
contiguous groups (optimal among all partitions too, for costs nondecreasing in the length;
tests/test_coordinated.py checks it against brute force). ``CoordinatedBatcher`` plugs a
policy into the engine (``runtime.open(..., batching="coordinated")``, runtime.engine).
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, field

import numpy as np

__all__ = ["POLICIES", "CoordinatedBatcher", "LatencyModel", "alpha_only", "beta_only", "coordinated", "dp_split",
           "fixed", "padded_share", "pet_type", "predicted_cost"]

PET_TYPES = ("adapter", "lora", "bitfit", "diff")


def pet_type(pet) -> str:
    """The beta table a ServingPet uses: adapter, lora, bitfit, diff, or head (no PET ops)."""
    kinds = {part[0] for part in pet.parts}
    for kind, name in (("adapter", "adapter"), ("lora", "lora"), ("diff", "diff"), ("bias", "bitfit")):
        if kind in kinds:
            return name
    return "head"


# -- the latency model ----------------------------------------------------------------------------


def _interp(xs, ys, x):
    """Piecewise linear in x; beyond the grid, proportional to x from the nearest end."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x > xs[-1]:
        return float(ys[-1] * x / xs[-1])
    if x < xs[0]:
        return float(ys[0] * x / xs[0])
    return float(np.interp(x, xs, ys))


def _bilinear(rows, cols, table, r, c):
    return _interp(rows, [_interp(cols, row, c) for row in table], r)


@dataclass
class LatencyModel:
    """alpha (N x L grid) and beta (per PET type, n x l grid) in seconds, plus where measured."""

    alpha_n: list
    alpha_l: list
    alpha: list  # alpha[i][j]: N = alpha_n[i], L = alpha_l[j]
    beta_n: list
    beta_l: list
    beta: dict  # type -> table like alpha, on beta_n x beta_l
    meta: dict = field(default_factory=dict)  # machine, executor, torch, when

    def a(self, N: int, L: int) -> float:
        return _bilinear(self.alpha_n, self.alpha_l, self.alpha, N, L)

    def b(self, kind: str, n: int, length: int) -> float:
        table = self.beta.get(kind)
        return 0.0 if table is None else _bilinear(self.beta_n, self.beta_l, table, n, length)

    def monotone(self) -> LatencyModel:
        """The tables made nondecreasing in both dimensions (running maxima over N, then L):
        a batch never gets cheaper by growing, so timing noise (a shared machine) cannot
        reward splitting, and dp_split stays optimal among all partitions."""

        def fix(table):
            t = np.maximum.accumulate(np.maximum.accumulate(np.asarray(table, dtype=float), axis=0), axis=1)
            return t.tolist()

        return LatencyModel(self.alpha_n, self.alpha_l, fix(self.alpha), self.beta_n, self.beta_l,
                            {k: fix(v) for k, v in self.beta.items()}, dict(self.meta, monotone=True))

    def to_json(self) -> dict:
        return {"alpha_n": self.alpha_n, "alpha_l": self.alpha_l, "alpha": self.alpha, "beta_n": self.beta_n,
                "beta_l": self.beta_l, "beta": self.beta, "meta": self.meta}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path) -> LatencyModel:
        with open(path) as f:
            raw = json.load(f)
        return cls(**raw)

    @classmethod
    def linear(cls, per_token: float = 1e-4, overhead: float = 1e-3, pet_per_token: float = 1e-5,
               pet_overhead: float = 2e-4) -> LatencyModel:
        """A synthetic model (tests, or before profiling): cost = overhead + rate * N * L."""
        ns, ls = [1, 64], [1, 512]
        alpha = [[overhead + per_token * n * lv for lv in ls] for n in ns]
        beta = [[pet_overhead + pet_per_token * n * lv for lv in ls] for n in ns]
        return cls(ns, ls, alpha, ns, ls, {t: beta for t in PET_TYPES},
                   {"executor": "synthetic", "machine": platform.node()})


# -- the DP ---------------------------------------------------------------------------------------


def dp_split(sizes: list, lengths: list, cost, max_batch: int) -> list:
    """Optimal cut of a sequence into contiguous groups: [(i, j)] covering 0..len.

    Element k has sizes[k] requests and length lengths[k] (nondecreasing); a group [i, j) costs
    cost(sum of sizes, lengths[j-1], i, j) and holds at most max_batch requests (an element
    larger than max_batch is a group of its own). Minimizes the total cost."""
    n = len(sizes)
    prefix = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    best = [0.0] + [math.inf] * n
    arg = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            count = int(prefix[j] - prefix[i])
            if count > max_batch and i < j - 1:
                break
            c = best[i] + cost(count, lengths[j - 1], i, j)
            if c < best[j]:
                best[j], arg[j] = c, i
    cuts, j = [], n
    while j > 0:
        cuts.append((arg[j], j))
        j = arg[j]
    return cuts[::-1]


# -- policies: queue = [(key, type, length)] -> [[queue index]] ------------------------------------


def fixed(queue, model=None, max_batch: int = 32) -> list:
    return [list(range(i, min(i + max_batch, len(queue)))) for i in range(0, len(queue), max_batch)]


def alpha_only(queue, model, max_batch: int = 32) -> list:
    order = sorted(range(len(queue)), key=lambda k: (queue[k][2], k))
    lengths = [queue[k][2] for k in order]
    cuts = dp_split([1] * len(order), lengths, lambda n, length, i, j: model.a(n, length), max_batch)
    return [order[i:j] for i, j in cuts]


def _mini_batches(queue, model, max_batch):
    """Intra-task DP: per tenant (in first-arrival order), its requests sorted by length cut
    by beta. Returns [(key, type, [queue index], max length)]."""
    clusters: dict = {}
    for k, (key, kind, _) in enumerate(queue):
        clusters.setdefault(key, (kind, []))[1].append(k)
    minis = []
    for key, (kind, members) in clusters.items():
        members = sorted(members, key=lambda k: (queue[k][2], k))
        lengths = [queue[k][2] for k in members]
        for i, j in dp_split([1] * len(members), lengths,
                             lambda n, length, i, j, kind=kind: model.b(kind, n, length), max_batch):
            minis.append((key, kind, members[i:j], lengths[j - 1]))
    return minis


def beta_only(queue, model, max_batch: int = 32) -> list:
    minis = sorted(_mini_batches(queue, model, max_batch), key=lambda m: min(m[2]))
    batches, cur = [], []
    for _, _, members, _ in minis:
        if cur and len(cur) + len(members) > max_batch:
            batches.append(cur)
            cur = []
        cur = cur + members
    if cur:
        batches.append(cur)
    return batches


def coordinated(queue, model, max_batch: int = 32, cv_threshold: float = 1.0, compare: bool = True) -> list:
    """PetS Alg. 1 (see the module doc); falls back to alpha_only when the coefficient of
    variation of the queue's lengths exceeds cv_threshold, and (compare=True) also when the
    latency model predicts the alpha-only cut to be cheaper than Alg. 1's."""
    if not queue:
        return []
    lengths = np.array([q[2] for q in queue], dtype=float)
    if len(queue) > 1 and lengths.std() / max(lengths.mean(), 1e-9) > cv_threshold:
        return alpha_only(queue, model, max_batch)
    minis = sorted(_mini_batches(queue, model, max_batch), key=lambda m: (m[3], min(m[2])))

    def cost(n, length, i, j):
        return model.a(n, length) + sum(model.b(m[1], len(m[2]), length) for m in minis[i:j])

    cuts = dp_split([len(m[2]) for m in minis], [m[3] for m in minis], cost, max_batch)
    batches = [[k for m in minis[i:j] for k in m[2]] for i, j in cuts]
    if compare:  # the model-based form of the fallback: keep whichever plan the model finds cheaper
        alpha = alpha_only(queue, model, max_batch)
        if predicted_cost(queue, alpha, model) < predicted_cost(queue, batches, model):
            return alpha
    return batches


POLICIES = {"fixed": fixed, "alpha_only": alpha_only, "beta_only": beta_only, "coordinated": coordinated}


# -- evaluation ------------------------------------------------------------------------------------


def padded_share(queue, batches) -> float:
    """Padded tokens / computed tokens when each batch pads to its longest request."""
    computed = real = 0
    for b in batches:
        lengths = [queue[k][2] for k in b]
        computed += len(b) * max(lengths)
        real += sum(lengths)
    return 1.0 - real / computed if computed else 0.0


def predicted_cost(queue, batches, model) -> float:
    """The model's time for the batches: alpha(N, L) + sum over tenants of beta(type, n, L)."""
    total = 0.0
    for b in batches:
        L = max(queue[k][2] for k in b)
        tenants: dict = {}
        for k in b:
            tenants.setdefault(queue[k][0], [queue[k][1], 0])[1] += 1
        total += model.a(len(b), L) + sum(model.b(kind, n, L) for kind, n in tenants.values())
    return total


# -- the engine's batching ------------------------------------------------------------------------


class CoordinatedBatcher:
    """The engine's coordinated batching: queued work (anything with ``pet`` and ``ids``, e.g.
    runtime.engine.Work) -> batches, as lists of indices into it, by a policy. The engine hands
    it what is queued (up to its window) and runs the batches in the order returned (shortest
    first for the length-sorted policies)."""

    def __init__(self, model: LatencyModel | None = None, policy: str = "coordinated", max_batch: int = 32,
                 cv_threshold: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.model = model or LatencyModel.linear()
        self.policy = policy
        self.max_batch = int(max_batch)
        self.cv_threshold = cv_threshold

    def queue_of(self, items) -> list:
        return [(it.pet.key if it.pet.key is not None else id(it.pet), pet_type(it.pet), len(it.ids)) for it in items]

    def __call__(self, items) -> list:
        queue = self.queue_of(items)
        if self.policy == "coordinated":
            batches = coordinated(queue, self.model, self.max_batch, self.cv_threshold)
        else:
            batches = POLICIES[self.policy](queue, self.model, self.max_batch)
        return batches
