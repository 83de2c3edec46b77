"""Candidate recipes for the PLOT-level PET, on dev: the harness's hplm (adapter) or hplm-lora
row, trained by `tenant create`'s code path with the candidate's recipe in place of the product's.

    python -m experiments.plot_recipe --run RUN --out OUT --candidate NAME [--tasks a,b]
    python -m experiments.plot_recipe --run RUN --out OUT --candidate NAME --eval-split test --extra-seeds 1,2
    python -m experiments.plot_recipe --report OUT [--write]     # the tables (benchmarks/results/plot_recipe.json)

RUN is a benchmarks.hmi_accuracy run with its store built (any split: no row is reused). OUT/NAME
gets a copy of it (segments and model weights hard-linked, benchmarks.cascade_bench.copy_store)
set to score dev (or, once a candidate is chosen there, test: OUT/NAME-test, with the harness's
extra training seeds), then benchmarks.hmi_accuracy runs the candidate's row there with
runtime.construct.recipe's PLOT table patched for this process only: OUT/NAME/results.json and
results.md hold the scores (resumable per task, as the harness's). Candidates (CANDIDATES):

  adapter        the adapter PLOT recipe (b=64, lr 2e-3, 10 epochs, warm-up 10%): the default before
                 lora16-2e-3
  adapter-drop   the same with BERT's dropout 0.1 in training (the full-depth recipe's rate)
  lora16         LoRA r16 (scale 2) on q,k,v,o,ffn_in,ffn_out of the upper layers with the
                 full-depth level's recipe: lr 1e-3, warm-up 6%, dropout 0.1, LoRA dropout 0.1
  lora16-2e-3    the same at lr 2e-3 (the default before lora16-u4)
  lora16-5e-3    the same at lr 5e-3 (the LoRA recipe's rate before)
  lora32-2e-3    lora16-2e-3 at rank 32 (the rank that put the full-depth level above full
                 fine-tuning on dev)
  lora16-e20     lora16-2e-3 trained 20 epochs instead of 10
  lora16-u5      lora16-2e-3 trained on inputs as served to unseen text at 0.5 instead of 0.3
                 (each backoff step taken with that probability, runtime.plot.unseen): the
                 tasks' training text is in the PLOT corpus, their dev and test text is not
  lora16-u4      the same at 0.4: the default (runtime.construct.recipe's PLOT["lora"])
  lora16-ln      lora16-u4 also training the upper layers' LayerNorm gains and shifts (as the
                 adapter does, Houlsby et al.): PLOT inputs are not distributed as the exact lower
                 layers' outputs the upper layers' LayerNorms were trained on
  lora16-v10     lora16-u4 with a fresh draw of backoffs for every epoch (10 draws, against 5
                 each seen twice: runtime.construct.manager.UNSEEN_VIEWS)
  lora16-st      lora16-u4 also learning the full-depth level's answers on up to 1,000 texts of
                 its domain corpus (self-training, tenant create --corpus: runtime.construct.pseudo)

The candidates are few on purpose: each is one change a reader can name, and the one chosen must
hold on tasks outside the suite, so nothing is tuned per task.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from types import MappingProxyType

from runtime.construct import recipe as recipes

LORA16 = dict(warmup=0.06, dropout=0.1, lora_dropout=0.1, rank=16, scale=2.0, targets=recipes.ALL_TARGETS)
# name -> (harness row, {PET type: recipe keywords} patched into the PLOT table[, further harness
# arguments: the training settings tenant create takes from its caller, not from the recipe[,
# {name: value} of runtime.construct.manager's module constants]])
CANDIDATES = {
    "adapter": ("hplm", {}),
    "adapter-drop": ("hplm", {"adapter": dict(lr=2e-3, dropout=0.1, bottleneck=64)}),
    "lora16": ("hplm-lora", {"lora": dict(lr=1e-3, **LORA16)}),
    "lora16-2e-3": ("hplm-lora", {"lora": dict(lr=2e-3, **LORA16)}),
    "lora16-5e-3": ("hplm-lora", {"lora": dict(lr=5e-3, **LORA16)}),
    "lora32-2e-3": ("hplm-lora", {"lora": dict(lr=2e-3, **(LORA16 | {"rank": 32}))}),
    "lora16-e20": ("hplm-lora", {"lora": dict(lr=2e-3, **LORA16)}, ("--epochs", "20")),
    "lora16-u5": ("hplm-lora", {"lora": dict(lr=2e-3, unseen=0.5, **LORA16)}),
    "lora16-u4": ("hplm-lora", {"lora": dict(lr=2e-3, unseen=0.4, **LORA16)}),
    "lora16-ln": ("hplm-lora", {"lora": dict(lr=2e-3, unseen=0.4, norms=("ln_attn", "ln_ffn"), **LORA16)}),
    "lora16-v10": ("hplm-lora", {"lora": dict(lr=2e-3, unseen=0.4, **LORA16)}, (), {"UNSEEN_VIEWS": 10}),
    "lora16-st": ("hplm-lora", {"lora": dict(lr=2e-3, unseen=0.4, **LORA16)}, ("--self-train",)),
}


TITLES = {
    "adapter": "adapter b=64, lr 2e-3 (the default before)",
    "adapter-drop": "the same + dropout 0.1",
    "lora16": "LoRA r16, six targets, lr 1e-3, dropout 0.1 + 0.1",
    "lora16-2e-3": "LoRA r16, lr 2e-3, unseen 0.3 (shipped before)",
    "lora16-5e-3": "the same at lr 5e-3",
    "lora32-2e-3": "the same at rank 32, lr 2e-3",
    "lora16-e20": "LoRA r16, lr 2e-3, 20 epochs",
    "lora16-u5": "LoRA r16, lr 2e-3, unseen 0.5",
    "lora16-u4": "LoRA r16, lr 2e-3, unseen 0.4 (the default)",
    "lora16-ln": "the same + the upper LayerNorms' gains and shifts",
    "lora16-v10": "LoRA r16, lr 2e-3, unseen 0.4, a fresh backoff draw every epoch",
    "lora16-st": "LoRA r16, lr 2e-3, unseen 0.4 + the full-depth level's answers on 1,000 domain texts (--corpus)",
}
TASKS = ("NCBI-disease", "sciie", "citation_intent", "chemprot", "bc5cdr", "sci-cite")
FIRST = TASKS[:3]  # every candidate ran these; the means of six need all six


def report(out: Path) -> dict:
    """The dev table of every candidate run under OUT: scores per task, the mean of the first
    three tasks and of all six (blank until a candidate has them), PET MiB (the first task's)."""
    rows = []
    for name in CANDIDATES:
        path = out / name / "results.json"
        if not path.exists():
            continue
        got = {t: cell for t, by in json.loads(path.read_text())["rows"].items() for cell in by.values()}
        if not all(t in got for t in FIRST):
            continue
        score = {t: round(100 * got[t]["score"], 1) for t in TASKS if t in got}
        mean3 = round(sum(100 * got[t]["score"] for t in FIRST) / 3, 1)
        mean6 = round(sum(100 * got[t]["score"] for t in TASKS) / 6, 1) if len(score) == 6 else ""
        mib = round(got[FIRST[0]]["pet_bytes"] / 2**20, 2)
        rows.append([TITLES[name], *(score.get(t, "") for t in TASKS), mean3, mean6, mib])
    columns = ["PLOT-level PET (dev, seed 0)", *TASKS, "mean of the first three", "mean of six", "PET MiB"]
    return {"tables": [{"columns": columns, "rows": rows}]}


# chosen on dev in turn and run on test; the last is the recipe of the goal's figure
TESTED = ("lora16-2e-3", "lora16-u4", "lora16-st")
CHOSEN = TESTED[-1]  # runtime.construct.recipe's PLOT["lora"] with tenant create --corpus


def seed_scores(path: Path, tasks) -> dict | None:
    """Per task the scores (%) of a test run over its seeds (seed 0 first); None without the run."""
    if not path.exists():
        return None
    got = json.loads(path.read_text())
    scores = {t: [100 * c["score"] for c in got["rows"].get(t, {}).values()] for t in tasks}
    for cell in got["seeds"].values():
        scores[cell["task"]].append(100 * cell["score"])
    return scores


def test_report(out: Path, accuracy: dict) -> dict | None:
    """The chosen candidate on test over the harness's training seeds (OUT/CHOSEN-test) against
    the adapter it replaced as the default (accuracy.json's three-seed PLOT-level rows: the same
    store, sample and seeds), beside the candidate chosen before it where that ran on test too;
    None until every task has every seed."""
    import statistics

    before = accuracy["three_seed_by_task"]
    tasks = [t for t in before if t != "mean of six"]
    seeds = len(before[tasks[0]]["plot_level"])
    runs = [(name, seed_scores(out / f"{name}-test" / "results.json", tasks)) for name in TESTED]
    runs = [(name, got) for name, got in runs if got and all(len(got[t]) == seeds for t in tasks)]
    if not runs or runs[-1][0] != CHOSEN:
        return None

    def cell(xs):
        return " / ".join(f"{x:.1f}" for x in xs)

    def means(scores):
        return [statistics.mean(scores[t][s] for t in tasks) for s in range(seeds)]

    scores = runs[-1][1]
    rows = []
    for t in tasks:
        gain = [round(a - b, 1) for a, b in zip(scores[t], before[t]["plot_level"])]
        rows.append([t, cell(before[t]["plot_level"]), *(cell(got[t]) for _, got in runs), cell(gain),
                     round(statistics.mean(gain), 1)])
    old = means({t: before[t]["plot_level"] for t in tasks})
    new = means(scores)
    rows.append(["mean of six", f"{cell(old)} ({statistics.mean(old):.1f})",
                 *(f"{cell(means(got))} ({statistics.mean(means(got)):.1f})" for _, got in runs),
                 cell(a - b for a, b in zip(new, old)), round(statistics.mean(new) - statistics.mean(old), 1)])
    columns = ["task (test)", "adapter (the default before), seeds 0 / 1 / 2",
               *(f"{TITLES[name]}, seeds 0 / 1 / 2" for name, _ in runs), "chosen − adapter per seed", "mean gain"]
    out = {"columns": columns, "rows": rows, "plot_level_mean": round(statistics.mean(new), 1),
           "plot_level_seed0": round(new[0], 1), "gain_mean": round(statistics.mean(new) - statistics.mean(old), 1)}
    if len(runs) > 1:
        out["previous_mean"] = round(statistics.mean(means(runs[-2][1])), 1)
        out["gain_over_previous"] = round(statistics.mean(new) - out["previous_mean"], 1)
    return out


def patch(changes: dict) -> None:
    """Replace PLOT-level recipes in runtime.construct.recipe, for this process."""
    plot = dict(recipes.PLOT)
    for pet_type, keywords in changes.items():
        plot[pet_type] = recipes._recipe(**keywords)
    recipes.PLOT = MappingProxyType(plot)
    recipes.RECIPES = MappingProxyType({"plot": recipes.PLOT, "full": recipes.FULL})


def prepare(run: Path, out: Path, split: str = "dev") -> None:
    """OUT/NAME as a copy of RUN's store and sample scoring `split` (nothing scored in it)."""
    from benchmarks.cascade_bench import copy_store

    if (out / "results.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    copy_store(run / "store", out / "store")
    shutil.copytree(run / "data", out / "data", dirs_exist_ok=True)
    results = json.loads((run / "results.json").read_text())
    results["config"]["eval_split"] = split
    for key in ("rows", "seeds", "alpha", "distill"):
        results[key] = {}
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--candidate", choices=sorted(CANDIDATES))
    p.add_argument("--report", type=Path, help="an OUT: print the dev table of its candidates (no training)")
    p.add_argument("--write", action="store_true", help="with --report: into benchmarks/results/plot_recipe.json")
    p.add_argument("--tasks", default="NCBI-disease,sciie,citation_intent")
    p.add_argument("--eval-split", choices=("dev", "test"), default="dev",
                   help="dev to choose; test to report the chosen candidate")
    p.add_argument("--extra-seeds", default="", help="the harness's further training seeds (e.g. 1,2)")
    args = p.parse_args(argv)
    if args.report:
        results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
        accuracy = json.loads((results / "accuracy.json").read_text())
        got = report(args.report)
        test = test_report(args.report, accuracy)
        if test:
            figures = {k: test.pop(k) for k in ("plot_level_mean", "plot_level_seed0", "gain_mean", "previous_mean",
                                                "gain_over_previous") if k in test}
            got["tables"].append(test)
            got["test"] = figures
        from benchmarks.bench_runtime import md_table

        print("\n\n".join(md_table(t["columns"], t["rows"]) for t in got["tables"]))
        if args.write:
            path = results / "plot_recipe.json"
            path.write_text(json.dumps(json.loads(path.read_text()) | got, indent=1, ensure_ascii=False) + "\n")
            if test:  # the goal's figure: the chosen PLOT-level recipe's three-seed test mean
                accuracy["plot_level_mean"] = got["test"]["plot_level_mean"]
                if "previous_mean" in got["test"]:  # tenant create's default (no --corpus)
                    accuracy["plot_level_mean_without_corpus"] = got["test"]["previous_mean"]
                (results / "accuracy.json").write_text(json.dumps(accuracy, indent=1, ensure_ascii=False) + "\n")
        return 0
    if not (args.run and args.out and args.candidate):
        p.error("--run, --out and --candidate are required (unless --report)")
    if not (args.run / "store" / "CURRENT").exists():
        p.error(f"{args.run} holds no harness store (run benchmarks.hmi_accuracy first)")
    row, changes, *more = CANDIDATES[args.candidate]
    harness_args, constants = (more[0] if more else ()), (more[1] if len(more) > 1 else {})
    patch(changes)
    from runtime.construct import manager

    for name, value in constants.items():
        assert hasattr(manager, name), name
        setattr(manager, name, value)
    out = args.out / (args.candidate + ("" if args.eval_split == "dev" else "-" + args.eval_split))
    prepare(args.run, out, args.eval_split)
    from benchmarks import hmi_accuracy

    config = json.loads((args.run / "results.json").read_text())["config"]
    hmi_accuracy.main(["--out", str(out), "--eval-split", args.eval_split, "--tasks", args.tasks, "--rows", row,
                       "--alpha-tasks", "", "--distill-tasks", "", "--extra-seeds", args.extra_seeds,
                       "--seed", str(config.get("seed", 0)), *harness_args])
    return 0


if __name__ == "__main__":
    sys.exit(main())
