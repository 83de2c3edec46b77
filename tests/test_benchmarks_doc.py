"""BENCHMARKS.md stays a short list of current claims that agree with benchmarks/results/*.json."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"


def _claims():
    # Loaded by path: the check needs no package __init__ and imports nothing of the project.
    spec = importlib.util.spec_from_file_location("benchmarks_claims", ROOT / "benchmarks" / "claims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_document_is_short():
    assert len(DOC.read_text(encoding="utf-8").splitlines()) <= 800


def test_no_tmp_paths_and_no_work_log_references():
    text = DOC.read_text(encoding="utf-8")
    assert "/tmp" not in text
    for pattern in (r"issue \d", r"#\d+", r"session \d"):
        found = re.findall(pattern, text, re.IGNORECASE)
        assert not found, f"{pattern}: {found[:5]}"


def test_every_results_file_parses_and_says_how_it_was_made():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in ("section", "command", "machine", "date"):
            assert data.get(key), f"{path.name}: no {key}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), path.name


def test_the_document_shows_the_results_numbers():
    report = _claims().check(DOC, RESULTS)
    assert report
    bad = [(name, problems) for name, _, problems in report if problems]
    assert not bad, bad


def test_the_accuracy_results_carry_the_headline_means():
    data = json.loads((RESULTS / "accuracy.json").read_text(encoding="utf-8"))
    assert isinstance(data["plot_level_mean"], float)
    assert isinstance(data["dedicated_mean"], float)


def test_the_check_fails_when_a_number_differs(tmp_path):
    claims = _claims()
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    path = copy / "accuracy.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    row = data["tables"][0]["rows"][0]          # dedicated, chemprot
    row[1] = round(row[1] + 0.1, 1)
    data["plot_level_mean"] += 0.37             # a number outside the tables (none has two decimals)
    path.write_text(json.dumps(data), encoding="utf-8")

    report = {name: problems for name, _, problems in claims.check(DOC, copy)}
    assert len(report["accuracy.json"]) == 2, report["accuracy.json"]
    assert "chemprot" in report["accuracy.json"][0]
    assert "plot_level_mean" in report["accuracy.json"][1]
    assert not any(problems for name, problems in report.items() if name != "accuracy.json")
    assert claims.main(["--doc", str(DOC), "--results", str(copy)]) == 1
    assert claims.main(["--doc", str(DOC), "--results", str(RESULTS)]) == 0


def test_a_claim_section_without_results_is_reported(tmp_path):
    claims = _claims()
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    (copy / "reliability.json").unlink()
    report = claims.check(DOC, copy)
    assert [section for name, section, problems in report if problems] == ["Reliability"]
