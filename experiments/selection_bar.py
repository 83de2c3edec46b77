"""Does `levels profile`'s selection bar keep its target more often on new queries? The cascade
tenants of benchmarks.cascade_bench, their levels' outputs saved once on dev and once on test
(runtime.level.profile.collect, as `levels profile` runs them), then per task and target the
policy each rule chooses on dev, scored on test from the saved test outputs:

  plain      the cheapest candidate within the target on dev (--assurance 0)
  assured    within it in 90% of dev's bootstrap resamples too (the rule before the bar)
  bar        the same with the selection bar (runtime.level.profile.selection_bar: the default)

A (task, target) case misses when the chosen policy scores more than the target below the top
on test; the cost is the chosen policy's on test, relative to the top alone.

    python -m experiments.selection_bar OUT [OUT ...] [--targets 0.5,1,2] [--out DIR] [--write]

OUT: cascade_bench output directories (their stores, tenants, dev and test files; the
temperatures are the ones `levels profile` stored). DIR/selection_bar.json holds every case;
--write puts the table into benchmarks/results/tabi_assurance.json (BENCHMARKS' section).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from unittest import mock

RULES = ("plain", "assured", "bar")
TITLES = {"plain": "plain (--assurance 0)", "assured": "assurance 0.9 alone (the rule before)",
          "bar": "assurance 0.9 + the selection bar (the default)"}
ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m experiments.selection_bar OUTA OUTB --write   # OUTA, OUTB: the cascade's cascade_bench runs"
KEY = ("level1", "c", "k", "alpha", "w", "gate")


def task_results(run: Path) -> list[tuple[str, dict]]:
    """(task, result) of each task cascade_bench served in `run` (its OUT/<task>.json; the
    other JSON there, steps, settings and what the experiments write, served nothing)."""
    found = ((path.stem, json.loads(path.read_text())) for path in sorted(run.glob("*.json")))
    return [(task, done) for task, done in found if isinstance(done, dict) and "served" in done]


def outputs(out: Path, task: str, splits=("dev", "test")) -> dict:
    """The tenant's saved level outputs on each split (dev, test), its temperatures and the queries."""
    import runtime
    from runtime.level import profile
    from runtime.level.queries import read_queries

    done = json.loads((out / f"{task}.json").read_text())
    with runtime.open(str(out / "store"), device="cpu") as rt:
        tenant = done["tenant"]
        pet, meta = rt.pet(tenant), rt.store.snapshot().read_pet(tenant).meta
        full = rt.full(tenant, pet)
        max_len = (meta.get("train") or {}).get("max_len", rt.max_len)
        got = {"temps": meta["levels"]["temperature"]}
        for split in splits:
            q = read_queries(done["files"][split], pet.task, rt.encoder, pet.labels, max_len)
            saved = profile.collect(rt.engine, pet, q.pairs(), n=rt.meta["n"], full=full,
                                    students=profile._students(rt, tenant, pet))
            got[split] = (q, saved)
    return got


def choose(saved, temps, q, target, rule):
    from runtime.level import profile

    assurance = 0.0 if rule == "plain" else profile.ASSURANCE
    if rule == "assured":  # the rule before the bar: the bar left at the target
        with mock.patch.object(profile, "selection_bar", lambda rows, costs, st2, metric, t, draws: t):
            return profile.choose(saved, temps, q.stats, q.metric, target, assurance=assurance)
    return profile.choose(saved, temps, q.stats, q.metric, target, assurance=assurance)


def cases(task: str, got: dict, targets) -> list[dict]:
    """Per target and rule: the policy chosen on dev, its test metric and cost against the top's."""
    (qd, dev), (qt, test) = got["dev"], got["test"]
    scored = choose(test, got["temps"], qt, 0.0, "plain")  # every candidate's test figures
    on_test = {tuple(c[k] for k in KEY): c for c in scored["candidates"]}
    top = scored["level2"]["metric"]
    rows = []
    for target in targets:
        for rule in RULES:
            res = choose(dev, got["temps"], qd, target / 100, rule)
            c = on_test[tuple(res["chosen"][k] for k in KEY)]
            rows.append({"task": task, "target": target, "rule": rule, "bar": res.get("bar"),
                         "dev_gap": round(100 * (res["level2"]["metric"] - res["chosen"]["metric"]), 2),
                         "test_gap": round(100 * (top - c["metric"]), 2), "test_cost": round(c["cost"], 3),
                         "miss": round(max(0.0, 100 * (top - c["metric"]) - target), 2)})
    return rows


def table(rows, targets) -> list[list]:
    out = []
    for rule in RULES:
        mine = [r for r in rows if r["rule"] == rule]
        misses = [r["miss"] for r in mine if r["miss"] > 1e-9]
        costs = " / ".join(f"{statistics.mean(r['test_cost'] for r in mine if r['target'] == t):.2f}" for t in targets)
        gap = statistics.mean(r["test_gap"] for r in mine)
        out.append([TITLES[rule], len(misses), f"{max(misses, default=0.0):.1f}", f"{gap:.2f}", costs])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="cascade_bench output directories")
    p.add_argument("--targets", default="0.5,1,2", help="points below the top")
    p.add_argument("--out", type=Path, default=None, help="where selection_bar.json goes (default: the first run)")
    p.add_argument("--write", action="store_true", help="the table into benchmarks/results/tabi_assurance.json")
    args = p.parse_args(argv)
    targets = [float(x) for x in args.targets.split(",") if x]
    rows, t0, load = [], time.time(), os.getloadavg()
    for run in args.runs:
        for task, _ in task_results(run):
            print(f"[{time.time() - t0:6.0f}s] {task}: saving dev and test outputs", flush=True)
            rows += cases(task, outputs(run, task), targets)
    head = ["rule", f"(task, target) cases that missed, of {len(rows) // len(RULES)}", "worst miss beyond its target",
            "mean test gap to the top", "mean test cost at " + " / ".join(f"{t:g}" for t in targets) + " points"]
    body = table(rows, targets)
    print("| " + " | ".join(head) + " |\n| " + " | ".join("---" for _ in head) + " |")
    for r in body:
        print("| " + " | ".join(str(x) for x in r) + " |")
    out = args.out or args.runs[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / "selection_bar.json").write_text(json.dumps({"columns": head, "rows": body, "cases": rows}, indent=1))
    if args.write:
        write(ROOT / "benchmarks" / "results" / "tabi_assurance.json", head, body, time.time() - t0, load)
    return 0


def write(path: Path, head, body, seconds, load) -> None:
    """The table as the section's first (experiments.router_bound's second stays), and its command."""
    got = json.loads(path.read_text()) if path.exists() else {"section": "Tabi: profiling with an assurance"}
    others = [line for line in got.get("command", "").splitlines() if "experiments.selection_bar" not in line]
    got.update(command="\n".join([COMMAND, *others]),
               machine="the 2-core development machine (AMD EPYC, AVX2, shared with other jobs)",
               load=f"{load[0]:.1f}-{os.getloadavg()[0]:.1f}; {seconds / 60:.0f} min", date=time.strftime("%Y-%m-%d"),
               tables=[{"columns": head, "rows": body}] + got.get("tables", [])[1:])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
