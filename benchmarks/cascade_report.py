"""The cascade's figures from benchmarks.cascade_bench's per-task outputs: per task and system
the delivered score, the share each level answered, the server's CPU time per query, the
oracle bound; the six-task means and the goal; the table and the figures for
benchmarks/results/accuracy.json.

    python -m benchmarks.cascade_report OUT [OUT ...] [--results benchmarks/results/accuracy.json] [--write]

A task's output keeps, per system (fast, exact = the top, auto) and per test query, the
scoring counts (correct, 1, 1) for accuracy or (spans found, predicted, gold) for entity F1, the
server's CPU seconds, the wall seconds and the level that answered. Everything here is
arithmetic on those, so a changed rule needs no rerun of the serving.

The oracle bound: a dispatcher that knows which test queries the PLOT level answers as well as
the top sends only the others to the top, without running the PLOT first. The fewest such
queries that bring the metric within --points of the top's (accuracy is additive over queries;
entity F1 = 2H / (G + P) reaches F* exactly when 2H - F* P >= F* G, additive in the queries'
span counts, so the queries that add most are taken first) cost r + share x (1 - r) of the top,
r the PLOT's CPU time per query relative to the top's. No dispatcher between these two levels
that returns one level's answer per query does better: a task whose bound is above the cost
limit cannot meet the goal with them. When the bench also served the tenant's students (their
best k pinned: system ``students``), the same bound for students -> top is reported beside it:
the cheapest first level a cascade could have. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.level.profile import bar_words

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("fast", "exact", "auto")  # exact pins the tenant's top (its full-depth PET)
LEVEL_NAMES = ("students", "plot", "exact", "full")
POINTS = 1.0  # the goal: auto within this many points of the top on the six-task mean ...
COST = 0.5  # ... at no more than this share of the top's CPU time per query
TABLE_HEAD = "task (test, cascade)"


def metric(kind: str, counts) -> float:
    """Accuracy, or entity F1 from the queries' summed (found, predicted, gold) span counts."""
    h, p, g = (sum(c[j] for c in counts) for j in range(3))
    if kind == "classification":
        return h / len(counts) if counts else 0.0
    return 2 * h / (g + p) if h else 0.0


def _contributions(kind, c1, c2, target):
    """(per query what taking its answer from the top adds, the total that must be reached)."""
    if kind == "classification":
        return [b[0] - a[0] for a, b in zip(c1, c2)], target * len(c1) - sum(a[0] for a in c1)
    value = [2 * (b[0] - a[0]) - target * (b[1] - a[1]) for a, b in zip(c1, c2)]
    need = target * sum(a[2] for a in c1) - (2 * sum(a[0] for a in c1) - target * sum(a[1] for a in c1))
    return value, need


def oracle_share(kind: str, cheap, top, points: float = POINTS) -> float:
    """The smallest share of queries an oracle takes from the top for the metric to come within
    `points` of the top's (module doc)."""
    target = metric(kind, top) - points / 100
    value, need = _contributions(kind, cheap, top, target)
    if need <= 1e-9:
        return 0.0
    total = 0.0
    for j, v in enumerate(sorted((v for v in value if v > 0), reverse=True), 1):
        total += v
        if total >= need - 1e-9:
            return j / len(cheap)
    return 1.0  # unreachable: every query from the top is the top


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def system_row(kind: str, served: dict) -> dict:
    """One system's figures from its per-query outputs."""
    names = served["level_name"]
    wall = sorted(served["wall_s"])
    return {"score": 100 * metric(kind, served["counts"]), "queries": len(names),
            "cpu_ms": 1000 * _mean(served["cpu_s"]), "wall_ms": 1000 * _mean(wall),
            "wall_p50_ms": 1000 * wall[len(wall) // 2] if wall else 0.0,
            "wall_p99_ms": 1000 * wall[min(len(wall) - 1, int(0.99 * len(wall)))] if wall else 0.0,
            "shares": {n: 100 * names.count(n) / len(names) if names else 0.0 for n in LEVEL_NAMES}}


def task_figures(result: dict, points: float = POINTS, cost: float = COST) -> dict:
    """A task's systems, auto's gap and cost against the top, the oracle bound and the verdict."""
    kind, served = result["kind"], result["served"]
    rows = {name: system_row(kind, served[name]) for name in SYSTEMS}
    top, auto, fast = rows["exact"], rows["auto"], rows["fast"]
    r = fast["cpu_ms"] / top["cpu_ms"] if top["cpu_ms"] else 1.0
    share = oracle_share(kind, served["fast"]["counts"], served["exact"]["counts"], points)
    out = {"task": result["task"], "kind": kind, "systems": rows, "gap": top["score"] - auto["score"],
           "cost_vs_top": auto["cpu_ms"] / top["cpu_ms"] if top["cpu_ms"] else 1.0,
           "fast_cost_vs_top": r, "oracle_share": share, "oracle_cost": r + share * (1 - r)}
    if "students" in served:
        rows["students"] = system_row(kind, served["students"])
        rs = rows["students"]["cpu_ms"] / top["cpu_ms"] if top["cpu_ms"] else 1.0
        s_share = oracle_share(kind, served["students"]["counts"], served["exact"]["counts"], points)
        out.update(students_cost_vs_top=rs, students_oracle_share=s_share, students_oracle_cost=rs + s_share * (1 - rs))
    out["met"] = out["gap"] <= points and out["cost_vs_top"] <= cost
    out["why"] = verdict(out, points, cost)
    return out


def verdict(f: dict, points: float, cost: float) -> str:
    """Why a task meets the goal or not, in a few words."""
    if f["met"]:
        return "met"
    if min(f["oracle_cost"], f.get("students_oracle_cost", 1.0)) > cost:
        return f"cannot: even an oracle needs {min(f['oracle_cost'], f.get('students_oracle_cost', 1.0)):.2f} of the top"
    if f["gap"] > points:
        return f"auto {f['gap']:.1f} points below the top (oracle: {f['oracle_cost']:.2f} of the top)"
    return f"auto costs {f['cost_vs_top']:.2f} of the top (oracle: {f['oracle_cost']:.2f})"


def summary(figures: list[dict], points: float = POINTS, cost: float = COST) -> dict:
    """The six-task means (each task weighs the same) and the goal on them."""
    gap = _mean([f["gap"] for f in figures])
    taught = [f for f in figures if "students" in f["systems"]]  # the tasks whose students were served
    ratio = _mean([f["cost_vs_top"] for f in figures])
    return {"tasks": [f["task"] for f in figures], "gap_mean": gap, "cost_vs_top_mean": ratio,
            "score_means": {s: _mean([f["systems"][s]["score"] for f in figures]) for s in SYSTEMS},
            "cpu_ms_means": {s: _mean([f["systems"][s]["cpu_ms"] for f in figures]) for s in SYSTEMS},
            "oracle_cost_mean": _mean([f["oracle_cost"] for f in figures]),
            "students_oracle_cost_mean": _mean([f["students_oracle_cost"] for f in taught]) if taught else None,
            "students_score_mean": _mean([f["systems"]["students"]["score"] for f in taught]) if taught else None,
            "met": bool(figures) and gap <= points and ratio <= cost}


def table(figures: list[dict], total: dict) -> dict:
    """The cascade table (accuracy.json's convention: columns, rows; numbers as shown)."""
    cols = [TABLE_HEAD, "students %", "plot %", "full %", "fast", "top (exact policy)", "auto", "gap to top",
            "fast CPU ms/query", "auto CPU ms/query", "top CPU ms/query", "auto cost vs top", "oracle cost",
            "students (best k)", "students oracle cost", "verdict"]
    rows = []
    for f in figures:
        s = f["systems"]
        shares = s["auto"]["shares"]
        rows.append([f["task"], round(shares["students"], 1), round(shares["plot"], 1),
                     round(shares["full"] + shares["exact"], 1), round(s["fast"]["score"], 1),
                     round(s["exact"]["score"], 1), round(s["auto"]["score"], 1), round(f["gap"], 1),
                     round(s["fast"]["cpu_ms"], 1), round(s["auto"]["cpu_ms"], 1), round(s["exact"]["cpu_ms"], 1), round(f["cost_vs_top"], 2),
                     round(f["oracle_cost"], 2), _cell(s.get("students", {}).get("score"), 1),
                     _cell(f.get("students_oracle_cost"), 2), f["why"]])
    if figures:
        m, c = total["score_means"], total["cpu_ms_means"]
        rows.append([f"mean of {len(figures)}", "", "", "", round(m["fast"], 1), round(m["exact"], 1),
                     round(m["auto"], 1), round(total["gap_mean"], 1), round(c["fast"], 1), round(c["auto"], 1), round(c["exact"], 1),
                     round(total["cost_vs_top_mean"], 2), round(total["oracle_cost_mean"], 2),
                     _cell(total["students_score_mean"], 1), _cell(total["students_oracle_cost_mean"], 2),
                     "met" if total["met"] else "not met"])
    return {"columns": cols, "rows": rows}


def _cell(value, digits):
    return "" if value is None else round(value, digits)


def markdown(t: dict) -> str:
    lines = ["| " + " | ".join(t["columns"]) + " |", "| " + " | ".join("---" for _ in t["columns"]) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in t["rows"]]
    return "\n".join(lines)


def profile_lines(results: list[dict]) -> list[str]:
    """Per task the policy `levels profile` chose on dev and what it expected there, beside
    what auto delivered on test (a gap between the two is dev-to-test drift)."""
    lines = []
    for r in results:
        rec = (r.get("steps") or {}).get("profile") or {}
        p, pr = rec.get("policy") or {}, rec.get("profile") or {}
        if not pr:
            continue
        lines.append(f"- {r['task']}: policy " + " ".join(f"{k}={p[k]:g}" for k in ("c", "k", "alpha", "w", "gate")
                                                             if k in p)
                     + f"; on dev (top {pr.get('top')}): expected {100 * pr['expected_metric']:.1f} at "
                     f"{pr['expected_cost']:.2f} of the top's cost (PLOT {100 * pr['level1_metric']:.1f}, top "
                     f"{100 * pr['level2_metric']:.1f}), target {'met' if pr.get('met') else 'not met'}"
                     + ("" if "bar" not in pr else f"; the bar: {bar_words(pr['bar'], 'the top')}"))
    return lines


def write_accuracy(path: Path, figures: list[dict], total: dict) -> dict:
    """Add the cascade's figures to the accuracy results file (as benchmarks.accuracy_goals adds
    the top's): ``auto_gap_to_top_mean`` (points, top minus auto: positive when auto is below),
    ``auto_cost_vs_top`` (auto's server CPU time per query over the top's, the mean of the
    tasks' ratios), ``cascade`` (per task what the table shows) and the table, replacing an
    earlier cascade table. Returns the file's new content."""
    accuracy = json.loads(path.read_text())
    t = table(figures, total)
    accuracy["auto_gap_to_top_mean"] = round(total["gap_mean"], 1)
    accuracy["auto_cost_vs_top"] = round(total["cost_vs_top_mean"], 2)
    accuracy["cascade"] = {"met": total["met"], "by_task": {
        row[0]: {"auto": row[6], "top": row[5], "gap": row[7], "cost_vs_top": row[11], "oracle_cost": row[12],
                 "met": f["met"]} for row, f in zip(t["rows"], figures)}}
    accuracy["tables"] = [x for x in accuracy["tables"] if x["columns"][0] != TABLE_HEAD] + [t]
    path.write_text(json.dumps(accuracy, indent=1, ensure_ascii=False) + "\n")
    return accuracy


def load(out: Path, tasks=None) -> list[dict]:
    """The finished tasks' outputs in OUT (OUT/<task>.json), in `tasks`' order when given."""
    found = {p.stem: json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json")) if p.stem != "summary"}
    found = {k: v for k, v in found.items() if isinstance(v, dict) and "served" in v}
    return [found[t] for t in (tasks or sorted(found)) if t in found]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="+",
                   help="benchmarks.cascade_bench output directories (runs of some tasks each, reported together)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "accuracy.json")
    p.add_argument("--write", action="store_true", help="write the figures into --results")
    args = p.parse_args(argv)
    figures = [task_figures(r) for out in args.out for r in load(out)]
    if not figures:
        raise SystemExit(f"{' '.join(map(str, args.out))}: no finished task (OUT/<task>.json)")
    total = summary(figures)
    print(markdown(table(figures, total)))
    if args.write:
        write_accuracy(args.results, figures, total)
        print(f"wrote auto_gap_to_top_mean and auto_cost_vs_top into {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
