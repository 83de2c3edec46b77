"""benchmarks.cascade_bench and its figures (benchmarks.cascade_report): the oracle bound against
a brute-force search, the goal's arithmetic and the accuracy.json it writes, the alignment of
a tagging answer's words, and the whole driver on a tiny harness run served by `hkstore serve`."""

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import cascade_report as report
from benchmarks.cascade_bench import cpu_seconds, word_predictions

ROOT = Path(__file__).resolve().parent.parent

# -- the oracle bound -----------------------------------------------------------------------------

cls_counts = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=7)
tag_counts = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                                st.integers(0, 3)), min_size=1, max_size=6)


def brute_share(kind, cheap, top, points):
    """The fewest queries taken from the top (any subset) that bring the metric within points."""
    target = report.metric(kind, top) - points / 100
    n = len(cheap)
    for size in range(n + 1):
        for chosen in itertools.combinations(range(n), size):
            mixed = [top[j] if j in chosen else cheap[j] for j in range(n)]
            if report.metric(kind, mixed) >= target - 1e-12:
                return size / n
    raise AssertionError("every query from the top reaches the top")


@settings(max_examples=150, deadline=None)
@given(cls_counts, st.sampled_from([0.0, 1.0, 10.0, 30.0]))
def test_the_oracle_share_is_the_fewest_queries_for_accuracy(pairs, points):
    cheap = [[a, 1, 1] for a, _ in pairs]
    top = [[b, 1, 1] for _, b in pairs]
    assert report.oracle_share("classification", cheap, top, points) == pytest.approx(
        brute_share("classification", cheap, top, points))


@settings(max_examples=150, deadline=None)
@given(tag_counts, st.sampled_from([0.0, 1.0, 10.0, 30.0]))
def test_the_oracle_share_is_the_fewest_queries_for_entity_f1(rows, points):
    # (found, predicted) per level over the same gold spans; found <= both
    cheap, top = [], []
    for h1, p1, h2, p2, g in rows:
        cheap.append([min(h1, p1, g), p1, g])
        top.append([min(h2, p2, g), p2, g])
    assert report.oracle_share("tagging", cheap, top, points) == pytest.approx(
        brute_share("tagging", cheap, top, points))


# -- the figures and accuracy.json ----------------------------------------------------------------


def served(kind, correct, cpu_ms, levels):
    n = len(correct)
    rows = [[c, 1, 1] for c in correct] if kind == "classification" else correct
    return {"counts": rows, "cpu_s": [cpu_ms / 1000] * n, "wall_s": [0.01 * (j + 1) for j in range(n)],
            "level_name": levels, "students": [0] * n, "pred": [0] * n}


def a_task(name, fast, top, auto, auto_levels, cpu=(2.0, 10.0, 4.0)):
    return {"task": name, "kind": "classification", "served": {
        "fast": served("classification", fast, cpu[0], ["plot"] * len(fast)),
        "exact": served("classification", top, cpu[1], ["full"] * len(top)),
        "auto": served("classification", auto, cpu[2], auto_levels)}}


def test_the_figures_of_a_task_that_meets_the_goal_and_one_that_cannot():
    # a: auto = top at 0.4 of its CPU; b: the PLOT is 50 points below, an oracle needs half the queries
    # from the top: 0.2 + 0.5 x 0.8 = 0.6 of its cost, above the limit
    a = report.task_figures(a_task("a", [1, 0, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], ["plot", "full", "plot", "plot"]))
    b = report.task_figures(a_task("b", [0, 0, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1], ["full", "plot", "plot", "plot"]))
    assert a["met"] and a["why"] == "met" and a["gap"] == 0 and a["cost_vs_top"] == pytest.approx(0.4)
    assert a["systems"]["auto"]["shares"] == {"students": 0, "plot": 75, "exact": 0, "full": 25}
    assert a["oracle_share"] == 0.25 and a["oracle_cost"] == pytest.approx(0.2 + 0.25 * 0.8)
    assert not b["met"] and b["gap"] == pytest.approx(25) and b["oracle_cost"] == pytest.approx(0.6)
    assert b["why"] == "cannot: even an oracle needs 0.60 of the top"
    total = report.summary([a, b])
    assert total["gap_mean"] == pytest.approx(12.5) and total["cost_vs_top_mean"] == pytest.approx(0.4)
    assert not total["met"]
    t = report.table([a, b], total)
    assert [r[0] for r in t["rows"]] == ["a", "b", "mean of 2"]
    assert t["rows"][0][1:4] == [0.0, 75.0, 25.0] and t["rows"][-1][7] == 12.5 and t["rows"][-1][-1] == "not met"
    assert report.markdown(t).count("\n") == 4


def test_the_students_bound_is_the_oracle_from_the_students_to_the_top():
    # the students answer 3 of 4 as the top does at 0.05 of its CPU: an oracle sends one query up
    task = a_task("s", [0, 0, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1], ["full", "plot", "plot", "plot"])
    task["served"]["students"] = served("classification", [1, 0, 1, 1], 0.5, ["students"] * 4)
    f = report.task_figures(task)
    assert f["students_oracle_share"] == 0.25 and f["students_oracle_cost"] == pytest.approx(0.05 + 0.25 * 0.95)
    assert f["oracle_cost"] == pytest.approx(0.6) and f["systems"]["students"]["score"] == 75
    assert f["why"].startswith("auto 25.0 points below")  # the students' bound is under the limit: not "cannot"
    total = report.summary([f, report.task_figures(a_task("p", [1], [1], [1], ["plot"]))])
    assert total["students_oracle_cost_mean"] == pytest.approx(f["students_oracle_cost"])  # only tasks with students
    row = report.table([f], report.summary([f]))["rows"][0]
    assert row[-3:] == [75.0, round(f["students_oracle_cost"], 2), f["why"]]


def test_the_results_file_gets_the_two_figures_and_one_cascade_table(tmp_path):
    path = tmp_path / "accuracy.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "accuracy.json", path)
    before = json.loads(path.read_text())
    figures = [report.task_figures(a_task(t, [1, 0], [1, 1], [1, 1], ["plot", "full"])) for t in ("x", "y")]
    total = report.summary(figures)
    report.write_accuracy(path, figures, total)
    report.write_accuracy(path, figures, total)  # again: the cascade table is replaced, not added
    after = json.loads(path.read_text())
    assert after["auto_gap_to_top_mean"] == 0.0 and after["auto_cost_vs_top"] == 0.4
    others = [t for t in before["tables"] if t["columns"][0] != report.TABLE_HEAD]  # the file may hold a cascade table
    assert after["tables"][:-1] == others and after["tables"][-1]["columns"][0] == report.TABLE_HEAD
    assert after["cascade"]["by_task"]["x"] == {"auto": 100.0, "top": 100.0, "gap": 0.0, "cost_vs_top": 0.4,
                                                "oracle_cost": 0.6, "met": True}
    added = ("tables", "cascade", "auto_gap_to_top_mean", "auto_cost_vs_top")
    assert {k: v for k, v in after.items() if k not in added} == {k: v for k, v in before.items() if k not in added}


def test_the_report_joins_runs_of_some_tasks_each(tmp_path, capsys):
    results = tmp_path / "accuracy.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "accuracy.json", results)
    for name, out in (("x", "a"), ("y", "b")):
        (tmp_path / out).mkdir()
        (tmp_path / out / f"{name}.json").write_text(json.dumps(a_task(name, [1, 0], [1, 1], [1, 1], ["plot", "full"])))
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--results", str(results), "--write"]) == 0
    assert "| mean of 2 |" in capsys.readouterr().out
    assert set(json.loads(results.read_text())["cascade"]["by_task"]) == {"x", "y"}
    with pytest.raises(SystemExit, match="no finished task"):
        report.main([str(tmp_path / "c")])


# -- a tagging answer's words -------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.from_regex(r"[a-z]{1,3}(-[a-z0-9]{1,2})?[.,]?", fullmatch=True), min_size=1, max_size=8),
       st.integers(0, 30))
def test_each_conll_word_takes_its_first_tokenizer_words_tag(words, cut):
    # the tokenizer splits punctuation off; an answer cut by max_len lacks the last words
    pieces = [(w, re.findall(r"[a-z0-9]+|[^a-z0-9]", w)) for w in words]
    tokens = [p for _, ps in pieces for p in ps][:cut]
    tags = [f"B-{j}" for j in range(len(tokens))]
    got = word_predictions(words, {"tokens": tokens, "tags": tags})
    first, expected = 0, []
    for _, ps in pieces:
        expected.append(tags[first] if first < len(tokens) else None)
        first += len(ps)
    assert got == expected


def test_the_words_of_an_answer_meet_the_harness_first_sub_tokens(tmp_path):
    """Through the runtime's tokenization of the joined text (what `hkstore serve` answers per
    word), each CoNLL word lands on the sub-token the harness scores it at (encode_tagging)."""
    from runtime.construct.data import IGNORE, encode_tagging
    from runtime.model.stored import load_model
    from runtime.serving import _words
    from test_runtime import tiny_model

    sentences = [["IL-2", "receptor", "(", "IL-2R", ")", "alpha", "chain", "."],
                 ["Mutations", "in", "BRCA1,", "and", "p53", "'s", "role", "--", "a", "review"],
                 ["x", "\u200b", "y"], ["e.g.", "3.5", "mg/kg", "of", "cis-platin", ";"]]
    encoder = load_model(tiny_model(tmp_path / "model", [" ".join(s) for s in sentences]), 2)
    ids, targets = encode_tagging(encoder, sentences, [["O"] * len(s) for s in sentences], ["O"], 64)
    for words, seq, y in zip(sentences, ids, targets):
        text = " ".join(words)
        encoding = encoder.tokenizer.encode(text)
        assert list(encoding.ids) == seq
        answer_words = _words(text, encoding)
        answer = {"tokens": [w for _, w in answer_words], "tags": [str(j) for j, _ in answer_words]}
        got = word_predictions(words, answer)
        assert [t for t in got if t is not None] == [str(j) for j, t in enumerate(y) if t != IGNORE]
        assert (None in got) == ("\u200b" in words)  # a word the tokenizer drops whole has no tag


def test_the_servers_cpu_time_counts_its_threads_work_and_not_its_sleep():
    import subprocess
    import sys

    # a child that spins two threads for 0.3 s each (one ends before it is read), then sleeps
    code = ("import threading, time\n"
            "def spin():\n    end = time.thread_time() + 0.3\n    while time.thread_time() < end: pass\n"
            "t = threading.Thread(target=spin); t.start(); spin(); t.join()\n"
            "print('done', flush=True); time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"
        first = cpu_seconds(child.pid)
        assert 0.6 <= first < 1.5
        assert cpu_seconds(child.pid) - first < 0.02  # asleep
    finally:
        child.kill()
        child.wait()


# -- the whole driver -----------------------------------------------------------------------------


def tiny_run(root: Path, max_len=32):
    """A benchmarks.hmi_accuracy-shaped run: RUN/store (root, cs and biology versions of a tiny
    model), RUN/data/<task>.train and .dev samples, the test splits in a suite beside it."""
    from runtime.construct import manager
    from test_runtime import docstring_sentences, tiny_model

    data = docstring_sentences()
    texts = [t for t, _ in data]
    run, suite = root / "run", root / "suite"
    (run / "data").mkdir(parents=True)
    corpus = run / "data" / "root.txt"
    corpus.write_text("\n".join(texts) + "\n")
    keywords = {"return", "returns", "string", "file", "path", "text"}

    def conll(rows):
        return "".join("".join(f"{w}\t{'B-KW' if w.lower() in keywords else 'O'}\n"
                               for w in re.findall(r"[A-Za-z0-9]+(?:[-.][A-Za-z0-9]+)?|[^\sA-Za-z0-9]", t)) + "\n"
                       for t in rows)

    def jsonl(rows):
        return "".join(json.dumps({"text": t, "label": m}) + "\n" for t, m in rows)

    train, dev, test = data[::2], data[1::4], data[3::4]
    (run / "data" / "citation_intent.train.jsonl").write_text(jsonl(train))
    (run / "data" / "citation_intent.dev.jsonl").write_text(jsonl(dev))
    (run / "data" / "NCBI-disease.train.conll").write_text(conll([t for t, _ in train]))
    (run / "data" / "NCBI-disease.dev.conll").write_text(conll([t for t, _ in dev]))
    (suite / "text_classification" / "citation_intent").mkdir(parents=True)
    (suite / "ner" / "NCBI-disease").mkdir(parents=True)
    (suite / "text_classification" / "citation_intent" / "test.txt").write_text(jsonl(test))
    (suite / "ner" / "NCBI-disease" / "test.txt").write_text(conll([t for t, _ in test]))
    model = tiny_model(root / "model", texts)
    store = run / "store"
    manager.build(store, model_path=model, corpus_paths=[corpus], lower_layers=2, max_len=max_len, progress=False)
    for domain in ("cs", "biology"):
        manager.domain_create(store, domain, [corpus], alpha=60, mlm_steps=2, batch_size=8, max_len=max_len,
                              progress=False)
    config = {"data": str(suite), "max_len": max_len, "max_test": 400, "seed": 0, "eval_split": "dev"}
    (run / "results.json").write_text(json.dumps({"config": config}))
    return run


@pytest.mark.slow
def test_the_driver_makes_profiles_and_serves_each_tasks_cascade(tmp_path, monkeypatch):
    from benchmarks import cascade_bench
    from runtime.construct import manager

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tiny_run(tmp_path)
    out = tmp_path / "out"
    results = tmp_path / "accuracy.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "accuracy.json", results)
    argv = ["--run", str(run), "--out", str(out), "--tasks", "citation_intent,NCBI-disease", "--limit", "5",
            "--results", str(results), "--write-results"]
    got = cascade_bench.main(argv)
    for task in ("citation_intent", "NCBI-disease"):
        r = json.loads((out / f"{task}.json").read_text())
        s = r["served"]
        assert len(s["auto"]["counts"]) == 5 == len(s["exact"]["cpu_s"])
        assert set(s["fast"]["level_name"]) == {"plot"} and set(s["exact"]["level_name"]) == {"full"}
        assert set(s["auto"]["level_name"]) <= {"plot", "full", "students"}
        assert all(c > 0 for name in report.SYSTEMS for c in s[name]["cpu_s"])
        assert set(s["students"]["level_name"]) == {"students"}  # the best k pinned: the students' bound
        assert r["steps"]["profile"]["profile"]["top"] == "full"
        assert r["steps"]["students"]["tenant"] == r["tenant"] and r["steps"]["create"]["levels"] == ["plot", "full"]
        # the PLOT level served over HTTP scores what the harness's serving-path scorer gives it
        evaluated = manager.tenant_eval(str(out / "store"), r["tenant"], r["files"]["test"], max_len=32)
        assert s["fast"]["score"] == pytest.approx(evaluated["score"])
    import hkstore

    with hkstore.open(str(run / "store")) as st:  # the run's store is left as it was: tenants go to a copy
        assert not [t for t in st.snapshot().pets if t.endswith("-cascade")]
    written = json.loads(results.read_text())
    assert written["auto_gap_to_top_mean"] == round(got["summary"]["gap_mean"], 1)
    assert written["auto_cost_vs_top"] == round(got["summary"]["cost_vs_top_mean"], 2)
    summary = (out / "summary.md").read_text()
    assert summary.count("| mean of 2 |") == 1 and summary.count("(top full)") == 2
    # a rerun finds every task done and reports the same figures
    again = cascade_bench.main(argv)
    assert again["summary"] == got["summary"]
    with pytest.raises(SystemExit, match="other settings"):
        cascade_bench.main(argv[:6] + ["--limit", "4"])


# -- the headline -------------------------------------------------------------------------------


def test_the_headline_keeps_each_tasks_measurement_and_writes_the_means(tmp_path, monkeypatch):
    from benchmarks import headline

    results = tmp_path / "accuracy.json"
    results.write_text(json.dumps({"three_seed_by_task": {"chemprot": {"dedicated": [60.0, 0, 0]},
                                                          "sciie": {"dedicated": [50.0, 0, 0]}}}))
    out = tmp_path / "out"
    out.mkdir()
    for task, score in (("chemprot", 0.61), ("sciie", 0.49)):
        (out / f"{task}.json").write_text(json.dumps({"task": task, "served": {"auto": {"score": score}}}))
    (out / "chemprot.steps.json").write_text("{}")  # not a task's result: no "served"
    measured = []

    def measure(out_dir, done, threads, limit):
        measured.append(done["task"])
        cpu = {"chemprot": (10.0, 20.0), "sciie": (5.0, 20.0)}[done["task"]]
        return {"auto_cpu_ms": cpu[0], "dedicated_cpu_ms": cpu[1], "throughput_vs_dedicated": cpu[1] / cpu[0],
                "auto": round(100 * done["served"]["auto"]["score"], 1)}

    monkeypatch.setattr(headline, "task_headline", measure)
    argv = [str(out), "--results", str(results), "--write-results"]
    first = headline.main(argv)
    assert sorted(measured) == ["chemprot", "sciie"]
    assert first["mean"]["throughput_vs_dedicated"] == 3.0  # (2x + 4x) / 2
    assert first["by_task"]["chemprot"]["auto_minus_dedicated"] == 1.0
    assert first["by_task"]["sciie"]["auto_minus_dedicated"] == -1.0
    written = json.loads(results.read_text())["headline"]
    assert written["throughput_vs_dedicated_by_task"] == {"chemprot": 2.0, "sciie": 4.0}
    assert written["auto_minus_dedicated_mean"] == 0.0
    # a rerun measures nothing again and reports the same; a deleted task's file is measured anew
    (out / "sciie.headline.all").unlink()
    again = headline.main(argv)
    assert measured[2:] == ["sciie"] and again == first
