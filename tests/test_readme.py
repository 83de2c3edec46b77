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
