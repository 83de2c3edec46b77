"""experiments.plot_recipe: a candidate replaces one PLOT-level recipe, for its process only."""

from runtime.construct import recipe as recipes

from experiments import plot_recipe


def test_a_candidate_replaces_its_plot_recipe_and_nothing_else(monkeypatch):
    monkeypatch.setattr(recipes, "PLOT", recipes.PLOT)  # restored after the test
    monkeypatch.setattr(recipes, "RECIPES", recipes.RECIPES)
    adapter, full = recipes.settings("adapter", "plot"), recipes.settings("lora", "full")
    assert recipes.settings("lora", "plot")[0]["rank"] == 8
    plot_recipe.patch(plot_recipe.CANDIDATES["lora16"][1])
    options, cfg = recipes.settings("lora", "plot")
    assert options["rank"] == 16 and set(options["targets"]) == set(recipes.ALL_TARGETS)
    assert (cfg.lr, cfg.dropout, cfg.lora_dropout, cfg.warmup) == (1e-3, 0.1, 0.1, 0.06)
    assert recipes.settings("adapter", "plot") == adapter
    assert recipes.settings("lora", "full") == full
    plot_recipe.patch(plot_recipe.CANDIDATES["adapter-drop"][1])
    options, cfg = recipes.settings("adapter", "plot")
    assert options == adapter[0] and cfg.dropout == 0.1 and cfg.lr == adapter[1].lr
