"""experiments.selection_bar on saved outputs: every rule's dev choice is scored on test as the
profile scores a candidate, and a case misses by how far its test gap exceeds the target."""

from types import SimpleNamespace

import numpy as np

from experiments import selection_bar as exp
from test_level import _saved_classification


def queries(n):
    """Queries whose answer is class 0 (as _saved_classification's)."""
    return SimpleNamespace(stats=lambda p, q: np.array([float(np.argmax(p) == 0), 1.0]), metric=lambda s: s[0] / s[1])


def test_a_lucky_level_1_on_dev_misses_on_test_and_the_assured_rules_do_not():
    """On dev the PLOT level ties the top (each right on 30 of 40); on test it is 25 points behind:
    the plain rule keeps the PLOT level and misses by 25 - target; the assured rules, which see
    dev's resamples disagree, send everything to the top and miss nothing."""
    dev1 = [True] * 15 + [False] * 5 + [True] * 15 + [False] * 5
    dev2 = [True] * 15 + [True] * 5 + [False] * 5 + [True] * 10 + [False] * 5
    test1, test2 = [True] * 20 + [False] * 20, [True] * 30 + [False] * 10
    got = {"temps": {"1": 1.0, "2": 1.0}, "dev": (queries(40), _saved_classification(dev1, dev2)),
           "test": (queries(40), _saved_classification(test1, test2))}
    rows = {(r["rule"], r["target"]): r for r in exp.cases("t", got, [0.5, 2.0])}
    assert rows[("plain", 0.5)]["test_gap"] == 25.0 and rows[("plain", 0.5)]["miss"] == 24.5
    assert rows[("plain", 2.0)]["miss"] == 23.0
    for rule in ("assured", "bar"):
        assert rows[(rule, 0.5)]["miss"] == 0.0 and rows[(rule, 0.5)]["test_cost"] >= 1.0 - 1e-9
    table = {r[0]: r for r in exp.table(list(rows.values()), [0.5, 2.0])}
    plain, bar = table[exp.TITLES["plain"]], table[exp.TITLES["bar"]]
    assert plain[1] == 2 and plain[2] == "24.5" and bar[1] == 0


def test_only_the_tasks_cascade_bench_served_are_read(tmp_path):
    """A run's steps, settings and the experiments' own JSON (written there by default) are no
    tasks: a rerun reads the same tasks."""
    import json

    (tmp_path / "chemprot.json").write_text(json.dumps({"task": "chemprot", "served": {}}))
    (tmp_path / "chemprot.steps.json").write_text("{}")
    (tmp_path / "settings.json").write_text(json.dumps({"run": "r"}))
    (tmp_path / "selection_bar.json").write_text(json.dumps({"columns": [], "rows": [], "cases": []}))
    assert [task for task, _ in exp.task_results(tmp_path)] == ["chemprot"]
