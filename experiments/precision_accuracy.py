"""Points lost by serving the full-depth level in bf16, on trained PETs, and what the
per-tenant choice (bf16 only where dev shows it loses at most --tolerance points) keeps.

Each seed directory holds the PETs `experiments.full_depth --rows fd-lora --save-pets --seed S`
trained; every PET is served as full rows through the CPU executor twice, forced fp32 and forced
bf16 (runtime.exec.precision), on the harness's dev and test samples (600 / 400, max-len 64,
data seed 0). The precision a tenant gets is chosen on dev, as `levels profile --dev` chooses
it; the test columns report it.

    python -m experiments.precision_accuracy --out OUT RUN0/pets RUN1/pets RUN2/pets

Results after every (seed, task) in OUT/precision-accuracy.json (resumable) and a markdown table
on stdout; --write writes benchmarks/results/precision_accuracy.json with max_points_lost (the
worst task's mean test loss over seeds at the chosen precision) and bf16_points_lost (the same
with bf16 for every tenant), and merges max_points_lost into benchmarks/results/precision.json.

The held-out check runs a task outside the suite (experiments.heldout_task writes it; its PETs
come from experiments.full_depth --data ROOT --tasks NAME) with the same --data and --tasks:

    python -m experiments.precision_accuracy --out OUT --data ROOT --tasks NAME RUN0/pets ... --write

and its --write adds the task's numbers under "held_out" in precision_accuracy.json, leaving the
suite's claims (and precision.json) as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hmi_accuracy import HELD_OUT
from experiments.int8_accuracy import TASK_ORDER, load_full_pets, score_full

SPLITS = ("dev", "test")
SECTION = "bf16 against fp32 on the six tasks"
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                       "precision_accuracy.json")


def tasks_of(names, encoder, out, split, data=None) -> dict:
    """{task: benchmarks.hmi_accuracy.Task} of the harness's sample of `split` (as the PETs' training run)."""
    from pathlib import Path

    from benchmarks.hmi_accuracy import SCIBERT, Task, prepare_data

    hargs = argparse.Namespace(tasks=list(names), data=data or str(SCIBERT), max_train=600, max_test=400, seed=0,
                               eval_split=split, max_domain_docs=0, general="")
    sampled = prepare_data(hargs, Path(out) / split)
    return {name: Task(name, sampled["tasks"][name], encoder, 64) for name in names}


def chosen(dev: dict, tolerance: float) -> str:
    return "bf16" if dev["fp32"]["score"] - dev["bf16"]["score"] <= tolerance else "fp32"


def summary(results: dict, tolerance: float) -> dict:
    """Per task over seeds: test fp32, bf16, chosen; mean losses; the claims."""
    rows, lost_chosen, lost_bf16 = {}, {}, {}
    for task in TASK_ORDER + tuple(HELD_OUT):
        runs = [results[seed][task] for seed in sorted(results) if task in results[seed]]
        if not runs:
            continue
        per = [{"fp32": r["test"]["fp32"]["score"], "bf16": r["test"]["bf16"]["score"],
                "choice": chosen(r["dev"], tolerance)} for r in runs]
        for p in per:
            p["chosen"] = p[p["choice"]]
        rows[task] = per
        lost_chosen[task] = sum(p["fp32"] - p["chosen"] for p in per) / len(per)
        lost_bf16[task] = sum(p["fp32"] - p["bf16"] for p in per) / len(per)
    return {"rows": rows, "lost_chosen": lost_chosen, "lost_bf16": lost_bf16,
            "max_points_lost": round(max(lost_chosen.values()), 2) if lost_chosen else None,
            "bf16_points_lost": round(max(lost_bf16.values()), 2) if lost_bf16 else None}


def table(results: dict, tolerance: float) -> dict:
    """The per-task table (claims format: columns, rows of cells as BENCHMARKS shows them)."""
    s = summary(results, tolerance)
    seeds = " / ".join(sorted(results))
    columns = ["task (test)", f"fp32, {seeds}", f"bf16, {seeds}", "chosen on dev", "bf16 - fp32 (mean)",
               "chosen - fp32 (mean)"]
    rows = []
    for task, per in s["rows"].items():
        cells = [" / ".join(f"{p[k]:.2f}" for p in per) for k in ("fp32", "bf16")]
        rows.append([task, *cells, " / ".join(p["choice"] for p in per),
                     f"{round(-s['lost_bf16'][task], 2) + 0.0:+.2f}", f"{round(-s['lost_chosen'][task], 2) + 0.0:+.2f}"])
    return {"columns": columns, "rows": rows}


def held_out(results: dict, tolerance: float, task: str) -> dict:
    """The held-out task's numbers per seed (lists, in seed order) and its mean test losses."""
    s = summary(results, tolerance)
    seeds = [seed for seed in sorted(results) if task in results[seed]]
    per = s["rows"][task]
    return {"task": task, "seeds": seeds, "tolerance": tolerance,
            "dev_fp32": [round(results[seed][task]["dev"]["fp32"]["score"], 2) for seed in seeds],
            "dev_bf16": [round(results[seed][task]["dev"]["bf16"]["score"], 2) for seed in seeds],
            "test_fp32": [round(p["fp32"], 2) for p in per], "test_bf16": [round(p["bf16"], 2) for p in per],
            "chosen": [p["choice"] for p in per],
            "points_lost_chosen": round(s["lost_chosen"][task], 2) + 0.0,
            "points_lost_bf16": round(s["lost_bf16"][task], 2) + 0.0}


def claims_file(saved: dict, run: dict, t: dict, s: dict, held: dict | None = None) -> dict:
    """precision_accuracy.json's new contents: the suite's claims (keeping a saved held-out
    record), or, for a held-out task, the saved claims with its record beside them."""
    if held is not None:
        return saved | {"held_out": held | run}
    claims = {"section": SECTION, **run, "tables": [t], "max_points_lost": s["max_points_lost"],
              "bf16_points_lost": s["bf16_points_lost"]}
    return claims | ({"held_out": saved["held_out"]} if "held_out" in saved else {})


def markdown(t: dict) -> str:
    return "\n".join(["| " + " | ".join(t["columns"]) + " |", "| --- | --- | --- | --- | ---: | ---: |"]
                     + ["| " + " | ".join(r) + " |" for r in t["rows"]])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pets", nargs="+", help="directories of TASK-fd-lora.pt PETs, one per training seed")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="the SciBERT task data (default: benchmarks.hmi_accuracy's)")
    ap.add_argument("--tasks", default=",".join(TASK_ORDER), help="comma-separated: the suite's, or held-out ones")
    ap.add_argument("--row", default="fd-lora")
    ap.add_argument("--tolerance", type=float, default=0.3, help="dev points bf16 may lose and still be chosen")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/precision_accuracy.json (its BENCHMARKS section) and merge "
                    "max_points_lost into benchmarks/results/precision.json")
    args = ap.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    if bad := [t for t in args.tasks if t not in TASK_ORDER + tuple(HELD_OUT)]:
        ap.error(f"unknown tasks {bad}")
    outside = [t for t in args.tasks if t in HELD_OUT]
    if args.write and outside and (len(outside) > 1 or len(args.tasks) > 1):
        ap.error("--write takes the suite's tasks, or one held-out task alone")

    import torch

    from runtime.exec.cpu import CpuExecutor
    from runtime.exec.precision import bf16_native
    from runtime.model.encoder import load_encoder

    if bf16_native() is None:
        ap.error("this CPU has no native bf16 (AVX512_BF16 / AMX-BF16): nothing to measure")
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "precision-accuracy.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    encoder = load_encoder(None, 2)  # full rows run the lower layers and the upper ones alike
    executors = {"fp32": CpuExecutor(encoder, prefetch=False, precision="fp32"),
                 "bf16": CpuExecutor(encoder, prefetch=False, precision="bf16")}
    splits = {}
    for directory in args.pets:
        seed = os.path.basename(os.path.dirname(os.path.abspath(directory))) or directory
        pets = load_full_pets(directory, args.row, encoder, args.tasks)
        done = results.setdefault(seed, {})
        for task, pet in pets.items():
            if task in done:
                continue
            t0 = time.perf_counter()
            serving = executors["fp32"].load_pet(pet, key=task)
            entry = {}
            for split in SPLITS:
                if split not in splits:
                    splits[split] = tasks_of(args.tasks, encoder, args.out, split, args.data)
                entry[split] = dict(score_full(executors, serving, splits[split][task], args.batch_size),
                                    load=round(os.getloadavg()[0], 1))
            done[task] = entry
            with open(path + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(path + ".tmp", path)
            print(f"{seed} {task}: dev fp32 {entry['dev']['fp32']['score']:.2f} bf16 {entry['dev']['bf16']['score']:.2f}; "
                  f"test fp32 {entry['test']['fp32']['score']:.2f} bf16 {entry['test']['bf16']['score']:.2f} "
                  f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    t = table(results, args.tolerance)
    print(markdown(t))
    s = summary(results, args.tolerance)
    print(f"max points lost at the chosen precision {s['max_points_lost']}, with bf16 everywhere {s['bf16_points_lost']}")
    if args.write:
        import datetime
        import shlex

        from benchmarks.bench_cores import cpu_model
        from benchmarks.claims import merge

        loads = [e[k]["load"] for r in results.values() for e in r.values() for k in SPLITS if "load" in e.get(k, {})]
        run = {"command": "python -m experiments.precision_accuracy " + shlex.join(sys.argv[1:]),
               "machine": f"{cpu_model()}, {os.cpu_count()} cores, native bf16 {bf16_native()}, one torch thread",
               "load": f"{min(loads):.1f}-{max(loads):.1f}" if loads else "", "date": str(datetime.date.today())}
        saved = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
        held = held_out(results, args.tolerance, outside[0]) if outside else None
        with open(RESULTS, "w") as f:
            json.dump(claims_file(saved, run, t, s, held), f, indent=1)
        if not outside:  # the suite's claim alone is the precision goal's number
            merge(os.path.join(os.path.dirname(RESULTS), "precision.json"), {"max_points_lost": s["max_points_lost"]})


if __name__ == "__main__":
    main()
