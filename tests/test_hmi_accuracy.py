"""tools.hmi_accuracy's reporting: the training-seed table and the gap it states."""

from tools.hmi_accuracy import TASKS, changed_settings, markdown, seed_spread

TASK_NAMES = list(TASKS)


def results(seeds, wide_seeds=()):
    """Seed s scores dedicated 0.6 + s/100 and hPLM 0.5 on every task (gap 10 + s points); the
    wide hPLM row 0.55 under wide_seeds (seed 0 = the main table)."""
    r = {"config": {"tasks": TASK_NAMES, "seed": 0, "wide_bottleneck": 128}, "rows": {}, "seeds": {},
         "alpha": {}, "distill": {}}
    for t in TASK_NAMES:
        r["rows"][t] = {"dedicated": {"score": 0.6}, "hplm": {"score": 0.5}}
        if 0 in wide_seeds:
            r["rows"][t]["hplm-wide"] = {"score": 0.55}
        for s in seeds:
            cells = [("dedicated", 0.6 + s / 100), ("hplm", 0.5)] + [("hplm-wide", 0.55)] * (s in wide_seeds)
            for row, score in cells:
                r["seeds"][f"{t}@{row}@{s}"] = {"task": t, "row": row, "seed": s, "score": score}
    return r


def test_seed_table_reports_the_mean_gap_and_each_seed():
    lines = seed_spread(results([1, 2]), TASK_NAMES)
    assert sum(line.startswith("| dedicated") for line in lines) == 3
    assert lines[-1] == ("Mean over 3 seeds: dedicated 61.0, hPLM (domain PLOT + adapter) 50.0, gap 11.0 points "
                         "(per seed: 10.0, 11.0, 12.0)")
    assert "Training seeds" in markdown(results([1, 2]))


def test_a_second_hplm_row_gets_its_own_gap_once_it_has_every_seed():
    assert not any("bottleneck" in line for line in seed_spread(results([1, 2], wide_seeds=[0, 1]), TASK_NAMES))
    lines = seed_spread(results([1, 2], wide_seeds=[0, 1, 2]), TASK_NAMES)
    assert sum(line.startswith("| hPLM, adapter bottleneck 128 |") for line in lines) == 3
    assert lines[-1] == ("Mean over 3 seeds: dedicated 61.0, hPLM, adapter bottleneck 128 55.0, gap 6.0 points "
                         "(per seed: 5.0, 6.0, 7.0)")
    assert lines[-2].startswith("Mean over 3 seeds: dedicated 61.0, hPLM (domain PLOT + adapter) 50.0")
    # seed 2 lacks a cell of it: left out, the others keep their three seeds
    partial = results([1, 2], wide_seeds=[0, 1, 2])
    del partial["seeds"][f"{TASK_NAMES[-1]}@hplm-wide@2"]
    assert seed_spread(partial, TASK_NAMES) == seed_spread(results([1, 2]), TASK_NAMES)


def test_no_seed_table_without_a_second_complete_seed():
    assert seed_spread(results([]), TASK_NAMES) == []
    partial = results([1])
    del partial["seeds"][f"{TASK_NAMES[0]}@hplm@1"]  # seed 1 lacks a cell: not a comparable mean
    assert seed_spread(partial, TASK_NAMES) == []


def test_a_rerun_may_add_rows_but_not_change_settings():
    defaults = {"lr_adapter": 2e-3, "lower_layers": 3, "rows": "hplm"}
    saved = {"lr_adapter": 2e-3, "rows": "hplm"}  # made before --lower-layers existed
    assert changed_settings(saved, {"lr_adapter": 2e-3, "lower_layers": 3, "rows": "hplm,dedicated"}, defaults) == []
    assert changed_settings(saved, {"lr_adapter": 2e-3, "lower_layers": 2, "rows": "hplm"}, defaults) == ["lower_layers"]
    assert changed_settings(saved, {"lr_adapter": 5e-3, "lower_layers": 3, "rows": "hplm"}, defaults) == ["lr_adapter"]
