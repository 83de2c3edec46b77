"""How far any dispatcher can go between Tabi's two levels (issue 16): the oracle bound.

    python -m experiments.tabi_bound --store STORE --tasks chemprot,citation_intent,sci-cite,bc5cdr,NCBI-disease,sciie \\
        --limit 400 --out /tmp/tabi-bound.json --figure figures/tabi_bound.png

For each task's tenant (--tenant, ``<task>-hplm``): level 1 (policy fast, the PLOT) and level 2 (policy
exact, full-context lower layers) answer the first --limit test queries (batched: accuracy
only); then --timed queries are sent one at a time to each level in turn, and the ratio of their
mean latencies is level 1's cost relative to level 2.

An oracle dispatcher knows which queries level 2 answers better and sends exactly those to level
2 without running level 1 first (a perfect coverage gate). A query it re-routes costs 1 (level
2's latency), one it keeps r (level 1's). The bound is the smallest share of queries it must
re-route for the task's metric to come within --target points of level 2's, and the mean cost
that share implies, r + share x (1 - r). No dispatcher that returns one level's answer per query
does better. Accuracy is additive over queries. Entity F1 = 2H / (G + P) (H: spans found, G:
gold spans, P: predicted spans) reaches F* exactly when 2H - F* P >= F* G, which is additive in
the queries' span counts, so for both metrics the fewest queries are the ones that add the most
to it, taken first.

Between the oracle and real dispatchers: one that knows exactly where the levels' answers differ,
but not which level is right (what a perfect, free probe of level 2 could tell), re-routes the
differing queries in a random order (disagreement_share). Real dispatchers re-route in the
order of a signal (level 1's confidence, the PLOT's coverage, a gate learned on dev).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from runtime.construct.data import entity_spans, word_tags
from runtime.plot.retrieve import retrieve
from benchmarks.bench_students import load_requests, uptime
from benchmarks.tabi_bench import SCIBERT, TASKS


def _predictions(rt, reqs, policy, batch=32):
    """(predictions, per query its uncertainty under each signal of `signals`)."""
    out, uncertain = [], []
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        res = rt.infer([{"tenant": q["tenant"], "ids": q["ids"], "policy": policy, "students": 0} for q in chunk])
        for q, r in zip(chunk, res):
            logits = np.asarray(r.logits, dtype=np.float64)
            pred = logits.argmax(-1)
            out.append(int(pred) if q["task"] == "classification" else
                       word_tags(pred.tolist(), q["target"], q["labels"], len(q["words"])))
            uncertain.append(signals(q, logits))
    return out, uncertain


def signals(q, logits) -> dict:
    """How unsure level 1 is of a query, by several sequence-level rules (higher: re-route first).
    Tagging reads the words' first sub-tokens, as the answer does."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if q["task"] == "classification":
        top = np.sort(p)[::-1]
        return {"1 - max prob": 1 - top[0], "1 - margin": 1 - (top[0] - top[1]),
                "entropy": float(-(p * np.log(p + 1e-12)).sum())}
    words = p[np.asarray(q["target"]) >= 0]
    best = words.max(-1)
    outside = [j for j, name in enumerate(q["labels"]) if name == "O"]
    entity = best[words.argmax(-1) != outside[0]] if outside else best
    return {"1 - min over words (the runtime's)": 1 - best.min(), "1 - mean over words": 1 - best.mean(),
            "words below 0.9": float((best < 0.9).sum()),
            "1 - min over predicted entity words": 1 - (entity.min() if len(entity) else best.min()),
            "words": float(len(best))}


def counts(reqs, preds):
    """Per query: (hits, predicted spans, gold spans) for tagging; (correct, 1, 1) otherwise."""
    out = []
    for q, p in zip(reqs, preds):
        if q["task"] == "classification":
            out.append((int(p == q["target"]), 1, 1))
        else:
            gold = entity_spans([t if t in q["labels"] else "O" for t in q["gold"]])
            spans = entity_spans(p)
            out.append((len(gold & spans), len(spans), len(gold)))
    return np.array(out, dtype=np.float64)


def metric(task, c):
    """Accuracy, or entity F1 from summed (hits, predicted, gold)."""
    h, p, g = c.sum(0)
    return h / len(c) if task == "classification" else (2 * h / (g + p) if h else 0.0)


def contributions(task, c1, c2, target):
    """(per query: what taking its answer from level 2 adds, the total those must reach) for the
    metric to reach `target` (module doc): accuracy counts, or 2H - F* P >= F* G with G fixed."""
    if task == "classification":
        return c2[:, 0] - c1[:, 0], target * len(c1) - c1[:, 0].sum()
    value = 2 * (c2[:, 0] - c1[:, 0]) - target * (c2[:, 1] - c1[:, 1])
    return value, target * c1[:, 2].sum() - (2 * c1[:, 0].sum() - target * c1[:, 1].sum())


def _first_reaching(values, need):
    """How many of values, in their order, sum to need; None when none do."""
    if need <= 1e-9:
        return 0
    reached = np.nonzero(np.cumsum(values) >= need - 1e-9)[0]
    return int(reached[0]) + 1 if len(reached) else None


def oracle_share(task, c1, c2, target):
    """The fewest queries to take from level 2 for the metric to reach `target` (module doc);
    None when even every query from level 2 does not."""
    value, need = contributions(task, c1, c2, target)
    return _first_reaching(np.sort(value[value > 0])[::-1], need)


def differs(reqs, p1, p2):
    """Per query: whether the levels' answers differ (the label; for tagging the entity spans,
    the units F1 counts)."""
    return np.array([a != b if q["task"] == "classification" else entity_spans(a) != entity_spans(b)
                     for q, a, b in zip(reqs, p1, p2)])


def disagreement_share(task, c1, c2, target, differ, rounds=50, seed=0):
    """The mean number of queries a dispatcher re-routes when it knows exactly where the levels'
    answers differ but not which is right: the differing queries in a random order, the rest
    never (they add nothing). None when an order does not reach `target` (never when level 2
    on every query does: taking all that differ is that). Any cheap probe of level 2 (a part
    of its lower layers computed exactly, say) can at best tell a dispatcher this much, unless
    it also tells which level is right."""
    rows = np.nonzero(differ)[0]
    rng = np.random.default_rng(seed)
    taken = [share_in_order(task, c1, c2, target, rng.permutation(rows)) for _ in range(rounds)]
    return None if None in taken else float(np.mean(taken))


def coverage(snap, version, q) -> dict:
    """How the PLOT served the query's (first sub-token) windows: the shares at full order and
    at a uni-gram, the coverage-aware gate's kind of signal."""
    _, _, served = retrieve(snap, version, [q["ids"]])
    order = served.order[0, :served.lengths[0]]
    if q["task"] == "tagging":
        order = order[np.asarray(q["target"]) >= 0]
    return {"share of windows served by a uni-gram": float((order == 1).mean()),
            "1 - share served at full order": float(1 - (order == order.max()).mean())}


def helps(task, c1, c2, target):
    """Per query: whether level 2's answer adds to the metric (the oracle's choice)."""
    return contributions(task, c1, c2, target)[0] > 0


def fit_gate(x, y, l2=1e-2, steps=3000):
    """A logistic regression of y on the standardized signals (gradient descent): a scorer."""
    y = np.asarray(y, dtype=np.float64)
    mu, sd = x.mean(0), x.std(0) + 1e-9
    z, w, b = (x - mu) / sd, np.zeros(x.shape[1]), 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(z @ w + b)))
        w -= 0.5 * (z.T @ (p - y) / len(y) + l2 * w)
        b -= 0.5 * float((p - y).mean())
    return lambda x: ((x - mu) / sd) @ w + b


def share_in_order(task, c1, c2, target, order):
    """How many queries, taken from level 2 in this order, bring the metric to `target`."""
    value, need = contributions(task, c1, c2, target)
    return _first_reaching(value[order], need)


def latency_ratio(rt, reqs, timed):
    """Level 1's mean latency over level 2's, one query at a time, the levels alternating."""
    times = {"fast": [], "exact": []}
    for j, q in enumerate(reqs[:timed]):
        for policy in (("fast", "exact") if j % 2 == 0 else ("exact", "fast")):
            t0 = time.perf_counter()
            rt.infer([{"tenant": q["tenant"], "ids": q["ids"], "policy": policy, "students": 0}])
            times[policy].append(time.perf_counter() - t0)
    return float(np.mean(times["fast"]) / np.mean(times["exact"])), {k: float(np.mean(v)) for k, v in times.items()}


def bound(rt, store, task, args) -> dict:
    kind, folder = TASKS[task]
    tenant = args.tenant.format(task=task)
    by_signal, gate = {}, None
    snap, version = rt.store.snapshot(), rt.pet(tenant).version
    for split in ("dev", "test"):  # dev first: the learned gate is fitted there
        reqs = load_requests(store, {tenant: f"{args.data}/{folder}/{split}.txt"}, args.limit)
        (p1, unsure), (p2, _) = (_predictions(rt, reqs, p) for p in ("fast", "exact"))
        for q, u in zip(reqs, unsure):
            u.update(coverage(snap, version, q))
        c1, c2 = counts(reqs, p1), counts(reqs, p2)
        m1, m2 = metric(kind, c1), metric(kind, c2)
        target = m2 - args.target / 100
        share = oracle_share(kind, c1, c2, target)
        rng = np.random.default_rng(0)
        features = np.array([list(u.values()) for u in unsure])
        if gate is None:
            gate = fit_gate(features, helps(kind, c1, c2, target))
        orders = {name: np.argsort(-features[:, j], kind="stable") for j, name in enumerate(unsure[0])}
        orders["learned on dev (all of the above)"] = np.argsort(-gate(features), kind="stable")
        orders["random order"] = rng.permutation(len(reqs))
        for name, order in orders.items():
            k = share_in_order(kind, c1, c2, target, order)
            by_signal.setdefault(name, {})[split] = None if k is None else k / len(reqs)
        by_signal.setdefault("oracle", {})[split] = None if share is None else share / len(reqs)
        differ = differs(reqs, p1, p2)
        k = disagreement_share(kind, c1, c2, target, differ)
        by_signal.setdefault(DIFFER, {})[split] = None if k is None else k / len(reqs)
        by_signal.setdefault("queries whose answers differ", {})[split] = float(differ.mean())
        better = contributions(kind, c1, c2, m2)[0]
        by_signal.setdefault("level 2 better / worse (queries)", {})[split] = [int((better > 0).sum()),
                                                                              int((better < 0).sum())]
    rt.infer([{"tenant": tenant, "ids": q["ids"], "policy": p, "students": 0} for q in reqs[:4] for p in ("fast", "exact")])
    r, means = latency_ratio(rt, reqs, args.timed)
    frac = None if share is None else share / len(reqs)
    # each query's change to the metric (for the average over tasks; F1's linearized around level 2's)
    scale = len(reqs) if kind == "classification" else c1[:, 2].sum() + (c1[:, 1].sum() + c2[:, 1].sum()) / 2
    gain = contributions(kind, c1, c2, m2)[0] / scale
    return {"task": task, "queries": len(reqs), "level1": m1, "level2": m2, "level1_cost": r, "mean_s": means,
            "oracle_rerouted": share, "oracle_share": frac,
            "oracle_cost": None if frac is None else r + frac * (1 - r), "gains": gain.tolist(),
            "signals": by_signal}


def average_bound(rows, target) -> dict:
    """The oracle for the goal on the average over tasks (each task's metric and mean cost
    weighted alike): queries taken from level 2 in order of metric gained per cost, any task,
    until the mean metric is within target of level 2's mean (F1 gains linearized)."""
    T = len(rows)
    metric_now = np.mean([r["level1"] for r in rows])
    cost = np.mean([r["level1_cost"] for r in rows])
    goal = np.mean([r["level2"] for r in rows]) - target
    offers = sorted(((g / T) / ((1 - r["level1_cost"]) / (r["queries"] * T)), g / T, (1 - r["level1_cost"]) / (r["queries"] * T))
                    for r in rows for g in r["gains"] if g > 0)[::-1]
    taken = 0
    for _, g, c in offers:
        if metric_now >= goal:
            break
        metric_now, cost, taken = metric_now + g, cost + c, taken + 1
    return {"reached": bool(metric_now >= goal), "rerouted": taken, "oracle_cost": float(cost),
            "metric": float(metric_now), "goal": float(goal)}


DIFFER = "knows where the levels differ, not which is right"
NOT_SIGNALS = ("oracle", DIFFER, "queries whose answers differ", "level 2 better / worse (queries)", "random order")


def costs(row) -> dict:
    """Mean cost relative to level 2 (test) that brings a task within the target of level 2, by
    dispatcher: the oracle and the one that knows where the levels differ skip level 1 for what
    they re-route, r + share x (1 - r); a signal's dispatcher runs level 1 on every query, r +
    share, with the signal chosen on dev (the smallest share there). None: never reached."""
    r, s = row["level1_cost"], row["signals"]
    free = {name: s[name]["test"] for name in ("oracle", DIFFER)}
    out = {"level 1 alone": r if s["oracle"]["test"] == 0 else None}
    out.update({name: None if v is None else r + v * (1 - r) for name, v in free.items()})
    usable = [n for n in s if n not in NOT_SIGNALS and s[n]["dev"] is not None and s[n]["test"] is not None]
    best = min(usable, key=lambda n: s[n]["dev"])
    out["best signal on dev: " + best] = r + s[best]["test"]
    return out


def figure(report, path, goal=0.6):
    """Per task, each dispatcher's cost (costs) against the goal's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["tasks"]
    kinds = ["level 1 alone", "oracle", DIFFER, "best signal on dev"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for j, kind in enumerate(kinds):
        values = []
        for row in rows:
            c = costs(row)
            key = next(k for k in c if k.startswith(kind))
            values.append(np.nan if c[key] is None else c[key])
        ax.bar(np.arange(len(rows)) + (j - 1.5) * 0.2, values, 0.2, label=kind)
    ax.axhline(goal, color="black", linestyle="--", label=f"goal: {goal:.0%} of level 2")
    ax.set_xticks(np.arange(len(rows)), [r["task"] for r in rows])
    ax.set_ylabel("mean cost / level 2's, within the target of level 2 (test)")
    ax.set_title("Tabi between the PLOT and the exact level: what each dispatcher would need (3 + 3, test)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--tasks", default="citation_intent,NCBI-disease")
    ap.add_argument("--data", default=SCIBERT)
    ap.add_argument("--tenant", default="{task}-hplm", help="each task's tenant ({task} is replaced)")
    ap.add_argument("--limit", type=int, default=400, help="test queries per task")
    ap.add_argument("--timed", type=int, default=60, help="queries timed one at a time at each level")
    ap.add_argument("--target", type=float, default=0.5, help="points below level 2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--figure", help="a PNG of each dispatcher's cost per task (figure)")
    args = ap.parse_args(argv)
    import torch

    import runtime

    torch.set_num_threads(1)
    report = {"machine": uptime(), "args": vars(args), "tasks": []}
    with runtime.open(args.store, device="cpu", max_batch=32) as rt:
        for task in args.tasks.split(","):
            row = bound(rt, args.store, task, args)
            report["tasks"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "gains"}), flush=True)
    rows = report["tasks"]
    report["average"] = {"level1": float(np.mean([r["level1"] for r in rows])),
                         "level2": float(np.mean([r["level2"] for r in rows])),
                         "level1_cost": float(np.mean([r["level1_cost"] for r in rows])),
                         "oracle": average_bound(rows, args.target / 100)}
    report["machine_after"] = uptime()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.figure:
        figure(report, args.figure)
    print(json.dumps(report["average"]), flush=True)


if __name__ == "__main__":
    main()
