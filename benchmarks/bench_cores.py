"""Scaling with cores: `hkstore serve --workers N` against one worker, through HTTP.

    python -m benchmarks.bench_cores --quick                     # < 3 min: tiny model, short runs
    python -m benchmarks.bench_cores --workers 1,2 --write       # the BENCHMARKS run (2 cores)
    python -m benchmarks.bench_cores --workers 1,16 --out OUT    # a 16-core machine

It builds a store on the embedded all-MiniLM-L6-v2 (or reuses --store): the root PLOT of
standard-library docstrings, one tenant trained with both levels (a LoRA PET for the PLOT
level, a full-depth LoRA for the top), cloned under more names. Then one server per worker
count (`python -m runtime.serve.cli --workers N`, all started at once, idle while another is
measured) and, interleaved over --rounds:

* **closed loop**: --clients clients, each sending a request of --texts texts of about
  --tokens tokens to a tenant drawn round-robin from the first T tenants (T in --tenants), then
  the next one as soon as it is answered, for --seconds. Throughput (texts/s), latency
  percentiles, and CPU seconds per text of the server and its workers (/proc).
* **the same offered load**: an open loop at --rate-share of one worker's closed-loop
  throughput (Poisson arrivals), on every worker count: its p99.

Levels: ``plot`` asks ``policy: fast`` (the PLOT level), ``top`` asks ``policy: exact`` (the
tenant's full-depth PET in every layer). Memory: each server's and worker's RSS and PSS, and
the store's mapped pages (smaps of its files: shared in the page cache, so their PSS is a
share of one copy). Writes OUT/cores.json and OUT/cores.md; --write also writes
benchmarks/results/cores.json (BENCHMARKS, "Scaling with cores").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import time

from benchmarks.loadgen import LOOPBACK, _end_with_parent, build_root, corpus_texts, free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "cores.json")
SECTION = "Scaling with cores"
LABELS = ("math", "os.path", "string", "json")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def names(n):
    return [f"c{i:05d}" for i in range(n)]


# -- the store --------------------------------------------------------------------------------------


def prepare_store(args) -> None:
    """args.store with max(--tenants) tenants, each with a PLOT-level PET and a full-depth PET."""
    import hkstore
    from formats.pack import PetRecord
    from runtime.construct import manager
    from runtime.demo.stdlib_text import first_lines

    store, data = args.store, os.path.join(args.out, "data")
    os.makedirs(data, exist_ok=True)
    build_root(store, data, "tiny" if args.quick else "minilm", args.tokens, log)
    want = names(max(args.tenants))
    with hkstore.open(store) as st:
        have = set(st.snapshot().pets)
    if want[0] not in have:
        t0 = time.perf_counter()
        train = os.path.join(data, "train.jsonl")
        with open(train, "w") as f:
            for m in LABELS:
                for line in first_lines(m)[:40]:
                    f.write(json.dumps({"text": line, "label": m}) + "\n")
        manager.tenant_create(store, want[0], version="root", train_path=train, epochs=1, max_examples=64,
                              max_len=64, progress=False)
        log(f"trained tenant {want[0]} (both levels) in {time.perf_counter() - t0:.1f} s")
        have.add(want[0])
    missing = [t for t in want if t not in have]
    if missing:
        with hkstore.open(store, writable=True) as st:
            pet, full = st.get_pet(want[0]), st.get_full(want[0])
            records = []
            for t in missing:
                records.append(PetRecord(tenant=t, meta=dict(pet.meta, tenant=t), tensors=pet.tensors))
                records.append(PetRecord(tenant=t, meta=dict(full.meta, tenant=t), tensors=full.tensors))
            st.put_pets(records)
        log(f"cloned {len(missing)} tenants")


def request_texts(tokens: int, count: int, seed: int = 0) -> list:
    """Texts of about `tokens` word pieces: docstring lines joined (a word is ~1.3 pieces)."""
    lines = corpus_texts()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = []
        while len(words) < int(tokens / 1.4):
            words += rng.choice(lines).split()
        out.append(" ".join(words[: int(tokens / 1.4)]))
    return out


# -- servers ---------------------------------------------------------------------------------------


class Server:
    def __init__(self, args, workers, token_file, ray=False, extra=()):
        self.workers, self.port, self.ray = workers, free_port(), ray
        self.name = f"ray{workers}" if ray else workers
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = os.path.join(args.out, f"server-{'ray' if ray else 'w'}{workers}{''.join(extra)}.log")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "runtime.serve.cli", args.store, "--host", LOOPBACK, "--port", str(self.port),
               "--admin-token-file", token_file, "--device", "cpu", "--max-len", str(args.tokens),
               "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms), "--queue-limit", "100000",
               "--request-timeout", "600", "--torch-threads", str(args.torch_threads), "--truncate"]
        cmd += (["--ray", "--replicas", str(workers)] if ray else ["--workers", str(workers)]) + list(extra)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=_end_with_parent)

    def wait(self, admin):
        import httpx

        took = wait_healthy(self.proc, self.url, f"the {self.name}-worker server (see {self.log_path})", 600)
        h = httpx.get(self.url + "/healthz", headers={"Authorization": f"Bearer {admin}"}, timeout=10).json()
        self.pids = [self.proc.pid] + [p for p in (h.get("workers") or {}).get("pids", []) if p]
        if self.ray:  # replicas are Ray's processes, not this server's children: no CPU or memory figures
            self.pids = []
        log(f"{self.name}-worker server up in {took:.1f} s (pids {self.pids})")

    def cpu_seconds(self) -> float:
        """User + system CPU of the server's process and its workers (live ones: /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except OSError:
                pass
        return total

    def memory(self, store) -> list:
        return [dict(pid=pid, **smaps(pid, store)) for pid in self.pids]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def smaps(pid, store) -> dict:
    """RSS and PSS of a process, and of its mappings of the store's files (MiB)."""
    out = {"rss_mib": 0.0, "pss_mib": 0.0, "store_rss_mib": 0.0, "store_pss_mib": 0.0}
    store = os.path.realpath(store)
    in_store = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if not head:
                    continue
                if not head[0].endswith(":") or len(head) > 3:  # a mapping's header line
                    in_store = len(head) >= 6 and head[5].startswith(store + os.sep)
                    continue
                if head[0] in ("Rss:", "Pss:"):
                    mib = int(head[1]) / 1024
                    key = head[0][:-1].lower()
                    out[f"{key}_mib"] += mib
                    if in_store:
                        out[f"store_{key}_mib"] += mib
    except OSError:
        pass
    return {k: round(v, 1) for k, v in out.items()}


# -- clients ---------------------------------------------------------------------------------------


async def closed_loop(url, admin, tenants, texts, args, policy, seconds):
    import httpx

    lat, done, errors = [], 0, {}
    stop = time.perf_counter() + seconds
    counter = iter(range(1 << 60))

    async def client(c):
        nonlocal done
        while time.perf_counter() < stop:
            i = next(counter)
            body = {"texts": [texts[(i * args.texts + k) % len(texts)] for k in range(args.texts)], "policy": policy}
            t0 = time.perf_counter()
            r = await c.post(f"/v1/tenants/{tenants[i % len(tenants)]}/infer", json=body)
            if r.status_code == 200:
                lat.append(time.perf_counter() - t0)
                done += args.texts
            else:
                errors[r.status_code] = errors.get(r.status_code, 0) + 1

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=600,
                                 limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(args.clients)))
        wall = time.perf_counter() - t0
    return {"texts_per_s": done / wall, "wall_s": wall, "texts": done, "errors": errors, **percentiles(lat)}


async def open_loop(url, admin, tenants, texts, args, policy, rate_texts, seconds):
    import httpx

    lat, errors = [], {}
    rng = random.Random(1)
    rate = rate_texts / args.texts  # requests/s

    async def one(c, i):
        body = {"texts": [texts[(i * args.texts + k) % len(texts)] for k in range(args.texts)], "policy": policy}
        t0 = time.perf_counter()
        r = await c.post(f"/v1/tenants/{tenants[i % len(tenants)]}/infer", json=body)
        if r.status_code == 200:
            lat.append(time.perf_counter() - t0)
        else:
            errors[r.status_code] = errors.get(r.status_code, 0) + 1

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=600,
                                 limits=limits) as c:
        tasks, t, i = [], time.perf_counter(), 0
        end = t + seconds
        while t < end:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(t - time.perf_counter(), 0))
            tasks.append(asyncio.create_task(one(c, i)))
            i += 1
        await asyncio.gather(*tasks)
    return {"offered_texts_per_s": rate_texts, "errors": errors, **percentiles(lat)}


def percentiles(lat) -> dict:
    if not lat:
        return {"p50_ms": None, "p99_ms": None}
    s = sorted(lat)
    return {"p50_ms": round(1000 * s[len(s) // 2], 1), "p99_ms": round(1000 * s[min(len(s) - 1, int(0.99 * len(s)))], 1)}


def warm(url, admin, tenants, texts, policy):
    """One request per tenant (not measured): the PET caches warm, as on a server up a while."""
    import httpx

    async def go():
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=600) as c:
            async def one(t):
                async with sem:
                    await c.post(f"/v1/tenants/{t}/infer", json={"texts": texts[:2], "policy": policy})
            await asyncio.gather(*(one(t) for t in tenants))

    asyncio.run(go())


# -- the run -------------------------------------------------------------------------------------


def run(args) -> dict:
    prepare_store(args)
    texts = request_texts(args.tokens, 64)
    admin = secrets.token_urlsafe(24)
    token_file = os.path.join(args.out, "admin.token")
    with open(token_file, "w") as f:
        f.write(admin + "\n")
    servers = {w: Server(args, w, token_file) for w in args.workers}
    if args.ray:  # Ray Serve on this machine, as many replicas as the most workers
        servers[f"ray{max(args.workers)}"] = Server(args, max(args.workers), token_file, ray=True)
    try:
        for s in servers.values():
            s.wait(admin)
        rows, started = [], time.perf_counter()
        plan = [(level, T) for level in args.levels for T in args.tenants]
        for n, (level, T) in enumerate(plan):
            policy = {"plot": "fast", "top": "exact"}[level]
            tenants = names(T)
            for s in servers.values():
                warm(s.url, admin, tenants, texts, policy)
            runs = {w: [] for w in servers}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(list(servers)))  # interleaved
                for w in order:
                    s = servers[w]
                    cpu0 = s.cpu_seconds()
                    out = asyncio.run(closed_loop(s.url, admin, tenants, texts, args, policy, args.seconds))
                    out["cpu_s_per_text"] = None if s.ray else (s.cpu_seconds() - cpu0) / max(out["texts"], 1)
                    out["load"] = os.getloadavg()[0]
                    runs[w].append(out)
                    log(f"{level} T={T} workers={w} round {r + 1}: {out['texts_per_s']:.1f} texts/s, "
                        f"p99 {out['p99_ms']} ms, {out['errors'] or 'no errors'}")
            base = statistics.median(x["texts_per_s"] for x in runs[min(args.workers)])
            same_load = {}
            for w in servers:  # p99 at the same offered load: a share of one worker's throughput
                same_load[w] = asyncio.run(open_loop(servers[w].url, admin, tenants, texts, args, policy,
                                                     args.rate_share * base, args.seconds))
            for w in servers:
                tput = [x["texts_per_s"] for x in runs[w]]
                rows.append({"level": level, "tenants": T, "workers": w, "texts_per_s": statistics.median(tput),
                             "spread": [min(tput), max(tput)], "vs_1": statistics.median(tput) / base,
                             "p99_closed_ms": statistics.median(x["p99_ms"] for x in runs[w]),
                             "p99_same_load_ms": same_load[w]["p99_ms"],
                             "offered_texts_per_s": round(args.rate_share * base, 1),
                             "cpu_ms_per_text": None if servers[w].ray else
                             1000 * statistics.median(x["cpu_s_per_text"] for x in runs[w]),
                             "errors": sum(sum(x["errors"].values()) for x in runs[w]) + sum(same_load[w]["errors"].values()),
                             "load": max(x["load"] for x in runs[w])})
            left = (time.perf_counter() - started) / (n + 1) * (len(plan) - n - 1)
            log(f"{n + 1}/{len(plan)} cases done, about {left / 60:.1f} min left")
        memory = {w: s.memory(args.store) for w, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    return {"rows": rows, "memory": memory}


def summary(args, result) -> dict:
    rows = result["rows"]
    most = max(args.workers)
    top = [r for r in rows if r["workers"] == most]
    ray = [r for r in rows if r["workers"] == f"ray{most}"]
    out = {"section": SECTION,
           "command": "python -m benchmarks.bench_cores " + " ".join(
               {args.out: "OUT", args.store: "STORE"}.get(a, a) for a in (args.argv or [])),
           "machine": f"{cpu_model()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
                      f"Python {platform.python_version()}",
           "load": round(max(r["load"] for r in rows), 2),
           "date": datetime.date.today().isoformat(),
           "tables": [{"columns": ["level", "tenants", "workers", "texts/s", "vs one worker", "p99 ms (closed loop)",
                                   "p99 ms (same offered load)", "CPU ms per text"],
                       "rows": [[r["level"], r["tenants"], r["workers"], round(r["texts_per_s"], 1),
                                 round(r["vs_1"], 2), round(r["p99_closed_ms"]), _num(r["p99_same_load_ms"], 0),
                                 _num(r["cpu_ms_per_text"], 1)] for r in rows]}]}
    out[f"workers{most}_vs_1"] = round(min(r["vs_1"] for r in top), 2)
    if ray:
        out[f"ray{most}_vs_1"] = round(min(r["vs_1"] for r in ray), 2)
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _num(x, digits):
    return "n/a" if x is None else round(x, digits) if digits else round(x)


def report(args, result, summ) -> str:
    t = summ["tables"][0]
    lines = ["| " + " | ".join(t["columns"]) + " |", "|" + " --- |" * len(t["columns"])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in t["rows"]]
    mem = ["", "| workers | process | RSS MiB | PSS MiB | store RSS MiB | store PSS MiB |", "|" + " --- |" * 6]
    for w, procs in result["memory"].items():
        for j, m in enumerate(procs):
            mem.append(f"| {w} | {'server' if j == 0 else f'worker {j}'} | {m['rss_mib']} | {m['pss_mib']} | "
                       f"{m['store_rss_mib']} | {m['store_pss_mib']} |")
    return "\n".join(lines + mem) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    ap.add_argument("--store", default=None, help="store to serve (built there when missing; default OUT/store)")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated (the smallest is the base)")
    ap.add_argument("--tenants", default="1,16,1000")
    ap.add_argument("--levels", default="plot,top")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--texts", type=int, default=4, help="texts per request")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text (about)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate-share", type=float, default=0.7)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs")
    ap.add_argument("--ray", action="store_true", help="also Ray Serve on this machine (--ray --replicas N, N the most "
                                                       "workers)")
    ap.add_argument("--write", action="store_true", help="also write benchmarks/results/cores.json")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.workers = sorted({int(w) for w in args.workers.split(",")})
    args.tenants = [int(t) for t in args.tenants.split(",")]
    args.levels = [x for x in args.levels.split(",") if x]
    if any(x not in ("plot", "top") for x in args.levels):
        ap.error("--levels: plot and/or top")
    if args.quick:
        args.tokens, args.seconds, args.rounds, args.tenants = min(args.tokens, 32), min(args.seconds, 3.0), 1, \
            [min(t, 16) for t in args.tenants]
    if args.out is None:
        import tempfile

        args.out = tempfile.mkdtemp(prefix="bench-cores-")
    os.makedirs(args.out, exist_ok=True)
    args.store = args.store or os.path.join(args.out, "store")
    return args


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    summ = summary(args, result)
    with open(os.path.join(args.out, "cores.json"), "w") as f:
        json.dump({**summ, "raw": result}, f, indent=1)
    md = report(args, result, summ)
    with open(os.path.join(args.out, "cores.md"), "w") as f:
        f.write(md)
    print(md)
    if args.write:
        with open(RESULTS, "w") as f:
            json.dump(summ, f, indent=1)
            f.write("\n")
        log(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
