"""The store commands of the CLI, through click's CliRunner."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

import hkstore
from formats.pack import PetRecord
from tools.cli import main

D, V = 8, 30


def model_dir(tmp_path):
    """A tiny BERT-format directory: config and vocabulary, enough for store metadata."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": D, "vocab_size": V, "num_hidden_layers": 4,
                                                  "pad_token_id": 0, "_name_or_path": "tiny-bert"}))
    (path / "vocab.txt").write_text("\n".join(f"w{i}" for i in range(V)))
    return str(path)


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "s")
    run("init", path, "--model", model_dir(tmp_path), "--lower-layers", 2)
    st = hkstore.open(path, writable=True)
    rng = np.random.default_rng(0)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    st.add_segment("root", uni, rng.standard_normal((V, 3, D)))
    tri = np.array([[1, 2, 3], [2, 3, 4], [3, 4, 5]], dtype=np.uint32)
    root_tri = rng.standard_normal((3, 3, D)).astype(np.float16)
    st.add_segment("root", tri, root_tri)
    st.create_version("bio", "root")
    st.add_segment("bio", tri[:2], np.concatenate([rng.standard_normal((1, 3, D)), root_tri[1:2]]))
    st.add_segment("bio", np.array([[7, 8, 9]], dtype=np.uint32), rng.standard_normal((1, 3, D)))
    st.put_pet(PetRecord("acme", {"pet_type": "adapter", "task": "classification", "version": "bio"},
                         {"w": np.ones(4, dtype=np.float32)}))
    st.close()
    return path


def test_info_and_tree(store):
    info = json.loads(run("info", store, "--json"))
    assert info["meta"]["base_model"] == "tiny-bert" and info["versions"] == 2 and info["tenants"] == 1
    rows = {r["name"]: r for r in json.loads(run("tree", store, "--json"))}
    assert rows["bio"]["entries"] == 3 and rows["bio"]["overrides"] == 2 and rows["bio"]["new_keys"] == 1
    assert rows["bio"]["overrides_of_parent"] == pytest.approx(2 / (V + 3))
    assert "bio  entries 3" in run("tree", store)


def test_lookup_reports_version_and_order(store):
    rows = json.loads(run("lookup", store, "--version", "bio", "--ids", "1,2,3,4,5", "--json"))
    assert [(r["version"], r["order"]) for r in rows] == [
        ("root", 1), ("bio", 3), ("bio", 3), ("root", 3), ("root", 1)]
    assert "unknown version" in run("lookup", store, "--version", "nope", "--ids", "1", code=1)
    assert "exactly one" in run("lookup", store, code=1)


def test_compact_drops_parent_equal_entries_and_diff_sees_it(store):
    before = json.loads(run("lookup", store, "--version", "bio", "--ids", "1,2,3,4,5", "--json"))
    r = json.loads(run("compact", store, "--version", "bio", "--json"))
    # The parent may still change: the entry equal to it stays (FORMAT.md section 2, Compaction).
    assert (r["segments_before"], r["entries_after"], r["dropped_equal_to_parent"]) == (2, 3, 0)
    with hkstore.open(store, writable=True) as st:
        st.seal("root")
    r = json.loads(run("compact", store, "--version", "bio", "--json"))
    assert (r["segments_before"], r["entries_after"], r["dropped_equal_to_parent"]) == (1, 2, 1)
    after = json.loads(run("lookup", store, "--version", "bio", "--ids", "1,2,3,4,5", "--json"))
    assert [a["norm"] for a in after] == [b["norm"] for b in before]
    d = json.loads(run("diff", f"{store}@root", f"{store}@bio", "--json"))["plot"]
    assert (d["added"], d["changed"]) == (1, 1) and d["cosine_distance"]["max"] > 0
    assert "changed" in run("diff", f"{store}@root", f"{store}@bio")


def test_tree_and_diff_report_position_tables(store):
    st = hkstore.open(store, writable=True)
    table = np.random.default_rng(1).standard_normal((4, D)).astype(np.float32)
    st.set_position("bio", table)
    st.close()
    rows = {r["name"]: r for r in json.loads(run("tree", store, "--json"))}
    assert (rows["root"]["position_rows"], rows["bio"]["position_rows"]) == (None, 4)
    d = json.loads(run("diff", f"{store}@root", f"{store}@bio", "--json"))["position"]
    assert (d["rows_a"], d["rows_b"]) == (None, 4)
    assert d["max_abs_difference"] == pytest.approx(float(np.abs(table).max()))
    assert json.loads(run("diff", f"{store}@bio", f"{store}@bio", "--json"))["position"]["max_abs_difference"] == 0
    assert "position   rows 0 -> 4" in run("diff", f"{store}@root", f"{store}@bio")


def test_diff_two_stores_reports_pets(store, tmp_path):
    other = str(tmp_path / "copy")
    import shutil

    shutil.copytree(store, other)
    st = hkstore.open(other, writable=True)
    st.put_pet(PetRecord("beta", {"pet_type": "lora"}, {"w": np.zeros(2, dtype=np.float32)}))
    st.put_pet(PetRecord("acme", {"pet_type": "adapter"}, {"w": np.zeros(4, dtype=np.float32)}))
    st.close()
    pets = json.loads(run("diff", store, other, "--json"))["pets"]
    assert pets == {"added": ["beta"], "removed": [], "changed": ["acme"], "unchanged": 0}


def test_verify_gc_and_pack_commands(store):
    assert "ok" in run("verify", store)
    run("compact", store, "--version", "bio")
    gc = json.loads(run("gc", store, "--json"))
    assert any(name.startswith("segments/") for name in gc["removed"])
    tenants = json.loads(run("pack", "ls", store, "--json"))
    assert [t["tenant"] for t in tenants] == ["acme"]
    run("pack", "rm", store, "acme")
    assert json.loads(run("pack", "ls", store, "--json")) == []
    assert "unknown tenant" in run("pack", "rm", store, "acme", code=1)
    seg = os.path.join(store, "segments", sorted(os.listdir(os.path.join(store, "segments")))[0])
    with open(seg, "r+b") as f:
        f.seek(300)
        b = f.read(1)
        f.seek(300)
        f.write(bytes([b[0] ^ 1]))
    out = run("verify", store, code=1)
    assert "PROBLEM" in out and "Traceback" not in out


def test_pack_import_peft_lora(store, tmp_path):
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["query", "value"],
        "base_model_name_or_path": "tiny-bert", "modules_to_save": ["classifier"], "task_type": "SEQ_CLS"}))
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in (2, 3):
        for mod in ("query", "value"):
            pre = f"base_model.model.bert.encoder.layer.{layer}.attention.self.{mod}"
            tensors[f"{pre}.lora_A.weight"] = rng.standard_normal((2, D)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = rng.standard_normal((D, 2)).astype(np.float32)
    tensors["base_model.model.classifier.modules_to_save.default.weight"] = rng.standard_normal((3, D)).astype(np.float32)
    tensors["base_model.model.classifier.modules_to_save.default.bias"] = np.zeros(3, dtype=np.float32)
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    meta = json.loads(run("pack", "import", store, peft, "--tenant", "imp", "--version", "bio",
                          "--labels", "a,b,c", "--json"))
    assert meta["rank"] == 2 and meta["scale"] == 2.0 and meta["labels"] == ["a", "b", "c"]
    rec = hkstore.open(store).get_pet("imp")
    np.testing.assert_array_equal(rec.tensors["layers.2.lora.q.A"],
                                  tensors["base_model.model.bert.encoder.layer.2.attention.self.query.lora_A.weight"])
    assert "--labels names 2 labels" in run("pack", "import", store, peft, "--tenant", "x", "--labels", "a,b", code=1)
    assert "unknown version" in run("pack", "import", store, peft, "--tenant", "x", "--version", "zz", code=1)
    assert "Error" in run("pack", "import", store, tmp_path, "--tenant", "x", code=1)


def test_user_errors_are_one_line(tmp_path):
    for args in (["info", tmp_path / "missing"], ["tree", tmp_path], ["init", tmp_path / "s", "--model", tmp_path]):
        out = run(*args, code=1)
        assert out.startswith("Error: ") and out.count("\n") == 1, out
    store, model = str(tmp_path / "s2"), model_dir(tmp_path)
    run("init", store, "--model", model)
    assert "already exists" in run("init", store, "--model", model, code=1)
    held = hkstore.open(store, writable=True)
    assert "another writer" in run("compact", store, "--version", "root", code=1)
    held.close()


# -- issue 19: first-run rough edges ----------------------------------------------------------------


def one_line_error(out):
    assert out.startswith("Error: ") and out.count("\n") == 1, out
    return out


def test_lookup_refuses_ids_outside_the_vocabulary_and_empty_text(store):
    for ids in ("-5", "1,99999999", str(V)):
        one_line_error(run("lookup", store, "--ids", ids, code=1))
    assert "outside the vocabulary (ids are 0..29)" in run("lookup", store, "--ids=-5", code=1)
    assert "nothing to look up: empty text" in run("lookup", store, "--text", " ", code=1)


def test_diff_says_what_it_compares_and_that_a_branch_inherits(store):
    d = json.loads(run("diff", f"{store}@root", f"{store}@bio", "--json"))["plot"]
    # bio holds 3 keys itself: 2 the root holds too (changed / unchanged), 1 new; the root's other
    # V + 1 keys are what bio inherits, not removed.
    assert (d["added"], d["overridden"], d["inherited"], d["removed"]) == (1, 0, V + 1, 0)
    assert d["compares"].startswith("own entries")
    back = json.loads(run("diff", f"{store}@bio", f"{store}@root", "--json"))["plot"]
    assert (back["added"], back["overridden"], back["inherited"], back["removed"]) == (0, 0, V + 1, 1)
    st = hkstore.open(store, writable=True)
    st.create_version("chem", "root")
    st.add_segment("chem", np.array([[7, 8, 9], [9, 9, 9]], dtype=np.uint32), np.ones((2, 3, D)))
    st.close()
    # Siblings: bio's own [1 2 3] and [2 3 4] are served to chem by the root; chem's [9 9 9] is new.
    side = json.loads(run("diff", f"{store}@bio", f"{store}@chem", "--json"))["plot"]
    assert (side["added"], side["inherited"], side["changed"]) == (1, 2, 1)
    out = run("diff", f"{store}@root", f"{store}@bio")
    assert "comparing own entries" in out and "inherited" in out


def test_info_names_the_model_and_agrees_with_verify_on_bytes(store):
    info = json.loads(run("info", store, "--json"))
    assert info["model"]["name"] == "tiny-bert" and info["model"]["source"].endswith("model")
    checked = json.loads(run("verify", store, "--json"))["checked"]
    assert info["bytes"] == checked["bytes"] == info["bytes_on_disk"]
    assert "tiny-bert  from " in run("info", store)
    run("pack", "rm", store, "acme")
    info = json.loads(run("info", store, "--json"))
    assert info["bytes_on_disk"] > info["bytes"] == json.loads(run("verify", store, "--json"))["checked"]["bytes"]


def test_every_command_takes_json_and_there_is_a_version(store):
    assert json.loads(run("pack", "rm", store, "acme", "--json")) == {"tenant": "acme", "removed": True}
    assert run("--version").startswith("hkstore ")
    from tools.cli import main as group

    missing = []
    for name in group.list_commands(None):
        cmd = group.get_command(None, name)
        subs = cmd.commands.values() if hasattr(cmd, "commands") else [cmd]
        for sub in subs:
            if not hasattr(sub, "commands") and not any("--json" in p.opts for p in sub.params) \
                    and sub.name not in ("serve",):  # serve runs a server: nothing to print as JSON
                missing.append(f"{name} {sub.name}")
    assert not missing, missing


def test_a_file_is_not_a_store(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    for command in ("info", "verify", "tree"):
        assert "is a file, not a store directory" in one_line_error(run(command, path, code=1))


def test_compact_with_nothing_to_drop_skips(store):
    run("compact", store, "--version", "bio")  # two segments -> one
    files = sorted(os.listdir(os.path.join(store, "segments")))
    r = json.loads(run("compact", store, "--version", "bio", "--json"))
    assert r["skipped"] == "one segment with nothing to drop" and r["bytes_reclaimed"] == 0
    assert sorted(os.listdir(os.path.join(store, "segments"))) == files
    assert "skipped, one segment with nothing to drop" in run("compact", store, "--version", "bio")


def test_a_command_whose_extra_is_missing_names_that_extra(monkeypatch):
    """As on a core-only install: the extra's module is not there, so every command of that extra
    answers one line naming the extra, --help included, and imports nothing of the runtime."""
    import tools.cli

    monkeypatch.setitem(tools.cli.EXTRA_MODULES, "serve", ("no_such_module_for_the_test",))
    for args in (["serve", "--help"], ["serve", "s"]):
        out = one_line_error(run(*args, code=1))
        assert "needs the serve extra (no_such_module_for_the_test is not installed)" in out
        assert "pip install torch==2.13.0 && pip install 'hkstore[model,serve]'" in out
    monkeypatch.setitem(tools.cli.EXTRA_MODULES, "model", ("no_such_module_for_the_test",))
    for name in tools.cli.MODEL_COMMANDS:
        assert "needs the model extra" in one_line_error(run(name, "x", code=1))
    assert "'hkstore[model]'" in one_line_error(run("demo", "x", code=1))


def test_token_issue_and_revoke(store):
    from hkstore.tokens import TokenStore

    token = run("token", "issue", store, "acme").strip()
    assert token.startswith("acme~") and TokenStore(store).verify(token) == "acme"
    again = json.loads(run("token", "issue", store, "acme", "--json"))
    assert TokenStore(store).verify(again["token"]) == "acme" and TokenStore(store).verify(token) is None
    assert json.loads(run("token", "revoke", store, "acme", "--json"))["revoked"] is True
    assert TokenStore(store).verify(again["token"]) is None
    assert "acme had no token" in run("token", "revoke", store, "acme")
    assert "unknown tenant 'ghost'" in one_line_error(run("token", "issue", store, "ghost", code=1))
