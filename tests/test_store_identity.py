"""A valid file in another file's slot is refused, never served: the manifest records each
segment's and pack's identity (FORMAT.md section 2, "File identity"), a pack read checks the
record is the tenant's, and verify names the file. Old manifests without identities still serve
and get them on the next commit."""

import os
import shutil
import tempfile
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hkstore
import hkstore.store
from formats import manifest as mf
from formats import pack
from formats.pack import PetRecord
from formats.segment import Segment
from tools.cli import main as cli

D, V = 8, 40


def unigrams():
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    return uni


KEYS = np.array([[1, 2, 3], [2, 3, 4], [5, 6, 7], [9, 9, 9]], dtype=np.uint32)
WINDOWS = np.concatenate([KEYS, np.random.default_rng(9).integers(0, V, (60, 3)).astype(np.uint32)])


def values(seed, count=len(KEYS)):
    return np.random.default_rng(seed).standard_normal((count, 3, D)).astype(np.float16)


def pet(tenant, seed):
    return PetRecord(tenant, {"tenant": tenant, "version": "root"},
                     {"w": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)})


def two_slot_store(path, monkeypatch):
    """Versions a and b holding one segment each (the same keys, other values: files of equal
    size), tenants alice and bob in packs of their own (records of equal length)."""
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 1)  # every record starts a new pack
    store = hkstore.create(path, d=D, vocab_size=V)
    store.add_segment("root", unigrams(), np.random.default_rng(0).standard_normal((V, 3, D)))
    store.create_version("a", "root", keys=KEYS, values=values(1))
    store.create_version("b", "root", keys=KEYS, values=values(2))
    store.put_pet(pet("alice", 1))
    store.put_pet(pet("bob", 2))
    snap = store.snapshot()
    files = {"a": snap.versions[1]["segments"][0], "b": snap.versions[2]["segments"][0],
             "alice": snap.pets["alice"]["file"], "bob": snap.pets["bob"]["file"]}
    store.close()
    assert files["alice"] != files["bob"]
    return files


def lookup(store, version):
    r = store.lookup(version, WINDOWS)
    return r.values.copy(), r.version.copy(), r.order.copy()


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def copy_over(path, sub, donor, target):
    shutil.copyfile(os.path.join(path, sub, donor), os.path.join(path, sub, target))


def swap(path, sub, x, y):
    a, b = os.path.join(path, sub, x), os.path.join(path, sub, y)
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)


def strip_identities(path):
    """Rewrite the live manifest as a writer from before file identities wrote it."""
    name = mf.current_name(path)
    manifest = mf.load(path)
    manifest.pop("files", None)
    with open(os.path.join(path, name), "wb") as f:
        f.write(mf.encode(manifest))


# -- the reproducer --------------------------------------------------------------------------------


def test_a_segment_copied_over_another_is_refused_and_named(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    files = two_slot_store(path, monkeypatch)
    with hkstore.open(path) as store:
        before = {v: lookup(store, v) for v in ("root", "a", "b")}
    assert not same(before["a"], before["b"])
    copy_over(path, "segments", files["b"], files["a"])

    store = hkstore.open(path)  # the store opens: what does not reach the file keeps serving
    with pytest.raises(hkstore.CorruptError, match=f"segment {files['a']}: not the file the manifest names"):
        store.lookup("a", WINDOWS)
    assert same(lookup(store, "b"), before["b"]) and same(lookup(store, "root"), before["root"])
    with hkstore.open(path, writable=True) as writer, pytest.raises(hkstore.CorruptError):
        hkstore.compact(writer, "a")

    report = hkstore.verify(path)
    assert not report["ok"]
    assert any(files["a"] in p and "not the file the manifest names" in p for p in report["problems"])
    assert not any(files["b"] in p for p in report["problems"])
    result = CliRunner().invoke(cli, ["verify", path])
    assert result.exit_code == 1 and files["a"] in result.output


def test_swapped_pack_files_never_serve_another_tenants_pet(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    files = two_slot_store(path, monkeypatch)
    swap(path, "packs", files["alice"], files["bob"])

    store = hkstore.open(path)
    for tenant in ("alice", "bob"):  # each slot now holds the other's valid record: both refused
        with pytest.raises(hkstore.CorruptError, match=f"pack {files[tenant]}: not the file the manifest names"):
            store.get_pet(tenant)
    problems = hkstore.verify(path)["problems"]
    for tenant in ("alice", "bob"):
        assert any(f"pack {files[tenant]}: not the file the manifest names" in p for p in problems), problems
    lookup(store, "a")  # lookups read no pack: they go on


def test_a_students_slot_holding_a_pet_record_is_refused(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    two_slot_store(path, monkeypatch)
    name = mf.current_name(path)
    manifest = mf.load(path)
    manifest["students"] = {"alice": manifest["pets"]["alice"]}
    with open(os.path.join(path, name), "wb") as f:
        f.write(mf.encode(manifest))
    with pytest.raises(hkstore.CorruptError, match="is tenant 'alice''s record, not tenant 'alice''s students record"):
        hkstore.open(path).get_students("alice")


def test_a_pack_read_checks_the_tenant_without_any_identity(tmp_path, monkeypatch):
    """The record's own tenant is checked on every read, identities recorded or not (an older
    manifest's store, or a pack appended past its recorded identity)."""
    path = str(tmp_path / "s")
    files = two_slot_store(path, monkeypatch)
    strip_identities(path)
    swap(path, "packs", files["alice"], files["bob"])
    store = hkstore.open(path)
    with pytest.raises(hkstore.CorruptError, match="is tenant 'bob''s record, not tenant 'alice''s"):
        store.get_pet("alice")
    assert any("tenant alice" in p for p in hkstore.verify(path)["problems"])


def test_an_older_record_of_the_same_tenant_in_its_slot_is_refused(tmp_path, monkeypatch):
    """The tenant check alone cannot tell alice's current PET from her previous one: the
    pack's identity does."""
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 1)
    path = str(tmp_path / "s")
    store = hkstore.create(path, d=D, vocab_size=V)
    store.put_pet(pet("alice", 1))
    old = store.pets()["alice"]["file"]
    store.put_pet(pet("alice", 2))
    new = store.pets()["alice"]["file"]
    store.close()
    copy_over(path, "packs", old, new)
    with pytest.raises(hkstore.CorruptError, match=f"pack {new}: not the file the manifest names"):
        hkstore.open(path).get_pet("alice")
    assert any(new in p for p in hkstore.verify(path)["problems"])


# -- identities in the manifest --------------------------------------------------------------------


def recorded(path):
    return mf.load(path).get("files")


def expected_identities(path):
    """Each live segment's and pack's identity, computed from the files as FORMAT.md says."""
    manifest = mf.load(path)
    out = {}
    for name in {s for v in manifest["versions"] for s in v["segments"]}:
        full = os.path.join(path, "segments", name)
        with open(full, "rb") as f:
            header = f.read(256)
        out[name] = {"size": os.path.getsize(full), "xxh64": f"{int.from_bytes(header[248:], 'little'):016x}"}
    for i, name in enumerate(manifest["packs"]):
        full = os.path.join(path, "packs", name)
        end = manifest["pack_end"] if i == len(manifest["packs"]) - 1 else os.path.getsize(full)
        value, offset = 0, 0
        with open(full, "rb") as f:
            data = f.read(end)
        while offset < end:
            length = int.from_bytes(data[offset + 16:offset + 24], "little")
            value = pack.chain(value, int.from_bytes(data[offset + 120:offset + 128], "little"))
            offset += length
        out[name] = {"size": end, "xxh64": f"{value:016x}"}
    return out


def test_every_commit_records_the_identity_of_every_live_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 10 << 10)
    path = str(tmp_path / "s")
    store = hkstore.create(path, d=D, vocab_size=V)
    assert recorded(path) == {}
    store.add_segment("root", unigrams(), np.zeros((V, 3, D)))
    store.create_version("a", "root", keys=KEYS, values=values(1))
    store.add_segment("a", KEYS[:2], values(3, 2))
    store.put_pets([pet(f"t{i}", i) for i in range(5)])  # several packs in one commit
    store.put_pet(pet("t1", 9))
    assert recorded(path) == expected_identities(path)
    hkstore.compact(store, "a")
    hkstore.gc(store)
    assert recorded(path) == expected_identities(path)  # files gone from the manifest, gone from here
    assert len(recorded(path)) == 2 + len(mf.load(path)["packs"])
    seg = store.snapshot().version_segments("a")[0]
    assert Segment(seg.path).identity() == recorded(path)[seg.name]
    store.close()
    assert hkstore.verify(path)["ok"]


def test_a_store_without_identities_serves_and_gets_them_on_its_next_commit(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    files = two_slot_store(path, monkeypatch)
    with hkstore.open(path) as store:
        before = {v: lookup(store, v) for v in ("root", "a", "b")}
        pets = {t: store.get_pet(t).tensors["w"] for t in ("alice", "bob")}
    identities = recorded(path)
    strip_identities(path)
    assert "files" not in mf.load(path)

    with hkstore.open(path) as store:  # reads as before
        for v, answer in before.items():
            assert same(lookup(store, v), answer)
        for t, w in pets.items():
            np.testing.assert_array_equal(store.get_pet(t).tensors["w"], w)
    report = hkstore.verify(path)
    assert report["ok"] and sorted(report["unrecorded"]) == sorted(identities)
    assert "no recorded identity" in CliRunner().invoke(cli, ["verify", path]).output
    hkstore.open(path, writable=True).close()  # opening alone changes nothing
    assert "files" not in mf.load(path)

    with hkstore.open(path, writable=True) as store:  # the next commit, whatever it is
        store.set_version_info("a", note="after the upgrade")
    assert recorded(path) == identities
    assert hkstore.verify(path)["unrecorded"] == []
    copy_over(path, "segments", files["b"], files["a"])
    with pytest.raises(hkstore.CorruptError, match="not the file the manifest names"):
        hkstore.open(path).lookup("a", WINDOWS)


def test_a_pack_identity_covering_a_prefix_still_serves_and_is_extended(tmp_path):
    """An older writer appends to the newest pack without extending its identity: records past
    the recorded size are read with the tenant check alone, and the next commit covers them."""
    path = str(tmp_path / "s")
    store = hkstore.create(path, d=D, vocab_size=V)
    store.put_pet(pet("alice", 1))
    prefix = recorded(path)
    store.put_pet(pet("bob", 2))
    store.close()
    name = mf.current_name(path)
    manifest = mf.load(path)
    manifest["files"] = prefix
    with open(os.path.join(path, name), "wb") as f:
        f.write(mf.encode(manifest))
    with hkstore.open(path) as store:
        assert store.get_pet("bob").tenant == "bob" and store.get_pet("alice").tenant == "alice"
    assert hkstore.verify(path)["ok"]
    with hkstore.open(path, writable=True) as store:
        store.set_version_info("root", note="x")
    assert recorded(path) == expected_identities(path) != prefix


def test_pack_chain_is_xxh64_of_each_header_checksum_seeded_with_the_last():
    import xxhash

    a, b = pack.encode_record(pet("a", 1)), pack.encode_record(pet("b", 2))
    da, db = pack.header_digest(a), pack.header_digest(b)
    assert da == int.from_bytes(a[120:128], "little")
    want = xxhash.xxh64_intdigest(db.to_bytes(8, "little"), xxhash.xxh64_intdigest(da.to_bytes(8, "little"), 0))
    assert pack.chain(pack.chain(0, da), db) == want
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.pack")
        pack.append_record(p, pet("a", 1))
        pack.append_record(p, pet("b", 2))
        size = os.path.getsize(p)
        assert pack.walk_chain(p, 0, size) == want
        assert pack.walk_chain(p, len(a), size, pack.chain(0, da)) == want
        with pytest.raises(hkstore.CorruptError, match="record"):
            pack.walk_chain(p, 0, size - 1)  # the end is not a record boundary
        with pytest.raises(hkstore.CorruptError, match="record"):
            pack.walk_chain(p, 64, size)


# -- the property ----------------------------------------------------------------------------------

DAMAGE = "damage"


def read_all(path, windows, versions, tenants):
    """Every read, one at a time: its answer, or DAMAGE where it raised CorruptError. Any other
    exception fails the test."""
    out = {}
    try:
        store = hkstore.open(path)
    except hkstore.CorruptError:
        return {k: DAMAGE for k in [*(f"lookup {v}" for v in versions), *(f"position {v}" for v in versions),
                                    *(f"pet {t}" for t in tenants)]}
    snap = store.snapshot()
    for v in versions:
        try:
            out[f"lookup {v}"] = lookup(snap, v)
        except hkstore.CorruptError:
            out[f"lookup {v}"] = DAMAGE
        try:
            out[f"position {v}"] = snap.position(v)
        except hkstore.CorruptError:
            out[f"position {v}"] = DAMAGE
    for t in tenants:
        try:
            rec = snap.read_pet(t)
            out[f"pet {t}"] = (rec.tenant, rec.meta, rec.tensors)
        except hkstore.CorruptError:
            out[f"pet {t}"] = DAMAGE
    return out


def equal(a, b):
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def build(path, plan):
    """A random small store: branches with one to three segments each, some compacted (their
    old segments stay as garbage), position tables, tenants with history across rolled packs."""
    rng = np.random.default_rng(plan["seed"])
    # Durability is not what this test is about, and fsyncs would be most of its time.
    with mock.patch.object(hkstore.store, "PACK_ROLL_BYTES", plan["roll"]), mock.patch("os.fsync"):
        store = hkstore.create(path, d=D, vocab_size=V)
        store.add_segment("root", unigrams(), rng.standard_normal((V, 3, D)))
        versions = ["root"]
        for i, segments in enumerate(plan["segments"]):
            name = f"v{i}"
            store.create_version(name, rng.choice(versions))
            for _ in range(segments):
                keys = np.unique(rng.integers(0, V, (int(rng.integers(3, 12)), 3)).astype(np.uint32), axis=0)
                store.add_segment(name, keys, rng.standard_normal((len(keys), 3, D)))
            if plan["compact"] and segments > 1:
                hkstore.compact(store, name)
            if plan["positions"]:
                store.set_position(name, rng.standard_normal((4, D)).astype(np.float32))
            versions.append(name)
        tenants = [f"t{i}" for i in range(plan["tenants"])]
        for _ in range(plan["rounds"]):
            store.put_pets([pet(t, int(rng.integers(1 << 30))) for t in tenants])
        store.close()
    return versions, tenants


plans = st.fixed_dictionaries({
    "seed": st.integers(0, 1 << 16),
    "segments": st.lists(st.integers(1, 3), min_size=1, max_size=3),
    "compact": st.booleans(),
    "positions": st.booleans(),
    "tenants": st.integers(1, 4),
    "rounds": st.integers(1, 3),
    "roll": st.sampled_from([1, 8 << 10, 1 << 20]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans, data=st.data())
def test_a_file_in_another_files_slot_never_changes_an_answer(plan, data):
    """Replace one live segment, pack or position table with another file of the store (or swap
    two): every read gives exactly the original answer or raises CorruptError, and verify names
    the file whose bytes changed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s")
        versions, tenants = build(path, plan)
        manifest = mf.load(path)
        live = [os.path.join("segments", s) for v in manifest["versions"] for s in v["segments"]]
        live += [os.path.join("packs", p) for p in manifest["packs"]]
        live += [os.path.join("positions", v["position"]["file"]) for v in manifest["versions"] if v.get("position")]
        every = sorted(os.path.join(sub, n) for sub in ("segments", "packs", "positions")
                       for n in os.listdir(os.path.join(path, sub)))
        kind = data.draw(st.sampled_from(sorted({os.path.dirname(f) for f in live})), label="kind")
        target = data.draw(st.sampled_from(sorted(f for f in live if f.startswith(kind))), label="target")
        same_kind = [f for f in every if f != target and f.startswith(kind)]
        # Mostly a file of the same kind (the misplacement no checksum of the file itself can see)
        donors = same_kind if same_kind and data.draw(st.integers(0, 3), label="other kind") < 3 else \
            [f for f in every if f != target]
        donor = data.draw(st.sampled_from(donors), label="donor")
        how = data.draw(st.sampled_from(["replace", "swap"]), label="how")
        original = {f: open(os.path.join(path, f), "rb").read() for f in every}
        reference = read_all(path, WINDOWS, versions, tenants)
        assert not any(answer is DAMAGE for answer in reference.values())

        if how == "replace":
            shutil.copyfile(os.path.join(path, donor), os.path.join(path, target))
        else:
            swap(path, "", target, donor)
        got = read_all(path, WINDOWS, versions, tenants)
        for key, answer in got.items():
            assert answer is DAMAGE or equal(answer, reference[key]), f"{key}: a different answer without an error"
        event(f"{how} {os.path.dirname(target)} with {os.path.dirname(donor)}: "
              f"{'some reads refused' if any(a is DAMAGE for a in got.values()) else 'every answer exact'}")
        changed = [f for f in (target, donor) if f in live and open(os.path.join(path, f), "rb").read() != original[f]]
        report = hkstore.verify(path)
        for f in changed:
            assert any(os.path.basename(f) in p for p in report["problems"]), (f, report["problems"])
