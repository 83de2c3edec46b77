"""docs/cli.md and docs/http.md are generated from the code (docs/make_reference.py): a command,
an option or a route changed without regenerating them fails here."""

import importlib.util
import pathlib

MAKER = pathlib.Path(__file__).resolve().parents[1] / "docs" / "make_reference.py"


def _maker():
    spec = importlib.util.spec_from_file_location("make_reference", MAKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_references_are_up_to_date(capsys):
    assert _maker().main(["--check"]) == 0, capsys.readouterr().out


def test_a_stale_reference_is_caught(tmp_path, capsys):
    for name in ("cli.md", "http.md"):
        (tmp_path / name).write_text((MAKER.parent / name).read_text())
    maker = _maker()
    assert maker.main(["--check"], tmp_path) == 0
    (tmp_path / "http.md").write_text((tmp_path / "http.md").read_text().replace("/v1/embeddings", "/v1/embed"))
    assert maker.main(["--check"], tmp_path) == 1
    assert "out of date: http.md" in capsys.readouterr().out
