"""Temperatures fitted at tenant create (issue 16, Tabi Eq. 3): expected calibration error of
both levels before and after, on the held-out training examples and on test text, and what
holding the examples out of training costs.

    python -m experiments.calibration_eval --store STORE --version cs --task classification \
        --train DATA/citation_intent.train.jsonl --test DATA/citation_intent.test.jsonl --share 0.1

Adds two tenants to STORE (replacing them if present): cal-NAME, created with
--calibration-share SHARE, and full-NAME, the same PET trained on every example. Settings are
tenant create's defaults (the hPLM row of benchmarks.hmi_accuracy: adapter, 10 epochs, lr 2e-3).
Test metrics: accuracy (classification) or token accuracy over scored sub-tokens (tagging).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def evaluate(store_path, tenant, version, test_path, task):
    """Per level: metric, ECE at T = 1 and at the tenant's fitted temperature, on test text."""
    import hkstore
    from runtime.construct import manager
    from runtime.construct.calibration import level_logits
    from runtime.model import calibrate as cal
    from runtime.model.stored import base_encoder

    with hkstore.open(store_path) as st:
        base = base_encoder(st)
        meta, pet = manager.load_tenant(st, tenant, base)
        data, _ = manager.read_task(test_path, task)
        ids, targets = manager.encode_eval(base, data, task, meta["labels"], meta["train"]["max_len"])
        logits = level_logits(st, base, version, pet, ids)
    temps = (meta.get("calibration") or {}).get("temperature") or {}
    out = {}
    for level, z in zip(("1", "2"), logits):
        zz, y = cal.samples(z, targets)
        keep = y >= 0
        zz, y = zz[keep], y[keep]
        T = float(temps.get(level, 1.0))
        out[level] = {"metric": round(100 * float((zz.argmax(-1) == y).mean()), 2),
                      "ece_T1": round(float(cal.reliability(cal.softmax(zz), y)["ece"]), 4),
                      "ece_fitted": round(float(cal.reliability(cal.softmax(zz, T), y)["ece"]), 4),
                      "temperature": T, "samples": len(y)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--task", choices=("classification", "tagging"), required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--name", default=None, help="tenant name suffix (default: the train file's stem)")
    ap.add_argument("--share", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="append the result as a JSON line here")
    args = ap.parse_args(argv)

    from runtime.construct import manager

    name = args.name or os.path.basename(args.train).split(".")[0]
    result = {"task": name, "share": args.share, "version": args.version}
    for tenant, share in ((f"cal-{name}", args.share), (f"full-{name}", 0.0)):
        t0 = time.perf_counter()
        summary = manager.tenant_create(args.store, tenant, version=args.version, train_path=args.train,
                                        task=args.task, epochs=args.epochs, max_len=args.max_len, replace=True,
                                        calibration_share=share, progress=False)
        result[tenant.split("-")[0]] = {"trained_on": summary["examples"],
                                        "test": evaluate(args.store, tenant, args.version, args.test, args.task),
                                        "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({tenant: result[tenant.split("-")[0]]}), flush=True)
    import hkstore

    with hkstore.open(args.store) as st:
        result["cal"]["held_out"] = st.snapshot().read_pet(f"cal-{name}").meta["calibration"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
