"""Crash safety, corruption detection, snapshot isolation and the key hash."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import hkstore
from formats import segment as sg
from formats.pack import PetRecord
from formats.xxh64 import hash_keys, xxh64_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, V = 8, 40


def commit_keys(i):
    """Commit i's keys: unique to it, so later commits never shadow them."""
    return np.array([[1 + i % 39, 1 + j, 1 + (i // 39) % 39] for j in range(4)], dtype=np.uint32)


def commit_values(i):
    return np.random.default_rng(i).standard_normal((4, 3, D)).astype(np.float16)


def position_table(i):
    return np.random.default_rng(10_000 + i).standard_normal((5 + i % 4, D)).astype(np.float32)


WRITER = textwrap.dedent(f"""
    import sys, numpy as np
    sys.path.insert(0, {ROOT!r})
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    import hkstore
    from formats.pack import PetRecord
    from test_store_durability import commit_keys, commit_values, position_table
    store = hkstore.open(sys.argv[1], writable=True)
    start = int(sys.argv[2])
    for i in range(start, start + 1000):
        version = "root" if i % 2 else "dom"
        store.add_segment(version, commit_keys(i), commit_values(i))
        store.put_pet(PetRecord(f"t{{i}}", {{"i": i}}, {{"w": commit_values(i)}}))
        if i % 3 == 0:
            store.set_position("dom", position_table(i))
        if i % 5 == 0:
            hkstore.compact(store, version)
        if i % 11 == 0:
            hkstore.gc(store)
        print(i, flush=True)
""")


def make_store(path):
    store = hkstore.create(path, d=D, vocab_size=V)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    store.add_segment("root", uni, np.random.default_rng(0).standard_normal((V, 3, D)))
    store.create_version("dom", "root")
    return store


def test_sigkill_during_commits_and_compactions_loses_no_acknowledged_write(tmp_path):
    path = str(tmp_path / "s")
    make_store(path).close()
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = random.Random(1)
    acked, start = [], 0
    for _ in range(25):
        proc = subprocess.Popen([sys.executable, str(script), path, str(start)], stdout=subprocess.PIPE, text=True)
        # Wait until the writer is committing, then kill it somewhere in the middle of its work.
        first = proc.stdout.readline()
        time.sleep(rng.uniform(0, 0.15))
        proc.send_signal(signal.SIGKILL)
        out = first + proc.stdout.read()
        proc.wait()
        done = [int(line) for line in out.split()]
        acked += done
        start = (done[-1] + 1) if done else start
        report = hkstore.verify(path)
        assert report["ok"], report["problems"]
    assert len(acked) > 25
    store = hkstore.open(path)
    for i in acked:
        version = "root" if i % 2 else "dom"
        got = store.lookup(version, commit_keys(i))
        assert (got.order == 3).all() and got.version_names[got.version[0]] == version
        np.testing.assert_array_equal(got.values, commit_values(i))
        np.testing.assert_array_equal(store.get_pet(f"t{i}").tensors["w"], commit_values(i))
    # The newest acknowledged table, or the next one if its commit landed before the kill cut
    # off its acknowledgement.
    last = max(i for i in acked if i % 3 == 0)
    got = store.snapshot().position("dom")
    assert any(np.array_equal(got, position_table(j)) for j in (last, last + 3))
    assert store.snapshot().position("root") is None


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
def test_truncated_segment_is_caught_at_open(tmp_path, dtype):
    store, uni = corruptible_store(tmp_path / "s", dtype)
    seg = store.snapshot().version_segments("root")[0]
    store.close()
    size = os.path.getsize(seg.path)
    for cut in (10, sg.HEADER_SIZE + 5, size // 2, size - 1):
        with open(seg.path, "r+b") as f:
            data = f.read()
            f.truncate(cut)
        assert not hkstore.verify(str(tmp_path / "s"))["ok"]
        with pytest.raises(hkstore.CorruptError, match="truncated"):
            hkstore.open(tmp_path / "s")
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


def test_snapshot_lookups_are_stable_while_compaction_and_gc_run(tmp_path):
    store = make_store(tmp_path / "s")
    rng = np.random.default_rng(3)
    for i in range(6):
        keys = np.unique(rng.integers(1, V, (300, 3)).astype(np.uint32), axis=0)
        store.add_segment("dom", keys, rng.standard_normal((len(keys), 3, D)))
    reader = hkstore.open(tmp_path / "s")
    snap = reader.snapshot()
    windows = rng.integers(0, V, (2000, 3)).astype(np.uint32)
    expected = snap.lookup("dom", windows)
    errors = []

    def read():
        try:
            while not stop.is_set():
                got = snap.lookup("dom", windows)
                np.testing.assert_array_equal(got.values, expected.values)
                np.testing.assert_array_equal(got.version, expected.version)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    stop = threading.Event()
    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for version in ("dom", "root", "dom"):
        hkstore.compact(store, version)
        hkstore.gc(store)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(os.listdir(tmp_path / "s" / "segments")) == 2  # old files really were deleted
    fresh = hkstore.open(tmp_path / "s").lookup("dom", windows)
    np.testing.assert_array_equal(fresh.values, expected.values)


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
