"""The README's code runs as written and prints what its comments say."""

import contextlib
import io
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_block(after):
    text = open(README, encoding="utf-8").read()
    start = text.index(after)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_store_example_runs_and_prints_its_comments(tmp_path, monkeypatch):
    code = python_block("## The store from Python")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    promised = [line.split("#")[-1].strip() for line in code.splitlines() if line.startswith("print(")]
    assert out.getvalue().splitlines() == promised


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK_LOG = re.compile(r"\b(issue|session)s? #?\d+|\(#\d+\)", re.IGNORECASE)


def _product_files():
    yield README
    for package in ("formats", "hkstore", "runtime", "tools"):
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith((".py", ".md", ".cu", ".h")):
                    yield os.path.join(root, name)


def test_the_product_speaks_to_users():
    """No work-item numbers and no machine's absolute paths in the product's code and docs; a
    README a person reads through."""
    bad = []
    for path in _product_files():
        text = open(path, encoding="utf-8").read()
        for pattern in (WORK_LOG, re.compile(r"/work/|/home/\w+")):
            bad += [f"{os.path.relpath(path, REPO)}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not bad, bad
    assert len(open(README, encoding="utf-8").read().splitlines()) <= 250


def test_the_check_sees_a_work_item():
    assert WORK_LOG.search("chosen on dev (BENCHMARKS, issue 21)") and WORK_LOG.search("the Tabi profile (#16)")
    assert not WORK_LOG.search("hkstore token issue STORE TENANT")
