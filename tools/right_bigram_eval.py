"""Does the right bi-gram step pay? (issue 21; measured, then removed: BENCHMARKS, session 9)

    python -m tools.right_bigram_eval --run /tmp/acc3 --copy /tmp/acc3rb

Copies a finished tools.hmi_accuracy run's store, gives the copy the step
(runtime.build.right_bigram), and serves every tenant of the copy's tasks on both stores:
coverage of the dev windows by order at the task's domain, and the tenant's dev score. Retrain
on the copy with `tools.hmi_tune --run COPY --row hplm --grid unseen=0.3`.
"""

import argparse
import json
import shutil
from pathlib import Path

import hkstore
from runtime.build import manager
from runtime.build.manager import read_task, tokenize_corpus
from runtime.build.right_bigram import add_right_bigrams
from runtime.model.stored import base_encoder
from runtime.plot.window import corpus_windows
from tools.hmi_accuracy import TASKS, texts_of
from tools.report import coverage


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--copy", required=True)
    args = ap.parse_args()
    run, copy = Path(args.run), Path(args.copy)
    if not copy.exists():
        shutil.copytree(run, copy)
        with hkstore.open(copy / "store", writable=True) as st:
            print(json.dumps(add_right_bigrams(st)))
    config = json.loads((run / "results.json").read_text())["config"]
    for task in config["tasks"]:
        kind, _, domain = TASKS[task]
        evalf = next((run / "data").glob(f"{task}.{config['eval_split']}.*"))
        for store in (run / "store", copy / "store"):
            with hkstore.open(store) as st:
                (x, _), _ = read_task(str(evalf), kind)
                seqs = tokenize_corpus(base_encoder(st), texts_of(kind, x), config["max_len"])
                wins, _ = corpus_windows(seqs, st.meta["n"], st.meta["window"], st.meta["pad_id"])
                c = coverage(st.snapshot(), domain, wins)
                tenants = sorted(t for t in st.pets() if t.startswith(f"{task}-hplm"))
            shares = {o: round(100 * v["share"], 1) for o, v in c["by_order"].items()}
            print(f"{task} {store}: orders {shares}")
            for t in tenants:
                score = manager.tenant_eval(str(store), t, str(evalf), max_len=config["max_len"])["score"]
                print(f"  {t}: {100 * score:.1f}", flush=True)


if __name__ == "__main__":
    main()
