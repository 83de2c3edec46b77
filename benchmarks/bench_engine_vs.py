"""The one serving engine against the wrapped path it replaced, side by side on one machine.

Two checkouts: this one (the engine) and an older one given by --old (e.g. a worktree of the
commit before the engine, its C extension built there). Every section runs each checkout's own
programs (PYTHONPATH and working directory set to that checkout), the checkouts taking turns
and the order alternating between rounds, so that both see the same machine load; the load
average is recorded before each run. Sections (--sections):

* runtime: benchmarks.bench_runtime's (a), hPLM requests/s at --tenants (--quick sizes);
* fig13: benchmarks.bench_students --fig13 (in process): teacher-only and adaptive p99;
* stepped: benchmarks.bench_students' stepped Poisson load at fixed --rates: burst p99;
* latency: `hkstore serve` of each checkout, one client: --sequential requests one after
  another, then a Poisson load at --poisson-rate; p50 / p99;
* batching (this checkout only): the serving app with batching fifo, length and coordinated
  under a Poisson load near saturation of texts of 8 to 128 words over --tenants-http tenants.

    python -m benchmarks.bench_engine_vs --old OLD --store STORE --scores SCORES \\
        --tenant t00000=TEST --tenant t00001=TEST --work OUT --out benchmarks/results/one_engine.json

STORE: a store with students for the --tenant tenants and at least --tenants-http tenants (e.g.
benchmarks.loadgen's store plus `hkstore students create`); SCORES: their `hkstore students
eval` results, tenant -> result. --out (BENCHMARKS.md's results format) gets every run's numbers
and the tables of per-round new / old ratios; a section run again replaces its runs there, and
--sections '' only rewrites the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("fifo", "length", "coordinated")
SECTION = "One engine against the wrapped path"  # BENCHMARKS.md


def load() -> float:
    return os.getloadavg()[0]


def env_for(tree: str) -> dict:
    return dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")


def run_in(tree: str, args: list, log_path: str) -> None:
    with open(log_path, "w") as f:
        subprocess.run([sys.executable, *args], cwd=tree, env=env_for(tree), stdout=f, stderr=subprocess.STDOUT,
                       check=True)


def turns(trees: dict, rnd: int) -> list:
    names = list(trees)
    return names if rnd % 2 == 0 else names[::-1]


# -- the sections over the two checkouts' own benchmark programs ------------------------------------


def runtime_run(tree, args, out):
    md = os.path.join(out, "runtime.md")
    run_in(tree, ["-m", "benchmarks.bench_runtime", "--quick", "--skip", "b,c,d", "--tenants", args.tenants,
                  "--repeats-a", "3", "--threads", "1", "--out", md], os.path.join(out, "runtime.log"))
    text = open(md).read().split("### CPU: throughput", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| ([\d,]+) \|.*\| ([\d.]+) \|$", text, re.M)
    return {f"hplm_{int(t.replace(',', ''))}": float(v) for t, v in rows}


def fig13_run(tree, args, out):
    run_in(tree, ["-m", "benchmarks.bench_students", "--fig13", "--store", args.store, *tenant_args(args),
                  "--scores", args.scores, "--burst-threads", str(args.burst_threads),
                  "--burst-stagger", str(args.burst_stagger),
                  "--burst-period", str(args.burst_period), "--burst-count", str(args.burst_count), "--rounds", "1",
                  "--target-ms", str(args.target_ms), "--threads", "1", "--out", out, "--figure", os.path.join(out, "f.png")],
           os.path.join(out, "fig13.log"))
    rows = {r["mode"]: r for r in json.load(open(os.path.join(out, "bench_students_fig13.json")))["pooled"]}
    return {"teacher_p99_ms": rows["teacher"]["p99_ms"], "adaptive_p99_ms": rows["adaptive"]["p99_ms"],
            "p99_ratio": rows["adaptive"]["p99_ms"] / rows["teacher"]["p99_ms"]}


def stepped_run(tree, args, out):
    run_in(tree, ["-m", "benchmarks.bench_students", "--store", args.store, *tenant_args(args), "--scores",
                  args.scores, "--skip-accuracy", "--rates", *map(str, args.rates), "--seconds",
                  *map(str, args.seconds), "--rounds", "1", "--target-ms", str(args.target_ms), "--threads", "1", "--out", out,
                  "--figure", os.path.join(out, "s.png")], os.path.join(out, "stepped.log"))
    rows = json.load(open(os.path.join(out, "bench_students.json")))["pooled"]
    burst = {r["mode"]: r for r in rows if r["phase"] == 1}
    return {"teacher_p99_ms": burst["teacher"]["p99_ms"], "adaptive_p99_ms": burst["adaptive"]["p99_ms"],
            "p99_ratio": burst["adaptive"]["p99_ms"] / burst["teacher"]["p99_ms"]}


def tenant_args(args) -> list:
    return [x for t in args.tenant for x in ("--tenant", t)]


# -- over HTTP ----------------------------------------------------------------------------------------


class Server:
    """`hkstore serve` of a checkout in its own process (with --batching when given)."""

    def __init__(self, tree, args, out, batching=None):
        from benchmarks.loadgen import _end_with_parent, free_port, wait_healthy

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = open(args.token_file).read().strip()
        common = [args.store, "--port", str(self.port), "--max-batch", "32", "--max-wait-ms", "5"]
        cmd = ["-m", "runtime.serve.cli", "--admin-token-file", args.token_file, "--device", "cpu", "--max-len", "128",
               "--truncate", "--queue-limit", "8192", "--request-timeout", "120",
               *(["--batching", batching] if batching else [])]
        self.log = open(os.path.join(out, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, *cmd, *common], cwd=tree, env=env_for(tree), stdout=self.log,
                                     stderr=subprocess.STDOUT, preexec_fn=_end_with_parent)
        wait_healthy(self.proc, self.url, f"the server (see {self.log.name})")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def texts_of(args, lengths) -> list:
    words = open(args.corpus).read().split()
    rng = random.Random(7)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(*lengths))) for _ in range(512)]


async def poisson(client, tenants, texts, rate, seconds, seed) -> dict:
    """Open-loop Poisson arrivals: latency percentiles and answered requests per second."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        arrivals.append(t)
    start = time.perf_counter()

    async def one(at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        status, lat, *_ = await client.call(rng.choice(tenants), {"text": rng.choice(texts)})
        return status, lat

    got = await asyncio.gather(*(one(a) for a in arrivals))
    wall = time.perf_counter() - start
    lat = sorted(x[1] for x in got if x[0] == 200)
    return {"offered": rate, "sent": len(got), "errors": sum(x[0] != 200 for x in got),
            "throughput": len(lat) / wall, **percentiles(lat)}


def percentiles(lat) -> dict:
    import numpy as np

    return {"p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3)}


async def sequential(client, tenants, texts, n) -> dict:
    lat = []
    for i in range(n):
        status, dt, *_ = await client.call(tenants[i % len(tenants)], {"text": texts[i % len(texts)]})
        if status != 200:
            raise RuntimeError(f"the server answered {status}")
        lat.append(dt)
    return percentiles(lat)


def latency_run(tree, args, out):
    from benchmarks.loadgen import Client

    server = Server(tree, args, out)
    tenants = [f"t{i:05d}" for i in range(8)]
    texts = texts_of(args, (8, 24))

    async def drive():
        client = Client(server.url, server.token, [], timeout=120)
        await sequential(client, tenants, texts, 20)  # PETs loaded, connections open
        seq = await sequential(client, tenants, texts, args.sequential)
        low = await poisson(client, tenants, texts, args.poisson_rate, args.poisson_seconds, 1)
        await client.close()
        return {"sequential": seq, "poisson": low}

    try:
        return asyncio.run(drive())
    finally:
        server.stop()


def batching_run(mode, args, out):
    from benchmarks.loadgen import Client

    server = Server(ROOT, args, out, batching=mode)
    tenants = [f"t{i:05d}" for i in range(args.tenants_http)]
    texts = texts_of(args, (8, 128))

    async def drive():
        client = Client(server.url, server.token, [], timeout=120)
        await sequential(client, tenants[:32], texts, 32)
        res = {}
        for rate in args.batch_rates:
            res[str(rate)] = await poisson(client, tenants, texts, rate, args.batch_seconds, 2)
        await client.close()
        return res

    try:
        return asyncio.run(drive())
    finally:
        server.stop()


# -- rounds and the report ----------------------------------------------------------------------------


def rounds(name, systems: dict, fn, args, report):
    """fn(system, args, out dir) -> numbers, for every system in turn, --rounds rounds."""
    runs = report["runs"].setdefault(name, [])
    for rnd in range(args.rounds):
        for system in turns(systems, rnd):
            out = os.path.join(args.work, f"{name}-{system}-{rnd}")
            os.makedirs(out, exist_ok=True)
            before = load()
            t0 = time.perf_counter()
            numbers = fn(systems[system], args, out)
            runs.append({"system": system, "round": rnd, "load_before": before, "load_after": load(),
                         "seconds": time.perf_counter() - t0, **numbers})
            print(json.dumps(runs[-1]), flush=True)
            save(args, report)


def per_round(runs, key_fn) -> dict:
    """{number name: ([old], [new], [new / old])} over the rounds both checkouts ran."""
    by = {}
    for r in runs:
        by.setdefault(r["round"], {})[r["system"]] = key_fn(r)
    out = {}
    for pair in by.values():
        if "new" in pair and "old" in pair:
            for k, v in pair["new"].items():
                old, new, ratio = out.setdefault(k, ([], [], []))
                old.append(pair["old"][k])
                new.append(v)
                ratio.append(v / pair["old"][k])
    return out


def row(label, values, digits) -> list:
    old, new, ratio = values
    med = statistics.median(ratio)
    rnd = (lambda x: int(round(x))) if digits == 0 else (lambda x: round(x, digits))
    return [label, rnd(statistics.median(old)), rnd(statistics.median(new)),
            f"{med:.2f} ({min(ratio):.2f}-{max(ratio):.2f})"]


def versus_table(report) -> dict:
    rows = []
    if "runtime" in report:
        got = per_round(report["runtime"], lambda r: {k: r[k] for k in r if k.startswith("hplm_")})
        rows += [row(f"hPLM requests/s, {int(k[5:]):,} tenant{'s' * (k != 'hplm_1')}", v, 1) for k, v in got.items()]
    for name, label in (("fig13", "Fig. 13 burst: p99 adaptive / teacher-only"),
                        ("stepped", "stepped load, burst: p99 adaptive / teacher-only")):
        if name in report:
            got = per_round(report[name], lambda r: {"x": r["p99_ratio"], "teacher": r["teacher_p99_ms"],
                                                     "adaptive": r["adaptive_p99_ms"]})
            what = label.split(":")[0]
            rows += [row(label, got["x"], 3)] if got else []
            if got and name == "fig13":  # its ratio moved: say which of its two p99s did
                rows += [row(f"{what}: p99 ms, teacher-only", got["teacher"], 0),
                         row(f"{what}: p99 ms, adaptive", got["adaptive"], 0)]
    if "latency" in report:
        got = per_round(report["latency"], lambda r: {(w, p): r[w][p] for w in ("sequential", "poisson")
                                                      for p in ("p50_ms", "p99_ms")})
        for (w, p), v in got.items():
            what = "one client, sequential" if w == "sequential" else "Poisson, low rate"
            rows.append(row(f"`hkstore serve`, {what}: {p[:3]} ms", v, 1))
    return {"columns": ["measure", "wrapped", "one engine", "engine / wrapped, median (range)"], "rows": rows}


def batching_table(report) -> dict:
    runs = report["batching"]
    rates = [k for k in runs[0] if k[0].isdigit()]
    rows = []
    for mode in (m for m in MODES if any(r["system"] == m for r in runs)):
        cells = [mode]
        for rate in rates:
            got = [r[rate] for r in runs if r["system"] == mode]
            for key, digits in (("throughput", 1), ("p50_ms", 0), ("p99_ms", 0)):
                v = [g[key] for g in got]
                cells.append(f"{statistics.median(v):,.{digits}f} ({min(v):,.{digits}f}-{max(v):,.{digits}f})")
        rows.append(cells)
    columns = ["batching"] + [f"{float(r):g} req/s: {c}" if i == 0 else c for r in rates
                              for i, c in enumerate(("served req/s", "p50 ms", "p99 ms"))]
    return {"columns": columns, "rows": rows}


def loads(report) -> str:
    seen = [x for runs in report.get("runs", {}).values() for r in runs for x in (r["load_before"], r["load_after"])]
    return f"{min(seen):.1f}-{max(seen):.1f}" if seen else ""


def save(args, report):
    report["tables"] = [versus_table(report["runs"])] + (
        [batching_table(report["runs"])] if "batching" in report["runs"] else [])
    report["load"] = loads(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the older checkout (its C extension built)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--tenant", action="append", default=[], help="TENANT=TEST_FILE with students (repeatable)")
    ap.add_argument("--scores", help="the --tenant tenants' `hkstore students eval` results, tenant -> result")
    ap.add_argument("--corpus", help="text whose words make the HTTP requests' texts (default: the store's "
                                     "benchmarks.loadgen corpus beside it)")
    ap.add_argument("--work", required=True, help="folder for the runs' own outputs")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "one_engine.json"))
    ap.add_argument("--sections", default="runtime,fig13,stepped,latency,batching")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tenants", default="1,1000,10000", help="runtime: tenant counts")
    ap.add_argument("--burst-threads", type=int, default=100)
    ap.add_argument("--burst-stagger", type=float, default=0.05)
    ap.add_argument("--burst-period", type=float, default=1.0)
    ap.add_argument("--burst-count", type=int, default=6)
    ap.add_argument("--target-ms", type=float, default=500.0,
                    help="fig13, stepped: the students' latency target (a burst must push teacher-only past it)")
    ap.add_argument("--rates", type=float, nargs=2, default=(15.0, 120.0), metavar=("LOW", "BURST"))
    ap.add_argument("--seconds", type=float, nargs=3, default=(4, 6, 6))
    ap.add_argument("--sequential", type=int, default=300)
    ap.add_argument("--poisson-rate", type=float, default=5.0)
    ap.add_argument("--poisson-seconds", type=float, default=20.0)
    ap.add_argument("--tenants-http", type=int, default=2000)
    ap.add_argument("--batch-rates", type=float, nargs="+", default=(40.0, 60.0))
    ap.add_argument("--batch-seconds", type=float, default=15.0)
    args = ap.parse_args(argv)
    args.corpus = args.corpus or os.path.join(os.path.dirname(os.path.abspath(args.store)), "data", "corpus.txt")
    os.makedirs(args.work, exist_ok=True)
    args.token_file = os.path.join(args.work, "admin.token")
    with open(args.token_file, "w") as f:
        f.write("bench-" + os.urandom(12).hex() + "\n")
    trees = {"new": ROOT, "old": os.path.abspath(args.old)}
    report = json.load(open(args.out)) if os.path.exists(args.out) else {}
    report.update(section=SECTION, machine=f"{platform.machine()}, {os.cpu_count()} cores",
                  date=time.strftime("%Y-%m-%d"))
    report.setdefault("command", " ".join(["python -m benchmarks.bench_engine_vs", *argv]))
    report.setdefault("runs", {})
    sections = {"runtime": (trees, runtime_run), "fig13": (trees, fig13_run), "stepped": (trees, stepped_run),
                "latency": (trees, latency_run), "batching": ({m: m for m in MODES}, batching_run)}
    for name in filter(None, args.sections.split(",")):  # none: the tables again from --out's runs
        systems, fn = sections[name]
        report["runs"].pop(name, None)
        rounds(name, systems, fn, args, report)
    save(args, report)


if __name__ == "__main__":
    main()
