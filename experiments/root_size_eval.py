"""hPLM accuracy against the root's general corpus (issue 21): serve a finished run's tenants as if
the root had been built from less general text.

    python -m experiments.root_size_eval --run /tmp/acc3 --fractions 0,0.25,1

For each fraction f the root keeps the keys a build from (the first f of the run's general lines
+ every task's train text) would hold (runtime.construct.plot.root_keys: windows, their backoff keys,
every uni-gram). The store is not rewritten: the lookup of this process serves a root entry only
if its key is kept and otherwise continues down the window's chain (FORMAT.md section 4), which is
exactly the answer of the smaller root. What it does not redo: the root's window distillation,
which saw the whole corpus (a second-order effect on the values, not on which keys exist).
Reads only; prints the served-order shares of each task's evaluation windows and each hplm*
tenant's score.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import hkstore
from formats.backoff import backoff, key_order
from formats.xxh64 import hash_keys
from hkstore import lookup as lk


def served_keys(windows, served_order, kind, pad):
    """The key that served each window: the window backed off to its served order."""
    keys = np.array(windows, dtype=np.uint32, copy=True)
    order = key_order(keys, kind, pad)
    while (high := order > np.maximum(served_order, 1)).any():
        keys[high] = backoff(keys[high], kind, pad)
        order[high] -= 1
    return keys


def kept_root(keep_hashes):
    """hkstore's lookup with the root reduced to the keys whose hashes are in keep_hashes."""
    full = lk.lookup

    def lookup(snapshot, version, windows):
        kind, pad = snapshot.meta["window"], snapshot.meta["pad_id"]
        res = full(snapshot, version, windows)
        served = served_keys(windows, res.order, kind, pad)

        def dropped(rows):  # served by a root key the smaller root would not hold
            return (res.version[rows] == 0) & (res.order[rows] > 1) & ~np.isin(hash_keys(served[rows]), keep_hashes)

        todo = np.flatnonzero(dropped(np.arange(len(res.order))))
        if len(todo) and not res.values.flags.writeable:
            res.values = np.array(res.values)
        while len(todo):
            again = full(snapshot, version, backoff(served[todo], kind, pad))
            res.values[todo], res.version[todo], res.order[todo] = again.values, again.version, again.order
            served[todo] = served_keys(backoff(served[todo], kind, pad), again.order, kind, pad)
            todo = todo[dropped(todo)]
        return res

    return lookup


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="OUT directory of a benchmarks.hmi_accuracy run")
    p.add_argument("--fractions", default="0,0.25,1")
    args = p.parse_args(argv)
    from runtime.construct import manager
    from runtime.construct.manager import read_task, tokenize_corpus
    from runtime.construct.plot import root_keys
    from runtime.model.stored import base_encoder
    from runtime.plot.window import corpus_windows
    from benchmarks.hmi_accuracy import TASKS, general_text, texts_of
    from experiments.plot_coverage import _lines
    from tools.report import coverage

    run = Path(args.run)
    config = json.loads((run / "results.json").read_text())["config"]
    store = str(run / "store")
    with hkstore.open(store) as st:
        enc, meta, tenants = base_encoder(st), st.meta, sorted(st.pets())
    general = set(general_text(config["general"])) if config.get("general") else set()
    root_lines = _lines(run / "data" / "root.txt")
    general_seqs = tokenize_corpus(enc, [t for t in root_lines if t in general], config["max_len"])
    train_seqs = tokenize_corpus(enc, [t for t in root_lines if t not in general], config["max_len"])
    full_lookup = lk.lookup
    out = []
    for frac in [float(f) for f in args.fractions.split(",")]:
        part = general_seqs[:round(frac * len(general_seqs))]
        keys, _ = root_keys(part + train_seqs, meta["n"], meta["window"], meta["pad_id"], meta["vocab_size"])
        lk.lookup = kept_root(np.unique(hash_keys(keys)))
        try:
            for task in config["tasks"]:
                kind, _, domain = TASKS[task]
                evalf = next((run / "data").glob(f"{task}.{config['eval_split']}.*"))
                (x, _), _ = read_task(str(evalf), kind)
                seqs = tokenize_corpus(enc, texts_of(kind, x), config["max_len"])
                wins, _ = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
                with hkstore.open(store) as st:
                    c = coverage(st.snapshot(), domain, wins)
                row = {"fraction": frac, "root_keys": len(keys), "task": task,
                       "orders": {o: round(100 * v["share"], 1) for o, v in c["by_order"].items()}, "scores": {}}
                for t in (t for t in tenants if t.startswith(f"{task}-hplm")):
                    score = manager.tenant_eval(store, t, str(evalf), max_len=config["max_len"])["score"]
                    row["scores"][t] = round(100 * score, 1)
                print(json.dumps(row), flush=True)
                out.append(row)
        finally:
            lk.lookup = full_lookup
    return out


if __name__ == "__main__":
    main()
