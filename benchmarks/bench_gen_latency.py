"""Time to first token and inter-token latency of generation through the HTTP server (the
OpenAI route) under a Poisson load of many tenants.

    python -m benchmarks.bench_gen_latency --store /tmp/hgpt-stores/n3-l2 --tenants 100 --rates 1 2 4 \
        --duration 30 --rounds 2

It copies the decoder store into --workdir once and adds --tenants LoRA tenants (rank 8 on q
and v of the upper layers, random: the latency does not depend on what they learned), starts
``hkstore serve`` on a loopback port (one torch thread), then for each rate sends streamed
``POST /v1/completions`` requests with exponential gaps (a Poisson process) for --duration
seconds: a tenant drawn uniformly, a prompt from WikiText-2 test.txt, greedy, --max-tokens
tokens, ``logprobs: 0`` so that every token is its own server-sent event. The client measures
time to first token (request sent -> first token's event) and inter-token latency (gaps
between a request's token events), and the percentiles over every request of a rate; rounds
repeat the rates in alternating order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

from benchmarks.bench_tenants_gen import uptime
from tools.pretrain_decoder import WIKITEXT, read_lines

ADMIN = "bench-admin-token-0123456789abcdef"


def make_store(src, workdir, tenants: int) -> str:
    """A copy of src with `tenants` random LoRA lm tenants (t0000, ...), made once."""
    import torch

    import hkstore
    from runtime.model import pet as petlib
    from runtime.model.stored import base_decoder

    path = os.path.join(workdir, "store")
    if os.path.exists(os.path.join(workdir, "done")):
        return path
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(src, path)
    with hkstore.open(path, writable=True) as st:
        dec = base_decoder(st)
        records = []
        for t in range(tenants):
            pet = petlib.create_pet(dec, "lora", "lm", [], seed=t)
            with torch.no_grad():
                for name, v in pet.tensors.items():
                    if name.endswith(".B"):
                        v.normal_(0, 0.01)
            pet = petlib.export(pet)
            meta = dict(pet.meta, tenant=f"t{t:04d}", version="root", base_model=st.meta.get("base_model"))
            records.append(hkstore.PetRecord(tenant=f"t{t:04d}", meta=meta,
                                             tensors={k: v.detach().numpy() for k, v in pet.tensors.items()}))
        st.put_pets(records)
    open(os.path.join(workdir, "done"), "w").close()
    return path


class Server:
    def __init__(self, store, workdir, threads):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        token = os.path.join(workdir, "admin.token")
        with open(token, "w") as f:
            f.write(ADMIN)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.log = open(os.path.join(workdir, "server.log"), "wb")  # noqa: SIM115 - the server's life long
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.cli", store, "--port", str(self.port),
                                      "--admin-token-file", token, "--device", "cpu", "--queue-limit", "4096",
                                      "--torch-threads", str(threads)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        from benchmarks.loadgen import wait_healthy

        wait_healthy(self.proc, self.url, f"the server (see {self.log.name})", timeout=120)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


async def one(client, body, out):
    t0 = time.perf_counter()
    times = []
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            if r.status_code != 200:
                out.append({"status": r.status_code})
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - counted, not fatal
        out.append({"status": repr(e)})
        return
    out.append({"status": 200, "ttft": times[0] - t0 if times else None, "itl": np.diff(times).tolist(),
                "tokens": len(times), "latency": time.perf_counter() - t0})


async def load_at(url, rate, duration, prompts, tenants, max_tokens, seed):
    import httpx

    rng = np.random.default_rng(seed)
    out, tasks = [], []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        at = 0.0
        while True:
            at += rng.exponential(1.0 / rate)
            if at > duration:
                break
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {"model": tenants[rng.integers(len(tenants))], "prompt": prompts[rng.integers(len(prompts))],
                    "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, "stream": True}
            tasks.append(asyncio.ensure_future(one(client, body, out)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [r for r in out if r["status"] == 200]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]

    def pct(xs):
        return {f"p{q}": round(1000 * float(np.percentile(xs, q)), 1) for q in (50, 90, 99)} if xs else {}

    return {"rate": rate, "requests": len(out), "ok": len(ok), "errors": len(out) - len(ok),
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "latency_ms": pct([r["latency"] for r in ok]),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1), "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a decoder store (copied; not changed)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hkstore-gen-latency"))
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4], help="requests per second")
    ap.add_argument("--duration", type=float, default=30, help="seconds of arrivals per rate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--out", default=None, help="JSON of every measurement")
    args = ap.parse_args(argv)

    store = make_store(args.store, args.workdir, args.tenants)
    prompts = [x.strip() for x in read_lines(os.path.join(WIKITEXT, "test.txt")) if x.strip() and not
               x.startswith("=")][:200]
    prompts = [" ".join(p.split()[:12]) for p in prompts]
    tenants = [f"t{t:04d}" for t in range(args.tenants)]
    server = Server(store, args.workdir, args.threads)
    rows = []
    try:
        print(f"# server {server.url}; {uptime()}", flush=True)
        asyncio.run(load_at(server.url, 1, 3, prompts, tenants, 4, 0))  # warm up: every code path once
        for rnd in range(args.rounds):
            for rate in (args.rates if rnd % 2 == 0 else args.rates[::-1]):
                row = asyncio.run(load_at(server.url, rate, args.duration, prompts, tenants, args.max_tokens,
                                          1000 * rnd + int(rate * 10)))
                row |= {"round": rnd, "load": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    summary = []
    for rate in args.rates:
        mine = [r for r in rows if r["rate"] == rate]
        summary.append({"rate": rate, **{k: {q: round(float(np.median([r[k][q] for r in mine if r[k]])), 1)
                                                for q in ("p50", "p90", "p99")}
                                         for k in ("ttft_ms", "itl_ms", "latency_ms")},
                        "tokens_per_s": round(float(np.median([r["tokens_per_s"] for r in mine])), 1),
                        "errors": sum(r["errors"] for r in mine)})
    result = {"store": os.path.abspath(args.store), "tenants": args.tenants, "max_tokens": args.max_tokens,
              "duration_s": args.duration, "rounds": args.rounds, "uptime": uptime(), "median_of_rounds": summary}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
