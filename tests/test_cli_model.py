"""runtime.construct.commands through click's CliRunner: every command, --json, one-line errors."""

import json
import os

import click
import pytest
from click.testing import CliRunner

import hkstore
from runtime.construct import manager
from runtime.construct.commands import COMMANDS
from runtime.model.tiny import make_tiny_model
from test_manager import make_data


@pytest.fixture(scope="module")
def cli():
    group = click.Group("hkstore")
    for name, command in COMMANDS.items():
        group.add_command(command, name)
    return group


@pytest.fixture(scope="module")
def env(tmp_path_factory, cli):
    root = str(tmp_path_factory.mktemp("cli"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")  # built here, for the error cases
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, progress=False)
    manager.domain_create(data["store"], "bio", [data["domain"]], mlm_steps=0, progress=False)
    data["fresh"] = os.path.join(root, "fresh")  # built by the CLI
    return data


def run(cli, *args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_commands_are_exported():
    assert set(COMMANDS) == {"build", "domain", "tenant"}
    assert set(COMMANDS["domain"].commands) == {"create", "update", "grow"}
    assert {"create", "update", "rm"} <= set(COMMANDS["tenant"].commands)


def test_cli_end_to_end(cli, env):
    s = env["fresh"]
    r = run(cli, "build", s, "--corpus", env["corpus"], "--model", env["model"], "--max-len", 32, "--quiet", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["version"] == "root" and out["keys"] > 0 and not out["resumed"]
    assert hkstore.verify(s)["ok"]

    r = run(cli, "domain", "create", s, "bio", "--corpus", env["domain"], "--mlm-steps", 2, "--alpha", 30,
            "--distill-steps", 2, "-q", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["alpha"] == 30 and json.loads(r.output)["distill"]["steps"] == 2

    r = run(cli, "domain", "update", s, "bio", "bio-2", "--corpus", env["more"], "--mlm-steps", 1, "-q")
    assert r.exit_code == 0, r.output
    assert "version: bio-2" in r.output  # the plain (non-JSON) output: key: value lines

    r = run(cli, "tenant", "create", s, "t1", "--version", "bio", "--train", env["cls"], "--pet-type", "lora",
            "--epochs", 1, "--max-len", 32, "-q", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["labels"] == ["math", "path"]

    r = run(cli, "tenant", "update", s, "t1", "--version", "bio-2", "-q", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["version"] == "bio-2"

    r = run(cli, "tenant", "eval", s, "t1", "--test", env["cls"], "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["metric"] == "accuracy"

    r = run(cli, "tenant", "rm", s, "t1", "--json")
    assert r.exit_code == 0 and json.loads(r.output) == {"removed": True, "tenant": "t1"}


@pytest.mark.parametrize("args,message", [
    (["tenant", "rm", "{store}", "ghost"], "unknown tenant 'ghost'"),
    (["tenant", "create", "{store}", "t2", "--version", "nope", "--train", "{cls}"], "unknown version 'nope'"),
    (["tenant", "create", "{store}", "t2", "--version", "root", "--train", "/no/such.jsonl"], "no such file"),
    (["tenant", "update", "{store}", "ghost"], "unknown tenant 'ghost'"),
    (["domain", "create", "{store}", "d2", "--corpus", "/no/such.txt", "--mlm-steps", "0"], "no such file"),
    (["domain", "create", "{store}", "bio", "--corpus", "{corpus}", "--mlm-steps", "0"], "already exists"),
    (["build", "{store}/../nostore", "--corpus", "{corpus}", "--model", "/no/model"], "config.json"),
])
def test_cli_errors_are_one_line(cli, env, args, message):
    r = run(cli, *[a.format(store=env["store"], cls=env["cls"], corpus=env["corpus"]) for a in args])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], r.output


def test_infer_command_texts_stdin_and_truncate(env):
    from tools.cli import main

    manager.tenant_create(env["store"], "inf", version="root", train_path=env["cls"], pet_type="lora", epochs=1,
                          max_len=32, progress=False)
    texts = env["texts"][:2]
    r = CliRunner().invoke(main, ["infer", env["store"], "--tenant", "inf", *texts])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 and all(line.split("\t")[1] in ("math", "path") for line in lines)
    assert all(line.split("\t")[2].startswith("probability 0.") or line.split("\t")[2] == "probability 1.000"
               for line in lines)
    stdin = "\n".join(json.dumps({"text": t}) for t in texts) + "\n"
    r = CliRunner().invoke(main, ["infer", env["store"], "--tenant", "inf", "--json"], input=stdin)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.strip().splitlines()]
    assert [row["label"] for row in rows] == [line.split("\t")[1] for line in lines]
    # Over --max-len: one line and exit 1, or cut with --truncate (which the answer says).
    r = CliRunner().invoke(main, ["infer", env["store"], "--tenant", "inf", "--max-len", 4, texts[0]])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "truncate" in r.output, r.output
    r = CliRunner().invoke(main, ["infer", env["store"], "--tenant", "inf", "--max-len", 4, "--truncate", "--json",
                                  texts[0]])
    assert r.exit_code == 0 and json.loads(r.output)["truncated"] > 0, r.output
    r = CliRunner().invoke(main, ["infer", env["store"], "--json"], input="not json\n")
    assert r.exit_code == 1 and "stdin line 1: not JSON" in r.output
    manager.tenant_rm(env["store"], "inf")


def test_pack_export_to_peft_round_trips_through_peft_itself(env, tmp_path):
    """A LoRA tenant exported to PEFT's format loads with peft on the same base model and gives
    the same hidden states (and, through its classifier on [CLS], the same logits); imported
    back, it is the same PET."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import numpy as np
    import torch

    from tools.cli import main
    from hkstore.peft import load_peft_lora
    from runtime.model.encoder import load_encoder
    from runtime.model.pet import head, load_pet, pet_meta

    manager.tenant_create(env["store"], "lora-out", version="root", train_path=env["cls"], pet_type="lora",
                          epochs=2, lr=1e-2, max_len=32, progress=False)
    out = str(tmp_path / "adapter")
    r = CliRunner().invoke(main, ["pack", "export", env["store"], "lora-out", out, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["task_type"] == "SEQ_CLS"
    record = hkstore.open(env["store"]).get_pet("lora-out")
    assert max(np.abs(v).max() for k, v in record.tensors.items() if k.endswith(".B")) > 0  # trained: not a no-op
    base = transformers.BertForSequenceClassification.from_pretrained(
        env["model"], num_labels=len(record.meta["labels"]), local_files_only=True).eval()
    model = peft.PeftModel.from_pretrained(base, out).eval()
    enc = load_encoder(env["model"], 3)
    pet = load_pet(enc, record.tensors, pet_meta(record.meta))
    ids, mask = enc.pad(enc.tokenize(env["texts"][:4], 32))
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        ours = enc(ids, mask, pet)
        np.testing.assert_allclose(theirs.hidden_states[-1][mask].numpy(), ours[mask].numpy(), atol=1e-4)
        classifier = model.base_model.model.classifier.modules_to_save["default"]
        np.testing.assert_allclose(classifier(theirs.hidden_states[-1][:, 0]).numpy(), head(pet, ours).numpy(),
                                   atol=1e-4)
    meta, tensors = load_peft_lora(out, lower_layers=3, num_layers=6)
    assert meta["rank"] == record.meta["rank"] and meta["scale"] == pytest.approx(record.meta["scale"])
    assert tensors.keys() == record.tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(tensors[k], record.tensors[k].astype(np.float32))
    r = CliRunner().invoke(main, ["pack", "export", env["store"], "nobody", out])
    assert r.exit_code == 1 and "unknown tenant" in r.output
    manager.tenant_rm(env["store"], "lora-out")
