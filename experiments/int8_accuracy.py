"""fp32 vs int8 shared GEMMs (runtime.exec.int8) on a store's tenants, through the serving path.

Each tenant is scored on a labeled file twice, by the same retrieval (its PLOT version) and
the same CPU executor except for ``int8``: accuracy for classification, entity-level F1 for
tagging (as ``hkstore tenant eval``). Prints a markdown table with the difference and the
upper layers' compute time of each path (same batches, the two paths taking turns).

    python -m experiments.int8_accuracy STORE --eval citation_intent-hplm=/tmp/acc2/data/citation_intent.dev.jsonl \\
        --eval NCBI-disease-hplm=/tmp/acc2/data/NCBI-disease.dev.conll
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--eval", action="append", required=True, metavar="TENANT=FILE",
                    help="a tenant and its labeled file (repeatable)")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
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
