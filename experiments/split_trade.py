"""The split trade (issue 21): lower/upper split x accuracy gap x serving throughput x bytes.

    python -m experiments.split_trade /tmp/acc2 /tmp/acc3 --repeats 3

Each argument is the OUT directory of a benchmarks.hmi_accuracy run (same tasks, different
--lower-layers). Accuracy and PET bytes come from its results.json; throughput is measured here
by serving every evaluation text of every task through runtime.open(STORE).infer with the
task's hPLM tenant (mixed-tenant batches), the runs' stores interleaved, best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def requests_of(run: Path, config) -> list[dict]:
    from runtime.construct.manager import read_task
    from benchmarks.hmi_accuracy import TASKS, texts_of

    out = []
    for name in config["tasks"]:
        kind = TASKS[name][0]
        path = run / "data" / f"{name}.{config['eval_split']}.{'jsonl' if kind == 'classification' else 'conll'}"
        (x, _), _ = read_task(path, kind)
        out += [{"tenant": f"{name}-hplm", "text": t, "truncate": True} for t in texts_of(kind, x)]
    # Interleave the tenants, as a mixed-tenant server sees them.
    random.Random(0).shuffle(out)
    return out


def serve_rate(store, requests) -> float:
    import runtime

    with runtime.open(store) as rt:
        rt.infer(requests[:32])  # warm: PETs loaded, first batch allocated
        t0 = time.perf_counter()
        rt.infer(requests)
        return len(requests) / (time.perf_counter() - t0)


def mean_score(results, row):
    rows = results["rows"]
    vals = [rows[t][row]["score"] for t in results["config"]["tasks"] if row in rows.get(t, {})]
    return 100 * sum(vals) / len(vals) if len(vals) == len(results["config"]["tasks"]) else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the table (markdown) and JSON here")
    args = p.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    results = {r: json.loads((r / "results.json").read_text()) for r in runs}
    reqs = {r: requests_of(r, results[r]["config"]) for r in runs}
    rates = {r: [] for r in runs}
    for i in range(args.repeats):
        for r in runs if i % 2 == 0 else reversed(runs):
            rates[r].append(serve_rate(str(r / "store"), reqs[r]))
            print(f"repeat {i + 1}/{args.repeats} {r}: {rates[r][-1]:.1f} req/s", flush=True)
    load = os.getloadavg()[0]
    rows = []
    for r in runs:
        res = results[r]
        ded, hplm, grown = (mean_score(res, k) for k in ("dedicated", "hplm", "hplm-grown"))
        pet_bytes = [res["rows"][t]["hplm"].get("pet_bytes") for t in res["config"]["tasks"] if "hplm" in res["rows"].get(t, {})]
        rows.append({"run": str(r), "split": f"{res['config']['lower_layers']} + {6 - res['config']['lower_layers']}",
                     "eval_split": res["config"]["eval_split"], "dedicated": ded, "hplm": hplm, "hplm_grown": grown,
                     "req_per_s": max(rates[r]), "requests": len(reqs[r]),
                     "pet_bytes": max(pet_bytes) if pet_bytes else None})
    head = (f"| split (lower + upper) | dedicated | hPLM (gap) | hPLM grown (gap) | serving req/s (best of {args.repeats}) "
            "| bytes per tenant (adapter PET) |")
    lines = [head, "|---|---|---|---|---|---|"]
    base_rate = rows[0]["req_per_s"]

    def gap(x, d):
        return "-" if x is None or d is None else f"{x:.1f} ({d - x:+.1f})"

    for row in rows:
        lines.append(f"| {row['split']} | {row['dedicated']:.1f} | {gap(row['hplm'], row['dedicated'])} | "
                     f"{gap(row['hplm_grown'], row['dedicated'])} | {row['req_per_s']:.1f} "
                     f"({row['req_per_s'] / base_rate:.2f}x) | {row['pet_bytes']:,} |")
    lines.append("")
    lines.append(f"Accuracy on the {rows[0]['eval_split']} split; {rows[0]['requests']} requests per store; "
                 f"1-minute load average at the end {load:.1f} on {os.cpu_count()} cores.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "split_trade.md").write_text(text)
        (Path(args.out) / "split_trade.json").write_text(json.dumps({"rows": rows, "rates": {str(k): v for k, v in rates.items()},
                                                                     "load": load}, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
