"""Crash safety, corruption detection, snapshot isolation and the key hash."""

import os
import threading
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import hkstore
import hkstore.store
from formats import segment as sg
from formats.pack import PetRecord
from formats.xxh64 import hash_keys, xxh64_rows
from benchmarks import reliability
# the crash campaign's store and commits (benchmarks/reliability runs the larger campaign); other tests import them here
from benchmarks.reliability import D, V, commit_keys, commit_values, make_store, position_table  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_crash_campaign(path, kills):
    """SIGKILLs during commits, compactions and gc (benchmarks/reliability.py's writer); packs roll
    at 48 KiB, so gc rewrites them between (and under) the kills."""
    result = reliability.crash_campaign(path, kills, seed=1, max_delay=0.3)
    assert result["kills"] == kills and not result["problems"], result["problems"]
    assert result["losses"] == 0 and result["verify_failures"] == 0, result
    assert result["acknowledged"] > kills and result["packs_retired"] > 0, result
    return result


def test_sigkill_during_commits_and_compactions_loses_no_acknowledged_write(tmp_path):
    check_crash_campaign(str(tmp_path / "s"), 30)


@pytest.mark.slow
def test_sigkill_campaign_long(tmp_path):
    check_crash_campaign(str(tmp_path / "s"), 120)


def test_second_writer_is_refused(tmp_path):
    store = make_store(tmp_path / "s")
    with pytest.raises(hkstore.StoreLocked, match="another writer"):
        hkstore.open(tmp_path / "s", writable=True)
    store.close()
    hkstore.open(tmp_path / "s", writable=True).close()


def corruptible_store(path, dtype):
    store = hkstore.create(path, d=D, vocab_size=V, dtype=dtype)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    store.add_segment("root", uni, np.random.default_rng(0).standard_normal((V, 3, D)))
    store.put_pet(PetRecord("t", {"x": 1}, {"w": np.arange(10, dtype=np.float32)}))
    return store, uni


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
@pytest.mark.parametrize("section", ["header"] + list(sg.SECTIONS))
def test_flipped_byte_in_each_segment_section_is_caught(tmp_path, dtype, section):
    store, uni = corruptible_store(tmp_path / "s", dtype)
    seg = store.snapshot().version_segments("root")[0]
    if section == "scales" and dtype == "fp16":
        pytest.skip("fp16 segments have an empty scales section")
    off, length = (0, sg.HEADER_SIZE) if section == "header" else seg.sections[section][:2]
    store.close()
    rng = np.random.default_rng(zlib.crc32(section.encode()))  # not hash(): it varies per process
    # The section's first byte (for the header: the magic) and three random ones.
    for pos in [off, *rng.integers(off, off + length, 3)]:
        with open(seg.path, "r+b") as f:
            f.seek(int(pos))
            byte = f.read(1)
            f.seek(int(pos))
            f.write(bytes([byte[0] ^ (1 << int(rng.integers(8)))]))
        report = hkstore.verify(str(tmp_path / "s"))
        assert not report["ok"] and any(seg.name in p for p in report["problems"])
        # Open or lookup raises a clear error: never a crash, never silently wrong vectors.
        with pytest.raises(hkstore.FormatError):
            hkstore.open(tmp_path / "s").lookup("root", uni)
        with open(seg.path, "r+b") as f:
            f.seek(int(pos))
            f.write(byte)
    assert hkstore.verify(str(tmp_path / "s"))["ok"]


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_truncated_segment_is_caught_at_first_use(tmp_path, dtype):
    store, uni = corruptible_store(tmp_path / "s", dtype)
    seg = store.snapshot().version_segments("root")[0]
    store.close()
    size = os.path.getsize(seg.path)
    for cut in (10, sg.HEADER_SIZE + 5, size // 2, size - 1):
        with open(seg.path, "r+b") as f:
            data = f.read()
            f.truncate(cut)
        assert not hkstore.verify(str(tmp_path / "s"))["ok"]
        # The store opens (other versions' readers are served); what reads the segment fails.
        with pytest.raises(hkstore.CorruptError, match="truncated"):
            hkstore.open(tmp_path / "s").lookup("root", uni[:4])
        with open(seg.path, "wb") as f:
            f.write(data)


def test_damaged_manifest_current_and_pack_are_caught(tmp_path):
    store, uni = corruptible_store(tmp_path / "s", "fp16")
    path = str(tmp_path / "s")
    store.close()
    manifest = os.path.join(path, open(os.path.join(path, "CURRENT")).read().strip())
    data = open(manifest, "rb").read()
    open(manifest, "wb").write(data.replace(b'"d": 8', b'"d": 9'))
    with pytest.raises(hkstore.CorruptError, match="checksum"):
        hkstore.open(path)
    assert not hkstore.verify(path)["ok"]
    open(manifest, "wb").write(data[: len(data) // 2])
    with pytest.raises(hkstore.CorruptError):
        hkstore.open(path)
    open(manifest, "wb").write(data)
    loc = hkstore.open(path).pets()["t"]
    pack_path = os.path.join(path, "packs", loc["file"])
    blob = bytearray(open(pack_path, "rb").read())
    blob[loc["offset"] + loc["length"] // 3] ^= 0x40
    open(pack_path, "wb").write(bytes(blob))
    with pytest.raises(hkstore.CorruptError):
        hkstore.open(path).get_pet("t")
    assert any("tenant t" in p for p in hkstore.verify(path)["problems"])


def test_snapshot_lookups_are_stable_while_compaction_and_gc_run(tmp_path, monkeypatch):
    # Packs roll at 16 KiB and every tenant is rewritten, so gc rewrites (and deletes) packs
    # while the readers work: a snapshot reads its PETs from pack files it holds open.
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 16 << 10)
    store = make_store(tmp_path / "s")
    rng = np.random.default_rng(3)
    for i in range(6):
        keys = np.unique(rng.integers(1, V, (300, 3)).astype(np.uint32), axis=0)
        store.add_segment("dom", keys, rng.standard_normal((len(keys), 3, D)))
    for i in range(3):
        store.put_pets([PetRecord(f"t{j}", {"i": i}, {"w": commit_values(10 * i + j)}) for j in range(8)])
    reader = hkstore.open(tmp_path / "s")
    snap = reader.snapshot()
    windows = rng.integers(0, V, (2000, 3)).astype(np.uint32)
    expected = snap.lookup("dom", windows)
    pets = {t: snap.read_pet(t).tensors["w"] for t in snap.pets}
    packs_before = set(snap.manifest["packs"])
    errors, refreshes = [], [0]

    def read():
        try:
            while not stop.is_set():
                got = snap.lookup("dom", windows)
                np.testing.assert_array_equal(got.values, expected.values)
                np.testing.assert_array_equal(got.version, expected.version)
                for t, w in pets.items():
                    np.testing.assert_array_equal(snap.read_pet(t).tensors["w"], w)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    def refreshing():
        # A reader that follows the writer: every refresh lands on a whole manifest.
        try:
            follower = hkstore.open(tmp_path / "s")
            while not stop.is_set():
                s = follower.refresh()
                for t in s.pets:
                    s.read_pet(t)
                refreshes[0] += 1
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    stop = threading.Event()
    threads = [threading.Thread(target=read) for _ in range(2)] + [threading.Thread(target=refreshing)]
    for t in threads:
        t.start()
    for i, version in enumerate(("dom", "root", "dom")):
        hkstore.compact(store, version)
        store.put_pets([PetRecord(f"t{j}", {"i": 3 + i}, {"w": commit_values(100 + j)}) for j in range(8)])
        hkstore.gc(store)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert refreshes[0] > 0
    assert len(os.listdir(tmp_path / "s" / "segments")) == 2  # old files really were deleted
    assert not packs_before & set(os.listdir(tmp_path / "s" / "packs"))  # and so were the old packs
    fresh = hkstore.open(tmp_path / "s")
    np.testing.assert_array_equal(fresh.lookup("dom", windows).values, expected.values)
    np.testing.assert_array_equal(fresh.get_pet("t3").tensors["w"], commit_values(103))


@settings(max_examples=200, deadline=None)
@given(arrays(np.uint32, st.tuples(st.integers(0, 64), st.integers(2, 5))))
def test_key_hash_equals_xxhash_library(keys):
    got = hash_keys(keys)
    assert [int(h) for h in got] == [xxhash.xxh64_intdigest(k.astype("<u4").tobytes()) for k in keys]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200), st.integers(1, 8), st.integers(0, 2**64 - 1))
def test_row_hash_equals_xxhash_library_at_any_length(length, rows, seed):
    data = np.random.default_rng(length).integers(0, 256, (rows, length), dtype=np.uint8)
    got = xxh64_rows(data, seed)
    assert [int(h) for h in got] == [xxhash.xxh64_intdigest(r.tobytes(), seed) for r in data]


def test_int8_values_stay_close_to_fp16(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((500, 3, 64)).astype(np.float32)
    values[..., 5] *= 8  # a BERT-like outlier dimension
    keys = np.stack([np.arange(500), np.arange(500), np.arange(500)], axis=1).astype(np.uint32)
    store = hkstore.create(tmp_path / "s", d=64, vocab_size=600, dtype="int8")
    store.add_segment("root", keys, values)
    got = store.lookup("root", keys).values.reshape(-1, 64)
    ref = values.reshape(-1, 64)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999


def test_put_pets_commits_many_records_at_once(tmp_path):
    store = make_store(tmp_path / "s")
    store.put_pet(PetRecord("t0", {"i": 0}, {"w": commit_values(0)}))
    before = store.snapshot().manifest["generation"]
    records = [PetRecord(f"t{i}", {"i": i}, {"w": commit_values(i)}) for i in range(1, 40)]
    store.put_pets(records + [PetRecord("t0", {}, {}, tombstone=True)])
    assert store.snapshot().manifest["generation"] == before + 1
    reader = hkstore.open(tmp_path / "s")
    assert sorted(reader.pets()) == sorted(f"t{i}" for i in range(1, 40))
    for i in (1, 20, 39):
        np.testing.assert_array_equal(reader.get_pet(f"t{i}").tensors["w"], commit_values(i))
    assert hkstore.verify(str(tmp_path / "s"))["ok"]


def test_names_are_validated_and_branches_appear_with_their_entries(tmp_path):
    store = make_store(tmp_path / "s")
    for bad in ("abc\n", "../x", "", "a" * 65, "-x", "a/b"):
        with pytest.raises(hkstore.StoreError, match="invalid"):
            store.create_version(bad, "root")
    before = store.snapshot().manifest["generation"]
    keys = np.array([[1, 2, 3], [2, 3, 4], [3, 4, 5]], dtype=np.uint32)
    meta = hkstore.create_branch(store, "bio", "root", keys, [5, 3, 1], 60,
                                 lambda k: np.ones((len(k), 3, D), dtype=np.float32))
    assert meta["ngrams_kept"] == 2
    # One commit: no reader ever sees the branch without its entries.
    assert store.snapshot().manifest["generation"] == before + 1
    got = store.lookup("bio", keys[:2])
    assert [got.version_names[v] for v in got.version] == ["bio", "bio"]
