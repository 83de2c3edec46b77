"""Choose a row's training settings on the dev split, on the store and data of a finished
benchmarks.hmi_accuracy run (issue 21: every setting is chosen on dev, test is reported once).

    python -m experiments.hmi_tune --run /tmp/acc2 --row dedicated --grid lr_full=5e-5,1e-4,2e-4 --grid epochs_full=3,6
    python -m experiments.hmi_tune --run /tmp/acc2 --row hplm-grown --grid lr_adapter=1e-3,2e-3 --grid epochs=5,10

Every point of the grid (the product of the --grid lists) trains the row on each task of the
run and scores it on the run's evaluation split, which must be dev. The hplm-grown row trains
its hplm tenant at the same point first and records that row's score too. Results go to RUN/tune.json (--name; resumable:
finished cells are skipped) and RUN/tune.md, with the mean per point and the best point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import hmi_accuracy as acc

TUNABLE = acc.TRAINING


def parse_grid(items) -> dict:
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        name = name.replace("-", "_")
        if name not in TUNABLE or not values:
            raise SystemExit(f"--grid {item!r}: expected NAME=v1,v2,... with NAME one of {', '.join(TUNABLE)}")
        cast = int if name in ("epochs", "epochs_full", "batch_size", "wide_bottleneck") else float
        try:
            grid[name] = [cast(v) for v in values.split(",")]
        except ValueError:
            raise SystemExit(f"--grid {item!r}: {values!r} are not {cast.__name__}s") from None
    return grid


def point_key(row, point: dict) -> str:
    return row + "@" + ",".join(f"{k}={v:g}" for k, v in sorted(point.items()))


def markdown(tune: dict) -> str:
    lines = []
    for row in sorted({c["row"] for c in tune["cells"].values()}):
        cells = [c for c in tune["cells"].values() if c["row"] == row]
        tasks = sorted({c["task"] for c in cells})
        points = sorted({c["point_key"] for c in cells})
        lines += [f"## {row}: dev scores per setting", "", "| setting | " + " | ".join(tasks) + " | mean |",
                  "|---|" + "---|" * (len(tasks) + 1)]
        means = {}
        for pk in points:
            by = {c["task"]: c["score"] for c in cells if c["point_key"] == pk}
            mean = sum(by.values()) / len(by) if len(by) == len(tasks) else None
            means[pk] = mean
            lines.append(f"| {pk.split('@', 1)[1]} | " + " | ".join(f"{100 * by[t]:.1f}" if t in by else "-" for t in tasks)
                         + f" | {'-' if mean is None else f'{100 * mean:.1f}'} |")
        done = {k: v for k, v in means.items() if v is not None}
        if done:
            best = max(done, key=done.get)
            lines += ["", f"Best on dev: {best.split('@', 1)[1]} (mean {100 * done[best]:.1f})", ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="OUT directory of a benchmarks.hmi_accuracy run on the dev split")
    p.add_argument("--row", required=True, choices=[r for r in acc.ROWS if r != "shared"])
    p.add_argument("--grid", action="append", default=[], help="NAME=v1,v2,... (repeat; the product is run)")
    p.add_argument("--tasks", default=None, help="comma-separated subset of the run's tasks")
    p.add_argument("--name", default="tune", help="results go to RUN/NAME.json and RUN/NAME.md (one per concurrent tuner)")
    args = p.parse_args(argv)
    run = Path(args.run)
    saved = json.loads((run / "results.json").read_text())
    config = saved["config"]
    if config.get("eval_split") != "dev":
        raise SystemExit(f"{run} scores the {config.get('eval_split', 'test')!r} split: settings are chosen on dev only")
    grid = parse_grid(args.grid)
    if not grid:
        raise SystemExit("give at least one --grid NAME=v1,v2,...")
    tasks = [t for t in (args.tasks.split(",") if args.tasks else config["tasks"]) if t]
    for t in tasks:
        if t not in config["tasks"]:
            raise SystemExit(f"task {t!r} is not in the run (its tasks: {', '.join(config['tasks'])})")

    from runtime.model.encoder import load_encoder

    base_args = argparse.Namespace(**{**acc.PREDATES, **config, "out": str(run), "progress": False, "fast": False})
    data = acc.prepare_data(base_args, run)  # the run's own files, rewritten identically (seeded)
    base = load_encoder(config.get("model"), config["lower_layers"])
    ctx = {"data": data, "store": str(run / "store"), "base": base}
    path = run / f"{args.name}.json"
    tune = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    total, t0, done = len(points) * len(tasks), time.time(), 0
    for name in tasks:
        task = acc.Task(name, data["tasks"][name], base, config["max_len"])
        for point in points:
            pk = point_key(args.row, point)
            key = f"{pk}/{name}"
            done += 1
            if key in tune["cells"]:
                continue
            targs = argparse.Namespace(**{**vars(base_args), **point})
            suffix = "-t-" + "_".join(f"{k.replace('_', '')[:6]}{v:g}" for k, v in sorted(point.items()))
            if args.row == "hplm-grown":
                # the same tenant, scored without growing too: what growing adds at this point
                h = acc.run_row(targs, ctx, task, "hplm", suffix=suffix)
                hk = point_key("hplm", point)
                tune["cells"][f"{hk}/{name}"] = {"row": "hplm", "task": name, "point": point, "point_key": hk, **h}
            r = acc.run_row(targs, ctx, task, args.row, suffix=suffix)
            tune["cells"][key] = {"row": args.row, "task": name, "point": point, "point_key": pk, **r}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(tune, indent=1, sort_keys=True))
            os.replace(tmp, path)
            path.with_suffix(".md").write_text(markdown(tune))
            rate = (time.time() - t0) / done
            acc.say(f"{key}: {100 * r['score']:.1f} ({r['seconds']:.0f}s; {done}/{total}, "
                    f"ETA {rate * (total - done) / 60:.0f} min)")
    print(markdown(tune))
    return tune


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
