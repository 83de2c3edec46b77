"""Profile PetS's latency models for this machine and executor into a JSON file (issue 17).

    python -m benchmarks.profile_latency --out latency_cpu.json [--quick] [--reps 3]

alpha[N][L]: the CPU executor's upper layers + heads for N requests of L tokens of one
head-only tenant (the shared operators); beta[type][n][l]: the PET operators alone
(runtime.exec.cpu_batched, weights already stacked) of one tenant of each PET type (adapter
b = 64 with LayerNorm deltas, LoRA rank 16 on q and v, BitFit, diff pruning at 0.5%) for n
requests of l tokens, over the upper layers. Each cell is the median of --reps timings. The
file records the machine, the executor and the grids; runtime.sched.coordinated.LatencyModel
loads it (re-profiling is this one command). The tables are saved made nondecreasing in N and
L (LatencyModel.monotone; the raw medians are kept in meta.raw).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
import torch

PET_SPECS = {"adapter": {"bottleneck": 64}, "lora": {"rank": 16, "targets": ("q", "v")}, "bitfit": {},
             "diff": {"density": 0.005}}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def random_pet(enc, kind, seed):
    from runtime.exec.plan import prepare_pet
    from runtime.model import pet as petlib

    g = torch.Generator().manual_seed(seed)
    pet = petlib.create_pet(enc, kind, "classification", ["a", "b", "c"], seed=seed, **PET_SPECS.get(kind, {}))
    with torch.no_grad():
        for v in pet.tensors.values():
            v.copy_(torch.randn(v.shape, generator=g) * 0.02)
    return prepare_pet(enc, petlib.export(pet), key=(kind, seed))


def median_time(fn, reps) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def pet_ops(ex, pet, n, L):
    """A function running the PET operators of n requests (L tokens) of `pet` on the upper layers."""
    from runtime.exec import cpu_batched

    c = ex.config
    plan = ex.plan([pet] * n)
    rows = n * L
    dims = {"q": (c.d, c.d), "k": (c.d, c.d), "v": (c.d, c.d), "o": (c.d, c.d), "ffn_in": (c.d, c.ffn),
            "ffn_out": (c.ffn, c.d)}
    work = []
    for i in ex.layers:
        for g in plan.layer_groups(i):
            runs, gaps = cpu_batched.segment_runs(plan.seg_starts, g.seg_ids, L)
            w = cpu_batched.stack_group_into({}, plan, g)
            if g.kind == "norm":
                ln = getattr(ex.encoder.layers[i], g.target)
                work.append((g.kind, runs, gaps, w, ln, torch.randn(rows, c.d), torch.randn(rows, c.d)))
            else:
                d_in, d_out = dims[g.target]
                work.append((g.kind, runs, gaps, w, None, torch.randn(rows, d_in), torch.randn(rows, d_out)))

    def run():
        with torch.no_grad():
            for kind, runs, gaps, w, ln, x, y in work:
                if kind == "lora":
                    cpu_batched.lora(y, x, runs, w["A"], w["B"], w["scales"])
                elif kind == "bias":
                    cpu_batched.bias(y, runs, w["delta"])
                elif kind == "diff":
                    cpu_batched.diff(y, x, runs, w["index"], w["value"], w["offsets"])
                elif kind == "adapter":
                    cpu_batched.adapter(y, runs, w["down"], w["down_bias"], w["up"], w["up_bias"])
                elif kind == "norm":
                    cpu_batched.layernorm(y.clone(), x, ln, runs, gaps, w["weight"], w["bias"])
    return run


def profile(enc, ns, ls, reps, log=print):
    from runtime.exec.cpu import CpuExecutor
    from runtime.sched.coordinated import LatencyModel

    ex = CpuExecutor(enc, prefetch=False)
    head = random_pet(enc, "head", 0)
    d = enc.config.d
    alpha = []
    for N in ns:
        row = []
        for L in ls:
            x, m = torch.randn(N, L, d), torch.ones(N, L, dtype=torch.bool)
            row.append(median_time(lambda x=x, m=m, N=N: ex.run(x, m, [head] * N), reps))
        alpha.append(row)
        log(f"alpha N={N}: " + " ".join(f"{t * 1e3:.1f}" for t in row) + " ms")
    beta = {}
    for kind in PET_SPECS:
        pet = random_pet(enc, kind, 1)
        table = []
        for n in ns:
            table.append([median_time(pet_ops(ex, pet, n, L), reps) for L in ls])
        beta[kind] = table
        log(f"beta {kind}: at N={ns[-1]}: " + " ".join(f"{t * 1e3:.1f}" for t in table[-1]) + " ms")
    meta = {"machine": machine(), "executor": "cpu (runtime.exec.cpu.CpuExecutor, kernels=batched)",
            "model": f"d={d}, layers={enc.config.num_layers}, lower={enc.lower_layers}", "reps": reps,
            "pets": {k: {kk: list(v) if isinstance(v, tuple) else v for kk, v in s.items()} for k, s in PET_SPECS.items()},
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return LatencyModel(list(ns), list(ls), alpha, list(ns), list(ls), beta, meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a coarse grid (N 1,4,16; L 16,64)")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args(argv)
    from runtime.model.encoder import load_encoder

    enc = load_encoder()
    if args.quick:
        ns, ls = [1, 4, 16], [16, 64]
    else:
        ns = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= args.max_batch]
        ls = [16, 32, 64, 128, 256]
    t0 = time.perf_counter()
    model = profile(enc, ns, ls, args.reps, log=lambda s: print(s, file=sys.stderr, flush=True))
    model.meta["seconds"] = round(time.perf_counter() - t0, 1)
    model.meta["raw"] = {"alpha": model.alpha, "beta": model.beta}
    model = model.monotone()  # timing noise must not make a bigger batch look cheaper
    model.save(args.out)
    print(f"wrote {args.out} ({model.meta['seconds']} s)")


if __name__ == "__main__":
    main()
