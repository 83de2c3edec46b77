"""experiments.router_bound: the share of tokens a router must send up for the cheap level to
come within a target of the top, against a recount from scratch, and the oracle that sends the
differing queries first never needs more than they hold."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import router_bound as exp


def _accuracy(s):
    return s[0] / s[1]


def _recount(order, tokens, st1, st2, points):
    """share_needed's answer recomputed from scratch for every prefix of the order."""
    top = _accuracy(st2.sum(0))
    for k in range(len(order) + 1):
        up = np.zeros(len(st1), dtype=bool)
        up[list(order[:k])] = True
        if _accuracy(np.where(up[:, None], st2, st1).sum(0)) >= top - points / 100 - 1e-12:
            return tokens[list(order[:k])].sum() / tokens.sum()
    return 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 30), st.sampled_from([0.0, 1.0, 5.0]))
def test_the_share_needed_is_the_first_prefix_within_the_target(seed, n, points):
    rng = np.random.default_rng(seed)
    cheap, top = rng.integers(0, 3, n), rng.integers(0, 3, n)
    gold = rng.integers(0, 3, n)
    st1 = np.stack([(cheap == gold).astype(float), np.ones(n)], axis=1)
    st2 = np.stack([(top == gold).astype(float), np.ones(n)], axis=1)
    tokens = rng.integers(3, 40, n).astype(float)
    order = rng.permutation(n)
    got = exp.share_needed(order, tokens, st1, st2, _accuracy, points)
    assert abs(got - _recount(order, tokens, st1, st2, points)) < 1e-9


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 25), st.sampled_from([0.0, 1.0]))
def test_the_oracle_needs_at_most_the_differing_queries_tokens(seed, n, points):
    """figures on random classification outputs: `differs` is the share of queries whose answers
    differ, and the oracle comes within the target once the differing queries went up."""
    rng = np.random.default_rng(seed)
    logits1, logits2 = rng.normal(size=(n, 3)) * 3, rng.normal(size=(n, 3)) * 3
    gold = rng.integers(0, 3, n)
    saved = SimpleNamespace(logits1=list(logits1), logits2={0.0: list(logits2)}, students=None,
                            tokens=rng.integers(3, 40, n), task="classification")
    q = SimpleNamespace(stats=lambda p, i: np.array([float(np.argmax(p) == gold[i]), 1.0]), metric=_accuracy)
    got = exp.figures(q, saved, {"1": 1.0, "2": 1.0}, "t", points)
    unlike = logits1.argmax(1) != logits2.argmax(1)
    assert set(got) == {"task", "plot"} and abs(got["plot"]["differs"] - unlike.mean()) < 1e-9
    held = saved.tokens[unlike].sum() / saved.tokens.sum()
    assert got["plot"]["oracle"] <= held + 1e-9
    if not unlike.any():
        assert got["plot"]["oracle"] == got["plot"]["confidence"] == 0.0


def test_the_table_names_each_level_and_task():
    rows = [{"task": "a", "plot": {"differs": 0.5, "confidence": 0.25, "oracle": 0.1}},
            {"task": "b", "plot": {"differs": 0.2, "confidence": 0.0, "oracle": 0.0},
             "students": {"differs": 0.9, "confidence": 1.0, "oracle": 0.75}}]
    head, body = exp.table(rows, 1.0)
    assert head[0].endswith("a / b") and "1 point" in head[2]
    assert body == [["students", "- / 90%", "- / 100%", "- / 75%", "- / -"],
                    ["PLOT level", "50% / 20%", "25% / 0%", "10% / 0%", "- / -"]]


def test_the_oracle_cascade_costs_the_cheap_level_plus_what_it_sends_up():
    """A dispatcher's cascade pays the cheap level on every query and the top on the sent-up
    share; one routed before running any level pays the top instead of the cheap level there;
    the mean takes each task's cheaper level."""
    n = 10
    logits1 = np.zeros((n, 2))
    logits1[:, 0] = 1.0
    logits2 = logits1.copy()
    logits2[:4] = logits2[:4, ::-1]  # the top answers 4 of 10 queries (of equal length) differently
    saved = SimpleNamespace(logits1=list(logits1), logits2={0.0: list(logits2)}, students=list(logits1),
                            tokens=np.full(n, 5), task="classification")
    gold = logits2.argmax(1)
    q = SimpleNamespace(stats=lambda p, i: np.array([float(np.argmax(p) == gold[i]), 1.0]), metric=_accuracy)
    got = exp.figures(q, saved, {"1": 1.0, "2": 1.0}, "t", 0.0, {"plot": 0.5, "students": 0.25})
    assert got["plot"]["oracle"] == 0.4 and abs(got["plot"]["cost"] - 0.9) < 1e-9
    assert abs(got["plot"]["before"] - (0.5 + 0.4 * 0.5)) < 1e-9
    assert abs(got["students"]["before"] - (0.25 + 0.4 * 0.75)) < 1e-9
    assert abs(exp.mean_before([got, got]) - 0.55) < 1e-9
    head, body = exp.table([got], 0.0)
    assert body[0][-1] == "0.65" and body[1][-1] == "0.90"
