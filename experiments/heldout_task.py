"""A classification task outside the suite, derived from SciERC's gold entity types: does a
sentence mention a Task entity, a Method entity, both, or neither?

The suite tags SciERC's entities (ner/sciie); it never asks a sentence-level question of them,
so this task is new to every PET and setting the suite chose, while its labels are the corpus's
own annotations (nothing hand-labelled or generated). Each split comes from the same split of
the source, so train, dev and test keep SciERC's document split. A text (its words joined by
single spaces) found in more than one split is dropped from all of them, and so is a text whose
copies within a split disagree on the label: a sentence the model could have seen in training, or
one with two answers, would not measure what the test claims to. Agreeing copies are kept once.

    python -m experiments.heldout_task --out /work/runs/heldout-data

writes OUT/text_classification/sciie-task-method/{train,dev,test}.txt in the suite's JSON-lines
format ({"text", "label", "metadata"}) and prints the label counts per split. The output is a
function of the source files alone: rerunning it writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "sciie-task-method"
SOURCE = Path("ner") / "sciie"
SPLITS = ("train", "dev", "test")
LABELS = ("both", "method", "neither", "task")


def label_of(tags) -> str:
    """Which of SciERC's Task and Method types the sentence's gold tags (BIO or IO) mention."""
    types = {t.split("-", 1)[1] for t in tags if "-" in t}
    task, method = "Task" in types, "Method" in types
    return "both" if task and method else "task" if task else "method" if method else "neither"


def examples(data, split) -> list[dict]:
    """The labelled sentences of one split's CoNLL file, in file order, each with where it came from."""
    from runtime.construct.data import read_conll

    source = (SOURCE / f"{split}.txt").as_posix()
    sentences, tags = read_conll(Path(data) / source)
    return [{"text": " ".join(words), "label": label_of(ts), "metadata": {"source": source, "sentence": i}}
            for i, (words, ts) in enumerate(zip(sentences, tags))]


def clean(by_split: dict) -> tuple[dict, dict]:
    """by_split with cross-split texts and conflicting duplicates dropped and agreeing copies
    kept once (the first); and how many examples each rule dropped."""
    splits_of, labels_of = {}, {}
    for split, exs in by_split.items():
        for e in exs:
            splits_of.setdefault(e["text"], set()).add(split)
            labels_of.setdefault((split, e["text"]), set()).add(e["label"])
    out, dropped = {}, Counter()
    for split, exs in by_split.items():
        seen, kept = set(), []
        for e in exs:
            if len(splits_of[e["text"]]) > 1:
                dropped["in several splits"] += 1
            elif len(labels_of[(split, e["text"])]) > 1:
                dropped["conflicting labels"] += 1
            elif e["text"] in seen:
                dropped["repeated"] += 1
            else:
                seen.add(e["text"])
                kept.append(e)
        out[split] = kept
    return out, dict(dropped)


def build(data, out) -> dict:
    """Write the task under out from the SciERC files under data; {split: Counter of labels}."""
    kept, dropped = clean({split: examples(data, split) for split in SPLITS})
    target = Path(out) / "text_classification" / NAME
    target.mkdir(parents=True, exist_ok=True)
    for split, exs in kept.items():
        with open(target / f"{split}.txt", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(e, sort_keys=True) + "\n" for e in exs)
    return {"counts": {split: Counter(e["label"] for e in exs) for split, exs in kept.items()}, "dropped": dropped,
            "directory": str(target)}


def main(argv=None):
    from benchmarks.hmi_accuracy import SCIBERT

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(SCIBERT), help="the SciBERT data root (ner/sciie is read)")
    ap.add_argument("--out", required=True, help="a data root for --data of benchmarks.hmi_accuracy and "
                    "experiments.full_depth; keep it outside the repository")
    args = ap.parse_args(argv)
    got = build(args.data, args.out)
    print(f"{got['directory']}; dropped {got['dropped'] or 'nothing'}")
    for split, counts in got["counts"].items():
        print(f"{split}: {sum(counts.values())} sentences, " + ", ".join(f"{k} {counts[k]}" for k in LABELS))


if __name__ == "__main__":
    main()
