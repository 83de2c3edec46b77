"""experiments.early_exit: the cost of "exit at layer k, else the top" and its threshold choice."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import early_exit


class Task:
    """A classification task whose score is accuracy against test_y."""
    kind = "classification"

    def __init__(self, gold):
        self.test_y = gold

    def score(self, predicted):
        return sum(p == g for p, g in zip(predicted, self.test_y)) / len(self.test_y)


def logits(label, sure=5.0, n=3):
    z = torch.zeros(n)
    z[label] = sure
    return z


def test_an_exit_that_agrees_with_the_top_answers_everything_at_its_own_cost():
    gold = [0, 1, 2, 1]
    top = [logits(g) for g in gold]
    top_score, found = early_exit.cascades(Task(gold), {2: [logits(g) for g in gold]}, top, tolerance=0.0)
    assert top_score == 100.0
    assert found[2]["best"]["share"] == 1.0 and found[2]["best"]["cost"] == round(2 / 6, 3)
    assert found[2]["oracle_cost"] == round(2 / 6, 3) and found[2]["alone"] == 100.0


def test_a_confidently_wrong_exit_sends_everything_to_the_top():
    gold = [0, 1, 2, 1]
    wrong = [logits((g + 1) % 3, sure=20.0) for g in gold]
    _, found = early_exit.cascades(Task(gold), {3: wrong}, [logits(g) for g in gold], tolerance=0.5)
    assert found[3]["best"]["share"] == 0.0 and found[3]["best"]["cost"] == 1.0
    assert found[3]["oracle_cost"] == 1.0 and found[3]["alone"] == 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.floats(0.1, 8.0)), min_size=1, max_size=12),
       st.sampled_from([0.0, 1.0, 5.0]), st.integers(1, 5))
def test_the_chosen_cascade_stays_within_tolerance_and_costs_what_its_share_says(rows, tolerance, k):
    gold = [g for g, _, _ in rows]
    exits = [logits(e, sure) for _, e, sure in rows]
    task = Task(gold)
    top_score, found = early_exit.cascades(task, {k: exits}, [logits(g) for g in gold], tolerance)
    best = found[k]["best"]
    assert best is not None  # sending everything up (share 0) always qualifies
    assert best["score"] >= top_score - tolerance - 0.05
    assert abs(best["cost"] - (best["share"] * k / 6 + 1 - best["share"])) < 2e-3
    assert k / 6 - 1e-3 <= best["cost"] <= 1.0  # rounded to 3 places


def _task(top, exits):
    """A --joint results entry: exits {k: (dev cost, test score, test share, test cost, alone)}."""
    return {"dev": {"top": top, "exits": {k: {"best": {"cost": c, "threshold": 0.9, "score": top, "share": 0.5},
                                              "alone": a, "oracle_cost": c} for k, (c, _, _, _, a) in exits.items()}},
            "test": {"top": top, "exits": {k: {"score": s, "share": sh, "cost": tc, "alone": a}
                                           for k, (_, s, sh, tc, a) in exits.items()}}}


def test_the_report_takes_each_tasks_cheapest_exit_on_dev_and_its_test_figures():
    frozen = {"config": {"tolerance": 1.0},
              "chemprot": _task(60.0, {"2": (0.9, 59.0, 0.2, 0.87, 40.0), "3": (0.6, 59.5, 0.8, 0.6, 55.0)}),
              "sciie": _task(50.0, {"2": (0.4, 48.0, 0.9, 0.4, 47.0), "3": (0.5, 49.9, 1.0, 0.5, 49.9)})}
    joint = {"config": {"tolerance": 1.0}, "chemprot": _task(61.0, {"3": (0.5, 60.0, 1.0, 0.5, 60.0)})}
    got = early_exit.report(frozen, joint)
    rows = {r[0]: r for r in got["tables"][0]["rows"]}
    assert rows["chemprot"][1:6] == [60.0, "exit 3", 80.0, 0.5, 0.6]
    assert rows["sciie"][1:6] == [50.0, "exit 2", 90.0, 2.0, 0.4] and rows["sciie"][6:] == [""] * 5
    assert rows["chemprot"][6:] == [61.0, "exit 3", 100.0, 1.0, 0.5]
    assert rows["mean (2 / 1 tasks)"][1:] == [55.0, "", "", 1.25, 0.5, 61.0, "", "", 1.0, 0.5]
    assert got["frozen_cost_mean"] == 0.5 and got["joint_cost_mean"] == 0.5
