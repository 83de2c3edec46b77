"""What the store promises when things go wrong or are deleted: gc takes a deleted tenant's
bytes off the disk (the newest pack included) and says what it frees; one missing or damaged
file fails only its readers; a failed position-table read is retried with a true reason; a
segment changed under a reader is checked again; verify covers model weights and tokens.json;
sealing has a command and a tolerance without a sealed parent is refused; gc takes the
temporary files killed writers leave."""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
import hkstore.store
from benchmarks.reliability import D, V, make_store
from formats.pack import PetRecord
from formats.xxh64 import checksum
from hkstore.cli import main as cli
from hkstore import maintenance


def pet(tenant, seed, **meta):
    # random float32 does not compress: the record holds these bytes as they are
    return PetRecord(tenant, {"seed": seed, **meta},
                     {"w": np.random.default_rng(seed).standard_normal(2048).astype(np.float32)})


def fingerprint(record):
    """A distinctive 64-byte slice of what the record stores."""
    return record.tensors["w"].tobytes()[1024:1088]


def store_files(path):
    for root, _, names in os.walk(path):
        for name in names:
            yield os.path.join(root, name)


def holding(path, needle):
    out = []
    for full in store_files(path):
        with open(full, "rb") as f:
            if needle in f.read():
                out.append(os.path.relpath(full, path))
    return out


def disk_bytes(path):
    return sum(os.path.getsize(f) for f in store_files(path))


def manifest_bytes(path):
    with open(os.path.join(path, "CURRENT")) as f:
        return os.path.getsize(os.path.join(path, f.read().strip()))


def agrees(freed, estimate, path):
    """gc frees what it estimated, but for the manifest it rewrote (a few bytes a moved record)."""
    return abs(freed - estimate) <= manifest_bytes(path)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# -- gc: deleted means gone from disk --------------------------------------------------------------


def test_tenant_rm_and_gc_leave_no_byte_of_its_pet_in_the_newest_pack(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        for i, t in enumerate(("a", "b", "c")):
            st.put_pet(pet(t, i))
        assert len(st.snapshot().manifest["packs"]) == 1  # one pack: the newest, which gc used to skip
        st.put_full(pet("b", 10, level="full", pet_created=0))
        gone = [fingerprint(pet("b", 1)), fingerprint(pet("b", 10))]
        st.delete_pet("b")
    assert all(holding(path, needle) for needle in gone)
    estimate = maintenance.reclaimable(path)
    assert run("info", path, "--json").exit_code == 0
    assert json.loads(run("info", path, "--json").output)["gc_reclaims"] == estimate > 0
    before = disk_bytes(path)
    with hkstore.open(path, writable=True) as st:
        dry = hkstore.gc(st, dry_run=True)
        assert dry["bytes_freed"] == estimate and disk_bytes(path) == before
        out = hkstore.gc(st)
    assert out["bytes_freed"] == before - disk_bytes(path) and agrees(out["bytes_freed"], estimate, path)
    assert out["bytes_freed"] > 2 * 8192 and out["packs_rewritten"]
    assert [holding(path, needle) for needle in gone] == [[], []]
    with hkstore.open(path) as reader:
        assert sorted(reader.pets()) == ["a", "c"]
        assert reader.get_pet("c").tensors["w"].tobytes() == pet("c", 2).tensors["w"].tobytes()
    assert hkstore.verify(path)["ok"]
    assert maintenance.reclaimable(path) == 0
    with hkstore.open(path, writable=True) as st:
        assert hkstore.gc(st) == {"removed": [], "bytes_freed": 0, "packs_rewritten": []}


def test_an_old_snapshot_reads_its_records_after_gc_moved_them(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(pet("a", 1))
        st.put_pet(pet("b", 2))
        st.delete_pet("b")
        reader = hkstore.open(path)
        old = reader.snapshot()
        hkstore.gc(st)
        st.put_pet(pet("c", 3))  # writes go on after the rewrite, into the new pack
        assert st.pets()["c"]["file"] == st.pets()["a"]["file"]
    assert old.read_pet("a").meta["seed"] == 1  # its pack file is gone from the directory, not from it
    assert old.pets["a"]["file"] not in os.listdir(os.path.join(path, "packs"))
    assert hkstore.verify(path)["ok"]


OPS = st.lists(st.tuples(st.sampled_from(["put", "rm", "full", "rm_full"]), st.integers(0, 3)), min_size=1,
               max_size=14)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, roll=st.sampled_from([3, 5, 1000]))
def test_gc_after_any_history_keeps_the_live_and_drops_every_deleted_record(ops, roll):
    old_roll = hkstore.store.PACK_ROLL_BYTES
    hkstore.store.PACK_ROLL_BYTES = roll * 12 << 10  # a few records a pack, or one pack
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s")
            live, deleted, seed = {}, [], 100
            with hkstore.create(path, d=4, vocab_size=10) as st:
                for op, i in ops:
                    t, seed = f"t{i}", seed + 1
                    if op == "put":
                        live[(t, "pet")] = pet(t, seed)
                        st.put_pet(live[(t, "pet")])
                    elif op == "full" and (t, "pet") in live:
                        # a replaced record is not a deleted one: gc may keep it until its pack is mostly dead
                        live[(t, "full")] = pet(t, seed, level="full", pet_created=0)
                        st.put_full(live[(t, "full")])
                    elif op == "rm" and (t, "pet") in live:
                        st.delete_pet(t)
                        deleted += [live.pop(k) for k in [(t, "pet"), (t, "full")] if k in live]
                    elif op == "rm_full" and (t, "full") in live:
                        st.delete_full(t)
                        deleted.append(live.pop((t, "full")))
                estimate = maintenance.reclaimable(path)
                before = disk_bytes(path)
                out = hkstore.gc(st)
            assert out["bytes_freed"] == before - disk_bytes(path) and agrees(out["bytes_freed"], estimate, path)
            kept = {fingerprint(r) for r in live.values()}
            for record in deleted:
                if fingerprint(record) not in kept:
                    assert holding(path, fingerprint(record)) == [], record.tenant
            with hkstore.open(path) as reader:
                for (t, kind), record in live.items():
                    got = reader.get_pet(t) if kind == "pet" else reader.get_full(t)
                    assert got.meta["seed"] == record.meta["seed"]
                assert set(reader.pets()) == {t for t, kind in live if kind == "pet"}
            assert hkstore.verify(path)["ok"]
    finally:
        hkstore.store.PACK_ROLL_BYTES = old_roll


# -- one missing or damaged file fails only its readers ---------------------------------------------


def two_branches(path):
    """root (every uni-gram), "dom" and "other" under it, each with a segment and a table."""
    store = make_store(path)
    store.create_version("other", "root")
    rng = np.random.default_rng(7)
    keys = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint32)
    for v in ("dom", "other"):
        store.add_segment(v, keys, rng.standard_normal((2, 3, D)))
        store.set_position(v, rng.standard_normal((4, D)).astype(np.float32))
    store.put_pet(pet("a", 1))
    hkstore.gc(store)  # only the live manifest: the tests below look at what else gc takes
    store.close()
    return keys


def answers(snap, version, windows):
    r, table = snap.lookup(version, windows), snap.position(version)
    return r.values.tobytes(), r.order.tobytes(), None if table is None else table.tobytes()


@pytest.mark.parametrize("kind", ["segments", "positions"])
@pytest.mark.parametrize("how", ["delete", "truncate", "header"])
def test_one_missing_or_damaged_branch_file_fails_only_that_branch(tmp_path, kind, how):
    path = str(tmp_path / "s")
    keys = two_branches(path)
    windows = np.concatenate([keys, np.random.default_rng(1).integers(0, V, (20, 3)).astype(np.uint32)])
    with hkstore.open(path) as st:
        snap = st.snapshot()
        want = {v: answers(snap, v, windows) for v in ("root", "other")}
        dom = snap.versions[snap.version_index("dom")]
        victim = os.path.join(path, kind, dom["segments"][0] if kind == "segments" else dom["position"]["file"])
    if how == "delete":
        os.remove(victim)
    elif how == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        with open(victim, "r+b") as f:
            f.seek(9)
            byte = f.read(1)
            f.seek(9)
            f.write(bytes([byte[0] ^ 0x20]))
    with hkstore.open(path) as st:  # opens: the other versions and the tenants are served
        snap = st.snapshot()
        assert {v: answers(snap, v, windows) for v in ("root", "other")} == want
        assert st.get_pet("a").meta["seed"] == 1
        with pytest.raises(hkstore.CorruptError, match=os.path.basename(victim)):
            answers(snap, "dom", windows)
    report = hkstore.verify(path)
    assert not report["ok"] and any(os.path.basename(victim) in p for p in report["problems"])


def test_a_writer_opens_and_commits_beside_a_missing_file(tmp_path):
    path = str(tmp_path / "s")
    two_branches(path)
    with hkstore.open(path) as st:
        seg = st.snapshot().versions[st.snapshot().version_index("dom")]["segments"][0]
    os.remove(os.path.join(path, "segments", seg))
    with hkstore.open(path, writable=True) as st:
        st.put_pet(pet("b", 2))  # acknowledged, and readable at once
        assert st.get_pet("b").meta["seed"] == 2
    with hkstore.open(path) as st:
        assert sorted(st.pets()) == ["a", "b"]
        pack = st.pets()["a"]["file"]
    os.remove(os.path.join(path, "packs", pack))  # the newest pack: appends go to a new one
    with hkstore.open(path, writable=True) as st:
        st.put_pet(pet("c", 3))
        assert st.get_pet("c").meta["seed"] == 3
        with pytest.raises(hkstore.CorruptError, match="missing"):
            st.get_pet("a")


# -- a position table read again after a failure -----------------------------------------------------


def test_a_failed_position_read_gives_the_true_reason_again_and_is_retried(tmp_path):
    path = str(tmp_path / "s")
    two_branches(path)
    st = hkstore.open(path)
    entry = st.snapshot().versions[st.snapshot().version_index("dom")]["position"]
    full = os.path.join(path, "positions", entry["file"])
    good = open(full, "rb").read()
    with open(full, "r+b") as f:
        f.truncate(len(good) - 4)
    st = hkstore.open(path)
    snap = st.snapshot()
    first = f"{len(good) - 4} bytes, expected {len(good)}"
    for _ in range(2):
        with pytest.raises(hkstore.CorruptError, match=first):
            snap.position("dom")
    with open(full, "wb") as f:  # put right (restored from a copy)
        f.write(good)
    assert snap.position("dom").tobytes() == good


# -- a segment changed under a reader is checked again -----------------------------------------------


def flip_a_value_byte(seg_path, entry, store):
    seg = store.snapshot().version_segments("dom")[0]
    off, _, _ = seg.sections["values"]
    at = off + entry * seg.slots * seg.d * 2 + 3
    time.sleep(0.05)  # past the file system's timestamp tick: the rewrite gets a new mtime
    with open(seg_path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x04]))


@pytest.mark.parametrize("how", ["scrub", "refresh after a commit"])
def test_a_segment_rewritten_in_place_after_it_was_served_is_refused(tmp_path, how):
    path = str(tmp_path / "s")
    keys = two_branches(path)
    reader = hkstore.open(path)
    served = reader.lookup("dom", keys[:1])
    assert served.order[0] == 3 and served.version[0] == reader.snapshot().version_index("dom")
    seg = reader.snapshot().version_segments("dom")[0]
    entry = int(seg.probe(keys[:1])[0])
    flip_a_value_byte(seg.path, entry, reader)
    if how == "scrub":
        assert reader.scrub() == [seg.name]
    else:
        with hkstore.open(path, writable=True) as writer:
            writer.put_pet(pet("b", 2))
        reader.refresh()
    with pytest.raises(hkstore.CorruptError, match="fails its checksum"):
        reader.lookup("dom", keys[:1])
    assert reader.lookup("other", keys[:1]).order[0] == 3  # the other branch is unaffected
    assert reader.scrub() == []  # nothing changed since: a stat per segment, nothing reopened


def test_a_deep_scrub_reopens_every_segment(tmp_path):
    path = str(tmp_path / "s")
    two_branches(path)
    reader = hkstore.open(path)
    names = sorted({s for v in reader.snapshot().versions for s in v["segments"]})
    assert reader.scrub(deep=True) == names


# -- verify: model weights and tokens.json; info counts models/ --------------------------------------


def save_weights(path, name, seed):
    from safetensors.numpy import save_file

    rel = f"models/{name}.safetensors"
    os.makedirs(os.path.join(path, "models"), exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"a": rng.standard_normal((8, 4)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float16)},
              os.path.join(path, rel))
    with open(os.path.join(path, rel), "rb") as f:
        return {"file": rel, "xxh64": f"{checksum(f.read()):016x}", "lower_layers": 1}


def test_verify_checks_model_weights_and_info_counts_them(tmp_path):
    path = str(tmp_path / "s")
    two_branches(path)
    with hkstore.open(path, writable=True) as st:
        st.set_version_info("dom", lower_weights=save_weights(path, "dom", 1))
    named = os.path.join(path, "models", "dom.safetensors")
    report = hkstore.verify(path)
    assert report["ok"] and report["checked"]["models"] == 1
    info = json.loads(run("info", path, "--json").output)
    assert info["bytes"] == report["checked"]["bytes"]  # the live total includes the weights
    assert info["bytes_models"] == os.path.getsize(named)
    good = open(named, "rb").read()
    with open(named, "r+b") as f:  # damage in the tensor data: the header still parses
        f.seek(len(good) - 10)
        f.write(b"\xff\xff")
    result = run("verify", path)
    assert result.exit_code == 1 and "models/dom.safetensors: checksum mismatch" in result.output
    os.remove(named)
    assert any("models/dom.safetensors: missing" in p for p in hkstore.verify(path)["problems"])
    with open(named, "wb") as f:
        f.write(good)
    # A file no version names is still checked for its structure.
    save_weights(path, "spare", 2)
    spare = os.path.join(path, "models", "spare.safetensors")
    assert hkstore.verify(path)["ok"]
    os.truncate(spare, os.path.getsize(spare) - 8)
    problems = hkstore.verify(path)["problems"]
    assert len(problems) == 1 and "models/spare.safetensors" in problems[0]


@pytest.mark.parametrize("data, ok", [
    (None, True),
    (json.dumps({"format": 1, "tenants": {"a": {"scheme": "sha256-salted", "salt": "00ff", "hash": "ab" * 32}}}), True),
    ("{not json", False),
    (json.dumps({"format": 1, "tenants": {"a": {"scheme": "sha256-salted", "salt": "zz", "hash": "ab" * 32}}}), False),
    (json.dumps({"format": 1, "tenants": {"a": {"scheme": "sha256-salted", "salt": "00", "hash": "ab"}}}), False),
    (json.dumps({"format": 1}), False),
    (json.dumps([1, 2]), False),
])
def test_verify_reports_a_damaged_tokens_file(tmp_path, data, ok):
    path = str(tmp_path / "s")
    two_branches(path)
    if data is not None:
        with open(os.path.join(path, "tokens.json"), "w") as f:
            f.write(data)
    report = hkstore.verify(path)
    assert report["ok"] == ok
    if not ok:
        assert len(report["problems"]) == 1 and report["problems"][0].startswith("tokens.json: ")
        result = run("verify", path)
        assert result.exit_code == 1 and "Traceback" not in result.output and "tokens.json" in result.output


# -- seal and compact --tolerance --------------------------------------------------------------------


def test_compact_tolerance_needs_a_sealed_parent_and_seal_has_a_command(tmp_path):
    path = str(tmp_path / "s")
    store = make_store(path)
    root_keys = np.zeros((3, 3), dtype=np.uint32)
    root_keys[:, 1] = [1, 2, 3]
    same = store.lookup("root", root_keys).values.astype(np.float32)
    store.add_segment("dom", root_keys, same + 1e-3)  # within 0.01 of what the root serves
    store.add_segment("dom", np.array([[7, 8, 9]], dtype=np.uint32), np.ones((1, 3, D)))
    store.close()
    result = run("compact", path, "--version", "dom", "--tolerance", "0.01")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "hkstore seal" in result.output and len(result.output.strip().splitlines()) == 1
    assert len(hkstore.open(path).snapshot().version_segments("dom")) == 2  # nothing was done
    assert run("seal", path, "nope").exit_code != 0
    result = run("seal", path, "root")
    assert result.exit_code == 0 and "sealed" in result.output, result.output
    assert json.loads(run("seal", path, "root", "--json").output)["already"] is True
    result = run("compact", path, "--version", "dom", "--tolerance", "0.01", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["dropped_equal_to_parent"] == 3 and r["entries_after"] == 1
    with pytest.raises(hkstore.StoreError, match="sealed"):
        hkstore.open(path, writable=True).add_segment("root", root_keys, same)


# -- gc takes the temporary files killed writers left ------------------------------------------------


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_gc_removes_a_killed_token_writers_temporary_but_not_a_live_ones(tmp_path):
    import fcntl

    path = str(tmp_path / "s")
    two_branches(path)
    tmp = os.path.join(path, f"tokens.json.tmp.{dead_pid()}.1")
    open(tmp, "w").write("{}")
    lock = os.open(os.path.join(path, "tokens.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a writer at work: its temporary file is not garbage
    with hkstore.open(path, writable=True) as st:
        assert hkstore.gc(st, dry_run=True)["removed"] == []
        assert hkstore.gc(st)["removed"] == [] and os.path.exists(tmp)
    os.close(lock)  # the writer is gone
    with hkstore.open(path, writable=True) as st:
        assert hkstore.gc(st, dry_run=True)["removed"] == [os.path.basename(tmp)]
        out = hkstore.gc(st)
    assert out["removed"] == [os.path.basename(tmp)] and out["bytes_freed"] == 2 and not os.path.exists(tmp)


def test_without_a_token_lock_gc_goes_by_the_writers_pid(tmp_path):
    path = str(tmp_path / "s")
    two_branches(path)
    gone = os.path.join(path, f"tokens.json.tmp.{dead_pid()}.1")
    alive = os.path.join(path, f"tokens.json.tmp.{os.getpid()}.1")
    weights = os.path.join(path, "models", "root.safetensors.tmp")
    os.makedirs(os.path.dirname(weights))
    for name in (gone, alive, weights):
        open(name, "w").write("x")
    with hkstore.open(path, writable=True) as st:
        assert hkstore.gc(st)["removed"] == [os.path.basename(gone)]
    old = time.time() - 3600  # older than any write takes: its writer was killed
    for name in (alive, weights):
        os.utime(name, (old, old))
    with hkstore.open(path, writable=True) as st:
        assert hkstore.gc(st)["removed"] == sorted([os.path.basename(alive), "models/root.safetensors.tmp"])
