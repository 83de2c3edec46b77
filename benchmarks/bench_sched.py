"""PET-aware batching on this machine (PetS §4.1, issue 17): fixed-size FIFO vs alpha-only vs
beta-only vs coordinated batching (Alg. 1), on the shared task suite's real lengths.

    python -m benchmarks.bench_sched --latency latency_cpu.json [--requests 256] [--tenants 16]
           [--max-batch 32] [--reps 3] [--out FILE]

Workload: the six tasks of --data (SciBERT suite: three classification, three NER; dev
splits), tokenized with the embedded MiniLM tokenizer (WordPiece, [CLS] .. [SEP], at most
--max-len tokens). --tenants tenants, tenant j serving task j mod 6 with PET type
(adapter b=64 + LayerNorm deltas, LoRA r=16 on q/v, BitFit, diff 0.5%)[j mod 4]; --requests
requests, each from a random tenant (Zipf 1.0 over tenants) with a random text of its task,
all queued at once (PetS's setting: the scheduler sees a full queue). Each policy cuts the
queue into batches of at most --max-batch; every batch runs through the CPU executor
(kernels=batched) on random upper-layer inputs with the requests' real lengths (the
retrieval is the same for every policy and is left out). The policies take turns, --reps
rounds; each reports the median wall time, requests/s, the padded-token share and the
latency model's prediction. A second workload mixes in the longest texts (--long-share of
the requests drawn from the top 10% of lengths) to show the high-variance fallback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
import torch

TASKS = [("text_classification", "sci-cite"), ("text_classification", "citation_intent"),
         ("text_classification", "chemprot"), ("ner", "sciie"), ("ner", "bc5cdr"), ("ner", "NCBI-disease")]
TYPES = ("adapter", "lora", "bitfit", "diff")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def task_lengths(enc, data, max_len):
    from runtime.construct.data import read_classification, read_conll

    out = []
    for kind, name in TASKS:
        path = os.path.join(data, kind, name, "dev.txt")
        if kind == "ner":
            sentences, _ = read_conll(path)
            ids = [i for i, _ in enc.tokenize_words(sentences, max_len)]
        else:
            texts, _ = read_classification(path)
            ids = enc.tokenize(texts, max_len)
        out.append(np.array([len(i) for i in ids], dtype=np.int64))
    return out


def workload(lengths_by_task, tenants, requests, seed, long_share=0.0):
    """[(tenant, pet type, length)]: tenant j serves task j % 6 with PET type TYPES[j % 4]."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, tenants + 1)
    p /= p.sum()
    who = rng.choice(tenants, size=requests, p=p)
    pooled = np.sort(np.concatenate(lengths_by_task))
    top = pooled[int(0.9 * len(pooled)):]
    queue = []
    for t in who:
        t = int(t)
        lengths = lengths_by_task[t % len(lengths_by_task)]
        n = int(rng.choice(top)) if rng.random() < long_share else int(rng.choice(lengths))
        queue.append((t, TYPES[t % len(TYPES)], n))
    return queue


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", help="the latency model (benchmarks/profile_latency.py); default: profile a quick one")
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "scibert"))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cv-threshold", type=float, default=1.0)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--out")
    ap.add_argument("--figure", help="write a PNG: requests/s and padded-token share per policy and workload")
    args = ap.parse_args(argv)

    from runtime.exec.cpu import CpuExecutor
    from runtime.model.encoder import load_encoder
    from runtime.sched import coordinated as cb
    from benchmarks.bench_runtime import md_table
    from benchmarks.profile_latency import random_pet

    t_start = time.perf_counter()
    enc = load_encoder()
    if args.latency:
        model = cb.LatencyModel.load(args.latency)
    else:
        from benchmarks.profile_latency import profile

        log("no --latency: profiling a quick model")
        model = profile(enc, [1, 4, 16, 32], [16, 64, 128], 1, log)
    lengths = task_lengths(enc, args.data, args.max_len)
    pooled = np.concatenate(lengths)
    ex = CpuExecutor(enc, prefetch=False)
    pets = [random_pet(enc, TYPES[j % len(TYPES)], 100 + j) for j in range(args.tenants)]
    pets = [dataclasses.replace(p, key=("tenant", j)) for j, p in enumerate(pets)]
    d = enc.config.d
    lines = ["# PET-aware batching (PetS Alg. 1) on this machine", ""]
    load0 = os.getloadavg()[0]
    lines.append(f"Latency model: {args.latency or 'profiled quick'} ({model.meta.get('executor')}, "
                 f"{model.meta.get('machine', {}).get('cpu', '?') if isinstance(model.meta.get('machine'), dict) else ''}); "
                 f"real lengths of {len(pooled):,} dev texts of {len(TASKS)} tasks: mean {pooled.mean():.1f}, "
                 f"median {np.median(pooled):.0f}, p90 {np.percentile(pooled, 90):.0f}, max {pooled.max()} tokens "
                 f"(cap {args.max_len}); {args.tenants} tenants, Zipf 1.0; {args.requests} requests; max batch "
                 f"{args.max_batch}; median of {args.reps} rounds, policies taking turns.")
    lines.append("")
    results = {}
    for wname, share in (("suite lengths", 0.0), (f"suite + {args.long_share:.0%} long", args.long_share)):
        queue = workload(lengths, args.tenants, args.requests, 7, share)
        ls = np.array([q[2] for q in queue], dtype=float)
        cv = ls.std() / ls.mean()
        cuts = {}
        for name in ("fixed", "alpha_only", "beta_only", "coordinated (Alg. 1 only)", "coordinated"):
            if name.startswith("coordinated"):
                cuts[name] = cb.coordinated(queue, model, args.max_batch, args.cv_threshold,
                                            compare=name == "coordinated")
            else:
                cuts[name] = cb.POLICIES[name](queue, model, args.max_batch)
        fell_back = cuts["coordinated"] == cuts["alpha_only"]
        inputs = {}
        for name, batches in cuts.items():
            prepared = []
            for b in batches:
                n = [queue[k][2] for k in b]
                L = max(n)
                x = torch.randn(len(b), L, d)
                m = torch.arange(L)[None, :] < torch.tensor(n)[:, None]
                prepared.append((x, m, [pets[queue[k][0]] for k in b]))
            inputs[name] = prepared

        def run(name, inputs=inputs):
            t0 = time.perf_counter()
            for x, m, p in inputs[name]:
                ex.run(x, m, p)
            return time.perf_counter() - t0

        run("fixed")  # warm-up
        seen = {k: [] for k in cuts}
        for rep in range(args.reps):
            for name in cuts:
                log(f"{wname}: {name} ({rep + 1}/{args.reps})")
                seen[name].append(run(name))
        med = {k: float(np.median(v)) for k, v in seen.items()}
        rows = []
        for name, batches in cuts.items():
            rows.append([name, len(batches), f"{cb.padded_share(queue, batches):.1%}",
                         f"{cb.predicted_cost(queue, batches, model):.2f}", f"{med[name]:.2f}",
                         f"{args.requests / med[name]:.1f}", f"{med['fixed'] / med[name]:.2f}x",
                         f"{max(seen[name]) / min(seen[name]):.2f}"])
        lines.append(f"### {wname}: length CV {cv:.2f}" + (" (coordinated kept the alpha-only cut)" if fell_back
                                                            else "") + "\n")
        lines.append(md_table(["policy", "batches", "padded tokens", "predicted s", "measured s", "requests/s",
                               "vs fixed", "max/min"], rows))
        lines.append(f"\n- coordinated / alpha-only: **{med['alpha_only'] / med['coordinated']:.2f}x**; "
                     f"alpha-only / fixed: **{med['fixed'] / med['alpha_only']:.2f}x**; "
                     f"coordinated / fixed: **{med['fixed'] / med['coordinated']:.2f}x**")
        lines.append("")
        results[wname] = {name: {"requests_s": args.requests / med[name], "padded": cb.padded_share(queue, batches)}
                          for name, batches in cuts.items()}
    lines.append(f"Load average (1 min): {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
                 f"total {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.figure:
        figure(results, args.figure, f"{args.requests} requests, {args.tenants} tenants, load {load0:.1f}")
    return results


def figure(results: dict, path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    policies = list(next(iter(results.values())))
    width = 0.8 / len(results)
    for w, (wname, by) in enumerate(results.items()):
        at = np.arange(len(policies)) + w * width
        axes[0].bar(at, [by[p]["requests_s"] for p in policies], width, label=wname)
        axes[1].bar(at, [100 * by[p]["padded"] for p in policies], width, label=wname)
    for ax, title in zip(axes, ("requests/s (higher is better)", "padded tokens, % (lower is better)")):
        ax.set_xticks(np.arange(len(policies)) + width * (len(results) - 1) / 2)
        ax.set_xticklabels([p.replace(" (", "\n(").replace("_", "-") for p in policies], fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"PET-aware batching (PetS Alg. 1) on the CPU executor: {subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
