"""Load generator for the HTTP server (HMI §7 workloads), loopback only.

    python -m benchmarks.loadgen --quick                 # < 60 s: tiny model, few tenants, short runs
    python -m benchmarks.loadgen                         # full run (<= 15 min on 2 cores): MiniLM

It builds a store (or reuses --store), trains one tenant and clones its PET under more names,
starts `python -m runtime.serve.cli` on a free 127.0.0.1 port for each system, drives the
workloads below, and writes OUT/loadgen.md (markdown tables), OUT/loadgen.json (raw numbers)
and PNGs through tools/plots.py:

* **constant rate** (HMI Fig. 12): every tenant sends one request every --period seconds,
  --count requests each (HMI: 20 s, 100; scaled down by default), for each tenant count in
  --tenants; tenants start at random phases. Where tenants / period would pass --max-offered
  requests/s the period grows to keep the offered load there (the full run: 4 s up to 1000
  tenants, 40 s at 10K, so 10K tenants offer what 1000 do). Open loop: a request goes out at its time
  whether or not earlier ones were answered. Reports end-to-end latency percentiles and
  throughput against the number of tenants (fig12_latency.png, fig12_throughput.png).
* **burst** (HMI Fig. 13): --burst-threads clients started --burst-stagger s apart, each
  sending a request every --burst-period s (waiting for the answer first, like a thread),
  --burst-count each (HMI: 250, 0.05 s, 1.2 s, 50); client i is tenant i mod tenants.
  Reports the latency CDF (fig13_burst_cdf.png).
* **Poisson**: arrivals at --poisson-rate per second over --poisson-seconds, each to a random
  tenant.

Before the runs each server gets one request per tenant (not measured), so the runs see
the runtime's PET cache warm, as a server that has been up for a while would.

Systems: ``hplm`` (the server's shared mode) and ``dedicated`` (its baseline emulation: a full
model per tenant, swapped in on demand; see runtime/serve/app.py). Every loop is bounded in count
and in time (--max-seconds per run); requests go to 127.0.0.1 only. Latency is measured by the
client from the moment a request is sent to its answer; only 200 answers count in the
percentiles, the others are reported by status (429 queue full, 504 timeout, 0 transport error
or client timeout, -1 not sent: the run's time was up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from runtime.demo.stdlib_text import first_lines as docstring_lines
from runtime.model.tiny import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPBACK = "127.0.0.1"
IDLE_S = 3.0  # the client drops keep-alive connections idle this long (the server's limit is 5 s)
CORPUS_MODULES = ("math", "os.path", "string", "json", "re", "itertools", "functools", "collections", "random",
                  "statistics", "shutil", "textwrap")
LABEL_MODULES = ("math", "os.path", "string", "json")

QUICK = dict(model="tiny", tenants="1,10,100", period=0.5, max_offered=0.0, count=5, max_seconds=10, burst_threads=20,
             burst_stagger=0.05, burst_period=0.3, burst_count=6, poisson_rate=40, poisson_seconds=2.0,
             request_timeout=5.0, max_len=32)
FULL = dict(model="minilm", tenants="1,10,100,1000,10000", period=4.0, max_offered=250.0, count=8, max_seconds=32, burst_threads=250,
            burst_stagger=0.05, burst_period=1.2, burst_count=50, poisson_rate=60, poisson_seconds=20.0,
            request_timeout=10.0, max_len=64)


# -- data and store ---------------------------------------------------------------------------------


def corpus_texts():
    return list(dict.fromkeys(line for m in CORPUS_MODULES for line in docstring_lines(m)))


def tenant_names(n):
    return [f"t{i:05d}" for i in range(n)]


def build_root(store, data, model, max_len, log):
    """The store's root PLOT of the docstring corpus, unless it exists. model: tiny (a random
    6-layer d=32 BERT), minilm (the embedded all-MiniLM-L6-v2) or a model directory."""
    from runtime.construct import manager

    if os.path.exists(os.path.join(store, "CURRENT")):
        return
    t0 = time.perf_counter()
    texts = corpus_texts()
    corpus = os.path.join(data, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(texts) + "\n")
    path = make_tiny_model(os.path.join(data, "tiny-model"), texts) if model == "tiny" else \
        None if model == "minilm" else model
    manager.build(store, model_path=path, corpus_paths=[corpus], max_len=max_len, progress=False)
    log(f"built the root PLOT of {store} in {time.perf_counter() - t0:.1f} s")


def prepare_store(args, log):
    """The store at args.store with at least max(--tenants) tenants (built or completed here)."""
    import hkstore
    from formats.pack import PetRecord
    from runtime.construct import manager

    want = max(args.tenant_counts + [min(args.burst_threads, max(args.tenant_counts))])
    store = args.store
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "data")
    os.makedirs(data, exist_ok=True)
    texts = corpus_texts()
    build_root(store, data, args.model, args.max_len, log)
    first = tenant_names(1)[0]
    with hkstore.open(store) as st:
        have = set(st.snapshot().pets)
    if first not in have:
        t0 = time.perf_counter()
        train = os.path.join(data, "train.jsonl")
        with open(train, "w") as f:
            for m in LABEL_MODULES:
                for line in docstring_lines(m)[:60]:
                    f.write(json.dumps({"text": line, "label": m}) + "\n")
        manager.tenant_create(store, first, version="root", train_path=train, pet_type="lora", rank=8, epochs=1,
                              max_examples=64 if args.quick else None, max_len=args.max_len, progress=False)
        log(f"trained tenant {first} (LoRA) in {time.perf_counter() - t0:.1f} s")
        have.add(first)
    missing = [t for t in tenant_names(want) if t not in have]
    if missing:
        t0 = time.perf_counter()
        with hkstore.open(store, writable=True) as st:
            record = st.get_pet(first)
            records = [PetRecord(tenant=t, meta=dict(record.meta, tenant=t), tensors=record.tensors) for t in missing]
            if hasattr(st, "put_pets"):  # one commit for all, where the store offers it
                st.put_pets(records)
            else:
                for r in records:
                    st.put_pet(r)
        log(f"cloned {len(missing)} tenants from {first} in {time.perf_counter() - t0:.1f} s")
    return texts


# -- the server ---------------------------------------------------------------------------------------


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _end_with_parent():
    """In the server child (Linux): SIGTERM when the load generator dies, so no server is left."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_healthy(proc, url: str, what: str, timeout: float = 180.0) -> float:
    """Wait until the server process `proc` answers GET url/healthz with 200; the seconds it
    took. RuntimeError naming `what` when the process exits first or `timeout` passes."""
    import httpx

    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=5) as c:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode})")
            try:
                if c.get("/healthz").status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not start in {timeout:.0f} s")


class ServerProcess:
    def __init__(self, args, mode, token_file, log, extra=()):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = os.path.join(args.out, f"server-{mode}.log")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "runtime.serve.cli", args.store, "--host", LOOPBACK, "--port", str(self.port),
               "--admin-token-file", token_file, "--mode", "shared" if mode == "hplm" else "dedicated",
               "--device", args.device, "--max-len", str(args.max_len), "--max-batch", str(args.max_batch),
               "--max-wait-ms", str(args.max_wait_ms), "--queue-limit", str(args.queue_limit),
               "--request-timeout", str(args.request_timeout), "--dedicated-resident", str(args.dedicated_resident),
               "--metrics-public", *extra]  # a loopback benchmark server: its scraper needs no token
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=_end_with_parent)
        try:
            took = wait_healthy(self.proc, self.url, f"the {mode} server (see {self.log_path})")
        except RuntimeError:
            self.stop()
            raise
        log(f"{mode} server up on {self.url} in {took:.1f} s")

    def metrics(self) -> dict:
        import httpx

        out = {}
        with httpx.Client(base_url=self.url, timeout=10) as c:
            for line in c.get("/metrics").text.splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- workloads ----------------------------------------------------------------------------------------


class Client:
    """A lean HTTP/1.1 keep-alive client on asyncio streams (httpx costs the client more CPU
    than the server spends on a request: on a small machine it would measure itself)."""

    def __init__(self, url, token, texts, timeout, max_connections=1024):
        host_port = url.split("://", 1)[1].rstrip("/")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        if self.host not in (LOOPBACK, "localhost", "[::1]"):
            raise ValueError(f"loopback only, not {self.host}")
        self.token, self.texts, self.timeout = token, texts, timeout
        self.rng = random.Random(0)
        self.slots = asyncio.Semaphore(max_connections)
        self.idle = []

    async def one(self, tenant):
        """(status, latency s, sent at, answered at); status 0 for a transport error or timeout."""
        text = self.texts[self.rng.randrange(len(self.texts))]
        return (await self.call(tenant, {"text": text}))[:4]

    async def call(self, tenant, fields: dict):
        """(status, latency s, sent at, answered at, response body bytes) of an infer request
        with these body fields."""
        body = json.dumps(fields).encode()
        request = (f"POST /v1/tenants/{tenant}/infer HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        t0 = time.perf_counter()  # before waiting for a connection slot: client queueing counts too
        async with self.slots:
            status, fresh, payload = 0, False, b""
            for attempt in range(2):
                conn = None if fresh else self._idle_connection()
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
                    conn[1].write(request)
                    status, keep, payload = await asyncio.wait_for(self._response(conn[0]), self.timeout)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
                    if conn is not None:
                        conn[1].close()
                    if reused and attempt == 0:
                        fresh = True  # the server had closed this idle connection: a new one
                        continue
                    status, keep = 0, False
                if keep:
                    self.idle.append((conn[0], conn[1], time.monotonic()))
                elif conn is not None:
                    conn[1].close()
                break
            t1 = time.perf_counter()
        return status, t1 - t0, t0, t1, payload

    def _idle_connection(self):
        """The most recently used idle connection that the server has not timed out (uvicorn
        closes keep-alive connections idle for 5 s); older ones are closed."""
        while self.idle:
            reader, writer, used = self.idle.pop()
            if time.monotonic() - used < IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    @staticmethod
    async def _response(reader):
        line = await reader.readline()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        status = int(line.split()[1])
        length, keep = 0, True
        while True:
            header = await reader.readline()
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        return status, keep, await reader.readexactly(length)

    async def close(self):
        for _, writer, _ in self.idle:
            writer.close()
        self.idle = []


async def open_loop(client, schedule, max_seconds):
    """Send each (time offset, tenant) of schedule at its time; nothing is sent past
    max_seconds (by the schedule or by the clock, should the client fall behind): the
    requests left over are reported with status -1."""
    start = time.perf_counter() + 0.1
    tasks = []
    for offset, tenant in schedule:
        if offset > max_seconds or time.perf_counter() - start > max_seconds:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.one(tenant)))
    results = await asyncio.gather(*tasks)
    now = time.perf_counter()
    unsent = sum(1 for offset, _ in schedule[len(tasks):] if offset <= max_seconds)
    return results + [(-1, 0.0, now, now)] * unsent


async def constant_rate(client, tenants, period, count, max_seconds, rng):
    phases = rng.uniform(0, period, size=len(tenants))
    schedule = sorted((float(p + k * period), t) for t, p in zip(tenants, phases) for k in range(count))
    return await open_loop(client, schedule, max_seconds)


async def poisson(client, tenants, rate, seconds, rng):
    n = int(rng.poisson(rate * seconds))
    times = np.sort(rng.uniform(0, seconds, size=n))
    schedule = [(float(t), tenants[int(rng.integers(len(tenants)))]) for t in times]
    return await open_loop(client, schedule, seconds)


async def burst(client, tenants, threads, stagger, period, count, max_seconds):
    """Each client: a request, wait for the answer, then the next at its tick (HMI's threads)."""
    results = []
    start = time.perf_counter()
    deadline = start + max_seconds

    async def worker(i):
        await asyncio.sleep(i * stagger)
        t0 = time.perf_counter()
        tenant = tenants[i % len(tenants)]
        for k in range(count):
            tick = t0 + k * period
            if tick > deadline or time.perf_counter() > deadline:
                return
            delay = tick - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results.append(await client.one(tenant))

    await asyncio.gather(*(worker(i) for i in range(threads)))
    return results


def summarize(results, offered_seconds=None) -> dict:
    ok = np.array([lat for status, lat, _, _ in results if status == 200], dtype=np.float64) * 1000.0
    codes = {}
    for status, *_ in results:
        codes[str(status)] = codes.get(str(status), 0) + 1
    sent = [r for r in results if r[0] != -1]
    if sent:
        first = min(r[2] for r in sent)
        last = max(r[3] for r in sent)
        span = max(last - first, 1e-9)
    else:
        span = 0.0
    out = {"sent": len(sent), "ok": int(len(ok)), "codes": codes, "seconds": round(span, 3),
           "throughput_rps": round(len(ok) / span, 2) if span else 0.0,
           "offered_rps": round(len(results) / offered_seconds, 2) if offered_seconds else None}
    for q in (50, 90, 99):
        out[f"p{q}_ms"] = round(float(np.percentile(ok, q)), 2) if len(ok) else None
    out["mean_ms"] = round(float(ok.mean()), 2) if len(ok) else None
    out["max_ms"] = round(float(ok.max()), 2) if len(ok) else None
    return out


def tenant_period(args, n) -> float:
    """Seconds between one tenant's requests at n tenants: --period, stretched where n tenants
    would offer more than --max-offered requests/s in all (one client process on the same
    cores as the server cannot send much more; past that point the run would measure it)."""
    return max(args.period, n / args.max_offered) if args.max_offered else args.period


async def run_system(args, system, url, token, texts, log):
    rng = np.random.default_rng(args.seed)
    client = Client(url, token, texts, timeout=args.request_timeout + 10)
    out = {"constant": [], "burst": None, "poisson": None}
    try:
        # Outside the measurements: one request per tenant, so that every run finds the PETs
        # decoded in the runtime's host cache (the steady state), at most 64 at a time.
        t0 = time.perf_counter()
        tenants = tenant_names(max(args.tenant_counts))
        gate = asyncio.Semaphore(64)

        async def warm(t):
            async with gate:
                if time.perf_counter() - t0 < args.max_seconds * 2:
                    return await client.one(t)

        warmed = [r for r in await asyncio.gather(*(warm(t) for t in tenants)) if r]
        log(f"{system} warm-up: {sum(r[0] == 200 for r in warmed)}/{len(tenants)} tenants answered "
            f"({time.perf_counter() - t0:.1f} s)")
        for n in args.tenant_counts:
            t0 = time.perf_counter()
            period = tenant_period(args, n)
            results = await constant_rate(client, tenant_names(n), period, args.count, args.max_seconds, rng)
            s = summarize(results, offered_seconds=min(period * args.count, args.max_seconds))
            s["tenants"], s["period_s"] = n, period
            out["constant"].append(s)
            log(f"{system} constant rate, {n} tenants: {s['ok']}/{s['sent']} ok, p50 {s['p50_ms']} ms, "
                f"p99 {s['p99_ms']} ms, {s['throughput_rps']} req/s ({time.perf_counter() - t0:.1f} s)")
        if args.burst_threads:
            t0 = time.perf_counter()
            tenants = tenant_names(min(args.burst_threads, max(args.tenant_counts)))
            results = await burst(client, tenants, args.burst_threads, args.burst_stagger, args.burst_period,
                                  args.burst_count, args.max_burst_seconds)
            s = summarize(results)
            s["latencies_ms"] = sorted(round(r[1] * 1000.0, 3) for r in results if r[0] == 200)
            out["burst"] = s
            log(f"{system} burst: {s['ok']}/{s['sent']} ok, p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms "
                f"({time.perf_counter() - t0:.1f} s)")
        if args.poisson_rate and args.poisson_seconds:
            t0 = time.perf_counter()
            tenants = tenant_names(max(args.tenant_counts))
            results = await poisson(client, tenants, args.poisson_rate, args.poisson_seconds, rng)
            s = summarize(results, offered_seconds=args.poisson_seconds)
            s["tenants"] = len(tenants)
            out["poisson"] = s
            log(f"{system} Poisson {args.poisson_rate}/s: {s['ok']}/{s['sent']} ok, p50 {s['p50_ms']} ms, "
                f"p99 {s['p99_ms']} ms ({time.perf_counter() - t0:.1f} s)")
    finally:
        await client.close()
    return out


# -- the report ---------------------------------------------------------------------------------------

NAMES = {"hplm": "hPLM", "dedicated": "dedicated"}
HOST_HITS = 'hkstore_pet_cache_hits_total{cache="host"}'
HOST_MISSES = 'hkstore_pet_cache_misses_total{cache="host"}'


def _fmt(v):
    return "–" if v is None else (f"{v:,.1f}" if isinstance(v, float) else f"{v:,}")


def _errors(codes):
    bad = {k: v for k, v in codes.items() if k != "200"}
    return ", ".join(f"{k}: {v}" for k, v in sorted(bad.items())) or "0"


def report(args, results, plots_made, elapsed) -> str:
    lines = [f"# Load test ({'quick' if args.quick else 'full'})", ""]
    lines.append(f"Store `{args.store}`, model {args.model}, device {args.device}, max_len {args.max_len}; server "
                 f"max_batch {args.max_batch}, max_wait {args.max_wait_ms} ms, queue {args.queue_limit}, timeout "
                 f"{args.request_timeout} s; dedicated keeps {args.dedicated_resident} models resident. "
                 f"Client and server share this machine ({os.cpu_count()} cores). Total {elapsed:.0f} s.")
    cap = f" (longer where tenants x rate would pass {args.max_offered:g} req/s)" if args.max_offered else ""
    lines += ["", f"## Constant rate (HMI Fig. 12): one request every {args.period} s per tenant{cap}, "
                  f"{args.count} each, at most {args.max_seconds:g} s",
              "", "| system | tenants | period s | offered req/s | throughput req/s | p50 ms | p90 ms | p99 ms | "
              "mean ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for system, r in results.items():
        for s in r["constant"]:
            lines.append(f"| {NAMES[system]} | {s['tenants']:,} | {s.get('period_s', args.period):g} | "
                         f"{_fmt(s['offered_rps'])} | "
                         f"{_fmt(s['throughput_rps'])} | {_fmt(s['p50_ms'])} | {_fmt(s['p90_ms'])} | "
                         f"{_fmt(s['p99_ms'])} | {_fmt(s['mean_ms'])} | {_errors(s['codes'])} |")
    if any(r["burst"] for r in results.values()):
        lines += ["", f"## Burst (HMI Fig. 13): {args.burst_threads} clients {args.burst_stagger} s apart, one "
                      f"request every {args.burst_period} s, {args.burst_count} each", "",
                  "| system | sent | ok | p10 ms | p50 ms | p90 ms | p99 ms | max ms | throughput req/s | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for system, r in results.items():
            s = r["burst"]
            if not s:
                continue
            lat = np.asarray(s["latencies_ms"])
            p10 = round(float(np.percentile(lat, 10)), 2) if len(lat) else None
            lines.append(f"| {NAMES[system]} | {s['sent']:,} | {s['ok']:,} | {_fmt(p10)} | {_fmt(s['p50_ms'])} | "
                         f"{_fmt(s['p90_ms'])} | {_fmt(s['p99_ms'])} | {_fmt(s['max_ms'])} | "
                         f"{_fmt(s['throughput_rps'])} | {_errors(s['codes'])} |")
    if any(r["poisson"] for r in results.values()):
        lines += ["", f"## Poisson arrivals: {args.poisson_rate} req/s for {args.poisson_seconds} s over "
                      f"{max(args.tenant_counts):,} tenants", "",
                  "| system | sent | ok | p50 ms | p90 ms | p99 ms | throughput req/s | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for system, r in results.items():
            s = r["poisson"]
            if s:
                lines.append(f"| {NAMES[system]} | {s['sent']:,} | {s['ok']:,} | {_fmt(s['p50_ms'])} | "
                             f"{_fmt(s['p90_ms'])} | {_fmt(s['p99_ms'])} | {_fmt(s['throughput_rps'])} | "
                             f"{_errors(s['codes'])} |")
    lines += ["", "## Server counters", "", "| system | batches | mean batch | PET cache hits | misses | swaps |",
              "|---|---:|---:|---:|---:|---:|"]
    for system, r in results.items():
        m = r.get("metrics", {})
        batches = m.get("hkstore_batch_size_count", 0.0)
        mean = m.get("hkstore_batch_size_sum", 0.0) / batches if batches else None
        lines.append(f"| {NAMES[system]} | {int(batches):,} | {_fmt(mean)} | "
                     f"{int(m.get(HOST_HITS, 0)):,} | {int(m.get(HOST_MISSES, 0)):,} | "
                     f"{int(m.get('hkstore_dedicated_swaps_total', 0)):,} |")
    if plots_made:
        lines += ["", "Figures: " + ", ".join(f"`{os.path.basename(p)}`" for p in plots_made)]
    return "\n".join(lines) + "\n"


def draw(args, results) -> list:
    try:
        from tools import plots
    except ImportError as e:
        print(f"no figures: tools.plots is not available ({e})", file=sys.stderr)
        return []
    made = []
    lat, thr = {}, {}
    for system, r in results.items():
        rows = [s for s in r["constant"] if s["p50_ms"] is not None]
        xs = [s["tenants"] for s in rows]
        for q in ("p50", "p99"):
            lat[f"{NAMES[system]} {q}"] = (xs, [s[f"{q}_ms"] for s in rows])
        thr[NAMES[system]] = ([s["tenants"] for s in r["constant"]], [s["throughput_rps"] for s in r["constant"]])
    if results:
        first = next(iter(results.values()))["constant"]
        thr["offered"] = ([s["tenants"] for s in first], [s["offered_rps"] for s in first])
    made.append(plots.line_plot(lat, "tenants", "end-to-end latency (ms)", os.path.join(args.out, "fig12_latency.png"),
                                logx=True, logy=True, title="Latency vs tenants (constant rate per tenant)"))
    made.append(plots.line_plot(thr, "tenants", "requests / s", os.path.join(args.out, "fig12_throughput.png"),
                                logx=True, logy=True, title="Throughput vs tenants"))
    cdf = {NAMES[s]: r["burst"]["latencies_ms"] for s, r in results.items() if r["burst"]}
    if cdf:
        made.append(plots.cdf_plot(cdf, "end-to-end latency (ms)", os.path.join(args.out, "fig13_burst_cdf.png"),
                                   logx=True, title="Burst workload: latency CDF"))
    return made


# -- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="< 60 s: tiny model and short runs")
    p.add_argument("--out", default=None,
                   help="output folder (default $TMPDIR/hkstore-loadgen-quick or $TMPDIR/hkstore-loadgen); "
                        "its store is reused by later runs")
    p.add_argument("--store", default=None, help="store to use (built in OUT/store when missing)")
    p.add_argument("--model", default=None, help="minilm (the embedded all-MiniLM-L6-v2), tiny, or a model folder")
    p.add_argument("--systems", default="hplm,dedicated", help="comma list of hplm, dedicated")
    p.add_argument("--tenants", default=None, help="tenant counts, comma list (HMI: 1 to 10000)")
    p.add_argument("--period", type=float, default=None, help="seconds between a tenant's requests (HMI: 20)")
    p.add_argument("--max-offered", type=float, default=None,
                   help="cap on tenants / period in req/s: the period grows past it (0: no cap)")
    p.add_argument("--count", type=int, default=None, help="requests per tenant (HMI: 100)")
    p.add_argument("--max-seconds", type=float, default=None, help="longest time one constant-rate run sends")
    p.add_argument("--burst-threads", type=int, default=None, help="HMI: 250 (0: no burst run)")
    p.add_argument("--burst-stagger", type=float, default=None, help="HMI: 0.05 s")
    p.add_argument("--burst-period", type=float, default=None, help="HMI: 1.2 s")
    p.add_argument("--burst-count", type=int, default=None, help="HMI: 50")
    p.add_argument("--poisson-rate", type=float, default=None, help="requests per second (0: no Poisson run)")
    p.add_argument("--poisson-seconds", type=float, default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--queue-limit", type=int, default=1024)
    p.add_argument("--request-timeout", type=float, default=None, help="server timeout (504) in seconds")
    p.add_argument("--dedicated-resident", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    default_out = os.path.join(tempfile.gettempdir(), "hkstore-loadgen-quick" if args.quick else "hkstore-loadgen")
    args.out = os.path.abspath(args.out or default_out)
    args.store = os.path.abspath(args.store or os.path.join(args.out, "store"))
    args.tenant_counts = sorted({int(x) for x in str(args.tenants).split(",") if x.strip()})
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.tenant_counts or min(args.tenant_counts) < 1 or max(args.tenant_counts) > 10_000:
        p.error("--tenants: counts between 1 and 10000")
    if any(s not in NAMES for s in args.systems):
        p.error("--systems: hplm and/or dedicated")
    if args.period <= 0 or args.count < 1 or args.max_seconds <= 0 or args.burst_threads < 0 or args.max_offered < 0:
        p.error("--period, --count and --max-seconds must be positive, --max-offered not negative")
    args.max_burst_seconds = args.burst_threads * args.burst_stagger + args.burst_count * args.burst_period + 5
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - t_start:6.1f} s] {message}", flush=True)

    texts = prepare_store(args, log)
    token = secrets.token_urlsafe(24)
    token_file = os.path.join(args.out, "admin.token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    results = {}
    for system in args.systems:
        server = ServerProcess(args, system, token_file, log)
        try:
            results[system] = asyncio.run(run_system(args, system, server.url, token, texts, log))
            results[system]["metrics"] = {k: v for k, v in server.metrics().items()
                                          if k.startswith(("hkstore_batch_size_count", "hkstore_batch_size_sum",
                                                           "hkstore_pet_cache", "hkstore_dedicated_swaps",
                                                           "hkstore_rejected"))}
        finally:
            server.stop()
    made = draw(args, results)
    elapsed = time.perf_counter() - t_start
    text = report(args, results, made, elapsed)
    with open(os.path.join(args.out, "loadgen.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "loadgen.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=1, default=str)
    print(text)
    log(f"wrote {os.path.join(args.out, 'loadgen.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
