"""experiments.tabi_bound's oracle: the fewest queries level 2 must answer, against brute force."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.tabi_bound import metric, oracle_share


def _brute(task, c1, c2, target):
    n = len(c1)
    for size in range(n + 1):
        for chosen in itertools.combinations(range(n), size):
            c = c1.copy()
            c[list(chosen)] = c2[list(chosen)]
            if metric(task, c) >= target - 1e-9:
                return size
    return None


@st.composite
def levels(draw):
    task = draw(st.sampled_from(["classification", "tagging"]))
    n = draw(st.integers(1, 7))
    rows = []
    for _ in range(n):
        if task == "classification":
            rows.append(([draw(st.integers(0, 1)), 1, 1], [draw(st.integers(0, 1)), 1, 1]))
        else:
            gold = draw(st.integers(0, 3))
            pair = []
            for _ in range(2):
                predicted = draw(st.integers(0, 4))
                pair.append([draw(st.integers(0, min(gold, predicted))), predicted, gold])
            rows.append(tuple(pair))
    c1 = np.array([a for a, _ in rows], dtype=float)
    c2 = np.array([b for _, b in rows], dtype=float)
    if task == "tagging" and c1[:, 2].sum() == 0:
        c1[0, 2] = c2[0, 2] = 1  # a test set with no entity at all has no F1 to reach
    return task, c1, c2, draw(st.integers(0, 16)) / 16  # exact in binary: ties are ties


@settings(max_examples=300, deadline=None)
@given(levels())
def test_the_oracle_takes_the_fewest_queries_from_level_2(case):
    task, c1, c2, target = case
    assert oracle_share(task, c1, c2, target) == _brute(task, c1, c2, target)


@settings(max_examples=200, deadline=None)
@given(levels(), st.randoms(use_true_random=False))
def test_no_order_of_re_routes_needs_fewer_than_the_oracle(case, rnd):
    from experiments.tabi_bound import share_in_order

    task, c1, c2, target = case
    order = list(range(len(c1)))
    rnd.shuffle(order)
    best, got = oracle_share(task, c1, c2, target), share_in_order(task, c1, c2, target, np.array(order))
    if best is None:  # no prefix adds more than every helpful query together
        assert got is None
    if got is not None:  # an order may also take queries level 2 answers worse: never fewer
        assert got >= best
        c = c1.copy()
        c[order[:got]] = c2[order[:got]]
        assert metric(task, c) >= target - 1e-9  # the prefix it counted does reach the target


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_the_learned_gate_ranks_a_separable_signal_first(seed):
    """fit_gate finds the one informative signal among noise: every query it should re-route
    scores above every one it should not."""
    from experiments.tabi_bound import fit_gate

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(200, 4))
    y = x[:, 2] > 0.5
    if y.all() or not y.any():
        return
    score = fit_gate(x, y)(x)
    assert score[y].min() > score[~y].max() - 1e-6 or np.mean(score[y][:, None] > score[~y][None, :]) > 0.99


@settings(max_examples=200, deadline=None)
@given(levels())
def test_knowing_where_the_levels_differ_is_between_the_oracle_and_all_that_differ(case):
    """A dispatcher that knows where the answers differ, not which is right, takes the
    differing queries in random orders: never fewer than the oracle, never more than differ,
    and always there when level 2 on every query reaches the target (taking all that differ
    is that)."""
    from experiments.tabi_bound import disagreement_share

    task, c1, c2, target = case
    differ = (c1 != c2).any(1)
    best, got = oracle_share(task, c1, c2, target), disagreement_share(task, c1, c2, target, differ, rounds=5)
    if metric(task, c2) >= target - 1e-9:
        assert got is not None
    if got is not None:
        assert best - 1e-9 <= got <= differ.sum() + 1e-9


def test_the_differing_queries_are_the_ones_whose_spans_or_labels_differ():
    from experiments.tabi_bound import differs

    reqs = [{"task": "classification"}, {"task": "classification"}, {"task": "tagging"}, {"task": "tagging"}]
    p1 = [1, 0, ["B-X", "I-X", "O"], ["B-X", "O", "O"]]
    p2 = [1, 2, ["B-X", "I-X", "O"], ["B-X", "I-X", "O"]]
    assert differs(reqs, p1, p2).tolist() == [False, True, False, True]


def test_not_knowing_which_level_is_right_costs_the_expected_extra_queries():
    """Two queries level 2 gets right, one it gets wrong, one it agrees on; level 1 needs one
    more right answer. The oracle takes 1; a random order of the three that differ takes 1 when
    a right one comes first (2/3) and all 3 otherwise: 5/3 expected."""
    from experiments.tabi_bound import disagreement_share

    c1 = np.array([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=float)
    c2 = np.array([[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]], dtype=float)
    differ = np.array([True, True, True, False])
    assert oracle_share("classification", c1, c2, 0.75) == 1
    got = disagreement_share("classification", c1, c2, 0.75, differ, rounds=3000)
    assert abs(got - 5 / 3) < 0.06


def test_costs_charge_level_1_to_a_signal_and_not_to_an_oracle(tmp_path):
    from experiments.tabi_bound import DIFFER, costs, figure

    signals = {"oracle": {"dev": 0.1, "test": 0.2}, DIFFER: {"dev": 0.3, "test": 0.5},
               "queries whose answers differ": {"dev": 0.4, "test": 0.6}, "random order": {"dev": 0.0, "test": 0.1},
               "level 2 better / worse (queries)": {"dev": [3, 1], "test": [4, 2]},
               "a": {"dev": 0.5, "test": 0.7}, "b": {"dev": 0.4, "test": 0.9}, "c": {"dev": None, "test": 0.1}}
    row = {"task": "t", "level1_cost": 0.6, "signals": signals}
    got = costs(row)
    assert got["level 1 alone"] is None  # level 1 alone does not reach the target: the oracle re-routes
    assert abs(got["oracle"] - (0.6 + 0.2 * 0.4)) < 1e-12
    assert abs(got[DIFFER] - (0.6 + 0.5 * 0.4)) < 1e-12
    assert got == {**got, "best signal on dev: b": 0.6 + 0.9}  # chosen on dev (0.4 < 0.5), charged on test
    figure({"tasks": [row, {**row, "task": "u"}]}, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_a_part_of_the_queries_is_scored_over_that_part():
    """benchmarks.tabi_bench's returned / re-routed split: accuracy over the part, not over all."""
    from runtime.level.queries import Queries
    from benchmarks.tabi_bench import part_metric

    q = Queries.__new__(Queries)
    q.kind, q.targets, q.ids = "classification", [0, 1, 1, 0], [[1]] * 4
    probs = [np.array([0.9, 0.1]), np.array([0.8, 0.2]), np.array([0.3, 0.7]), np.array([0.6, 0.4])]
    assert part_metric(q, [0, 1], probs) == 0.5 and part_metric(q, [2, 3], probs) == 1.0
    assert part_metric(q, [0, 1, 2, 3], probs) == q.score(probs) == 0.75
