"""The headline: `auto` against a dedicated model's work through `hkstore serve`, query for query.

    python -m benchmarks.headline OUT [OUT ...] [--write-results]

Each OUT is a benchmarks.cascade_bench output directory: per task its tenant, test sample and
store. A fresh `hkstore serve` over that store answers each test query twice, one at a time,
in alternating order and paced as cascade_bench paces them: at policy auto (the tenant's
profiled cascade) and pinned to level exact (every layer computed on the query's full context,
then the tenant's upper-layer PET and head: a dedicated model's forward pass, with no PLOT and,
one tenant at a time, no model swap to pay). Per query the server's CPU seconds are read as
cascade_bench reads them. On a core a server's throughput is the inverse of its CPU time per
query, so auto's throughput over a dedicated model's is the exact level's CPU time per query
over auto's (what `hkstore serve --mode dedicated`, the load benchmarks' baseline, serves too,
with a model swap whenever its tenant is not resident). Accuracy: auto as cascade_bench served and scored it, against
dedicated fine-tuning on the same test sample (the harness's dedicated row, seed 0:
benchmarks/results/accuracy.json). --write-results adds ``headline`` there: the ratios and the
accuracy differences per task and their six-task means. A task's measurement is kept in
OUT/<task>.headline.<limit> (a rerun reuses it: delete it to measure again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from benchmarks import cascade_bench as bench

ROOT = Path(__file__).resolve().parent.parent

SYSTEMS = {"auto": {"policy": "auto"}, "dedicated": {"level": "exact"}}


def task_headline(out: Path, done: dict, threads: int, limit: int = 0) -> dict:
    from runtime.construct.manager import read_task

    (x, _), _ = read_task(done["files"]["test"], done["kind"])
    texts = bench.texts_of(done["kind"], x)[:limit or None]
    args = argparse.Namespace(out=str(out), threads=threads)
    server = bench.Server(args, {"max_len": done["server"]["max_len"]}, out / "store")

    async def go():
        try:
            return await bench.paced_pass(server, done["tenant"], done["task"], texts, texts, SYSTEMS)
        finally:
            await server.close()

    got = asyncio.run(go())
    auto, dedicated = (statistics.mean(cpu for _, cpu, _ in got[s]) for s in ("auto", "dedicated"))
    names = [r.get("level_name", "plot") for r, _, _ in got["auto"]]
    return {"auto_cpu_ms": round(1e3 * auto, 2), "dedicated_cpu_ms": round(1e3 * dedicated, 2),
            "throughput_vs_dedicated": round(dedicated / auto, 2), "auto_at_top": round(names.count("full") / len(names), 2),
            "auto": round(100 * done["served"]["auto"]["score"], 1), "queries": len(texts)}


def compact(headline: dict) -> dict:
    """What accuracy.json keeps (BENCHMARKS quotes every number of it): the ratios per task and the means."""
    return {"throughput_vs_dedicated_mean": headline["mean"]["throughput_vs_dedicated"],
            "auto_minus_dedicated_mean": headline["mean"]["auto_minus_dedicated"],
            "throughput_vs_dedicated_by_task": {t: v["throughput_vs_dedicated"] for t, v in headline["by_task"].items()},
            "auto_minus_dedicated_by_task": {t: v["auto_minus_dedicated"] for t, v in headline["by_task"].items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path, help="benchmarks.cascade_bench output directories")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (as cascade_bench's)")
    p.add_argument("--limit", type=int, default=0, help="the first N test queries of a task (0: all, as published)")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "accuracy.json")
    args = p.parse_args(argv)
    accuracy = json.loads(args.results.read_text())
    by_task = {}
    for out in args.outs:
        for path in sorted(out.glob("*.json")):
            done = json.loads(path.read_text())
            if "served" not in done:
                continue
            task = done["task"]
            saved = out / f"{task}.headline.{args.limit or 'all'}"  # a task measured before is kept: resume
            if saved.exists():
                got = json.loads(saved.read_text())
            else:
                got = task_headline(out, done, args.threads, args.limit)
                saved.write_text(json.dumps(got))
            got["dedicated"] = accuracy["three_seed_by_task"][task]["dedicated"][0]
            got["auto_minus_dedicated"] = round(got["auto"] - got["dedicated"], 1)
            by_task[task] = got
            print(task, json.dumps(got), flush=True)
    mean = {k: round(statistics.mean(v[k] for v in by_task.values()), 2)
            for k in ("throughput_vs_dedicated", "auto", "dedicated", "auto_minus_dedicated")}
    headline = {"by_task": by_task, "mean": mean}
    print(json.dumps(mean))
    if args.write_results:
        accuracy["headline"] = compact(headline)
        args.results.write_text(json.dumps(accuracy, indent=1, ensure_ascii=False) + "\n")
    return headline


if __name__ == "__main__":
    main()
