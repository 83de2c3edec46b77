"""Candidate recipes for the PLOT-level PET, on dev: the harness's hplm (adapter) or hplm-lora
row, trained by `tenant create`'s code path with the candidate's recipe in place of the shipped one.

    python -m experiments.plot_recipe --run RUN --out OUT --candidate NAME [--tasks a,b]

RUN is a benchmarks.hmi_accuracy run with its store built (any split: no row is reused). OUT/NAME
gets a copy of it (segments and model weights hard-linked, benchmarks.cascade_bench.copy_store)
set to score dev, then benchmarks.hmi_accuracy runs the candidate's row there with
runtime.construct.recipe's PLOT table patched for this process only: OUT/NAME/results.json and
results.md hold the scores (resumable per task, as the harness's). Candidates (CANDIDATES):

  adapter        the shipped PLOT recipe (adapter b=64, lr 2e-3, 10 epochs, warm-up 10%)
  adapter-drop   the same with BERT's dropout 0.1 in training (the full-depth recipe's rate)
  lora16         LoRA r16 (scale 2) on q,k,v,o,ffn_in,ffn_out of the upper layers with the
                 full-depth level's recipe: lr 1e-3, warm-up 6%, dropout 0.1, LoRA dropout 0.1
  lora16-2e-3    the same at lr 2e-3
  lora16-5e-3    the same at lr 5e-3 (the shipped LoRA recipe's rate)

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
CANDIDATES = {  # name -> (harness row, {PET type: recipe keywords}) patched into the PLOT table
    "adapter": ("hplm", {}),
    "adapter-drop": ("hplm", {"adapter": dict(lr=2e-3, dropout=0.1, bottleneck=64)}),
    "lora16": ("hplm-lora", {"lora": dict(lr=1e-3, **LORA16)}),
    "lora16-2e-3": ("hplm-lora", {"lora": dict(lr=2e-3, **LORA16)}),
    "lora16-5e-3": ("hplm-lora", {"lora": dict(lr=5e-3, **LORA16)}),
}


def patch(changes: dict) -> None:
    """Replace PLOT-level recipes in runtime.construct.recipe, for this process."""
    plot = dict(recipes.PLOT)
    for pet_type, keywords in changes.items():
        plot[pet_type] = recipes._recipe(**keywords)
    recipes.PLOT = MappingProxyType(plot)
    recipes.RECIPES = MappingProxyType({"plot": recipes.PLOT, "full": recipes.FULL})


def prepare(run: Path, out: Path) -> None:
    """OUT/NAME as a dev-scoring copy of RUN's store and sample (nothing scored in it)."""
    from benchmarks.cascade_bench import copy_store

    if (out / "results.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    copy_store(run / "store", out / "store")
    shutil.copytree(run / "data", out / "data", dirs_exist_ok=True)
    results = json.loads((run / "results.json").read_text())
    results["config"]["eval_split"] = "dev"
    for key in ("rows", "seeds", "alpha", "distill"):
        results[key] = {}
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--candidate", required=True, choices=sorted(CANDIDATES))
    p.add_argument("--tasks", default="NCBI-disease,sciie,citation_intent")
    args = p.parse_args(argv)
    if not (args.run / "store" / "CURRENT").exists():
        p.error(f"{args.run} holds no harness store (run benchmarks.hmi_accuracy first)")
    row, changes = CANDIDATES[args.candidate]
    patch(changes)
    out = args.out / args.candidate
    prepare(args.run, out)
    from benchmarks import hmi_accuracy

    config = json.loads((args.run / "results.json").read_text())["config"]
    hmi_accuracy.main(["--out", str(out), "--eval-split", "dev", "--tasks", args.tasks, "--rows", row,
                       "--alpha-tasks", "", "--distill-tasks", "", "--extra-seeds", "", "--seed", str(config.get("seed", 0))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
