"""Multi-level inference (Tabi) on the SciBERT suite: level 1 (hPLM), level 2 (full-context
lower layers, same PET) and Tabi at the profiled candidate (issue 16).

    python -m benchmarks.tabi_bench --store /tmp/acc-tabi/store --out /tmp/tabi --figures figures

Per task (tenant ``<task>-hplm`` of the store, e.g. /tmp/acc2's, copied first: the bench
writes the tenant's levels record into the store):

1. calibration: temperatures of both levels fitted on held-out *training* rows (the task's
   train split minus the rows the tenant was trained on, --train-used), ECE before/after;
2. profiling on dev (--dev): level outputs saved once (level 1 with attention and coverage,
   level 2 on the full text and pruned at each alpha), every candidate (c, k, alpha, w,
   coverage gate) scored from them; the cheapest within --target of level 2 is chosen and
   stored with the tenant; the same with the gate fixed at 0 (confidence alone);
3. test (--test, never seen before): every query answered one at a time under each system
   (fast, exact, auto with the coverage-aware candidate, auto with the confidence-only one),
   the systems interleaved in rotating order, through the runtime's engine (Engine.serve: the path
   runtime.infer takes after tokenizing: tagging queries keep their CoNLL words); accuracy /
   entity F1 and mean, p50, p99 latency; the share re-routed; returned vs re-routed queries
   scored under each level (Tabi §7.3.2); word pruning per alpha (share of tokens dropped,
   level-2 seconds, metric loss; Tabi Table 3); reliability diagrams before/after calibration
   (PNG). Results: OUT/<task>.json (a finished task is not redone: resume), OUT/summary.md.
4. --poisson RATE[,RATE...]: fast, exact and auto under the same Poisson arrivals of the tasks'
   test queries (tenants mixed, concurrent callers batched by the engine), taking turns, at
   each offered rate; with several rates, throughput and p99 against the offered rate
   (saturation) in FIGURES/tabi_saturation.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import numpy as np

from runtime.level.queries import Queries

from benchmarks.hmi_accuracy import SCIBERT
TASKS = {  # task -> (kind, split dir)
    "citation_intent": ("classification", "text_classification/citation_intent"),
    "NCBI-disease": ("tagging", "ner/NCBI-disease"),
    "chemprot": ("classification", "text_classification/chemprot"),
    "sciie": ("tagging", "ner/sciie"),
    "sci-cite": ("classification", "text_classification/sci-cite"),
    "bc5cdr": ("tagging", "ner/bc5cdr"),
}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


# -- data ---------------------------------------------------------------------------------------


def split_data(task, kind, args):
    """(calibration, dev, test) data: calibration = train rows the tenant did not train on."""
    from runtime.construct.manager import read_task

    base = os.path.join(args.data, TASKS[task][1])
    ext = "jsonl" if kind == "classification" else "conll"
    train, _ = read_task(os.path.join(base, "train.txt"), kind)
    used_path = os.path.join(args.train_used, f"{task}.train.{ext}")
    used, _ = read_task(used_path, kind)
    key = (lambda x: x) if kind == "classification" else tuple
    seen = {key(x) for x in used[0]}
    rows = [j for j, x in enumerate(train[0]) if key(x) not in seen]
    rng = np.random.default_rng(args.seed)
    rows = sorted(rng.permutation(rows)[:args.calib_max].tolist())
    calib = ([train[0][j] for j in rows], [train[1][j] for j in rows])
    dev_path = os.path.join(args.dev, f"{task}.dev.{ext}") if args.dev else os.path.join(base, "dev.txt")
    dev, _ = read_task(dev_path, kind)
    test, _ = read_task(os.path.join(base, "test.txt"), kind)
    return calib, dev, test, {"calibration": f"{len(rows)} of {len(train[0])} train rows not in {used_path}",
                              "dev": dev_path, "test": os.path.join(base, "test.txt")}


# -- measurement ----------------------------------------------------------------------------------


def expected(saved, temps, queries, cand, target):
    """Expected metric / cost / re-route share of one candidate on saved outputs."""
    from runtime.level import profile

    grid = {k: [cand[k]] for k in ("c", "k", "alpha", "w", "gate")}
    return profile.choose(saved, temps, queries.stats, queries.metric, target, grid)


def part_metric(queries, idx, probs) -> float:
    """The metric of queries idx answered with probs (per query)."""
    return queries.metric(np.sum([queries.stats(probs[q], q) for q in idx], 0))


def answer(rt, tenant, ids, pos, pet, policy):
    """One query's answer through the runtime's engine, at `policy` with `pet`'s levels record."""
    from runtime.engine import Ask
    from runtime.level.serve import policy_of

    name, chosen = policy_of(pet, policy)
    (a,) = rt.engine.serve([Ask(tenant, list(ids), pos, pet, name, chosen)])
    return a


def serve_one_at_a_time(rt, pet, tenant, queries, systems, limit):
    """Per system: answers and latencies (seconds), each query alone, systems interleaved."""
    out = {name: {"answers": [], "seconds": []} for name in systems}
    names = list(systems)
    n = min(len(queries), limit) if limit else len(queries)
    t0 = time.perf_counter()
    for q in range(n):
        ids, pos = queries.ids[q], queries.positions[q]
        order = names[q % len(names):] + names[:q % len(names)]
        for name in order:
            policy, use = systems[name]
            t = time.perf_counter()
            a = answer(rt, tenant, ids, pos, use, policy)
            out[name]["seconds"].append(time.perf_counter() - t)
            out[name]["answers"].append(a)
        if (q + 1) % 100 == 0 or q + 1 == n:
            rate = (q + 1) / (time.perf_counter() - t0)
            print(f"    test {q + 1}/{n} queries, {rate:.1f}/s, ETA {(n - q - 1) / rate:.0f} s", flush=True)
    return out, n


def latency(seconds) -> dict:
    s = np.asarray(seconds) * 1000
    return {"mean_ms": float(s.mean()), "p50_ms": float(np.percentile(s, 50)), "p99_ms": float(np.percentile(s, 99))}


def with_policy(pet, policy):
    """A copy of a ServingPet whose levels record holds another policy (for the confidence-only
    candidate; same tensors, same key)."""
    import copy

    other = copy.copy(pet)
    other.meta = dict(pet.meta, levels=dict(pet.meta["levels"], policy=policy))
    return other


def run_task(task, args):
    import torch

    import runtime
    from runtime.level import profile
    from runtime.model import calibrate as cal

    kind = TASKS[task][0]
    tenant = f"{task}-hplm"
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    rt = runtime.open(args.store, device="cpu", max_len=args.max_len, max_batch=args.batch)
    try:
        pet = rt.pet(tenant)
        if pet.task != kind:
            raise SystemExit(f"tenant {tenant!r} is a {pet.task} tenant, expected {kind}")
        max_len = (rt.store.snapshot().read_pet(tenant).meta.get("train") or {}).get("max_len", args.max_len)
        calib, dev, test, sources = split_data(task, kind, args)
        labels = list(pet.labels)
        qc, qd, qt = (Queries(rt.encoder, d, kind, labels, max_len) for d in (calib, dev, test))
        n = rt.meta["n"]
        print(f"[{task}] calibration {len(qc)}, dev {len(qd)}, test {len(qt)} queries; {uptime()}", flush=True)
        t = time.perf_counter()
        saved_c = profile.collect(rt.engine, pet, qc.pairs(), alphas=[0.0], n=n, batch=args.batch)
        cal_targets = qc.targets
        calib_out = profile.calibrate(saved_c, cal_targets)
        temps = calib_out["temperature"]
        print(f"  calibrated in {time.perf_counter() - t:.0f} s: T = {temps}, ECE {calib_out['ece']}", flush=True)
        t = time.perf_counter()
        saved_d = profile.collect(rt.engine, pet, qd.pairs(), alphas=args.alphas, n=n, batch=args.batch)
        grid = dict(profile.GRID, alpha=args.alphas)
        # as `hkstore levels profile` chooses (its default assurance)
        chosen = profile.choose(saved_d, temps, qd.stats, qd.metric, args.target, grid, assurance=profile.ASSURANCE)
        conf_only = profile.choose(saved_d, temps, qd.stats, qd.metric, args.target, dict(grid, gate=[0.0]),
                                   assurance=profile.ASSURANCE)
        print(f"  profiled on dev in {time.perf_counter() - t:.0f} s: level 1 {chosen['level1']['metric']:.4f}, "
              f"level 2 {chosen['level2']['metric']:.4f}; chosen {chosen['chosen']}; confidence only "
              f"{conf_only['chosen']}", flush=True)
        loose = profile.choose(saved_d, temps, qd.stats, qd.metric, args.serve_target, grid,
                               assurance=profile.ASSURANCE)
        variants = {"coverage + confidence": (grid, 0.0), "confidence only": (dict(grid, gate=[0.0]), 0.0),
                    "coverage only": (dict(grid, c=[0.0], k=[1000.0]), 0.0),
                    **{f"coverage + confidence, held in {a:.0%} of dev resamples": (grid, a) for a in args.assurance}}
        record = profile.record(temps, calib_out["ece"], chosen["chosen"], chosen, args.target, len(qd),
                                profile.ASSURANCE)
        profile.save(args.store, tenant, record)
        rt.refresh()
        pet = rt.pet(tenant)
        assert pet.meta["levels"]["policy"]["c"] == chosen["chosen"]["c"]

        # test: saved outputs (per-level scores, pruning, reliability), then served one at a time
        t = time.perf_counter()
        saved_t = profile.collect(rt.engine, pet, qt.pairs(), alphas=args.alphas, n=n, batch=args.batch)
        p1 = [cal.softmax(z, temps["1"]) for z in saved_t.logits1]
        p2 = [cal.softmax(z, temps["2"]) for z in saved_t.logits2[0.0]]
        pruning = []
        for alpha in args.alphas:
            p2a = profile._probs(saved_t, temps, alpha, 0.0)
            pruning.append({"alpha": alpha, "tokens_dropped": float(1 - saved_t.kept_tokens[alpha].sum()
                                                                      / saved_t.tokens.sum()),
                            "level2_seconds": saved_t.seconds.get(f"level2@{alpha}"),
                            "metric": qt.score(p2a)})
        base_s = pruning[0]["level2_seconds"]
        for row in pruning:
            row["speedup"] = base_s / row["level2_seconds"] if row["level2_seconds"] else None
            row["metric_loss"] = pruning[0]["metric"] - row["metric"]
        z1, y1 = cal.samples(saved_t.logits1, qt.targets)
        z2, y2 = cal.samples(saved_t.logits2[0.0], qt.targets)
        reliability = {f"level{lv}": {"before": cal.reliability(cal.softmax(z), y), "after":
                                      cal.reliability(cal.softmax(z, temps[str(lv)]), y)}
                       for lv, z, y in ((1, z1, y1), (2, z2, y2))}
        exp_test = {name: expected(saved_t, temps, qt, c["chosen"], args.target)["chosen"]
                    for name, c in (("coverage-aware", chosen), ("confidence-only", conf_only))}
        sweep = []  # per accuracy target and dispatcher: chosen on dev, expected on test
        for target in args.sweep:
            for name, (g, assurance) in variants.items():
                c = profile.choose(saved_d, temps, qd.stats, qd.metric, target, g, assurance=assurance)
                e = expected(saved_t, temps, qt, c["chosen"], target)["chosen"]
                sweep.append({"target": target, "dispatcher": name, "met_on_dev": c["met"],
                              "policy": {k: c["chosen"][k] for k in ("c", "k", "alpha", "w", "gate")},
                              "dev_metric": c["chosen"]["metric"], "dev_cost": c["chosen"]["cost"],
                              "test_metric": e["metric"], "test_cost": e["cost"], "test_reroute": e["reroute"]})
        print(f"  test outputs saved in {time.perf_counter() - t:.0f} s", flush=True)

        systems = {"level 1 (fast)": ("fast", pet), "level 2 (exact)": ("exact", pet),
                   "Tabi (auto)": ("auto", pet),
                   "Tabi, confidence only": ("auto", with_policy(pet, {k: conf_only["chosen"][k]
                                                                       for k in ("c", "k", "alpha", "w", "gate")})),
                   f"Tabi, within {100 * args.serve_target:g} points": (
                       "auto", with_policy(pet, {k: loose["chosen"][k] for k in ("c", "k", "alpha", "w", "gate")}))}
        for _ in range(args.warmup):
            serve_one_at_a_time(rt, pet, tenant, qt, systems, 8)
        served, count = serve_one_at_a_time(rt, pet, tenant, qt, systems, args.limit)
        rows = {}
        for name, got in served.items():
            probs = [a.probs for a in got["answers"]]
            sub = Queries.__new__(Queries)
            sub.__dict__ = dict(qt.__dict__, ids=qt.ids[:count], positions=qt.positions[:count],
                                targets=qt.targets[:count], words=qt.words[:count], gold=qt.gold[:count])
            rows[name] = {"metric": sub.score(probs), **latency(got["seconds"]),
                          "rerouted": float(np.mean([a.level == 2 for a in got["answers"]])),
                          "pruned_words": int(sum(a.pruned for a in got["answers"]))}
        l2 = rows["level 2 (exact)"]
        for r in rows.values():
            r["latency_vs_level2"] = r["mean_ms"] / l2["mean_ms"]
            r["metric_vs_level2_points"] = 100 * (r["metric"] - l2["metric"])
        # returned vs re-routed queries under each level (Tabi §7.3.2), by the route auto took
        routed = np.array([a.level == 2 for a in served["Tabi (auto)"]["answers"]])
        auto = [a.probs for a in served["Tabi (auto)"]["answers"]]
        split = {}
        for part, where in (("returned", ~routed), ("re-routed", routed)):
            idx = np.flatnonzero(where)
            if not len(idx):
                continue
            sub = {name: part_metric(qt, idx, p) for name, p in (("level1", p1), ("level2", p2), ("tabi", auto))}
            split[part] = dict(sub, queries=len(idx))
        goal = rows["Tabi (auto)"]
        result = {
            "task": task, "tenant": tenant, "metric": "accuracy" if kind == "classification" else "entity_f1",
            "sources": sources, "queries": {"calibration": len(qc), "dev": len(qd), "test": len(qt),
                                            "test_served": count},
            "calibration": calib_out, "profile_dev": {"chosen": chosen["chosen"], "confidence_only": conf_only["chosen"],
                                                      "level1": chosen["level1"], "level2": chosen["level2"],
                                                      "met": chosen["met"], "candidates": len(chosen["candidates"])},
            "test_saved": {"level1": qt.score(p1), "level2": qt.score(p2), "expected": exp_test,
                           "coverage_mean": float(saved_t.coverage.mean()), "seconds": saved_t.seconds},
            "loose": {"target": args.serve_target, "chosen": loose["chosen"]}, "sweep": sweep,
            "test_served": rows, "returned_vs_rerouted": split, "pruning": pruning, "reliability": reliability,
            "goal": {"within_0.5_points": goal["metric"] >= l2["metric"] - 0.005,
                     "latency_le_60pct": goal["latency_vs_level2"] <= 0.6},
            "frontier_dev": [(c["cost"], c["metric"], c["gate"]) for c in chosen["candidates"]],
            "machine": {"uptime_end": uptime(), "cpu": platform.processor() or platform.machine(),
                        "torch_threads": args.threads}, "seconds": time.perf_counter() - t_start}
        return result
    finally:
        rt.close()


# -- Poisson load -----------------------------------------------------------------------------------


def poisson(args, results) -> list:
    """Each system under the same Poisson arrivals of the tasks' test queries (tenants mixed), at
    each rate of --poisson: achieved throughput and latency; the systems take turns,
    --poisson-rounds times. One runtime and one query pool serve every rate."""
    import torch

    import runtime

    torch.set_num_threads(args.threads)
    rt = runtime.open(args.store, device="cpu", max_len=args.max_len, max_batch=args.batch)
    try:
        pool = []
        for r in results:
            kind = TASKS[r["task"]][0]
            pet = rt.pet(r["tenant"])
            max_len = (rt.store.snapshot().read_pet(r["tenant"]).meta.get("train") or {}).get("max_len", 128)
            _, _, test, _ = split_data(r["task"], kind, args)
            q = Queries(rt.encoder, test, kind, list(pet.labels), max_len)
            pool += [(r["tenant"], ids, pos, pet) for ids, pos in q.pairs()]
        return [poisson_rate(args, rt, pool, rate) for rate in args.poisson]
    finally:
        rt.close()


def poisson_rate(args, rt, pool, rate: float) -> dict:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(args.seed)
    picks = rng.choice(len(pool), size=args.poisson_count)
    gaps = rng.exponential(1.0 / rate, size=args.poisson_count)
    systems = ("fast", "exact", "auto")
    out = {name: {"seconds": [], "throughput": []} for name in systems}
    lock = threading.Lock()
    for rnd in range(args.poisson_rounds):
        for name in systems[rnd % 3:] + systems[:rnd % 3]:
            lat = []

            def one(j, name=name, lat=lat):
                tenant, ids, pos, pet = pool[j]
                t = time.perf_counter()
                answer(rt, tenant, ids, pos, pet, name)
                with lock:
                    lat.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(64) as ex:
                due = t0
                for j, gap in zip(picks, gaps):
                    due += gap
                    time.sleep(max(0.0, due - time.perf_counter()))
                    ex.submit(one, int(j))
            elapsed = time.perf_counter() - t0
            out[name]["seconds"] += lat
            out[name]["throughput"].append(len(lat) / elapsed)
            print(f"  poisson {rate:g}/s round {rnd + 1} {name}: {len(lat) / elapsed:.1f} req/s, mean "
                  f"{1000 * np.mean(lat):.0f} ms; {uptime()}", flush=True)
    return {"rate": rate, "count": args.poisson_count, "rounds": args.poisson_rounds,
            **{name: {"throughput_rps": float(np.median(v["throughput"])), **latency(v["seconds"])}
               for name, v in out.items()}, "uptime_end": uptime()}


# -- report ---------------------------------------------------------------------------------------


def saturation_figure(loads, path):
    """Achieved throughput and p99 latency against the offered Poisson rate, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [load["rate"] for load in loads]
    for name in ("fast", "exact", "auto"):
        a.plot(rates, [load[name]["throughput_rps"] for load in loads], marker="o", label=name)
        b.plot(rates, [load[name]["p99_ms"] for load in loads], marker="o", label=name)
    a.plot(rates, rates, color="grey", linestyle=":", label="offered")
    a.set(xlabel="offered requests/s", ylabel="achieved requests/s", title="throughput")
    b.set(xlabel="offered requests/s", ylabel="p99 latency, ms", title="p99 latency", yscale="log")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(9, 4 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        for ax, level in zip(row, ("level1", "level2")):
            for when, style in (("before", "o--"), ("after", "s-")):
                rel = r["reliability"][level][when]
                mask = np.array(rel["count"]) > 0
                ax.plot(np.array(rel["confidence"])[mask], np.array(rel["accuracy"])[mask], style,
                        label=f"{when} (ECE {100 * rel['ece']:.1f})")
            ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
            ax.set_title(f"{r['task']} (test), {level.replace('level', 'level ')}")
            ax.set_xlabel("confidence")
            ax.set_ylabel("accuracy")
            ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(path, "tabi_reliability.png"), dpi=110)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        f = np.array(r["frontier_dev"])
        ax.scatter(f[:, 0], 100 * f[:, 1], s=3, c=f[:, 2], cmap="viridis", alpha=0.5)
        c = r["profile_dev"]["chosen"]
        ax.scatter([c["cost"]], [100 * c["metric"]], marker="*", s=150, color="red", label="chosen")
        ax.axhline(100 * r["profile_dev"]["level2"]["metric"], color="black", lw=0.8, label="level 2")
        ax.axhline(100 * r["profile_dev"]["level1"]["metric"], color="grey", lw=0.8, ls="--", label="level 1")
        ax.set_title(f"{r['task']}: dev candidates (colour: gate)")
        ax.set_xlabel("expected cost / level 2")
        ax.set_ylabel(r["metric"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(path, "tabi_candidates.png"), dpi=110)


def summary(results) -> str:
    lines = ["| task | system | metric | mean ms | p50 ms | p99 ms | vs level 2 latency | Δ points | re-routed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, row in r["test_served"].items():
            lines.append(f"| {r['task']} | {name} | {100 * row['metric']:.1f} | {row['mean_ms']:.1f} | "
                         f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['latency_vs_level2']:.2f} | "
                         f"{row['metric_vs_level2_points']:+.1f} | {100 * row['rerouted']:.0f}% |")
    names = list(results[0]["test_served"])
    lines.append("")
    lines.append("| average | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    lines.append("| metric | " + " | ".join(f"{100 * np.mean([r['test_served'][n]['metric'] for r in results]):.1f}"
                                           for n in names) + " |")
    lines.append("| mean ms | " + " | ".join(f"{np.mean([r['test_served'][n]['mean_ms'] for r in results]):.1f}"
                                            for n in names) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="a COPY of the accuracy store (the bench writes levels records)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--figures", default="figures")
    ap.add_argument("--tasks", default="citation_intent,NCBI-disease")
    ap.add_argument("--data", default=str(SCIBERT))
    ap.add_argument("--train-used", required=True, help="the tenants' training files (<task>.train.*)")
    ap.add_argument("--dev", default="", help="dev files (<task>.dev.*); empty: the suite's dev.txt")
    ap.add_argument("--calib-max", type=int, default=400)
    ap.add_argument("--alphas", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.25, 0.5, 0.75])
    ap.add_argument("--target", type=float, default=0.005, help="accuracy target: within this of level 2")
    ap.add_argument("--serve-target", type=float, default=0.02, help="a looser target also served on test")
    ap.add_argument("--sweep", type=lambda s: [float(x) for x in s.split(",")], default=[0.005, 0.01, 0.02, 0.05, 0.1],
                    help="targets whose dev-chosen candidates are scored (expected) on test")
    ap.add_argument("--assurance", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.8, 0.9],
                    help="the sweep's plain rule against these assurances (runtime.level.profile.choose); "
                         "the served candidates use profile.ASSURANCE")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="serve at most this many test queries (0: all)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--poisson", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                    help="also a Poisson load at these rates (requests/s, comma-separated)")
    ap.add_argument("--poisson-count", type=int, default=200)
    ap.add_argument("--poisson-rounds", type=int, default=2)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.figures, exist_ok=True)
    results = []
    for task in args.tasks.split(","):
        path = os.path.join(args.out, f"{task}.json")
        if os.path.exists(path):
            print(f"[{task}] done before: {path}")
            with open(path) as f:
                results.append(json.load(f))
            continue
        r = run_task(task, args)
        with open(path + ".tmp", "w") as f:
            json.dump(r, f, indent=1, default=float)
        os.replace(path + ".tmp", path)
        results.append(r)
    figures(results, args.figures)
    text = summary(results)
    if args.poisson:
        loads = poisson(args, results)
        with open(os.path.join(args.out, "poisson.json"), "w") as f:
            json.dump(loads, f, indent=1)
        text += "\n\nPoisson load, both tenants mixed:\n\n"
        text += "| offered req/s | system | throughput req/s | mean ms | p50 ms | p99 ms |\n|---|---|---|---|---|---|\n"
        text += "\n".join(f"| {load['rate']:g} | {n} | {load[n]['throughput_rps']:.1f} | {load[n]['mean_ms']:.0f} | "
                           f"{load[n]['p50_ms']:.0f} | {load[n]['p99_ms']:.0f} |"
                           for load in loads for n in ("fast", "exact", "auto"))
        if len(loads) > 1:
            saturation_figure(loads, os.path.join(args.figures, "tabi_saturation.png"))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
