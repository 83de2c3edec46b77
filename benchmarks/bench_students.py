"""Student Parallelism (issue 18): accuracy of the teacher vs its students, padding saved by the
length-aware buffer, and latency under a stepped Poisson load with a burst.

    python -m benchmarks.bench_students --store STORE --tenant citation_intent-hplm=TEST \\
        --tenant NCBI-disease-hplm=TEST --out /tmp/sp-bench --figure figures/students_load.png

Students must exist (`hkstore students create`; best k was chosen on dev there). Sections:

* accuracy: the teacher (hPLM) and the first k students, every k, on each tenant's TEST file;
* padding: FIFO batches vs the length-aware buffer on the test requests' real lengths;
* load: an open-loop stepped Poisson load (low -> burst -> low), the rates scaled from the
  teacher's measured capacity on this machine, against two servers in turn (teacher-only and
  adaptive students that may also use the teacher), --rounds rounds interleaved; p50/p99
  latency and throughput per phase, the number of students used over time, and the accuracy
  actually delivered (each answer scored against its label).
* cascade (--cascade without --fig13, instead of the sections above): the stepped load at fixed
  --rates against tenants with a full-depth top, every request pinned to the top against the
  tenants' profiled cascade (policy auto), through runtime.open(STORE)'s engine; per phase and
  tenant p99 and the score delivered, and the share each level answered.
* fig13 (--fig13, instead of the sections above): HMI Fig. 13's burst through the real serving
  path (--http: `hkstore serve STORE` in its own process, driven by an asyncio client; else
  client threads calling runtime.open(STORE).infer) (the engine measures the load, the pruning policy picks
  teacher or k students per batch, runtime/student/serve.py): --burst-threads clients started
  --burst-stagger s apart, each sending one request every --burst-period s (waiting for the
  answer first, like a thread), --burst-count each (HMI: 250, 0.05 s, 1.2 s, 50); teacher-only
  (every request pins students=0) and adaptive (the policy's choice), --rounds interleaved;
  latency CDF, p50/p99, throughput, how many students answered over time, accuracy delivered.

    python -m benchmarks.bench_students --fig13 --store STORE --tenant A=TEST --tenant B=TEST --out DIR \
        --scores EVAL.json --burst-threads 40 --burst-count 10 --figure figures/students_fig13.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time

import numpy as np
import torch

import hkstore
from runtime.construct.data import accuracy, entity_f1, word_tags
from runtime.construct.manager import encode_eval, load_tenant, read_task
from runtime.model.stored import base_encoder
from runtime.student.buffer import LengthBuffer, padded_tokens
from benchmarks.student_engine import StudentEngine
from runtime.student.evaluate import students_eval


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def load_requests(store_path, tenants: dict, limit: int):
    """[(tenant, ids, target, words or None)] of every tenant's test file (at most limit each)."""
    out = []
    with hkstore.open(store_path) as store:
        enc = base_encoder(store)
        for tenant, path in tenants.items():
            meta, _ = load_tenant(store, tenant, enc)
            data, _ = read_task(path, meta["task"])
            data = (data[0][:limit], data[1][:limit])
            ids, targets = encode_eval(enc, data, meta["task"], list(meta["labels"]),
                                       (meta.get("train") or {}).get("max_len", 128))
            for i in range(len(ids)):
                gold = data[1][i] if meta["task"] == "tagging" else None
                out.append({"tenant": tenant, "ids": ids[i], "target": targets[i], "words": data[0][i], "gold": gold,
                            "task": meta["task"], "labels": list(meta["labels"])})
    return out


def delivered_score(reqs, answers) -> dict:
    """Per tenant: accuracy (classification) or entity F1 (tagging) of the answers delivered."""
    out = {}
    for tenant in sorted({r["tenant"] for r in reqs}):
        pairs = [(r, a) for r, a in zip(reqs, answers) if r["tenant"] == tenant and a is not None]
        if not pairs:
            continue
        r0 = pairs[0][0]
        if r0["task"] == "classification":
            out[tenant] = accuracy([r["target"] for r, _ in pairs], [a.prediction for _, a in pairs])
        else:
            gold = [[t if t in r["labels"] else "O" for t in r["gold"]] for r, _ in pairs]
            pred = [word_tags(a.prediction, r["target"], r["labels"], len(r["words"])) for r, a in pairs]
            out[tenant] = entity_f1(gold, pred)
    return out


def capacity(store_path, tenants, reqs, mode, max_batch, repeats=3) -> float:
    """Requests per second `mode` serves with full batches (median of repeats)."""
    with StudentEngine(store_path, tenants, mode=mode, max_batch=max_batch) as engine:
        times = []
        for r in range(repeats + 1):
            batch = random.Random(r).sample(reqs, min(max_batch, len(reqs)))
            t0 = time.perf_counter()
            for f in [engine.submit(q["tenant"], q["ids"]) for q in batch]:
                f.result()
            if r:  # the first is warm-up
                times.append(len(batch) / (time.perf_counter() - t0))
    return float(np.median(times))


def schedule(phases, seed):
    """Arrival times of an open-loop Poisson process, piecewise constant rate."""
    rng = np.random.default_rng(seed)
    t, out, start = 0.0, [], 0.0
    for rate, seconds in phases:
        t = start
        while True:
            t += rng.exponential(1 / rate)
            if t >= start + seconds:
                break
            out.append(t)
        start += seconds
    return out


def run_load(store_path, tenants, reqs, mode, phases, target_s, max_batch, seed):
    arrivals = schedule(phases, seed)
    rng = random.Random(seed)
    chosen = [reqs[rng.randrange(len(reqs))] for _ in arrivals]
    with StudentEngine(store_path, tenants, mode=mode, target_s=target_s, max_batch=max_batch) as engine:
        # warm: one batch at every level, so the policy starts with measured costs
        for level in engine.policy.levels:
            engine.mode = level
            for f in [engine.submit(q["tenant"], q["ids"]) for q in reqs[:max_batch]]:
                f.result()
        top = engine.policy.levels[0]
        engine.mode, engine.timeline = mode, []
        engine.padding = [0, 0]
        futures = [None] * len(arrivals)
        t0 = time.perf_counter()
        for i, (at, q) in enumerate(zip(arrivals, chosen)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures[i] = engine.submit(q["tenant"], q["ids"])
        answers = [f.result() for f in futures]
        timeline = [(t - t0, level, queued, size) for t, level, queued, size in engine.timeline]
        padding = list(engine.padding)
    bounds = np.cumsum([0] + [s for _, s in phases])
    out = {"mode": str(mode), "phases": []}
    for p, (rate, seconds) in enumerate(phases):
        idx = [i for i, at in enumerate(arrivals) if bounds[p] <= at < bounds[p + 1]]
        lat = np.array([answers[i].latency_s for i in idx])
        done = [arrivals[i] + answers[i].latency_s for i in idx]
        out["phases"].append({
            "rate": rate, "seconds": seconds, "requests": len(idx),
            "p50_ms": float(np.percentile(lat, 50) * 1e3) if len(idx) else None,
            "p99_ms": float(np.percentile(lat, 99) * 1e3) if len(idx) else None,
            "throughput": len(idx) / max(max(done) - bounds[p], 1e-9) if idx else 0.0,
            # among the answers students gave (the teacher's share is the next field)
            "students_mean": float(np.mean([answers[i].students for i in idx if answers[i].students] or [0])),
            "teacher_share": float(np.mean([answers[i].students == 0 for i in idx])) if idx else None,
            "delivered": delivered_score([chosen[i] for i in idx], [answers[i] for i in idx]),
        })
    out["delivered"] = delivered_score(chosen, answers)
    # after the burst: how long until a batch is served at the most accurate level again
    back = [t for t, level, _, _ in timeline if t >= bounds[2] and level == ("teacher" if mode == "teacher" else top)]
    out["recovery_s"] = back[0] - bounds[2] if back else None
    out["timeline"] = timeline
    out["latency"] = [(arrivals[i], answers[i].latency_s, answers[i].students, chosen[i]["tenant"])
                      for i in range(len(arrivals))]
    out["padding"] = padding
    return out


def padding_saved(reqs, max_batch, seed=0):
    lengths = [len(q["ids"]) for q in reqs]
    random.Random(seed).shuffle(lengths)
    out = {}
    for name, fifo in (("fifo", True), ("length-aware", False)):
        # as a busy server sees it: 4 batches' worth waiting at a time
        buf, batches, it = LengthBuffer(8, fifo), [], iter(lengths)
        for n in it:
            buf.add(n, n)
            if len(buf) >= 4 * max_batch:
                batches.append(buf.pop(max_batch))
        while len(buf):
            batches.append(buf.pop(max_batch))
        computed, real = padded_tokens(batches)
        out[name] = {"computed_tokens": computed, "real_tokens": real, "padding_share": 1 - real / computed}
    return out


def pooled(results, phases, scores) -> list:
    """Per mode and phase, over every round: p50/p99 latency and the accuracy delivered, as the
    test score of the level that answered each request (scores: students eval per tenant),
    which varies far less than scoring the few answers of one phase directly."""
    bounds = np.cumsum([0] + [s for _, s in phases])
    rows = []
    for mode in ("teacher", "adaptive"):
        for p in range(len(phases)):
            hits = [x for r in results if r["mode"] == mode for x in r["latency"] if bounds[p] <= x[0] < bounds[p + 1]]
            if not hits:
                continue
            lat = np.array([x[1] for x in hits])
            row = {"mode": mode, "phase": p, "rate": phases[p][0], "requests": len(hits),
                   "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3)}
            if scores:
                for t in sorted({x[3] for x in hits}):
                    e = scores[t]
                    by_k = {int(k): v for k, v in e["students"].items()}  # str keys once through JSON
                    got = [e["teacher"] if x[2] == 0 else by_k[x[2]] for x in hits if x[3] == t]
                    row[t] = {"delivered": float(np.mean(got)), "teacher": e["teacher"], "n": len(got)}
            rows.append(row)
    return rows


def figure(results, path, phases):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    bounds = np.cumsum([0] + [s for _, s in phases])
    for r in results:
        lat = np.array([x[:2] for x in r["latency"]], dtype=float)
        axes[0].scatter(lat[:, 0], lat[:, 1] * 1e3, s=4, alpha=0.5, label=f"{r['mode']} (round {r['round']})")
        if r["mode"] == "adaptive":
            tl = np.array([(t, 0 if lv == "teacher" else lv) for t, lv, _, _ in r["timeline"]], dtype=float)
            axes[1].step(tl[:, 0], tl[:, 1], where="post", label=f"round {r['round']}")
    for b in bounds[1:-1]:
        for ax in axes:
            ax.axvline(b, color="grey", linestyle=":")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("latency (ms)")
    axes[0].legend(fontsize=7, markerscale=3)
    axes[1].set_ylabel("students per batch (0 = teacher)")
    axes[1].set_xlabel("seconds since the first arrival")
    axes[1].legend(fontsize=7)
    rates = " -> ".join(f"{r:.0f}/s" for r, _ in phases)
    axes[0].set_title(f"stepped Poisson load {rates}: teacher-only vs adaptive students")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def burst(reqs, mode, args, seed):
    """(each client's requests, the fields pinning teacher-only modes to the teacher)."""
    rng = random.Random(seed)
    plan = [[reqs[rng.randrange(len(reqs))] for _ in range(args.burst_count)] for _ in range(args.burst_threads)]
    pin = {"students": 0} if mode.startswith("teacher") else {"level": "full"} if mode == "top" else {}
    return plan, pin


class Answered:
    """An answer as delivered_score reads it."""

    def __init__(self, prediction):
        self.prediction = prediction


def prediction(result):
    """A runtime Result's label id (classification) or per-token label ids (tagging)."""
    pred = np.asarray(result.logits).argmax(-1)
    return int(pred) if pred.ndim == 0 else pred.tolist()


def measure_levels(rt, warm):
    """One timed batch of `warm` at every level of the runtime's pruning policy: it starts with
    measured costs."""
    for level in rt.students.policy.levels:
        t0 = time.perf_counter()
        rt.infer([{"tenant": q["tenant"], "ids": q["ids"], "students": 0 if level == "teacher" else level}
                  for q in warm])
        padded = len(warm) * max(len(q["ids"]) for q in warm)
        rt.students.policy.observe(level, padded, time.perf_counter() - t0, tokens=sum(len(q["ids"]) for q in warm))


def run_fig13(store_path, reqs, mode, args, seed) -> dict:
    """One Fig. 13 burst against runtime.open(store).infer (module doc); mode teacher | adaptive,
    or for --cascade top (every request pinned to the tenant's full-depth top) | auto (the
    tenant's profiled cascade, the default policy)."""
    import threading

    import runtime

    plan, pin = burst(reqs, mode, args, seed)
    with runtime.open(store_path, device="cpu", max_batch=args.max_batch, students_target_s=args.target_ms / 1e3,
                      length_buffer=not mode.endswith("fifo")) as rt:
        warm = reqs[:args.max_batch]
        rt.infer([{"tenant": q["tenant"], "ids": q["ids"]} for q in warm])  # loads PETs and groups
        if pin:
            rt.infer([{"tenant": q["tenant"], "ids": q["ids"], **pin} for q in warm])
        measure_levels(rt, warm)
        records = [[] for _ in plan]
        t_start = time.perf_counter()

        def client(i):
            time.sleep(max(0.0, t_start + i * args.burst_stagger - time.perf_counter()))
            for j, q in enumerate(plan[i]):
                due = t_start + i * args.burst_stagger + j * args.burst_period
                time.sleep(max(0.0, due - time.perf_counter()))
                sent = time.perf_counter()
                r = rt.infer([{"tenant": q["tenant"], "ids": q["ids"], **pin}])[0]
                records[i].append((sent - t_start, time.perf_counter() - sent, r.students, q, prediction(r),
                                   r.level_name))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(plan))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_start
        padding = 1 - rt.engine.tokens / max(rt.engine.padded_tokens, 1)
    flat = sorted((x for rs in records for x in rs), key=lambda x: x[0])
    names = [x[5] for x in flat]
    return {**fig13_summary(mode, [(x[0], x[1], x[2], x[3]["tenant"]) for x in flat], wall),
            "scored": delivered_score([x[3] for x in flat], [Answered(x[4]) for x in flat]), "padding_share": padding,
            "levels": {n: names.count(n) / len(names) for n in sorted(set(names))}}


def run_load_cascade(store_path, reqs, mode, phases, args, seed) -> dict:
    """The stepped Poisson load (open loop: arrivals do not wait for answers) against
    runtime.open(store)'s engine, mode top (every request pinned to the tenant's full-depth top)
    or auto (the tenant's profiled cascade, with the pruning policy): per phase p50 / p99, the
    score delivered per tenant and the share each level answered."""
    import runtime

    arrivals = schedule(phases, seed)
    rng = random.Random(seed)
    chosen = [reqs[rng.randrange(len(reqs))] for _ in arrivals]
    pin = {"level": "full"} if mode == "top" else {}
    with runtime.open(store_path, device="cpu", max_batch=args.max_batch,
                      students_target_s=args.target_ms / 1e3) as rt:
        warm = reqs[:args.max_batch]
        for extra in ({}, {"level": "full"}):  # PETs, groups and the top loaded before the clock starts
            rt.infer([{"tenant": q["tenant"], "ids": q["ids"], **extra} for q in warm])
        measure_levels(rt, warm)
        done = [None] * len(arrivals)
        futures = []
        t0 = time.perf_counter()
        for i, (at, q) in enumerate(zip(arrivals, chosen)):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            f = rt.submit([{"tenant": q["tenant"], "ids": q["ids"], **pin}])[0]
            f.add_done_callback(lambda _, i=i: done.__setitem__(i, time.perf_counter() - t0))
            futures.append(f)
        answers = [f.result() for f in futures]
    bounds = np.cumsum([0] + [s for _, s in phases])
    out = {"mode": mode, "phases": []}
    for p, (rate, seconds) in enumerate(phases):
        idx = [i for i, at in enumerate(arrivals) if bounds[p] <= at < bounds[p + 1]]
        lat = np.array([done[i] - arrivals[i] for i in idx])
        names = [answers[i].level_name for i in idx]
        tenant_p99 = {t: float(np.percentile([done[i] - arrivals[i] for i in idx if chosen[i]["tenant"] == t], 99) * 1e3)
                      for t in sorted({chosen[i]["tenant"] for i in idx})}
        out["phases"].append({"rate": rate, "seconds": seconds, "requests": len(idx),
                              "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                              "p99_ms_by_tenant": tenant_p99,
                              "scored": delivered_score([chosen[i] for i in idx],
                                                        [Answered(prediction(answers[i])) for i in idx]),
                              "levels": {n: names.count(n) / len(names) for n in sorted(set(names))}})
    return out


def stepped_cascade_rows(results) -> list:
    """Per phase and tenant: top-only's and auto's p99 (ms, the tenant's own requests) and the
    score each delivered, both the mean over rounds, and auto against top."""
    rows = []
    for p, phase in enumerate(results[0]["phases"]):
        for tenant in sorted(phase["scored"]):
            by_mode = {mode: [r["phases"][p] for r in results if r["mode"] == mode] for mode in ("top", "auto")}
            p99 = {m: float(np.mean([x["p99_ms_by_tenant"][tenant] for x in rs])) for m, rs in by_mode.items()}
            score = {m: 100 * float(np.mean([x["scored"][tenant] for x in rs])) for m, rs in by_mode.items()}
            rows.append({"phase": p, "rate": phase["rate"], **auto_against_top(tenant, p99, score)})
    return rows


def auto_against_top(tenant, p99: dict, score: dict) -> dict:
    """One row of BENCHMARKS' burst table from each mode's p99 (ms) and score (%)."""
    return {"tenant": tenant, "top_p99_ms": round(p99["top"]), "auto_p99_ms": round(p99["auto"]),
            "p99_ratio": round(p99["auto"] / max(p99["top"], 1e-9), 2), "top_score": round(score["top"], 1),
            "auto_score": round(score["auto"], 1), "auto_minus_top": round(score["auto"] - score["top"], 1)}


def fig13_summary(mode, latency, wall) -> dict:
    """One Fig. 13 run's figures from its (sent at, latency s, students that answered, tenant) rows."""
    lat = np.array([x[1] for x in latency])
    answered = [x[2] for x in latency]
    return {"mode": mode, "requests": len(latency), "wall_s": wall, "throughput": len(latency) / wall,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "teacher_share": float(np.mean([k == 0 for k in answered])),
            "students_mean": float(np.mean([k for k in answered if k] or [0])), "latency": latency}


def run_fig13_http(store_path, reqs, mode, args, seed) -> dict:
    """The same burst against `hkstore serve STORE` (a fresh server process, its runtime's
    default policy) from an asyncio client in this process: the clients no longer share the
    server's interpreter, as HMI's do not. Its predictions are not read back; accuracy delivered
    is the `--scores` score of the level that answered each request."""
    import asyncio
    import secrets
    import tempfile

    from benchmarks import loadgen

    plan, pin = burst(reqs, mode, args, seed)

    def text(q):
        return q["words"] if isinstance(q["words"], str) else " ".join(q["words"])

    server_args = argparse.Namespace(out=args.out, store=store_path, device="cpu", max_len=128,
                                     max_batch=args.max_batch, max_wait_ms=5, queue_limit=4096, request_timeout=120,
                                     dedicated_resident=1)
    with tempfile.NamedTemporaryFile("w", dir=args.out, suffix=".token", delete=False) as f:
        token = secrets.token_urlsafe(24)
        f.write(token + "\n")
    server = loadgen.ServerProcess(server_args, "hplm", f.name, lambda m: print(m, flush=True),
                                   extra=("--torch-threads", str(args.threads)))
    try:
        async def drive():
            client = loadgen.Client(server.url, token, [], timeout=150)
            for q in reqs[:args.max_batch]:  # not measured: PETs and groups loaded
                await client.call(q["tenant"], {"text": text(q), "truncate": True})
            records = []
            start = time.perf_counter()

            async def worker(i):
                await asyncio.sleep(i * args.burst_stagger)
                t0 = time.perf_counter()
                for j, q in enumerate(plan[i]):
                    delay = t0 + j * args.burst_period - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    status, lat, sent, _, payload = await client.call(q["tenant"], {"text": text(q), "truncate": True, **pin})
                    if status != 200:
                        raise RuntimeError(f"the server answered {status}: {payload[:200]!r}")
                    k = int(json.loads(payload)["results"][0].get("students", 0))
                    records.append((sent - start, lat, k, q["tenant"]))

            await asyncio.gather(*(worker(i) for i in range(len(plan))))
            wall = time.perf_counter() - start
            await client.close()
            return records, wall

        records, wall = asyncio.run(drive())
    finally:
        server.stop()
        os.unlink(f.name)
    return {**fig13_summary(mode, sorted(records), wall), "scored": None}


def fig13_figure(results, path, via="runtime.infer"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        lat = np.sort([x[1] * 1e3 for x in r["latency"]])
        axes[0].plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=f"{r['mode']} (round {r['round']})")
        if r["mode"].startswith("adaptive") or r["mode"] == "auto":
            pts = np.array([(x[0], x[2]) for x in r["latency"]], dtype=float)
            axes[1].scatter(pts[:, 0], pts[:, 1] + 0.08 * r["round"], s=5, alpha=0.4, label=f"round {r['round']}")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("end-to-end latency (ms)")
    axes[0].set_ylabel("share of requests")
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"HMI Fig. 13 burst through {via}: latency CDF")
    axes[1].set_xlabel("seconds since the first client started")
    axes[1].set_ylabel("students that answered (0 = teacher)")
    axes[1].legend(fontsize=7, markerscale=3)
    axes[1].set_title("adaptive: students per answer over time")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def by_level_score(latency, scores) -> dict:
    """Per tenant: the mean test score of the level that answered each request (students eval)."""
    out = {}
    for t in sorted({x[3] for x in latency}):
        e = scores[t]
        by_k = {int(k): v for k, v in e["students"].items()}
        got = [e["teacher"] if x[2] == 0 else by_k[x[2]] for x in latency if x[3] == t]
        out[t] = {"delivered": float(np.mean(got)), "teacher": e["teacher"], "n": len(got)}
    return out


def by_tenant(results) -> list:
    """Per tenant of a --cascade run: each mode's p99 (ms, over its rounds' requests) and its
    score (the mean over rounds), and auto against top (BENCHMARKS' burst table)."""
    rows = []
    for tenant in sorted({x[3] for r in results for x in r["latency"]}):
        p99, score = {}, {}
        for mode in ("top", "auto"):
            rs = [r for r in results if r["mode"] == mode]
            p99[mode] = float(np.percentile([x[1] for r in rs for x in r["latency"] if x[3] == tenant], 99)) * 1e3
            score[mode] = 100 * float(np.mean([r["scored"][tenant] for r in rs]))
        rows.append(auto_against_top(tenant, p99, score))
    return rows


def main_fig13(args, tenants, earlier, report):
    reqs = load_requests(args.store, tenants, args.load_requests)
    results = []
    for rnd in range(args.rounds):
        modes = ["top", "auto"] if args.cascade else \
            ["teacher", "adaptive"] + (["teacher-fifo", "adaptive-fifo"] if args.fifo else [])
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            before = uptime()
            r = (run_fig13_http if args.http else run_fig13)(args.store, reqs, mode, args, seed=200 + rnd)
            r["round"], r["machine_before"], r["machine_after"] = rnd, before, uptime()
            if earlier:
                r["delivered"] = by_level_score(r["latency"], earlier)
            results.append(r)
            print(f"round {rnd} {mode}: {r['requests']} requests in {r['wall_s']:.1f} s ({r['throughput']:.2f} req/s), "
                  f"p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms, teacher {r['teacher_share']:.2f}, "
                  f"students {r['students_mean']:.2f}, padding {r.get('padding_share', float('nan')):.3f}, "
                  f"scored {json.dumps(r['scored'])}, levels {json.dumps(r.get('levels'))}, "
                  f"delivered {json.dumps(r.get('delivered'))}; {r['machine_after']}", flush=True)
    pooled_rows = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        lat = np.array([x[1] for r in rs for x in r["latency"]])
        row = {"mode": mode, "requests": len(lat), "p50_ms": float(np.percentile(lat, 50) * 1e3),
               "p99_ms": float(np.percentile(lat, 99) * 1e3),
               "throughput": float(np.mean([r["throughput"] for r in rs]))}
        if earlier:
            row["delivered"] = by_level_score([x for r in rs for x in r["latency"]], earlier)
        pooled_rows.append(row)
        print(json.dumps(row), flush=True)
    report["fig13"], report["pooled"] = results, pooled_rows
    save(args, report, "bench_students_fig13.json", by_tenant(results) if args.cascade else None)
    fig13_figure(results, args.figure, "hkstore serve (HTTP)" if args.http else "runtime.infer")
    print(f"wrote {args.out}/bench_students_fig13.json and {args.figure}; {report['machine_after']}", flush=True)


def main_stepped_cascade(args, tenants, report):
    """--cascade without --fig13: the stepped load at --rates against top-only and auto."""
    if not args.rates:
        raise SystemExit("--cascade's stepped load needs --rates LOW BURST (req/s)")
    reqs = load_requests(args.store, tenants, args.load_requests)
    low, burst_rate = args.rates
    phases = [(low, args.seconds[0]), (burst_rate, args.seconds[1]), (low, args.seconds[2])]
    results = []
    for rnd in range(args.rounds):
        for mode in (["top", "auto"] if rnd % 2 == 0 else ["auto", "top"]):
            r = run_load_cascade(args.store, reqs, mode, phases, args, seed=100 + rnd)
            r["round"], r["load"] = rnd, os.getloadavg()[0]
            results.append(r)
            print(f"round {rnd} {mode}: " + "; ".join(
                f"{p['rate']:.0f}/s p50 {p['p50_ms']:.0f} ms p99 {p['p99_ms']:.0f} ms scored {json.dumps(p['scored'])} "
                f"levels {json.dumps(p['levels'])}" for p in r["phases"]) + f"; load {r['load']:.1f}", flush=True)
    report["phases"], report["stepped"] = phases, results
    save(args, report, "bench_students_stepped_cascade.json", stepped_cascade_rows(results))
    print(f"wrote {args.out}/bench_students_stepped_cascade.json; {report['machine_after']}", flush=True)


def save(args, report, name, rows=None):
    """OUT/name: the report, with the machine's load after the runs and, where given, the
    per-tenant rows of BENCHMARKS' table (printed too)."""
    if rows is not None:
        report["by_tenant"] = rows
        for row in rows:
            print(json.dumps(row), flush=True)
    report["machine_after"] = uptime()
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--tenant", action="append", required=True, help="TENANT=TEST_FILE (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--figure", default="figures/students_load.png")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-test", type=int, default=None, help="at most this many test examples per tenant (accuracy)")
    ap.add_argument("--load-requests", type=int, default=300, help="test requests per tenant the load draws from")
    ap.add_argument("--low", type=float, default=0.3, help="low phases' rate, times the teacher's capacity")
    ap.add_argument("--burst", type=float, default=2.5, help="burst rate, times the teacher's capacity")
    ap.add_argument("--rates", type=float, nargs=2, default=None, metavar=("LOW", "BURST"),
                    help="fixed rates (req/s) instead of multiples of the measured capacity, which the "
                         "machine's other load makes noisy")
    ap.add_argument("--seconds", type=float, nargs=3, default=(6, 8, 8), help="low, burst, low phase lengths")
    ap.add_argument("--target-ms", type=float, default=1000.0, help="the policy's latency target")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--scores", default=None, help="JSON of an earlier run's accuracy (tenant -> students eval), "
                                                    "with --skip-accuracy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cascade", action="store_true", help="the tenants' full-depth top (level pinned) against "
                    "their profiled cascade (policy auto) instead of teacher / adaptive: with --fig13 its burst "
                    "in process, else the stepped load at --rates")
    ap.add_argument("--fig13", action="store_true", help="HMI Fig. 13's burst through runtime.infer (module doc)")
    ap.add_argument("--fifo", action="store_true", help="--fig13 in-process: also both systems with first come "
                                                         "first served batches instead of the length-aware buffer")
    ap.add_argument("--http", action="store_true", help="--fig13 against `hkstore serve` from an asyncio client "
                                                         "process instead of threads calling runtime.infer")
    ap.add_argument("--burst-threads", type=int, default=40, help="HMI: 250")
    ap.add_argument("--burst-stagger", type=float, default=0.05, help="HMI: 0.05 s")
    ap.add_argument("--burst-period", type=float, default=1.2, help="HMI: 1.2 s")
    ap.add_argument("--burst-count", type=int, default=10, help="HMI: 50")
    args = ap.parse_args(argv)
    if args.fifo and args.http:
        ap.error("--fifo compares batchings in-process; the server behind --http always uses the length-aware buffer")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    tenants = dict(t.split("=", 1) for t in args.tenant)
    earlier = None
    if args.scores:  # read first: a missing file fails now, not after the runs
        with open(args.scores) as f:
            earlier = json.load(f)
    report = {"machine": uptime(), "args": vars(args)}
    print(f"# {report['machine']}", flush=True)
    if args.fig13:
        return main_fig13(args, tenants, earlier, report)
    if args.cascade:
        return main_stepped_cascade(args, tenants, report)
    if not args.skip_accuracy:
        report["accuracy"] = {}
        for tenant, path in tenants.items():
            t0 = time.perf_counter()
            report["accuracy"][tenant] = students_eval(args.store, tenant, path, max_examples=args.max_test)
            print(f"accuracy {tenant}: {json.dumps(report['accuracy'][tenant])} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    reqs = load_requests(args.store, tenants, args.load_requests)
    report["padding"] = padding_saved(reqs, args.max_batch)
    print(f"padding: {json.dumps(report['padding'])}", flush=True)
    names = list(tenants)
    cap_t = capacity(args.store, names, reqs, "teacher", args.max_batch)
    cap_1 = capacity(args.store, names, reqs, 1, args.max_batch)
    report["capacity"] = {"teacher_rps": cap_t, "one_student_rps": cap_1}
    print(f"capacity: teacher {cap_t:.1f} req/s, one student {cap_1:.1f} req/s; {uptime()}", flush=True)
    low, burst = args.rates or (args.low * cap_t, args.burst * cap_t)
    phases = [(low, args.seconds[0]), (burst, args.seconds[1]), (low, args.seconds[2])]
    target = args.target_ms / 1e3
    report["phases"], report["target_s"] = phases, target
    results = []
    for rnd in range(args.rounds):
        order = ["teacher", "adaptive"] if rnd % 2 == 0 else ["adaptive", "teacher"]
        for mode in order:
            r = run_load(args.store, names, reqs, mode, phases, target, args.max_batch, seed=100 + rnd)
            r["round"], r["load"] = rnd, os.getloadavg()[0]
            results.append(r)
            print(f"round {rnd} {mode}: " + "; ".join(
                f"{p['rate']:.1f}/s p50 {p['p50_ms']:.0f} ms p99 {p['p99_ms']:.0f} ms students {p['students_mean']:.2f} "
                f"teacher {p['teacher_share']:.2f} delivered {json.dumps(p['delivered'])}" for p in r["phases"])
                + f"; back to the top level {r['recovery_s']} s after the burst; load {r['load']:.1f}", flush=True)
    report["load"] = results
    scores = report.get("accuracy") or earlier
    report["pooled"] = pooled(results, phases, scores)
    for row in report["pooled"]:
        print(json.dumps(row), flush=True)
    report["machine_after"] = uptime()
    with open(os.path.join(args.out, "bench_students.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    figure(results, args.figure, phases)
    print(f"wrote {args.out}/bench_students.json and {args.figure}; {report['machine_after']}", flush=True)


if __name__ == "__main__":
    main()
