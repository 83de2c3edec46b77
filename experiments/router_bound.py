"""How much of the top's work can any router save? On the cascade tenants of
benchmarks.cascade_bench, each cheap level's answers on test (runtime.level.profile.collect,
as `levels profile` runs them) against the top's:

  differs      the share of queries the cheap level answers differently from the top (tagging:
               any reported position)
  confidence   the share of tokens the dispatcher must send up, least confident first (its
               sequence-level confidence, runtime.level.dispatch), for the cheap level to come
               within 1 point of the top on test
  oracle       the same for a router that knows where the cheap level differs from the top and
               sends those first (least confident first): a query both answer alike gains
               nothing from going up, and sending every differing one gives the top's metric
  cost         that oracle's cascade cost against the top: the cheap level's served CPU time per
               query r (the run's `hkstore serve` measurement) plus the oracle's share, as a
               dispatcher pays it (a sent-up query pays both levels); `before` (in the JSON and
               the mean below the table): r + share (1 - r), as a router that knew before
               running any level would pay

The gold-label bound of BENCHMARKS' cascade table (cascade_report's oracle) may use the top's
mistakes to offset the cheap level's; this one asks only for the top's answers, which is what
the cascade's goal (within 1 point of the top) measures against.

    python -m experiments.router_bound OUT [OUT ...] [--points 1] [--out DIR] [--write]

OUT: cascade_bench output directories. DIR/router_bound.json holds every figure; --write adds
the table to benchmarks/results/tabi_assurance.json (BENCHMARKS' section, as its second table).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("chemprot", "citation_intent", "sci-cite", "NCBI-disease", "bc5cdr", "sciie")
LEVELS = {"students": "students", "plot": "PLOT level"}
COMMAND = "python -m experiments.router_bound OUTA OUTB --write   # OUTA, OUTB: the cascade's cascade_bench runs"


def answers(saved, temps: dict) -> dict:
    """Per level (students, plot, top) the calibrated probabilities of each query, as served."""
    from runtime.model import calibrate as cal

    out = {"plot": [cal.softmax(z, temps["1"]) for z in saved.logits1],
           "top": [cal.softmax(z, temps["2"]) for z in saved.logits2[0.0]]}
    if saved.students is not None:
        out["students"] = [cal.softmax(z, 1.0) for z in saved.students]  # served at T = 1
    return out


def differs(cheap: list, top: list) -> np.ndarray:
    """Per query whether the two levels' answers differ (tagging: at any reported position)."""
    return np.array([bool(np.any(np.atleast_2d(a).argmax(-1) != np.atleast_2d(b).argmax(-1)))
                     for a, b in zip(cheap, top)])


def share_needed(order, tokens, st1, st2, metric, points: float) -> float:
    """The smallest share of the tokens that, sent up in `order` (whole queries), brings the
    metric within `points` of the top's (st1, st2: per-query scoring counts of the cheap level
    and the top)."""
    target = metric(st2.sum(0)) - points / 100
    counts, sent = st1.sum(0).astype(np.float64), 0.0
    if metric(counts) >= target - 1e-12:
        return 0.0
    for q in order:
        counts += st2[q] - st1[q]
        sent += tokens[q]
        if metric(counts) >= target - 1e-12:
            return float(sent / tokens.sum())
    return 1.0


def figures(q, saved, temps: dict, task: str, points: float, costs: dict | None = None) -> dict:
    """Per cheap level: differs (share of queries), confidence and oracle (share of tokens), and
    with costs ({level: its served CPU time against the top's}) the oracle cascade's cost."""
    from runtime.level import dispatch

    got = answers(saved, temps)
    tokens = saved.tokens.astype(np.float64)
    st2 = np.array([q.stats(p, i) for i, p in enumerate(got["top"])], dtype=np.float64)
    out = {}
    for level in LEVELS:
        if level not in got:
            continue
        st1 = np.array([q.stats(p, i) for i, p in enumerate(got[level])], dtype=np.float64)
        conf = np.array([dispatch.confidence(p, saved.task) for p in got[level]])
        unlike = differs(got[level], got["top"])
        by_conf = np.argsort(conf, kind="stable")
        oracle = np.lexsort((conf, ~unlike))  # the differing queries first, least confident first
        out[level] = {"differs": float(unlike.mean()),
                      "confidence": share_needed(by_conf, tokens, st1, st2, q.metric, points),
                      "oracle": share_needed(oracle, tokens, st1, st2, q.metric, points)}
        if costs and level in costs:
            r, share = costs[level], out[level]["oracle"]
            out[level].update(cost=r + share, before=r + share * (1 - r))
    return {"task": task, **out}


def served_costs(result: dict) -> dict:
    """{level: served CPU time per query against the top's} of a cascade_bench task result."""
    from benchmarks import cascade_report

    f = cascade_report.task_figures(result)
    top = f["systems"]["exact"]["cpu_ms"]
    out = {"plot": f["systems"]["fast"]["cpu_ms"] / top}
    if "students" in f["systems"]:
        out["students"] = f["systems"]["students"]["cpu_ms"] / top
    return out


def mean_before(rows: list) -> float:
    """The six tasks' mean of the cheapest oracle cascade routed before running any level."""
    return float(np.mean([min(r[level]["before"] for level in LEVELS if level in r) for r in rows]))


def table(rows: list, points: float) -> tuple:
    names = [r["task"] for r in rows]
    head = [f"cheap level (test): {' / '.join(names)}", "queries it answers differently from the top",
            f"tokens sent up for within {points:g} point of the top, least confident first",
            "the same, the queries it answers differently first (oracle)",
            "cost of that oracle's cascade against the top (a sent-up query pays both levels)"]

    def cells(level, key):
        return " / ".join(f"{100 * r[level][key]:.0f}%" if level in r else "-" for r in rows)

    def costs(level):
        return " / ".join(f"{r[level]['cost']:.2f}" if "cost" in r.get(level, {}) else "-" for r in rows)

    return head, [[LEVELS[level], cells(level, "differs"), cells(level, "confidence"), cells(level, "oracle"),
                   costs(level)] for level in LEVELS]


def main(argv=None) -> int:
    from experiments.selection_bar import outputs, task_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="cascade_bench output directories")
    p.add_argument("--points", type=float, default=1.0, help="how close to the top (points)")
    p.add_argument("--out", type=Path, default=None, help="where router_bound.json goes (default: the first run)")
    p.add_argument("--write", action="store_true", help="the table into benchmarks/results/tabi_assurance.json")
    args = p.parse_args(argv)
    rows, t0, load = [], time.time(), os.getloadavg()
    for run in args.runs:
        for task, done in task_results(run):
            print(f"[{time.time() - t0:6.0f}s] {task}: saving test outputs", flush=True)
            got = outputs(run, task, splits=("test",))
            q, saved = got["test"]
            rows.append(figures(q, saved, got["temps"], task, args.points, served_costs(done)))
    rows.sort(key=lambda r: TASKS.index(r["task"]) if r["task"] in TASKS else len(TASKS))
    head, body = table(rows, args.points)
    print("| " + " | ".join(head) + " |\n| " + " | ".join("---" for _ in head) + " |")
    for r in body:
        print("| " + " | ".join(r) + " |")
    out = args.out or args.runs[0]
    out.mkdir(parents=True, exist_ok=True)
    before = mean_before(rows)
    print(f"the cheapest oracle cascade per task, routed before running any level: mean {before:.2f} of the top")
    (out / "router_bound.json").write_text(json.dumps({"columns": head, "rows": body, "tasks": rows,
                                                       "mean_before": before}, indent=1))
    if args.write:
        write(ROOT / "benchmarks" / "results" / "tabi_assurance.json", head, body, before, time.time() - t0, load)
    return 0


def write(path: Path, head, body, before, seconds, load) -> None:
    """The table as the section's second (the selection bar's stays first), its command and
    the mean cost of the oracle cascades routed before running any level."""
    got = json.loads(path.read_text())
    got["router_bound_mean_cost_routed_before"] = round(before, 2)
    others = [line for line in got.get("command", "").splitlines() if "experiments.router_bound" not in line]
    got.update(command="\n".join([*others, COMMAND]), tables=got["tables"][:1] + [{"columns": head, "rows": body}],
               load=f"{got.get('load', '').split('; router bound')[0]}; router bound {load[0]:.1f}-{os.getloadavg()[0]:.1f}, "
                    f"{seconds / 60:.0f} min, {time.strftime('%Y-%m-%d')}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
