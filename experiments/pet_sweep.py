"""Score one task's PET over a grid of settings, on the inputs a store version serves.

    python -m experiments.pet_sweep --store /tmp/hmi4/store --version root \
        --train /tmp/hmi4/data/NCBI-disease.train.conll --test /tmp/hmi4/data/NCBI-disease.test.conll \
        --task tagging --targets o --targets ffn_out --targets o,ffn_out --epochs 5,10 --lr 0.002,0.005

The inputs are computed once (runtime.plot.retrieve.retrieve_list: the serving path); every grid point
trains a fresh PET + head on them (runtime.construct.train.train_pet, same seed) and scores the test set
as benchmarks/hmi_accuracy does (accuracy, or entity-level F1 for tagging). This is how the adapter
design in BENCHMARKS.md (Houlsby's two adapters a layer) was chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time


def sweep(store_path, version, train_path, test_path, task, *, pet_type="adapter", targets=(None,),
          epochs=(10,), lrs=(2e-3,), batch_size=16, max_len=64, seeds=(0,), bottlenecks=(64,)) -> list[dict]:
    """One row per (targets, bottleneck, epochs, lr, seed): the score and the last training-batch loss
    (a last loss near the first one is a run that did not converge: try a lower lr)."""
    import hkstore
    from runtime.model.stored import base_encoder
    from runtime.model.pet import create_pet, head
    from runtime.plot.retrieve import retrieve_list
    from runtime.construct.train import TrainConfig, train_pet
    from benchmarks.hmi_accuracy import Task, padded, predict

    with hkstore.open(store_path) as st:
        encoder = base_encoder(st)  # the store's model, checked against its tokenizer
        t = Task(task, {"kind": task, "train": train_path, "eval": test_path}, encoder, max_len)
        train_x = retrieve_list(st.snapshot(), version, t.train_ids)
        test_x = retrieve_list(st.snapshot(), version, t.test_ids)
    rows = []
    for target, bottleneck, n_epochs, lr, seed in itertools.product(targets, bottlenecks, epochs, lrs, seeds):
        t0 = time.perf_counter()
        pet = create_pet(encoder, pet_type, task, t.labels, targets=target, bottleneck=bottleneck, seed=seed)
        cfg = TrainConfig(lr=lr, epochs=n_epochs, batch_size=batch_size, seed=seed, progress=False)
        trained, log = train_pet(encoder, pet, train_x, t.train_y, cfg)
        score = t.score(predict(lambda b: head(trained, encoder.upper(*padded(b), trained)), test_x))
        rows.append({"pet_type": pet_type, "targets": list(trained.meta.get("targets", [])),
                     "bottleneck": trained.meta.get("bottleneck"), "epochs": n_epochs,
                     "lr": lr, "seed": seed, "score": score, "loss_last": log[-1],
                     "seconds": round(time.perf_counter() - t0, 1)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--version", default="root")
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--task", choices=["classification", "tagging"], required=True)
    p.add_argument("--pet", default="adapter")
    p.add_argument("--targets", action="append", help="comma-separated targets; repeat for a grid (default: the type's)")
    p.add_argument("--bottleneck", default="64", help="comma-separated adapter bottlenecks")
    p.add_argument("--epochs", default="10", help="comma-separated")
    p.add_argument("--lr", default="0.002", help="comma-separated")
    p.add_argument("--seed", default="0", help="comma-separated training seeds")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    args = p.parse_args(argv)
    from hkstore.errors import StoreError

    targets = [tuple(t.split(",")) for t in args.targets] if args.targets else [None]

    def grid(text, kind):
        return [kind(x) for x in text.split(",")]

    try:
        rows = sweep(args.store, args.version, args.train, args.test, args.task, pet_type=args.pet, targets=targets,
                     epochs=grid(args.epochs, int), lrs=grid(args.lr, float), max_len=args.max_len,
                     seeds=grid(args.seed, int), bottlenecks=grid(args.bottleneck, int))
    except (StoreError, ValueError, OSError) as e:  # one line, as the hkstore CLI
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows))
    else:
        print("| pet | targets | bottleneck | epochs | lr | seed | score % | last loss | s |\n"
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['pet_type']} | {','.join(r['targets'])} | {r['bottleneck'] or ''} | {r['epochs']} | {r['lr']:g} | {r['seed']} "
                  f"| {100 * r['score']:.1f} "
                  f"| {r['loss_last']:.4f} | {r['seconds']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
