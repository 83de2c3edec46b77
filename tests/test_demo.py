"""The demo (runtime/demo/run.py): its sizes, the commands it prints last, and (slow) the quick run."""

import json
import os

import pytest
from click.testing import CliRunner

from runtime.demo import run


def test_a_store_keeps_its_demo_size(tmp_path):
    data = str(tmp_path / "demo")
    os.makedirs(data)
    run._check_preset(data, "quick")
    run._check_preset(data, "quick")
    with pytest.raises(run.DemoError, match="holds the quick demo; run with no --full"):
        run._check_preset(data, "full")


def test_a_file_is_not_a_demo_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    r = CliRunner().invoke(run.demo, [str(path), "--no-progress"])
    assert r.exit_code == 1 and r.output.strip() == f"Error: {path} is a file, not a directory"


def test_next_steps_are_exact_commands():
    lines = run.next_steps("/tmp/my demo", "Return the day's name.")
    assert lines[0].startswith("hkstore infer '/tmp/my demo' --tenant which-module 'Return the day'\"'\"'s name.'")
    assert any(line.startswith("hkstore serve '/tmp/my demo'") for line in lines)
    assert any(line.startswith("TOKEN=$(hkstore token issue '/tmp/my demo' which-module)") for line in lines)
    curl = next(line for line in lines if line.startswith("curl"))
    assert "/v1/tenants/which-module/infer" in curl and "Bearer $TOKEN" in curl
    assert any(line.startswith("hkstore report '/tmp/my demo' --out") for line in lines)


def test_tagging_examples_keep_their_text():
    docs = [("Return a str or None.", "json", "function"), ("A plain sentence here.", "json", "function")]
    train, test = run.tasks(docs)["type-words"]
    words, tags, text = (train + test)[0]
    assert text == "Return a str or None." and tags == run.type_tags(words) and "B-TYPE" in tags


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    """The README's first command: the quick demo builds a store with a domain and four tenants
    of four PET types, serves them, and says what to do next."""
    r = CliRunner().invoke(run.demo, [str(tmp_path / "s"), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["preset"] == "quick" and out["versions"] == ["root", "email"]
    assert out["tenants"] == sorted(run.TENANTS) and out["requests"] > 100
    assert all(score > 0.5 for score in out["accuracy"].values()), out["accuracy"]
    import hkstore

    assert hkstore.verify(str(tmp_path / "s"))["ok"]
