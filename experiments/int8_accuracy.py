"""fp32 vs int8 shared GEMMs (runtime.exec.int8) on a store's tenants, or on saved full-depth PETs, through the serving path.

Store mode: each tenant is scored on a labeled file twice, by the same retrieval (its PLOT
version) and the same CPU executor except for ``int8``: accuracy for classification,
entity-level F1 for tagging (as ``hkstore tenant eval``). Prints a markdown table with the
difference and the upper layers' compute time of each path (same batches, the paths taking turns).

    python -m experiments.int8_accuracy STORE --eval citation_intent-hplm=RUN/data/citation_intent.dev.jsonl \\
        --eval NCBI-disease-hplm=RUN/data/NCBI-disease.dev.conll

Full-depth mode: every int8 scheme against fp32 on the full-depth PETs
that experiments.full_depth --save-pets kept, served as full rows; --gemm: the GEMM rates.

    python -m experiments.int8_accuracy --full-depth RUN/pets --out OUT --schemes row,row-outlier,tensor,outlier,smooth
    python -m experiments.int8_accuracy --gemm
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hkstore
from runtime.construct.data import accuracy, entity_f1, word_tags
from runtime.construct.manager import encode_eval, load_tenant, read_task
from runtime.exec.cpu import CpuExecutor
from runtime.model.stored import base_encoder
from runtime.plot.retrieve import retrieve


def score_tenant(store, tenant, path, batch_size=64, max_len=None) -> dict:
    encoder = base_encoder(store)
    meta, pet = load_tenant(store, tenant, encoder)
    task, labels, version = meta["task"], list(meta["labels"]), meta["version"]
    (x, y), _ = read_task(path, task)
    max_len = max_len or (meta.get("train") or {}).get("max_len", 128)
    ids, targets = encode_eval(encoder, (x, y), task, labels, max_len)
    execs = {"fp32": CpuExecutor(encoder, prefetch=False), "int8": CpuExecutor(encoder, prefetch=False, int8=True)}
    serving = execs["fp32"].load_pet(pet, key=tenant)
    predicted = {k: [] for k in execs}
    seconds = dict.fromkeys(execs, 0.0)
    snap = store.snapshot()
    for start in range(0, len(ids), batch_size):
        inputs, mask, _ = retrieve(snap, version, ids[start:start + batch_size])
        for k, ex in execs.items():
            t0 = time.perf_counter()
            logits = ex.run(inputs, mask, [serving] * len(inputs))
            seconds[k] += time.perf_counter() - t0
            predicted[k] += [lg.argmax(-1).tolist() for lg in logits]
    out = {"tenant": tenant, "file": path, "examples": len(ids), "task": task}
    for k in execs:
        if task == "classification":
            out[k] = 100 * accuracy(targets, predicted[k])
        else:
            pred = [word_tags(p, t, labels, len(w)) for p, t, w in zip(predicted[k], targets, x)]
            out[k] = 100 * entity_f1([[t if t in labels else "O" for t in ts] for ts in y], pred)
        out[k + " s"] = seconds[k]
    out["metric"] = "accuracy" if task == "classification" else "entity F1"
    return out


# -- full-depth PETs, every scheme (--full-depth) and the GEMM rates (--gemm) ----------------

TASK_ORDER = ("NCBI-disease", "chemprot", "bc5cdr", "citation_intent", "sciie", "sci-cite")
GEMM_SHAPES = ((384, 384), (384, 1536), (1536, 384))


def add_full_arguments(ap):
    ap.add_argument("--full-depth", metavar="PETS", help="a directory of TASK-ROW.pt full-depth PETs "
                    "(experiments.full_depth --save-pets), scored on the harness's dev sample (600/400, max-len 64, seed 0)")
    ap.add_argument("--out", help="full-depth mode: where the sampled data and int8-full.json go")
    ap.add_argument("--data", help="the SciBERT task data (default: benchmarks.hmi_accuracy's)")
    ap.add_argument("--row", default="fd-lora", help="the saved PETs' row name")
    ap.add_argument("--schemes", default="row,row-outlier,tensor,outlier,smooth", help="runtime.exec.int8 schemes, comma-separated")
    ap.add_argument("--calibrate", type=int, default=50,
                    help="train texts per task the calibrated schemes' activation ranges come from")
    ap.add_argument("--gemm", action="store_true", help="the GEMM rates of every scheme against fp32 torch.addmm")
    ap.add_argument("--gemm-rows", default="2048,8192")
    ap.add_argument("--reps", type=int, default=5, help="--gemm: timed repetitions (the minimum is kept)")


def full_rows(serving, ids):
    from runtime.exec.rows import Row

    return [Row(list(s), serving, "", source="full") for s in ids]


def serve(ex, rows):
    """Logits of full rows through the executor's plan path (gather, prepare, compute)."""
    return ex.compute(ex.prepare(ex.gather(None, rows), rows))


def load_full_pets(directory, row, encoder, tasks=TASK_ORDER) -> dict:
    """{task: full-depth Pet} of the saved PETs of tasks present (meta level "full" added: saved before it existed)."""
    import torch
    from runtime.model.pet import FULL, load_pet

    pets = {}
    for task in tasks:
        path = os.path.join(directory, f"{task}-{row}.pt")
        if os.path.exists(path):
            saved = torch.load(path)
            pets[task] = load_pet(encoder, saved["tensors"], dict(saved["meta"], level=FULL))
    return pets


def calibrate(encoder, tasks, servings, n, batch=64) -> dict:
    """Per-channel activation absmax of every projection over n train texts per task (each with its PET)."""
    from runtime.exec.int8 import Recorder

    rec = Recorder(encoder)
    ex = CpuExecutor(encoder, prefetch=False, int8=rec)
    for name, t in tasks.items():
        ids = t.train_ids[:n]
        for start in range(0, len(ids), batch):
            serve(ex, full_rows(servings[name], ids[start:start + batch]))
    return rec.absmax


def score_full(executors, serving, task, batch) -> dict:
    """Each executor's score of one task (its PET as full rows), its compute CPU seconds, and the
    share of its predictions (per example or per token) equal to the first executor's. serving:
    the ServingPet every executor serves, or {executor name: its ServingPet}."""
    predicted = {k: [] for k in executors}
    seconds = dict.fromkeys(executors, 0.0)
    for start in range(0, len(task.test_ids), batch):
        ids = task.test_ids[start:start + batch]
        for k, ex in executors.items():
            rows = full_rows(serving[k] if isinstance(serving, dict) else serving, ids)
            t0 = time.thread_time()
            logits = serve(ex, rows)
            seconds[k] += time.thread_time() - t0
            predicted[k] += [lg.argmax(-1).tolist() for lg in logits]
    flat = {k: [t for p in v for t in (p if isinstance(p, list) else [p])] for k, v in predicted.items()}
    base = next(iter(flat.values()))  # the first executor's (fp32's) predictions
    return {k: {"score": 100 * task.score(predicted[k]), "cpu_s": round(seconds[k], 2),
                "agree": round(100 * sum(a == b for a, b in zip(flat[k], base)) / max(len(base), 1), 2)}
            for k in executors}


def main_full(args, ap):
    import json

    import torch

    from runtime.exec.int8 import CALIBRATED, SCHEMES, Int8Shared

    torch.set_num_threads(1)
    schemes = [s for s in args.schemes.split(",") if s]
    if bad := [s for s in schemes if s not in SCHEMES]:
        ap.error(f"unknown schemes {bad}; expected some of {', '.join(SCHEMES)}")
    out = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "isa_env": {k: v for k, v in os.environ.items() if k.endswith(("CPU_CAPABILITY", "INSTRUCTIONS", "CPU_ISA"))}}
    if args.gemm:
        out["gemm"] = gemm_rates([int(r) for r in args.gemm_rows.split(",")], schemes, args.reps)
    if args.full_depth:
        if not args.out:
            ap.error("--full-depth needs --out (the sampled data goes there)")
        out["full_depth"] = full_depth(args, schemes, CALIBRATED, Int8Shared)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "int8-full.json"), "w") as f:
            json.dump(out, f, indent=1)


def dev_tasks(names, encoder, out, data=None) -> dict:
    """{task: benchmarks.hmi_accuracy.Task} of the harness's dev sample (600/400, max-len 64,
    seed 0), sampled into OUT/data; data: the SciBERT task data (default the harness's)."""
    from pathlib import Path

    from benchmarks.hmi_accuracy import SCIBERT, Task, prepare_data

    hargs = argparse.Namespace(tasks=list(names), data=data or str(SCIBERT), max_train=600, max_test=400, seed=0,
                               eval_split="dev", max_domain_docs=0, general="")
    sampled = prepare_data(hargs, Path(out))
    return {name: Task(name, sampled["tasks"][name], encoder, 64) for name in names}


def full_depth(args, schemes, calibrated, Int8Shared) -> dict:
    from runtime.model.encoder import load_encoder

    encoder = load_encoder(None, 2)  # full rows run the lower layers (here 0-1) and the upper ones alike
    pets = load_full_pets(args.full_depth, args.row, encoder)
    if not pets:
        raise SystemExit(f"no {args.row} PETs in {args.full_depth}")
    tasks = dev_tasks(pets, encoder, args.out, args.data)
    fp32 = CpuExecutor(encoder, prefetch=False)
    servings = {name: fp32.load_pet(p, key=name) for name, p in pets.items()}
    absmax = None
    if set(schemes) & set(calibrated):
        t0 = time.perf_counter()
        absmax = calibrate(encoder, tasks, servings, args.calibrate)
        print(f"calibrated on {args.calibrate} train texts per task in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    layers = range(encoder.config.num_layers)
    executors = {"fp32": fp32, **{s: CpuExecutor(encoder, prefetch=False, int8=Int8Shared(encoder, layers, s, absmax))
                                  for s in schemes}}
    results = {}
    print("| task | metric | examples | fp32 | " + " | ".join(f"{s} - fp32" for s in schemes) + " |")
    print("| --- | --- | ---: | ---: |" + " ---: |" * len(schemes))
    for name, t in tasks.items():
        r = score_full(executors, servings[name], t, args.batch_size)
        results[name] = dict(r, examples=len(t.test_ids), metric="accuracy" if t.kind == "classification" else "entity F1")
        base = r["fp32"]["score"]
        print(f"| {name} | {results[name]['metric']} | {len(t.test_ids)} | {base:.2f} | "
              + " | ".join(f"{r[s]['score'] - base:+.2f}" for s in schemes) + " |", flush=True)
        print(f"{name}: cpu s, % predictions as fp32: " + ", ".join(f"{k} {v['cpu_s']} {v['agree']}" for k, v in r.items()),
              file=sys.stderr, flush=True)
    return {"row": args.row, "pets": args.full_depth, "tasks": results}


def gemm_rates(rows_list, schemes, reps) -> list:
    """CPU ms (one thread, minimum of reps, the paths taking turns) of fp32 torch.addmm and of each
    scheme's Int8Shared.linear, at the executor's shapes. The activations are Gaussian with 2% of
    the channels 10x wider, calibrated as the only outliers (the encoder's projections have 0-4%
    of their input channels above the outlier threshold: the outlier schemes' fp32 part)."""
    import types

    import torch

    from runtime.exec.int8 import TARGETS, Int8Shared

    torch.manual_seed(0)
    table = []
    for rows in rows_list:
        for d_in, d_out in GEMM_SHAPES:
            lin = torch.nn.Linear(d_in, d_out)
            x = torch.randn(rows, d_in)
            wide = torch.arange(d_in) < max(1, d_in // 50)
            x[:, wide] *= 10
            enc = types.SimpleNamespace(layers=[types.SimpleNamespace(**dict.fromkeys(TARGETS, lin))])
            absmax = {(0, t): torch.where(wide, 30.0, 3.0) for t in TARGETS}
            out = torch.empty(rows, d_out)
            paths = {"fp32": lambda: torch.addmm(lin.bias, x, lin.weight.t(), out=out)}
            for s in schemes:
                q = Int8Shared(enc, [0], s, absmax)
                paths[s] = (lambda q: lambda: q.linear(0, "q", x, out))(q)
            best = time_paths(paths, reps)
            cell = {"rows": rows, "shape": f"{d_in}->{d_out}", "fp32 ms": round(best["fp32"], 2),
                    **{f"{s} ms": round(best[s], 2) for s in schemes},
                    **{f"{s} x": round(best["fp32"] / best[s], 2) for s in schemes}}
            print(" ".join(f"{k} {v}" for k, v in cell.items()), file=sys.stderr, flush=True)
            table.append(cell)
    return table


def time_paths(paths, reps) -> dict:
    with torch_no_grad():
        for f in paths.values():
            f()
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(reps):
            for k, f in paths.items():
                t0 = time.thread_time()
                f()
                best[k] = min(best[k], time.thread_time() - t0)
    return {k: 1e3 * v for k, v in best.items()}


def torch_no_grad():
    import torch

    return torch.no_grad()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", nargs="?")
    ap.add_argument("--eval", action="append", default=[], metavar="TENANT=FILE",
                    help="a tenant and its labeled file (repeatable)")
    ap.add_argument("--batch-size", type=int, default=64)
    add_full_arguments(ap)
    args = ap.parse_args(argv)
    if args.gemm or args.full_depth:
        return main_full(args, ap)
    if not args.store or not args.eval:
        ap.error("expected STORE and at least one --eval (or --full-depth / --gemm)")
    pairs = []
    for e in args.eval:
        tenant, sep, path = e.partition("=")
        if not sep or not os.path.exists(path):
            ap.error(f"--eval {e!r}: expected TENANT=FILE with an existing file")
        pairs.append((tenant, path))
    rows = []
    with hkstore.open(args.store) as store:
        for tenant, path in pairs:
            r = score_tenant(store, tenant, path, args.batch_size)
            print(f"{tenant}: fp32 {r['fp32']:.2f}, int8 {r['int8']:.2f}", file=sys.stderr, flush=True)
            rows.append(r)
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print("| tenant | file | examples | metric | fp32 % | int8 % | int8 - fp32 | upper layers fp32 s | int8 s | speed-up |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['tenant']} | {os.path.basename(r['file'])} | {r['examples']} | {r['metric']} | {r['fp32']:.2f} | "
              f"{r['int8']:.2f} | {r['int8'] - r['fp32']:+.2f} | {r['fp32 s']:.1f} | {r['int8 s']:.1f} | "
              f"{r['fp32 s'] / r['int8 s']:.2f}x |")
    mean = sum(r["int8"] - r["fp32"] for r in rows) / len(rows)
    print(f"\nmean int8 - fp32: {mean:+.2f} points")


if __name__ == "__main__":
    main()
