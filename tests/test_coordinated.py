"""PET-aware batching (runtime.sched.coordinated): the DP against brute force, the policies'
invariants, the latency model file, and the engine's coordinated batching.

Properties: dp_split's cut is the cheapest contiguous cut (all 2^(n-1) of them) for any
cost; for costs nondecreasing in the length it is also the cheapest of all set partitions
of the requests (sorted contiguous groups lose nothing); every policy serves each queued
request exactly once in batches of at most max_batch requests.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.sched import coordinated as cb

SETTINGS = settings(max_examples=60, deadline=None)


def _contiguous_best(sizes, lengths, cost, max_batch):
    n, best = len(sizes), math.inf
    for mask in range(1 << (n - 1)):
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        total = 0.0
        for i, j in itertools.pairwise(cuts):
            count = sum(sizes[i:j])
            if count > max_batch and j - i > 1:
                break
            total += cost(count, lengths[j - 1], i, j)
        else:
            best = min(best, total)
    return best


def _cut_cost(cuts, sizes, lengths, cost):
    return sum(cost(sum(sizes[i:j]), lengths[j - 1], i, j) for i, j in cuts)


@SETTINGS
@given(data=st.data())
def test_dp_equals_brute_force_contiguous(data):
    n = data.draw(st.integers(1, 8))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    lengths = sorted(data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)))
    max_batch = data.draw(st.integers(1, 12))
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    table = rng.random((n + 1, n + 1)) * 3  # any cost of (i, j), plus a size/length term

    def cost(count, length, i, j):
        return table[i, j] + 0.01 * count * length

    cuts = cb.dp_split(sizes, lengths, cost, max_batch)
    assert [c[0] for c in cuts] == [0] + [c[1] for c in cuts[:-1]] and cuts[-1][1] == n
    for i, j in cuts:
        assert sum(sizes[i:j]) <= max_batch or j - i == 1
    assert math.isclose(_cut_cost(cuts, sizes, lengths, cost), _contiguous_best(sizes, lengths, cost, max_batch),
                        rel_tol=1e-9, abs_tol=1e-12)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1:]
        yield [[first], *part]


@SETTINGS
@given(data=st.data())
def test_dp_is_optimal_among_all_partitions_for_monotone_costs(data):
    n = data.draw(st.integers(1, 7))
    lengths = sorted(data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)))
    max_batch = data.draw(st.integers(1, n))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    # table[count][length]: any cost per count, nondecreasing in the length
    table = np.cumsum(rng.random((n + 1, 10)), axis=1)

    def cost(count, length, i=None, j=None):
        return float(table[count, length])

    cuts = cb.dp_split([1] * n, lengths, cost, max_batch)
    best = min(sum(cost(len(g), max(lengths[k] for k in g)) for g in part)
               for part in _set_partitions(list(range(n))) if all(len(g) <= max_batch for g in part))
    assert math.isclose(_cut_cost(cuts, [1] * n, lengths, cost), best, rel_tol=1e-9)


queues = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["adapter", "lora", "bitfit", "diff", "head"]),
                            st.integers(1, 200)), min_size=0, max_size=40)


@SETTINGS
@given(queue=queues, max_batch=st.integers(1, 16), policy=st.sampled_from(sorted(cb.POLICIES)),
       cv=st.sampled_from([0.0, 1.0, 10.0]))
def test_policies_serve_each_request_once(queue, max_batch, policy, cv):
    # a tenant has one PET type
    queue = [(key, ("adapter", "lora", "bitfit", "diff", "head", "lora")[key], length) for key, _, length in queue]
    model = cb.LatencyModel.linear()
    if policy == "coordinated":
        batches = cb.coordinated(queue, model, max_batch, cv)
    else:
        batches = cb.POLICIES[policy](queue, model, max_batch)
    served = sorted(k for b in batches for k in b)
    assert served == list(range(len(queue)))
    assert all(0 < len(b) <= max_batch for b in batches)
    assert 0.0 <= cb.padded_share(queue, batches) < 1.0


def test_length_sorting_cuts_padding():
    rng = np.random.default_rng(0)
    queue = [(int(t), "adapter", int(n)) for t, n in zip(rng.integers(0, 4, 128), rng.integers(8, 128, 128))]
    model = cb.LatencyModel.linear()
    fixed = cb.fixed(queue, model, 32)
    coord = cb.coordinated(queue, model, 32, cv_threshold=10.0)
    alpha = cb.alpha_only(queue, model, 32)
    assert cb.padded_share(queue, coord) < cb.padded_share(queue, fixed)
    assert cb.padded_share(queue, alpha) < cb.padded_share(queue, fixed)
    assert cb.predicted_cost(queue, alpha, model) < cb.predicted_cost(queue, fixed, model)
    assert cb.predicted_cost(queue, coord, model) < cb.predicted_cost(queue, fixed, model)
    # with compare, coordinated is never predicted worse than alpha-only
    assert cb.predicted_cost(queue, coord, model) <= cb.predicted_cost(queue, alpha, model) + 1e-12
    plain = cb.coordinated(queue, model, 32, cv_threshold=10.0, compare=False)
    assert sorted(k for b in plain for k in b) == list(range(len(queue)))


def test_latency_model_file_and_interpolation(tmp_path):
    m = cb.LatencyModel([1, 4], [8, 16], [[1.0, 2.0], [4.0, 8.0]], [1, 4], [8, 16],
                        {"adapter": [[0.1, 0.2], [0.4, 0.8]]}, {"machine": "x", "executor": "cpu"})
    path = tmp_path / "latency.json"
    m.save(path)
    m2 = cb.LatencyModel.load(path)
    assert m2.meta == {"machine": "x", "executor": "cpu"}
    assert m2.a(1, 8) == 1.0 and m2.a(4, 16) == 8.0
    assert math.isclose(m2.a(2.5, 12), (1.5 + 6.0) / 2)
    assert math.isclose(m2.a(8, 16), 16.0)  # beyond the grid: proportional
    assert m2.b("head", 3, 10) == 0.0 and math.isclose(m2.b("adapter", 4, 12), 0.6)
    noisy = cb.LatencyModel([1, 2], [8, 16], [[3.0, 1.0], [2.0, 5.0]], [1], [8], {"lora": [[1.0]]})
    assert noisy.monotone().alpha == [[3.0, 3.0], [3.0, 5.0]] and noisy.monotone().meta["monotone"]


def test_the_engine_runs_the_batcher(tmp_path):
    import itertools as it

    from runtime.engine import Engine
    from runtime.exec.rows import Gathered, Prepared, Row

    class Pet:
        def __init__(self, key):
            self.key, self.parts = key, {("adapter", 0, "o"): ()}

    class Echo:  # an executor that returns each row's length and records the batches
        def __init__(self):
            self.batches = []

        def gather(self, snapshot, rows):
            return Gathered([], None, [None] * len(rows))

        def prepare(self, gathered, rows):
            return Prepared(rows)

        def compute(self, prepared):
            self.batches.append([len(r.ids) for r in prepared.rows])
            return [np.array([len(r.ids)]) for r in prepared.rows]

    ex = Echo()
    lengths = [5, 90, 7, 88, 6, 91, 8, 89]
    rows = [Row(list(range(n)), Pet(k % 2), "root") for k, n in zip(it.count(), lengths)]
    batcher = cb.CoordinatedBatcher(cb.LatencyModel.linear(per_token=1e-3, overhead=1.0), "alpha_only", 4)
    engine = Engine(ex, lambda: None, max_batch=4, pipeline=False, batching="coordinated", batcher=batcher)
    futures = engine.submit(rows=rows)
    outs = [f.result(timeout=10) for f in futures]
    engine.close()
    assert [int(o.logits[0]) for o in outs] == lengths
    assert sorted(map(sorted, ex.batches)) == [[5, 6, 7, 8], [88, 89, 90, 91]]


def test_the_runtime_serves_with_coordinated_batching():
    """batching="coordinated" (PetS) in the product's engine answers as FIFO batching does."""
    import runtime
    from test_runtime import requests_for, shared_tiny_store

    tiny = shared_tiny_store()
    reqs = requests_for(tiny, 12)
    with runtime.open(tiny[0], device="cpu", max_len=48, batching="fifo") as rt:
        expected = [r.logits for r in rt.infer(reqs)]
    with runtime.open(tiny[0], device="cpu", max_len=48, max_batch=4, batching="coordinated") as rt:
        assert rt.engine.batcher is not None
        got = rt.infer(reqs)
    for e, r in zip(expected, got):
        np.testing.assert_allclose(r.logits, e, rtol=1e-4, atol=1e-5)
