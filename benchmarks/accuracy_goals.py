"""The accuracy goals' figures for benchmarks/results/accuracy.json, computed from run outputs.

    python -m benchmarks.accuracy_goals OUT0 OUT1 OUT2 [--results benchmarks/results/accuracy.json]

OUTs are runs of ``experiments.full_depth --eval-split test --rows fd-lora --seed S`` (one
training seed each, the harness's data sample: ``--data-seed 0``); the dedicated row per task
and seed is the harness's (``three_seed_by_task`` in the results file: the same sample, same
code, so a rerun reproduces it, e.g. NCBI-disease seed 0: 67.6 both times). Adds to the file:

* ``top``: the full-depth level (the top of a tenant's cascade) per task and seed, its six-task
  means, each task's gap to dedicated (dedicated minus top: positive when the top is below)
  and the PET's share of the encoder's bytes;
* ``top_gap_to_dedicated_mean`` (the mean over seeds of the six-task gap) and
  ``top_gap_to_dedicated_by_task`` (per task, over seeds);
* ``auto_gap_to_top_mean`` and ``auto_cost_vs_top`` are not this program's: benchmarks.cascade_bench
  (``--write-results``) measures the cascade through ``hkstore serve`` and adds them.

The table it prints is the BENCHMARKS section's (benchmarks.claims checks them against each
other). With ``--pareto DEV_OUT`` (an ``experiments.full_depth`` run on dev with several rows) it
writes the size table instead (further dev runs of fd-* rows add theirs: LoRA ranks, adapter
sizes, diff densities, the recipe as shipped): each PET's bytes and share of the encoder against its six-task
gap to dedicated and its worst task (benchmarks/results/accuracy_full_depth.json). Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = "fd-lora"


def top_scores(outs: list[Path]) -> dict:
    """seed -> {task: (score in points, PET share of the encoder)} from full_depth runs."""
    found = {}
    for out in outs:
        results = json.loads((out / "results.json").read_text())
        config = results["config"]
        if config.get("eval_split") != "test" or config.get("data_seed", 0) != 0:
            raise SystemExit(f"{out}: not a test-split run on the harness's sample (--eval-split test --data-seed 0)")
        if config["seed"] in found:
            raise SystemExit(f"{out}: a second run of training seed {config['seed']}")
        found[config["seed"]] = {task: (100 * rows[ROW]["score"], rows[ROW]["pet_share_of_encoder"])
                                 for task, rows in results["rows"].items() if ROW in rows}
    return found


def figures(accuracy: dict, found: dict) -> dict:
    tasks = accuracy["tasks"]
    seeds = sorted(found)
    dedicated = accuracy["three_seed_by_task"]
    by_task, gaps_by_seed = {}, {s: [] for s in seeds}
    for task in tasks:
        if not all(task in found[s] for s in seeds):
            raise SystemExit(f"task {task} is missing from a run")
        top = [round(found[s][task][0], 1) for s in seeds]
        ded = [dedicated[task]["dedicated"][s] for s in seeds]
        gap = [round(d - t, 1) for d, t in zip(ded, top)]
        for s, g in zip(seeds, gap):
            gaps_by_seed[s].append(g)
        by_task[task] = {"dedicated": ded, "top": top, "gap": gap, "gap_mean": round(statistics.mean(gap), 1)}
    top_means = [round(statistics.mean(by_task[t]["top"][j] for t in tasks), 1) for j in range(len(seeds))]
    ded_means = [round(statistics.mean(by_task[t]["dedicated"][j] for t in tasks), 1) for j in range(len(seeds))]
    share = max(found[s][t][1] for s in seeds for t in tasks)
    gap_mean = round(statistics.mean(d - t for d, t in zip(ded_means, top_means)), 1)
    return {"seeds": seeds, "by_task": by_task, "top_means": top_means, "dedicated_means": ded_means,
            "top_mean": round(statistics.mean(top_means), 1), "dedicated_mean": round(statistics.mean(ded_means), 1),
            "pet_share_of_encoder_max": round(100 * share, 2),
            "met": gap_mean <= 0 and all(v["gap_mean"] <= 1.0 for v in by_task.values()) and share <= 0.05,
            "gap_mean": gap_mean}


def table(accuracy: dict, top: dict) -> dict:
    seeds = " / ".join(str(s) for s in top["seeds"])
    rows = [[task, " / ".join(f"{x:.1f}" for x in v["dedicated"]), " / ".join(f"{x:.1f}" for x in v["top"]),
             " / ".join(f"{x:.1f}" for x in v["gap"]), v["gap_mean"]] for task, v in top["by_task"].items()]
    rows.append(["mean of six", " / ".join(f"{x:.1f}" for x in top["dedicated_means"]) + f" ({top['dedicated_mean']})",
                 " / ".join(f"{x:.1f}" for x in top["top_means"]) + f" ({top['top_mean']})", "", top["gap_mean"]])
    return {"columns": ["task (test)", f"dedicated, seeds {seeds}", f"full-depth LoRA r16, seeds {seeds}",
                        "gap per seed", "mean gap"], "rows": rows}


PARETO = {  # experiments.full_depth row -> what it is
    "dedicated": "every weight (full fine-tuning)",
    "fd-lora": "full-depth LoRA r16, six targets, layers 0-5",
    "fd-adapter": "full-depth adapter b64 + LayerNorm deltas, layers 0-5",
    "upper-lora": "upper LoRA r16, six targets, layers 3-5, exact lower layers",
    "upper-lora8": "upper LoRA r8, q and v, layers 3-5, exact lower layers (lr 5e-3)",
    "upper-adapter": "upper adapter b64, layers 3-5, exact lower layers (lr 1e-3)",
}


def _lr(cfg, key="lr") -> str:
    return f"{cfg[key]:.0e}".replace("e-0", "e-")


def _size_rows(results: dict, first: bool) -> list[tuple[str, str, int, dict]]:
    """(title, group, bytes as stored, {task: score}) of a full_depth run's rows. The first run
    contributes every PARETO row; further runs (other ranks, sizes, densities) their fd-* rows."""
    rows, cfg = results["rows"], results["config"]
    tasks = list(rows)
    found = []
    for row in dict.fromkeys(r for t in tasks for r in rows[t]):
        if not all(row in rows[t] for t in tasks) or (not first and not row.startswith("fd-")):
            continue
        if row not in PARETO and not row.startswith("fd-"):
            continue
        cell = rows[tasks[0]][row]
        scores = {t: rows[t][row]["score"] for t in tasks}
        if row == "dedicated":
            found.append((PARETO[row], row, results["encoder_bytes"], scores))
        elif row == "fd-diff":  # one trained delta, kept at several densities (int32 index + fp16 value)
            for d, by in cell["by_density"].items():
                title = f"full-depth diff {100 * float(d):g}%, six targets, layers 0-5, lr {_lr(cfg, 'lr_diff')}"
                found.append((title, row, by["pet_bytes_stored"], {t: rows[t][row]["by_density"][d]["score"]
                                                                   for t in tasks}))
                if "retrained_score" in by:
                    found.append((f"{title}, + {cfg['retrain_epochs']} epochs on the kept entries", row,
                                  by["retrained_bytes_stored"],
                                  {t: rows[t][row]["by_density"][d]["retrained_score"] for t in tasks}))
        else:
            size = cell["pet_bytes_no_head"]
            if row.startswith("fd-"):  # tenant create stores a full-depth PET's layer tensors in fp16
                size //= 2
            if row == "fd-lora" and not first:
                title = (f"full-depth LoRA r{cfg['rank']}, six targets, layers 0-5, lr {_lr(cfg)}, "
                         f"dropout {cfg.get('dropout', 0.0):g}")
            elif row == "fd-adapter" and not first:
                title = f"full-depth adapter b{cfg['bottleneck']} + LayerNorm deltas, layers 0-5, lr {_lr(cfg)}"
            else:
                title = PARETO[row]
            found.append((title, row, size, scores))
    return found


GROUPS = ("dedicated", "fd-lora", "fd-adapter", "fd-diff")  # then the upper-only rows


def pareto(out: Path, more: list[Path] = ()) -> dict:
    """The size table of a dev run: PET bytes as stored (without the head; a full-depth PET's
    in fp16, a diff's index in int32, the rest fp32) against the gap to dedicated.
    more: further dev runs of fd-* rows (LoRA ranks, adapter sizes, diff densities, the recipe
    as shipped), scored against out's dedicated row on the same sample. When more holds
    fd-lora rows, they stand for out's (the recipe as shipped)."""
    results = json.loads((out / "results.json").read_text())
    rows, encoder = results["rows"], results["encoder_bytes"]
    tasks = [t for t in rows if "dedicated" in rows[t]]
    found = _size_rows(results, True)
    extra = [r for m in more for r in _size_rows(json.loads((m / "results.json").read_text()), False)]
    if any(group == ROW for _, group, _, _ in extra):
        found = [f for f in found if f[1] != ROW]
    found += extra
    order = {g: i for i, g in enumerate(GROUPS)}
    found.sort(key=lambda f: (order.get(f[1], len(GROUPS)), f[2] if f[1] in order else list(PARETO).index(f[1])))
    table = []
    for title, row, size, scores in found:
        if not all(t in scores for t in tasks):
            continue
        gaps = {t: round(100 * (rows[t]["dedicated"]["score"] - scores[t]), 1) for t in tasks}
        mean = round(statistics.mean(100 * scores[t] for t in tasks), 1)
        worst = max(gaps, key=gaps.get)
        table.append([title, size, round(100 * size / encoder, 2), mean, round(statistics.mean(gaps.values()), 1),
                      "–" if row == "dedicated" else f"{worst} {gaps[worst]}"])
    return {"config": {k: results["config"][k] for k in ("eval_split", "seed", "max_train", "max_test", "max_len")
                       if k in results["config"]},
            "encoder_bytes": encoder, "tasks": tasks,
            "tables": [{"columns": ["PET (dev, seed 0)", "bytes as stored", "% of the encoder", "six-task mean",
                                    "gap to dedicated", "worst task (gap)"], "rows": table}]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path, help="experiments.full_depth output directories (test split)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "accuracy.json")
    p.add_argument("--pareto", action="store_true",
                   help="OUTS[0] is a dev run: write the size table; further OUTS add their fd-* rows")
    args = p.parse_args(argv)
    if args.pareto:
        path = args.results.parent / "accuracy_full_depth.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        new = old | pareto(args.outs[0], args.outs[1:])
        path.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n")
        for r in new["tables"][0]["rows"]:
            print("| " + " | ".join(str(c) for c in r) + " |")
        return 0
    accuracy = json.loads(args.results.read_text())
    top = figures(accuracy, top_scores(args.outs))
    accuracy["top"] = top
    accuracy["top_gap_to_dedicated_mean"] = top["gap_mean"]
    accuracy["top_gap_to_dedicated_by_task"] = {t: v["gap_mean"] for t, v in top["by_task"].items()}
    tables = [t for t in accuracy["tables"] if t["columns"][0] != "task (test)" or "full-depth" not in t["columns"][2]]
    accuracy["tables"] = tables + [table(accuracy, top)]
    args.results.write_text(json.dumps(accuracy, indent=1, ensure_ascii=False) + "\n")
    t = accuracy["tables"][-1]
    print("| " + " | ".join(t["columns"]) + " |")
    print("| " + " | ".join("---" for _ in t["columns"]) + " |")
    for r in t["rows"]:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print(f"top gap to dedicated (mean over seeds): {top['gap_mean']}; goal met: {top['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
