"""An experiment for issue 16: train a tenant's PET on both levels' inputs, then bound it.

    python -m tools.tabi_mixed --store STORE --data DATA --tasks bc5cdr,NCBI-disease,sciie --exact-views 2
    python -m tools.tabi_bound --store STORE --tasks bc5cdr,NCBI-disease,sciie --tenant '{task}-hplm-mix2' ...

Level 2 runs a PET that was trained on level 1's inputs (the PLOT, as served to unseen text), so
it improves some queries and worsens others, and no dispatcher can tell which. This trains a
copy of each task's ``<task>-hplm`` tenant the way tenant create does (its version, the adapter,
the same hyperparameters as tools.hmi_accuracy's hPLM row) except that --exact-views of the
UNSEEN_VIEWS training views are the full-context lower layers of level 2 instead of PLOT draws,
and stores it as ``<task>-hplm-mix<K>``. DATA holds ``<task>.train.conll`` / ``.jsonl`` (an
hmi_accuracy run's data folder: the examples the hPLM tenant was trained on).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import hkstore
from runtime.build import manager
from runtime.build.train import TrainConfig, train_pet
from runtime.model import pet as petlib
from runtime.model.stored import base_encoder, context_encoder
from runtime.plot.retrieve import retrieve_list
from tools.tabi_bench import TASKS


def full_context(store, version, encoder, ids, batch=64) -> list[torch.Tensor]:
    """Level 2's inputs of each sequence: the version's full-context lower layers."""
    enc = context_encoder(store, version, encoder)
    out = []
    with torch.no_grad():
        for s in range(0, len(ids), batch):
            chunk = ids[s:s + batch]
            x, m = enc.pad(chunk)
            h = enc.lower(x, m)
            out += [h[b, :len(q)].clone() for b, q in enumerate(chunk)]
    return out


def views(store, version, encoder, ids, exact_views, unseen, seed) -> list[torch.Tensor]:
    """manager.UNSEEN_VIEWS training views of ids: exact_views of level 2's inputs, the rest
    PLOT draws as tenant create makes them (unseen backoffs)."""
    snap, rng = store.snapshot(), np.random.default_rng(seed)
    exact = full_context(store, version, encoder, ids) if exact_views else []
    out = []
    for v in range(manager.UNSEEN_VIEWS):
        out += exact if v < exact_views else retrieve_list(snap, version, ids, unseen=unseen, rng=rng)
    return out


def train(store_path, task, data, exact_views, args) -> dict:
    kind, _ = TASKS[task]
    t0 = time.perf_counter()
    with hkstore.open(store_path) as store:
        version = store.get_pet(f"{task}-hplm").meta["version"]
        encoder = base_encoder(store)
        path = f"{data}/{task}.train.{'conll' if kind == 'tagging' else 'jsonl'}"
        rows, labels = manager.read_task(path, kind)
        ids, targets = manager.encode_task(encoder, rows, kind, labels, args.max_len)
        pet = petlib.create_pet(encoder, "adapter", kind, labels, bottleneck=64, seed=args.seed)
        # tenant create's schedule: as many steps as epochs over the examples, spread over the views
        cfg = TrainConfig(lr=args.lr, epochs=max(1, round(args.epochs / manager.UNSEEN_VIEWS)),
                          batch_size=args.batch_size, seed=args.seed, progress=False)
        inputs = views(store, version, encoder, ids, exact_views, args.unseen, args.seed)
        exported, log = train_pet(encoder, pet, inputs, list(targets) * manager.UNSEEN_VIEWS, cfg)
        tenant = f"{task}-hplm-mix{exact_views}"
        record = manager._record(tenant, store, version, exported,
                                 {"train": {"path": path, "examples": len(ids), "exact_views": exact_views,
                                            "unseen": args.unseen, "loss_last": log[-1], "updates": 0}})
    with manager._open_writable(store_path) as store:
        store.put_pet(record)
    return {"tenant": tenant, "version": version, "examples": len(ids), "loss_first": log[0], "loss_last": log[-1],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--data", required=True, help="the folder of <task>.train.* files")
    ap.add_argument("--tasks", default="bc5cdr,NCBI-disease,sciie")
    ap.add_argument("--exact-views", type=int, default=2, help=f"of {manager.UNSEEN_VIEWS} training views")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--unseen", type=float, default=manager.UNSEEN)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 <= args.exact_views <= manager.UNSEEN_VIEWS:
        ap.error(f"--exact-views must be in 0..{manager.UNSEEN_VIEWS}")
    torch.set_num_threads(1)
    for task in args.tasks.split(","):
        print(json.dumps(train(args.store, task, args.data, args.exact_views, args)), flush=True)


if __name__ == "__main__":
    main()
