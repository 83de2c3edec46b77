"""How fast a client's leaving a stream reaches the worker under ``hkstore serve --ray``, idle
and with CPU burners.

    python -m benchmarks.bench_gen_cancel --rounds 3 --burners 2

It builds a tiny decoder store (runtime.model.tiny_decoder, 4 layers, d = 32) with one lm
tenant, starts a local Ray Serve cluster of the application (one worker replica), then for
each round, with no burner and then with --burners `while 1: pass` processes (the conditions
alternate, so the machine's other load falls on both), streams --requests completions of
--max-tokens greedy tokens with ``ignore_eos`` and leaves each after its first event. The
worker's token counter (its /metrics, pushed to the Manager every 2 s) says how many tokens
each sequence made before the cancellation stopped it; a non-streamed request of --max-tokens
first gives the worker's time per token, so tokens made turn into milliseconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.bench_tenants_gen import uptime

ADMIN = "bench-admin-token-0123456789abcdef"
TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


def make_store(tmp: pathlib.Path) -> str:
    from runtime.construct.decoder_store import build_decoder
    from runtime.construct.decoder_tenant import lm_tenant_create
    from runtime.model.tiny_decoder import make_tiny_decoder

    model = make_tiny_decoder(tmp / "m", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=1024, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2, progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    lm_tenant_create(tmp / "s", "acme", train_path=tmp / "acme.txt", epochs=3, batch_size=4, lr=1e-2, progress=False)
    return str(tmp / "s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_tokens(client) -> float:
    text = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("hkstore_gen_tokens_total{"))


def settled_tokens(client) -> float:
    """The counter once two pushes have passed without a change."""
    last = worker_tokens(client)
    while True:
        time.sleep(4.5)
        now = worker_tokens(client)
        if now == last:
            return now
        last = now


def leave_after_first_event(client, max_tokens) -> None:
    body = {"model": "acme", "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status_code == 200, r.status_code
        next(line for line in r.iter_lines() if line.startswith("data: "))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3, help="streams left per round and condition")
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import httpx
    import ray
    import torch
    from ray import serve

    from runtime.serve import ray_app

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hkcancel"))
    store = make_store(tmp)
    temp = tempfile.mkdtemp(prefix="hkray", dir="/tmp")
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    burners = []
    try:
        port = free_port()
        ray_app.run(store, ADMIN, port=port, blocking=False, replicas=1, device="cpu", max_len=32, replica_cpus=1)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300.0)
        results = {"machine": uptime(), "max_tokens": args.max_tokens, "idle": [], "loaded": [], "ms_per_token": {}}
        for rnd in range(args.rounds):
            for cond in ("idle", "loaded"):
                if cond == "loaded":
                    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)]
                    time.sleep(2)
                body = {"model": "acme", "prompt": "the cat", "max_tokens": 200, "temperature": 0,
                        "ignore_eos": True}
                t = time.perf_counter()
                client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
                results["ms_per_token"].setdefault(cond, []).append((time.perf_counter() - t) * 1000 / 200)
                before = settled_tokens(client)
                for _ in range(args.requests):
                    leave_after_first_event(client, args.max_tokens)
                    after = settled_tokens(client)
                    results[cond].append(after - before)
                    before = after
                load = uptime()
                for p in burners:
                    p.kill()
                    p.wait()
                burners = []
                print(f"round {rnd + 1}/{args.rounds} {cond}: tokens made before the cancel "
                      f"{results[cond][-args.requests:]}, {np.median(results['ms_per_token'][cond]):.1f} ms/token; "
                      f"{load}", flush=True)
        for cond in ("idle", "loaded"):
            made, ms = np.array(results[cond]), float(np.median(results["ms_per_token"][cond]))
            print(f"{cond}: tokens made of {args.max_tokens} median {np.median(made):.0f} max {made.max():.0f} "
                  f"(~{np.median(made) * ms:.0f} ms / {made.max() * ms:.0f} ms at {ms:.1f} ms/token); "
                  f"every stream cancelled: {bool((made < args.max_tokens).all())}")
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        for p in burners:
            p.kill()
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
