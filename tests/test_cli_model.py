"""runtime.build.commands through click's CliRunner: every command, --json, one-line errors."""

import json
import os

import click
import pytest
from click.testing import CliRunner

import hkstore
from runtime.build import manager
from runtime.build.commands import COMMANDS
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
    assert set(COMMANDS["domain"].commands) == {"create", "update"}
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

    r = run(cli, "tenant", "create", s, "t1", "--version", "bio", "--train", env["cls"], "--pet", "lora",
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
    from hkstore.cli import main

    manager.tenant_create(env["store"], "inf", version="root", train_path=env["cls"], pet_type="lora", epochs=1,
                          max_len=32, progress=False)
    texts = env["texts"][:2]
    r = CliRunner().invoke(main, ["infer", env["store"], "--tenant", "inf", *texts])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 and all(line.split("\t")[1] in ("math", "path") for line in lines)
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
