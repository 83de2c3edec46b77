"""tools.hmi_accuracy's reporting: the training-seed table and the gap it states."""

from tools.hmi_accuracy import TASKS, markdown, seed_spread

TASK_NAMES = list(TASKS)


def results(seeds):
    """Seed s scores dedicated 0.6 + s/100 and hPLM 0.5 on every task (gap 10 + s points)."""
    r = {"config": {"tasks": TASK_NAMES, "seed": 0}, "rows": {}, "seeds": {}, "alpha": {}, "distill": {}}
    for t in TASK_NAMES:
        r["rows"][t] = {"dedicated": {"score": 0.6}, "hplm": {"score": 0.5}}
        for s in seeds:
            for row, score in (("dedicated", 0.6 + s / 100), ("hplm", 0.5)):
                r["seeds"][f"{t}@{row}@{s}"] = {"task": t, "row": row, "seed": s, "score": score}
    return r


def test_seed_table_reports_the_mean_gap_and_each_seed():
    lines = seed_spread(results([1, 2]), TASK_NAMES)
    assert sum(line.startswith("| dedicated") for line in lines) == 3
    assert lines[-1] == ("Mean over 3 seeds: dedicated 61.0, hPLM 50.0, gap 11.0 points "
                         "(per seed: 10.0, 11.0, 12.0)")
    assert "Training seeds" in markdown(results([1, 2]))


def test_no_seed_table_without_a_second_complete_seed():
    assert seed_spread(results([]), TASK_NAMES) == []
    partial = results([1])
    del partial["seeds"][f"{TASK_NAMES[0]}@hplm@1"]  # seed 1 lacks a cell: not a comparable mean
    assert seed_spread(partial, TASK_NAMES) == []
