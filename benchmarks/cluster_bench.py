"""Throughput and latency of hkstore on Ray Serve with 1 and 2 replicas, against `hkstore serve`
(one process), on this machine (issue 20).

    python -m benchmarks.cluster_bench --out /tmp/cluster_bench.md             # MiniLM store, ~3 min
    python -m benchmarks.cluster_bench --model tiny --seconds 5 --out /tmp/b.md  # quick

The store is benchmarks.loadgen's (docstring corpus, one trained LoRA tenant cloned to --tenants).
Closed-loop clients (--clients threads, each sends an infer request for a random tenant, waits for
the answer, sends the next) run for --seconds against each configuration in turn: `hkstore
serve` (uvicorn), then a local Ray cluster (127.0.0.1) with --replicas workers each, routed by
tenant (--routers). Clients, servers and Ray share the machine's cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

ADMIN = "cluster-bench-admin-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drive(url, tenants, texts, clients, seconds, warmup=2.0):
    import httpx

    stats, stop, t_start = [], threading.Event(), [0.0]
    lock = threading.Lock()

    def client(k):
        rng = random.Random(k)
        with httpx.Client(base_url=url, timeout=60.0, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = c.post(f"/v1/tenants/{rng.choice(tenants)}/infer", json={"text": rng.choice(texts)})
                    code = r.status_code
                except httpx.HTTPError:
                    code = 0
                t1 = time.perf_counter()
                if t0 >= t_start[0] > 0:
                    with lock:
                        stats.append((code, t1 - t0, t1))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    t_start[0] = time.perf_counter()
    time.sleep(seconds)
    t_end = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(60)
    ok = sorted(d for code, d, t1 in stats if code == 200 and t1 <= t_end)
    errors = sum(1 for code, _, t1 in stats if code != 200 and t1 <= t_end)
    pct = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1000 if ok else float("nan"))
    return {"throughput": len(ok) / (t_end - t_start[0]), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "ok": len(ok),
            "errors": errors}


def wait_http(url, timeout=180):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    from benchmarks import loadgen

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "hkstore-cluster-cost"))
    p.add_argument("--tenants", type=int, default=96)
    p.add_argument("--replicas", default="1,2")
    p.add_argument("--routers", default="multiplex")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    store = os.path.join(a.work, "store")
    texts = loadgen.prepare_store(types.SimpleNamespace(store=store, tenant_counts=[a.tenants], burst_threads=1,
                                                        out=a.work, model=a.model, quick=True, max_len=a.max_len),
                                  print)
    tenants = loadgen.tenant_names(a.tenants)
    texts = [t for t in texts if 3 < len(t.split()) < 40]
    rows = []
    token_file = os.path.join(a.work, "admin.token")
    with open(token_file, "w") as f:
        f.write(ADMIN + "\n")
    common = dict(device="cpu", max_len=a.max_len, max_batch=32, max_wait_ms=5)

    # one process: hkstore serve
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.cli", store, "--port", str(port), "--admin-token-file",
                             token_file, "--device", "cpu", "--max-len", str(a.max_len)], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}")
        r = drive(f"http://127.0.0.1:{port}", tenants, texts, a.clients, a.seconds)
        rows.append({"system": "hkstore serve", "replicas": 1, "router": "-", **r})
        print(rows[-1], flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    import ray
    from ray import serve

    from runtime.serve import ray_app

    temp = tempfile.mkdtemp(prefix="hkray", dir="/tmp")
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        for router in a.routers.split(","):
            for n in (int(x) for x in a.replicas.split(",")):
                port = free_port()
                ray_app.run(store, ADMIN, port=port, blocking=False, replicas=n, router=router, replica_cpus=1,
                            **common)
                wait_http(f"http://127.0.0.1:{port}")
                r = drive(f"http://127.0.0.1:{port}", tenants, texts, a.clients, a.seconds)
                rows.append({"system": "Ray Serve", "replicas": n, "router": router, **r})
                print(rows[-1], flush=True)
                serve.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    md = ["| system | replicas | router | throughput req/s | p50 ms | p99 ms | ok | errors |",
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['system']} | {r['replicas']} | {r['router']} | {r['throughput']:.1f} | {r['p50_ms']:.0f} | "
           f"{r['p99_ms']:.0f} | {r['ok']} | {r['errors']} |" for r in rows]
    text = (f"{a.model} store, {a.tenants} tenants, {a.clients} closed-loop clients, {a.seconds:g} s each, "
            f"max batch 32, max wait 5 ms, max_len {a.max_len}, CPU, one torch thread per replica.\n\n"
            + "\n".join(md) + "\n")
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
