"""Measure the runtime's per-batch cost model for benchmarks/cluster_sim.py (issue 20).

    python -m benchmarks.cluster_cost --out figures/cluster_cost.json              # MiniLM (the embedded model)
    python -m benchmarks.cluster_cost --model tiny --out /tmp/cost.json            # the tiny test model, seconds

A store (benchmarks.loadgen's: docstring corpus, one trained LoRA tenant cloned to --tenants) is
served by ``runtime.open`` on the CPU with one torch thread (as `hkstore serve` runs), and timed:

- a warm batch of n texts spread over s distinct tenants, for n in --sizes and s in {1, n}
  (the fastest of --repeats: the machine may be shared), fitted to  batch_ms = a + b * n + c * s  by least squares;
- a host-cache miss: ``Runtime.pet(tenant)`` for tenants not yet loaded (read the PET record
  from the store and decode it), the median over --cold tenants.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import statistics
import time
import types


def measure(store, texts, tenants, sizes, repeats, cold, max_len):
    import numpy as np
    import torch

    import runtime

    torch.set_num_threads(1)
    rt = runtime.open(store, "cpu", max_len=max_len, max_batch=max(sizes))
    try:
        names = sorted(rt.store.snapshot().pets)[:tenants]
        cold_ms = []
        for t in names[-cold:]:
            t0 = time.perf_counter()
            rt.pet(t)
            cold_ms.append((time.perf_counter() - t0) * 1000)
        rt.infer([{"tenant": t, "text": texts[i % len(texts)]} for i, t in enumerate(names[:max(sizes)])])  # warm
        rows = []
        for n in sizes:
            for s in sorted({1, n}):
                reqs = [{"tenant": names[i % s], "text": texts[(i * 7) % len(texts)]} for i in range(n)]
                rt.infer(reqs)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    rt.infer(reqs)
                    times.append((time.perf_counter() - t0) * 1000)
                # the fastest of the repeats: on a shared machine the others carry other jobs' time
                rows.append({"n": n, "s": s, "ms": min(times), "median_ms": statistics.median(times)})
        X = np.array([[1.0, r["n"], r["s"]] for r in rows])
        y = np.array([r["ms"] for r in rows])
        (a, b, c), *_ = np.linalg.lstsq(X, y, rcond=None)
        return {"a_ms": float(max(a, 0.0)), "b_ms": float(max(b, 0.0)), "c_ms": float(max(c, 0.0)),
                "pet_load_ms": float(statistics.median(cold_ms)), "points": rows,
                "torch_threads": 1, "max_len": max_len}
    finally:
        rt.close()


def main(argv=None):
    from benchmarks import loadgen

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="minilm (default), tiny, or a model directory")
    p.add_argument("--store", default=None, help="store to use or build (default: WORK/store)")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "hkstore-cluster-cost"))
    p.add_argument("--tenants", type=int, default=96)
    p.add_argument("--sizes", default="1,4,16,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cold", type=int, default=32)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    store = a.store or os.path.join(a.work, "store")
    args = types.SimpleNamespace(store=store, tenant_counts=[a.tenants], burst_threads=1, out=a.work, model=a.model,
                                 quick=True, max_len=a.max_len)
    t0 = time.perf_counter()
    texts = loadgen.prepare_store(args, lambda m: print(m, flush=True))
    sizes = [int(x) for x in a.sizes.split(",")]
    out = measure(store, texts, a.tenants, sizes, a.repeats, min(a.cold, a.tenants - max(sizes)), a.max_len)
    out.update(model=a.model, seconds=round(time.perf_counter() - t0, 1))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "points"}))


if __name__ == "__main__":
    main()
