"""experiments.plot_recipe: a candidate replaces one PLOT-level recipe, for its process only."""

from runtime.construct import recipe as recipes

from experiments import plot_recipe


def test_a_candidate_replaces_its_plot_recipe_and_nothing_else(monkeypatch):
    monkeypatch.setattr(recipes, "PLOT", recipes.PLOT)  # restored after the test
    monkeypatch.setattr(recipes, "RECIPES", recipes.RECIPES)
    adapter, full = recipes.settings("adapter", "plot"), recipes.settings("lora", "full")
    assert recipes.settings("lora", "plot")[0]["rank"] == recipes.PLOT["lora"].options["rank"]
    plot_recipe.patch(plot_recipe.CANDIDATES["lora16"][1])
    options, cfg = recipes.settings("lora", "plot")
    assert options["rank"] == 16 and set(options["targets"]) == set(recipes.ALL_TARGETS)
    assert (cfg.lr, cfg.dropout, cfg.lora_dropout, cfg.warmup) == (1e-3, 0.1, 0.1, 0.06)
    assert recipes.settings("adapter", "plot") == adapter
    assert recipes.settings("lora", "full") == full
    plot_recipe.patch(plot_recipe.CANDIDATES["adapter-drop"][1])
    options, cfg = recipes.settings("adapter", "plot")
    assert options == adapter[0] and cfg.dropout == 0.1 and cfg.lr == adapter[1].lr


def test_the_report_gives_a_mean_of_six_only_to_candidates_with_all_six(tmp_path):
    import json

    def run(name, scores):
        (tmp_path / name).mkdir()
        rows = {t: {"hplm": {"score": s / 100, "pet_bytes": 2**20}} for t, s in scores.items()}
        (tmp_path / name / "results.json").write_text(json.dumps({"rows": rows}))

    run("adapter", dict(zip(plot_recipe.TASKS, (40, 20, 60, 50, 50, 70))))
    run("lora16", dict(zip(plot_recipe.FIRST, (43, 23, 63))))
    run("lora16-5e-3", {"NCBI-disease": 10.0})  # not the first three: left out
    rows = plot_recipe.report(tmp_path)["tables"][0]["rows"]
    assert [r[0] for r in rows] == [plot_recipe.TITLES["adapter"], plot_recipe.TITLES["lora16"]]
    assert rows[0][7:] == [40.0, 48.3, 1.0]
    assert rows[1][4:7] == ["", "", ""] and rows[1][7:] == [43.0, "", 1.0]


def test_the_test_report_waits_for_every_seed_then_compares_seed_by_seed(tmp_path):
    import json

    accuracy = {"three_seed_by_task": {"a": {"plot_level": [50.0, 52.0]}, "b": {"plot_level": [30.0, 28.0]},
                                       "mean of six": {}}}
    run = tmp_path / f"{plot_recipe.CHOSEN}-test"
    run.mkdir()
    rows = {"a": {"hplm-lora": {"score": 0.55}}, "b": {"hplm-lora": {"score": 0.33}}}
    seeds = {"a@hplm-lora@1": {"task": "a", "seed": 1, "score": 0.56}}
    (run / "results.json").write_text(json.dumps({"rows": rows, "seeds": seeds}))
    assert plot_recipe.test_report(tmp_path, accuracy) is None  # b has one seed of two
    seeds["b@hplm-lora@1"] = {"task": "b", "seed": 1, "score": 0.29}
    (run / "results.json").write_text(json.dumps({"rows": rows, "seeds": seeds}))
    got = plot_recipe.test_report(tmp_path, accuracy)
    by = {r[0]: r for r in got["rows"]}
    assert by["a"][1:] == ["50.0 / 52.0", "55.0 / 56.0", "5.0 / 4.0", 4.5]
    assert by["b"][3:] == ["3.0 / 1.0", 2.0]
    assert by["mean of six"][4] == 3.2 and got["plot_level_mean"] == 43.2 and got["gain_mean"] == 3.2


def test_the_test_report_puts_the_candidate_shipped_before_beside_the_chosen_one(tmp_path):
    import json

    accuracy = {"three_seed_by_task": {"a": {"plot_level": [50.0, 52.0]}, "mean of six": {}}}

    def run(name, s0, s1):
        (tmp_path / f"{name}-test").mkdir()
        (tmp_path / f"{name}-test" / "results.json").write_text(json.dumps(
            {"rows": {"a": {"hplm-lora": {"score": s0}}}, "seeds": {"a@1": {"task": "a", "seed": 1, "score": s1}}}))

    run(plot_recipe.TESTED[0], 0.54, 0.55)
    assert plot_recipe.test_report(tmp_path, accuracy) is None  # the chosen one has not run on test
    run(plot_recipe.CHOSEN, 0.57, 0.56)
    got = plot_recipe.test_report(tmp_path, accuracy)
    assert got["rows"][0][1:] == ["50.0 / 52.0", "54.0 / 55.0", "57.0 / 56.0", "7.0 / 4.0", 5.5]
    assert got["gain_mean"] == 5.5 and got["gain_over_previous"] == 2.0 and got["plot_level_mean"] == 56.5
