"""experiments.heldout_task against a plain reference on small synthetic SciERC-like files: each
split's examples come from the same split of the source, no text is in two splits, a text with
two labels in its split is dropped, agreeing copies are kept once, labels follow the Task /
Method rule, and the output is the same bytes every time; the harness reads it by its name."""

import argparse
import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.heldout_task import NAME, SOURCE, SPLITS, build, label_of

TYPES = ("Task", "Method", "Material", "Metric", "Generic", "OtherScientificTerm")
WORDS = ("we", "parse", "text", "a", "model", "of")  # few words: sentences repeat across and within splits
token = st.tuples(st.sampled_from(WORDS), st.sampled_from(("O",) + tuple(f"{p}-{t}" for p in "BI" for t in TYPES)))
sentence = st.lists(token, min_size=1, max_size=3)
corpus = st.fixed_dictionaries({s: st.lists(sentence, min_size=1, max_size=12) for s in SPLITS})


def write_source(root: Path, corpus: dict) -> None:
    (root / SOURCE).mkdir(parents=True)
    for split, sentences in corpus.items():
        lines = ["-DOCSTART- NN O O", ""]
        for s in sentences:
            lines += [f"{w} NN O {t}" for w, t in s] + [""]
        (root / SOURCE / f"{split}.txt").write_text("\n".join(lines) + "\n")


def read_out(root: Path) -> dict:
    return {s: [json.loads(line) for line in (root / "text_classification" / NAME / f"{s}.txt").open()]
            for s in SPLITS}


def reference_label(tags) -> str:
    kinds = {t[2:] for t in tags if t != "O"}
    return {(True, True): "both", (True, False): "task", (False, True): "method",
            (False, False): "neither"}[("Task" in kinds, "Method" in kinds)]


@settings(max_examples=80, deadline=None)
@given(corpus)
def test_the_task_is_the_sources_splits_without_leaks_or_conflicts(corpus):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_source(tmp / "src", corpus)
        build(tmp / "src", tmp / "a")
        build(tmp / "src", tmp / "b")
        out = read_out(tmp / "a")
        for s in SPLITS:
            a = tmp / "a" / "text_classification" / NAME / f"{s}.txt"
            assert a.read_bytes() == (tmp / "b" / "text_classification" / NAME / f"{s}.txt").read_bytes()
    labels = {s: {} for s in SPLITS}  # split -> text -> the labels its copies carry
    for s, sentences in corpus.items():
        for sent in sentences:
            labels[s].setdefault(" ".join(w for w, _ in sent), set()).add(reference_label([t for _, t in sent]))
    for s in SPLITS:
        elsewhere = {t for o in SPLITS if o != s for t in labels[o]}
        expected = [t for t, ls in labels[s].items() if len(ls) == 1 and t not in elsewhere]
        got = out[s]
        assert [e["text"] for e in got] == expected  # source order, each once, nothing else
        for e in got:
            assert e["label"] == next(iter(labels[s][e["text"]]))
            assert e["metadata"]["source"] == f"{SOURCE.as_posix()}/{s}.txt"
            words = corpus[s][e["metadata"]["sentence"]]
            assert " ".join(w for w, _ in words) == e["text"]


def test_labels_read_bio_and_io_tags_alike():
    assert label_of(["O", "B-Task", "I-Task", "I-Method"]) == "both"
    assert label_of(["I-Task", "O"]) == "task"
    assert label_of(["B-Method"]) == "method"
    assert label_of(["I-Material", "I-Generic", "O"]) == "neither"
    assert label_of(["O"]) == "neither"


def test_the_harness_samples_the_built_task_by_name():
    from benchmarks.hmi_accuracy import HELD_OUT, prepare_data

    assert HELD_OUT[NAME][:2] == ("classification", f"text_classification/{NAME}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_source(tmp / "src", {"train": [[("we", "B-Task")], [("parse", "O")]], "dev": [[("model", "I-Method")]],
                                   "test": [[("a", "I-Task"), ("text", "I-Method")]]})
        build(tmp / "src", tmp / "data")
        hargs = argparse.Namespace(tasks=[NAME], data=str(tmp / "data"), max_train=600, max_test=400, seed=0,
                                   eval_split="test", max_domain_docs=0, general="")
        info = prepare_data(hargs, tmp / "run")["tasks"][NAME]
        rows = [json.loads(line) for line in open(info["eval"])]
        assert [(r["text"], r["label"]) for r in rows] == [("a text", "both")]
        assert sorted(json.loads(line)["label"] for line in open(info["train"])) == ["neither", "task"]
