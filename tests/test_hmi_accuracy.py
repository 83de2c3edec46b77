"""benchmarks.hmi_accuracy's reporting: the training-seed table and the gap it states."""

from benchmarks.hmi_accuracy import TASKS, changed_settings, markdown, seed_spread

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
    # Before any row is scored only the store's settings are fixed: training ones may change.
    assert changed_settings(saved, {"lr_adapter": 5e-3, "lower_layers": 3}, defaults, scored=False) == []
    assert changed_settings(saved, {"lr_adapter": 5e-3, "lower_layers": 2}, defaults, scored=False) == ["lower_layers"]


def _suite(tmp_path):
    """A two-task suite in the shared data's layout; train repeats one test sentence."""
    import json

    cls = tmp_path / "scibert" / "text_classification" / "citation_intent"
    ner = tmp_path / "scibert" / "ner" / "NCBI-disease"
    cls.mkdir(parents=True)
    ner.mkdir(parents=True)
    rows = {"train": ["we use the method of", "results follow prior work", "a test sentence seen twice"],
            "dev": ["a dev sentence here"], "test": ["a test sentence seen twice", "another test line"]}
    for split, texts in rows.items():
        (cls / f"{split}.txt").write_text("".join(json.dumps({"text": t, "label": "x"}) + "\n" for t in texts))
        words = {"train": "the gene mutation", "dev": "dev disease words", "test": "test disease words"}[split]
        (ner / f"{split}.txt").write_text("".join(f"{w} O\n" for w in words.split()) + "\n")
    general = tmp_path / "wikitext-2" / "valid.txt"
    general.parent.mkdir()
    general.write_text(" = Heading = \n\n A general paragraph of text . \n")
    (general.parent / "test.txt").write_text(" held out general text \n")
    return tmp_path / "scibert"


def test_no_evaluation_text_enters_a_plot_corpus(tmp_path):
    import argparse

    from benchmarks.hmi_accuracy import general_text, prepare_data

    data = _suite(tmp_path)
    args = argparse.Namespace(tasks=["citation_intent", "NCBI-disease"], data=str(data), max_train=10, max_test=10,
                              max_domain_docs=10, seed=0, eval_split="dev",
                              general=str(tmp_path / "wikitext-2" / "valid.txt"))
    out = prepare_data(args, tmp_path / "out")
    corpora = {k: open(p).read().splitlines() for k, p in out["corpora"].items()}
    everything = [line for lines in corpora.values() for line in lines]
    for held in ("a dev sentence here", "a test sentence seen twice", "another test line", "dev disease words",
                 "test disease words", "held out general text"):
        assert held not in everything
    assert "we use the method of" in corpora["root"] and "the gene mutation" in corpora["root"]
    assert "A general paragraph of text ." in corpora["root"] and not any("Heading" in x for x in everything)
    assert out["dropped_eval_lines"]["root"] == 1 and out["dropped_eval_lines"]["cs"] == 1
    assert open(out["tasks"]["citation_intent"]["eval"]).read().count("a dev sentence here") == 1
    assert general_text(tmp_path / "wikitext-2" / "valid.txt") == ["A general paragraph of text ."]


def test_coverage_table_in_the_markdown():
    r = results([])
    r["coverage"] = {"x@root": {"text": "citation_intent (dev)", "version": "root", "windows": 1200, "exact": 0.25,
                                "by_order": {"3": 0.2, "2": 0.5, "1": 0.3}}}
    md = markdown(r)
    assert "| citation_intent (dev) | root | 1,200 | 20.0 | 50.0 | 30.0 | 25.0 |" in md


def test_tune_parses_grids_and_refuses_a_test_run(tmp_path):
    import json

    import pytest

    from experiments.hmi_tune import main, parse_grid, point_key

    assert parse_grid(["lr-full=5e-5,1e-4", "epochs_full=3"]) == {"lr_full": [5e-5, 1e-4], "epochs_full": [3]}
    assert point_key("dedicated", {"lr_full": 1e-4, "epochs_full": 3}) == "dedicated@epochs_full=3,lr_full=0.0001"
    for bad in (["lower_layers=2"], ["epochs=three"], ["lr_full"]):
        with pytest.raises(SystemExit):
            parse_grid(bad)
    (tmp_path / "results.json").write_text(json.dumps({"config": {"eval_split": "test", "tasks": ["x"]}}))
    with pytest.raises(SystemExit, match="dev only"):
        main(["--run", str(tmp_path), "--row", "dedicated", "--grid", "lr_full=1e-4"])
