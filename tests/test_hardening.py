"""Issue 14: no silent rollback through CURRENT, damaged or missing files reported as damage,
verify walks whole packs, compaction keeps a branch's answers, and the damage campaign."""

import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import hkstore
from formats import manifest as mf
from formats.pack import PetRecord
from tools.cli import main as cli
from hkstore.maintenance import garbage
from benchmarks import reliability

D, V = 8, 40


def make_store(path):
    store = reliability.make_store(str(path))
    store.put_pet(PetRecord("t", {"i": 0}, {"w": np.arange(8, dtype=np.float32)}))
    return store


def generation(path):
    return mf.generation_of(mf.current_name(str(path)))


def roll_back(path, to):
    with open(os.path.join(path, "CURRENT"), "wb") as f:
        f.write(mf.manifest_name(to).encode() + b"\n")


def cli_run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# -- 1. rollback through CURRENT ----------------------------------------------------------------------


def test_rolled_back_current_is_refused_and_reported(tmp_path):
    path = str(tmp_path / "s")
    store = make_store(path)
    old = generation(path)
    store.create_version("newer", "root")
    store.put_pet(PetRecord("t2", {"i": 1}, {"w": np.ones(4, dtype=np.float32)}))
    store.close()
    new = generation(path)
    roll_back(path, old)  # the older manifest is intact: only CURRENT moved back

    with pytest.raises(hkstore.CorruptError, match="rolled back"):
        hkstore.open(path)
    with pytest.raises(hkstore.CorruptError, match="rolled back"):
        hkstore.open(path, writable=True)
    with pytest.raises(hkstore.StoreError, match="read-only"):
        hkstore.open(path, writable=True, allow_rollback=True)
    # An explicit read-only open sees the older state.
    older = hkstore.open(path, allow_rollback=True)
    assert "newer" not in older.snapshot().version_names and "t2" not in older.pets()

    report = hkstore.verify(path)
    assert not report["ok"] and report["problems"][0].startswith("rollback")
    result = cli_run("verify", path)
    assert result.exit_code == 1 and "rollback" in result.output
    assert cli_run("info", path).exit_code != 0
    info = cli_run("--allow-rollback", "info", path, "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.output)["tenants"] == 1
    # gc cannot run (no writer opens), and garbage() never names a newer manifest.
    assert cli_run("gc", path).exit_code != 0
    assert os.path.exists(os.path.join(path, mf.manifest_name(new)))
    roll_back(path, new)
    assert all(mf.generation_of(n) is None or mf.generation_of(n) <= new for n in garbage(path))
    assert hkstore.verify(path)["ok"]
    assert "t2" in hkstore.open(path).pets()


def test_crash_between_manifest_and_current_is_not_a_rollback(tmp_path):
    """A writer killed after writing MANIFEST-<g+1> but before the CURRENT rename leaves an
    uncommitted manifest that CURRENT.tmp names: readers ignore it, the next writer removes it."""
    path = str(tmp_path / "s")
    make_store(path).close()
    g = generation(path)
    manifest = mf.load(path)
    manifest["generation"] = g + 1
    manifest["versions"].append({"name": "lost", "parent": "root", "segments": [], "created": 0, "info": {}})
    with open(os.path.join(path, "CURRENT.tmp"), "wb") as f:
        f.write(mf.manifest_name(g + 1).encode() + b"\n")
    with open(os.path.join(path, mf.manifest_name(g + 1)), "wb") as f:
        f.write(mf.encode(manifest))
    assert hkstore.verify(path)["ok"]
    assert "lost" not in hkstore.open(path).snapshot().version_names
    hkstore.open(path, writable=True).close()
    assert not os.path.exists(os.path.join(path, mf.manifest_name(g + 1)))
    assert not os.path.exists(os.path.join(path, "CURRENT.tmp"))
    # The same manifest without CURRENT.tmp naming it: nothing proves it uncommitted.
    with open(os.path.join(path, mf.manifest_name(g + 1)), "wb") as f:
        f.write(mf.encode(manifest))
    with pytest.raises(hkstore.CorruptError, match="rolled back"):
        hkstore.open(path)


def test_current_must_be_exact(tmp_path):
    path = str(tmp_path / "s")
    make_store(path).close()
    name = mf.current_name(path)
    for damaged in (name.encode(), name.encode() + b"\r\n", b" " + name.encode() + b"\n", name.encode() + b"\n\n"):
        with open(os.path.join(path, "CURRENT"), "wb") as f:
            f.write(damaged)
        with pytest.raises(hkstore.CorruptError, match="CURRENT is damaged"):
            hkstore.open(path)
        assert not hkstore.verify(path)["ok"]
    with open(os.path.join(path, "CURRENT"), "wb") as f:
        f.write(name.encode() + b"\n")
    assert hkstore.verify(path)["ok"]
    os.remove(os.path.join(path, "CURRENT"))
    with pytest.raises(hkstore.CorruptError, match="CURRENT is missing"):
        hkstore.open(path)


# -- 6. missing files, whole-pack verify --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["segments", "packs", "positions"])
def test_a_deleted_file_is_damage_not_a_bare_oserror(tmp_path, kind):
    path = str(tmp_path / "s")
    store = make_store(path)
    store.set_position("dom", reliability.position_table(1))
    store.close()
    victim = sorted(os.listdir(os.path.join(path, kind)))[0]
    os.remove(os.path.join(path, kind, victim))
    # The store opens; only what reads the missing file fails, with a reason.
    snap = hkstore.open(path).snapshot()
    with pytest.raises(hkstore.CorruptError, match="missing"):
        if kind == "segments":
            snap.lookup("dom", np.zeros((1, 3), dtype=np.uint32))
        elif kind == "positions":
            snap.position("dom")
        else:
            snap.read_pet(next(iter(snap.pets)))
    assert any(victim in p for p in hkstore.verify(path)["problems"])


def test_verify_walks_dead_records_and_notices_trailing_garbage(tmp_path, monkeypatch):
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 8 << 10)
    path = str(tmp_path / "s")
    store = make_store(path)
    for i in range(4):
        store.put_pet(PetRecord("t", {"i": i}, {"w": np.full(8, i, dtype=np.float32)}))
    first, live = store.snapshot().manifest["packs"][0], store.pets()["t"]
    store.close()
    assert first != live["file"] and hkstore.verify(path)["checked"]["pack_records"] == 5
    pack_path = os.path.join(path, "packs", first)
    data = open(pack_path, "rb").read()
    open(pack_path, "wb").write(data[:200] + bytes([data[200] ^ 1]) + data[201:])  # a dead record
    assert hkstore.open(path).get_pet("t").meta["i"] == 3  # readers are unaffected
    assert any(first in p for p in hkstore.verify(path)["problems"])
    open(pack_path, "wb").write(data + b"garbage")  # after the last record of a full pack
    assert any(first in p for p in hkstore.verify(path)["problems"])
    open(pack_path, "wb").write(data)
    # Past the committed end of the newest pack: a torn append's tail, cut off by the next append.
    with open(os.path.join(path, "packs", live["file"]), "ab") as f:
        f.write(b"torn")
    assert hkstore.verify(path)["ok"]


# -- 5. compaction keeps a branch's answers ----------------------------------------------------------


def test_compaction_keeps_parent_equal_entries_while_the_parent_can_change(tmp_path):
    store = hkstore.create(tmp_path / "s", d=D, vocab_size=V)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    store.add_segment("root", uni, np.zeros((V, 3, D)))
    key = np.array([[1, 2, 3]], dtype=np.uint32)
    store.add_segment("root", key, np.full((1, 3, D), 1.0))
    store.create_version("branch", "root", keys=key, values=np.full((1, 3, D), 1.0))
    store.add_segment("branch", np.array([[4, 5, 6]], dtype=np.uint32), np.full((1, 3, D), 3.0))
    r = hkstore.compact(store, "branch")
    assert r["dropped_equal_to_parent"] == 0
    store.add_segment("root", key, np.full((1, 3, D), 2.0))  # the parent is updated later
    assert store.lookup("branch", key).values.max() == 1.0  # the branch keeps what it held
    # Once the parent is sealed its answers cannot change, and compaction may drop the entry.
    store.add_segment("root", key, np.full((1, 3, D), 1.0))
    store.seal("root")
    with pytest.raises(hkstore.StoreError, match="sealed"):
        store.add_segment("root", key, np.full((1, 3, D), 2.0))
    with pytest.raises(hkstore.StoreError, match="sealed"):
        store.set_position("root", np.ones((2, D), dtype=np.float32))
    r = hkstore.compact(store, "branch")
    assert r["dropped_equal_to_parent"] == 1 and r["entries_after"] == 1
    assert store.lookup("branch", key).values.max() == 1.0
    assert hkstore.open(tmp_path / "s").snapshot().versions[0]["sealed"] is True


# -- the damage campaign ---------------------------------------------------------------------------


def check_damage(path, trials, seed):
    result = reliability.damage_campaign(path, trials, seed=seed)
    assert not result["problems"], result["problems"]
    for kind, row in result["table"].items():
        assert row["trials"] == trials // len(reliability.FILE_TYPES), (kind, row)
        assert row["silently_wrong"] == 0 and row["verify_errors"] == 0, (kind, row)
        assert row["detected"] + row["exact"] == row["trials"], (kind, row)


def test_random_damage_to_every_file_type_is_detected_or_harmless(tmp_path):
    check_damage(str(tmp_path / "s"), 150, seed=0)


@pytest.mark.slow
def test_random_damage_campaign_long(tmp_path):
    check_damage(str(tmp_path / "s"), 1000, seed=1)


def test_reliability_tool_prints_the_table(tmp_path, capsys):
    reliability.main(["--kills", "0", "--damage", "10"])
    out = capsys.readouterr().out
    assert "| damaged file | trials |" in out and "| all | 10 |" in out
    shutil.rmtree(tmp_path, ignore_errors=True)
