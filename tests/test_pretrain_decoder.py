"""tools.pretrain_decoder: trains, checkpoints, resumes and writes a directory load_decoder reads."""

import json

import torch

from runtime.model.decoder import load_decoder
from tools.pretrain_decoder import main

LINES = [" = Valid = ", " the cat sat on the mat and the dog ran in the park . ",
         " storage engines keep tables of vectors in versions . ", " a tenant is a fine-tuned model . "]


def test_pretrain_resume_and_load(tmp_path, capsys):
    wiki = tmp_path / "wikitext-2"
    wiki.mkdir()
    (wiki / "valid.txt").write_text("\n".join(LINES * 20) + "\n")
    (wiki / "test.txt").write_text("\n".join(LINES[1:]) + "\n")
    out = tmp_path / "dec"
    args = ["--out", str(out), "--wikitext", str(wiki), "--no-stdlib", "--layers", "2", "--d", "32", "--heads", "2",
            "--ctx", "16", "--batch", "4", "--log-every", "1", "--checkpoint-s", "0", "--vocab-size", "200"]
    assert main([*args, "--steps", "3"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["steps"] == 3 and first["test"]["word_ppl"] > 1
    assert main([*args, "--steps", "5"]) == 0  # resumes at step 3
    assert "resumed at step 3" in capsys.readouterr().err
    result = json.loads((out / "results.json").read_text())
    assert result["steps"] == 5
    dec = load_decoder(out, lower_layers=1)
    ids = dec.tokenize(["the cat sat"])[0]
    assert ids[0] == dec.config.bos_id and dec.decode(ids[1:]) == "the cat sat"
    with torch.no_grad():
        assert torch.isfinite(dec(torch.tensor([ids]))).all()
    assert main([*args, "--eval-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["test"]["tokens"] == result["test"]["tokens"]


def test_without_wikitext_it_trains_on_the_standard_library(tmp_path, capsys):
    """The recipe on a machine with nothing but the install: no WikiText-2 directory."""
    from tools.pretrain_decoder import corpus

    train, val, test, source = corpus(str(tmp_path / "absent"))
    assert "standard library" in source and len(train) > 10 * (len(val) + len(test)) > 0
    assert not set(train) & (set(val) | set(test))  # held-out modules are held out
    out = tmp_path / "dec"
    args = ["--out", str(out), "--wikitext", "", "--layers", "1", "--d", "16", "--heads", "2", "--ctx", "16",
            "--batch", "2", "--steps", "2", "--vocab-size", "200", "--test-tokens", "64"]
    assert main(args) == 0
    assert "the standard library's docstrings" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["test"]["tokens"] > 0


def test_a_wikitext_directory_without_its_files_is_refused(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "d"), "--wikitext", str(tmp_path)]) == 2
    assert "no valid.txt there" in capsys.readouterr().err
