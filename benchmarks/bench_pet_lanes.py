"""PET operator scheduling (PetS §4.2, Alg. 2) on the CPU: one lane vs lanes (issue 17).

    python -m benchmarks.bench_pet_lanes [--tenants 32,64,128] [--len 32] [--lanes 2] [--reps 7]

One upper layer's PET operators for a batch of T tenants, one request of --len tokens each,
PET types mixed round-robin (adapter b=64, LoRA r=16 on q/v, BitFit, diff 0.5%): the four
stages (q/k/v, o, ffn_in, ffn_out; LayerNorm deltas are not lane operators) run either as the
executor runs them (one lane: one batched runtime.exec.cpu_batched call per kind and target,
torch's intra-op threads) or as runtime.exec.pet_lanes operators placed by Alg. 2 on --lanes
threads of one torch thread each; and, to separate the two effects, the one-lane calls on a
single worker thread of one torch thread. Median of --reps interleaved rounds; prints a table.

    python -m benchmarks.bench_pet_lanes --gpu [--lanes 4]      # on a CUDA GPU (CuPy)

--gpu times the GPU executor's whole upper layers for the same batches with lanes=1 against
lanes=--lanes (PetS Alg. 2 on CUDA streams, runtime.exec.gpu), the two taking turns; --emulate
runs that path on the CUDA-on-CPU emulation instead (a smoke test of the tool: small
--tenants and --len, the times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
import torch

TYPES = ("adapter", "lora", "bitfit", "diff")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", default="32,64,128")
    ap.add_argument("--len", type=int, default=32)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out")
    ap.add_argument("--gpu", action="store_true", help="GpuExecutor lanes=1 vs lanes=--lanes (needs CuPy + a GPU)")
    ap.add_argument("--emulate", action="store_true", help="--gpu on the CUDA-on-CPU emulation (smoke test)")
    args = ap.parse_args(argv)
    if args.gpu or args.emulate:
        return gpu_lanes(args)
    import dataclasses

    from runtime.exec import cpu_batched, pet_lanes
    from runtime.exec.cpu import CpuExecutor
    from runtime.model.encoder import load_encoder
    from benchmarks.bench_runtime import md_table
    from benchmarks.profile_latency import random_pet

    enc = load_encoder()
    c = enc.config
    ex = CpuExecutor(enc, prefetch=False)
    base = {k: random_pet(enc, k, 7 + j) for j, k in enumerate(TYPES)}
    layer = ex.layers[0]
    pool = pet_lanes.lane_pool(args.lanes)
    single = pet_lanes.lane_pool(1)
    rows_out, load0 = [], os.getloadavg()[0]
    for T in [int(t) for t in args.tenants.split(",")]:
        pets = [dataclasses.replace(base[TYPES[j % 4]], key=("t", j)) for j in range(T)]
        plan = ex.plan(pets)
        L, R = args.len, T * args.len
        g = torch.Generator().manual_seed(T)
        xd, xf = torch.randn(R, c.d, generator=g), torch.randn(R, c.ffn, generator=g)
        ys = {t: torch.randn(R, c.ffn if t == "ffn_in" else c.d, generator=g)
              for t in ("q", "k", "v", "o", "ffn_in", "ffn_out")}
        stages = [("q", "k", "v"), ("o",), ("ffn_in",), ("ffn_out",)]
        work = {}
        for grp in plan.layer_groups(layer):
            if grp.kind == "norm":
                continue
            runs, _ = cpu_batched.segment_runs(plan.seg_starts, grp.seg_ids, L)
            w = cpu_batched.stack_group_into({}, plan, grp)
            work.setdefault(grp.target, {})[grp.kind] = (runs, w)
        stage_defs = [{t: (xf if t == "ffn_out" else xd, ys[t], work.get(t, {})) for t in st} for st in stages]
        ops = [pet_lanes.split_ops(sd) for sd in stage_defs]
        lanes = [pet_lanes.assign_lanes(o, args.lanes) for o in ops]

        whole = [pet_lanes.split_ops(sd, chunk=1 << 30) for sd in stage_defs]  # one op per kind, target, run

        def one_lane(whole=whole):
            for stage_ops in whole:
                for op in stage_ops:
                    op()

        def many(lanes=lanes):
            for ln in lanes:
                pet_lanes.run_lanes(pool, ln)

        def one_lane_1thread(one_lane=one_lane):  # the same calls on one single-threaded worker
            single.submit(one_lane).result()

        fns = {"one lane (batched calls, intra-op threads)": one_lane,
               "one lane, 1 thread": one_lane_1thread, f"{args.lanes} lanes (Alg. 2)": many}
        for fn in fns.values():
            fn()
        seen = {k: [] for k in fns}
        with torch.no_grad():
            for _ in range(args.reps):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    seen[k].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in seen.items()}
        a, a1, b = med.values()
        nops = sum(len(o) for o in ops)
        rows_out.append([T, nops, f"{a * 1e3:.1f}", f"{a1 * 1e3:.1f}", f"{b * 1e3:.1f}", f"{a / b:.2f}x",
                         f"{a1 / b:.2f}x"])
        print(f"T={T}: {med}", file=sys.stderr, flush=True)
    title = (f"### PET operators of one layer: one lane vs {args.lanes} lanes (Alg. 2), one request of "
             f"{args.len} tokens per tenant, median of {args.reps}; load average {load0:.1f} -> "
             f"{os.getloadavg()[0]:.1f}\n")
    text = "\n".join([title,
                      md_table(["tenants", "operators", "one lane ms", "one lane, 1 thread ms",
                                f"{args.lanes} lanes ms", "lanes vs one lane", "lanes vs one lane, 1 thread"],
                               rows_out)])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def gpu_lanes(args):
    """The GPU executor's upper layers, lanes=1 vs lanes=args.lanes, the same batches."""
    import contextlib
    import dataclasses

    from runtime.exec.gpu import GpuExecutor
    from runtime.model.encoder import load_encoder
    from benchmarks.bench_runtime import md_table
    from benchmarks.profile_latency import random_pet

    enc = load_encoder()
    base = {k: random_pet(enc, k, 7 + j) for j, k in enumerate(TYPES)}
    kwargs, ctx = {}, contextlib.nullcontext()
    if args.emulate:
        from runtime.exec import ops_gpu
        from runtime.exec.emu import cupy_standin

        kwargs, ctx = {"_cupy": cupy_standin, "_ops": ops_gpu}, ops_gpu.use_cupy(cupy_standin)
    rows, load0 = [], os.getloadavg()[0]
    with ctx:
        for T in [int(t) for t in args.tenants.split(",")]:
            L = args.len
            pets = [dataclasses.replace(base[TYPES[j % 4]], key=("t", j)) for j in range(T)]
            rng = np.random.default_rng(T)
            x = rng.standard_normal((T, L, enc.config.d)).astype(np.float32)
            mask = np.ones((T, L), dtype=bool)
            execs = {n: GpuExecutor(enc, lanes=n, hot_tier_rows=0, max_batch=T, max_len=L, **kwargs)
                     for n in (1, args.lanes)}
            for ex in execs.values():
                ex.run(x, mask, pets)  # warm-up: uploads, kernel builds
            seen = {n: [] for n in execs}
            for _ in range(args.reps):
                for n, ex in execs.items():
                    t0 = time.perf_counter()
                    ex.run(x, mask, pets)  # returns host logits: synchronised
                    seen[n].append(time.perf_counter() - t0)
            one, many = (float(np.median(seen[n])) for n in execs)
            rows.append([T, f"{one * 1e3:.2f}", f"{many * 1e3:.2f}", f"{one / many:.2f}x"])
            print(f"T={T}: one lane {one * 1e3:.2f} ms, {args.lanes} lanes {many * 1e3:.2f} ms", file=sys.stderr)
            for ex in execs.values():
                ex.close()
    where = "CUDA-on-CPU emulation (times mean nothing)" if args.emulate else "GPU"
    title = (f"### GPU executor, upper layers: one lane vs {args.lanes} lane streams (Alg. 2), one request of "
             f"{args.len} tokens per tenant, mixed PET types, median of {args.reps}; {where}; load average "
             f"{load0:.1f}\n")
    text = "\n".join([title,
                      md_table(["tenants", "one lane ms", f"{args.lanes} lanes ms", "lanes vs one lane"], rows)])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
