"""The compiled fast path (formats/_probe.c via formats/accel.py) against the NumPy reference.

Property tests: the C XXH64 and key hash equal the xxhash library; the C probe equals the
NumPy probe on random segments (n = 2..5, empty segments, full-collision clusters, absent keys);
whole lookups (versions, tombstones, several segments, backoff, misses, fp16 and int8) are
identical with and without the accelerator, bit for bit. Without a built extension only the
NumPy-side checks run.
"""

import os
import struct
import tempfile

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
from formats import accel
from formats import manifest as mf
from formats import segment as sg
from formats.xxh64 import hash_keys

needs_accel = pytest.mark.skipif(not accel.BUILT, reason=f"C accelerator not built: {accel.IMPORT_ERROR}")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def both_paths(fn):
    """fn() on the NumPy path and on the C path."""
    with accel.using(False):
        ref = fn()
    with accel.using(True):
        got = fn()
    return ref, got


def test_env_switch_and_description():
    assert isinstance(accel.describe(), str)
    with accel.using(False):
        assert accel.ext is None and not accel.HAVE_ACCEL
        assert accel.describe().startswith("NumPy")
    if accel.BUILT and not accel.DISABLED_BY_ENV:
        assert accel.ext is not None and accel.HAVE_ACCEL


# -- hashes ------------------------------------------------------------------------------------


@needs_accel
@SETTINGS
@given(data=st.binary(max_size=300), seed=st.integers(0, 2**64 - 1))
def test_xxh64_equals_xxhash_library(data, seed):
    assert accel._compiled.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@needs_accel
def test_xxh64_every_length_and_alignment():
    blob = np.random.default_rng(0).integers(0, 256, 400, dtype=np.uint8).tobytes()
    for length in range(0, 130):
        for start in (0, 1, 3, 7):
            chunk = blob[start:start + length]
            assert accel._compiled.xxh64(chunk) == xxhash.xxh64_intdigest(chunk)
            assert accel._compiled.xxh64(chunk, 2**63 + 5) == xxhash.xxh64_intdigest(chunk, 2**63 + 5)


@needs_accel
@SETTINGS
@given(n=st.integers(1, 12), m=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
def test_key_hash_equals_xxhash_and_numpy(n, m, seed):
    keys = np.random.default_rng(seed).integers(0, 2**32, (m, n), dtype=np.uint64).astype(np.uint32)
    out = np.empty(m, dtype=np.uint64)
    accel._compiled.hash_keys(keys, n, out)
    assert out.tolist() == [xxhash.xxh64_intdigest(k.astype("<u4").tobytes()) for k in keys]
    np.testing.assert_array_equal(out, hash_keys(keys))


# -- probe -------------------------------------------------------------------------------------


def colliding_keys(rng, count, n, capacity, home=None, vocab=2**32):
    """`count` distinct keys whose home slot (hash & (capacity - 1)) is the same."""
    found = {}
    while True:
        cand = rng.integers(0, vocab, (max(4096, 64 * capacity), n), dtype=np.uint64).astype(np.uint32)
        slots = hash_keys(cand) & np.uint64(capacity - 1)
        if home is None:
            home = int(slots[0])
        for k in cand[slots == np.uint64(home)]:
            found.setdefault(k.tobytes(), k)
        if len(found) >= count:
            return np.array(list(found.values())[:count], dtype=np.uint32).reshape(count, n), home


def write_empty_segment(path, n, d):
    """A valid segment of 0 entries, laid out as FORMAT.md §3 says (write_segment refuses
    count 0: its row-checksum step cannot reshape an empty array)."""
    blobs = {"index": np.zeros(sg._capacity(0), "<u4").tobytes()}
    table, offset = [], sg.HEADER_SIZE
    for name in sg.SECTIONS:
        raw = blobs.get(name, b"")
        table.append((offset, len(raw), xxhash.xxh64_intdigest(raw), raw))
        offset += -(-len(raw) // sg.ALIGN) * sg.ALIGN
    header = bytearray(sg.HEADER_SIZE)
    sg._HEAD.pack_into(header, 0, sg.MAGIC, sg.FORMAT_VERSION, n, d, sg.DTYPES["fp16"], 0, sg._capacity(0), 0)
    for i, (off, length, digest, _) in enumerate(table):
        sg._SECTION.pack_into(header, sg._HEAD.size + i * sg._SECTION.size, off, length, digest)
    struct.pack_into("<Q", header, sg.HEADER_SIZE - 8, xxhash.xxh64_intdigest(bytes(header[:sg.HEADER_SIZE - 8])))
    with open(path, "wb") as f:
        f.write(header)
        for off, length, _, raw in table:
            f.seek(off)
            f.write(raw)
        f.truncate(table[-1][0] + table[-1][1])


def make_segment(path, keys, values):
    if len(keys):
        sg.write_segment(path, keys, values)
    else:
        write_empty_segment(path, keys.shape[1], values.shape[2])
    return sg.Segment(path)


def segment_case(rng, n, count, cluster, vocab):
    """Keys of a segment (`cluster` of them all at one home slot) and queries: every stored key,
    absent keys at the cluster's home slot, random absent keys, some duplicated."""
    capacity = sg._capacity(count)
    parts = []
    home = None
    if cluster:
        ck, home = colliding_keys(rng, min(cluster, count) + 6, n, capacity)
        parts.append(ck[:min(cluster, count)])
        absent_cluster = ck[min(cluster, count):]
    else:
        absent_cluster = np.zeros((0, n), np.uint32)
    rest = count - sum(len(p) for p in parts)
    if rest:
        r = rng.integers(0, vocab, (rest * 3 + 8, n), dtype=np.uint64).astype(np.uint32)
        parts.append(r)
    keys = np.unique(np.concatenate(parts) if parts else np.zeros((0, n), np.uint32), axis=0)
    if cluster:  # keep the whole cluster, fill up with the others
        ck = parts[0]
        others = keys[~(keys[:, None, :] == ck[None, :, :]).all(axis=2).any(axis=1)]
        keys = np.concatenate([ck, others[:count - len(ck)]])
    keys = keys[:count]
    keys = keys[rng.permutation(len(keys))]
    stored = {k.tobytes() for k in keys}
    absent = rng.integers(0, vocab, (20, n), dtype=np.uint64).astype(np.uint32)
    absent = absent[[a.tobytes() not in stored for a in absent]]
    absent_cluster = absent_cluster[[a.tobytes() not in stored for a in absent_cluster]]
    queries = np.concatenate([keys, absent_cluster, absent, keys[:5]])
    return keys, queries[rng.permutation(len(queries))]


@needs_accel
@SETTINGS
@given(n=st.integers(2, 5), count=st.integers(0, 300), cluster=st.sampled_from([0, 0, 5, 40]),
       vocab=st.sampled_from([3, 50, 2**32]), seed=st.integers(0, 2**32 - 1), pass_hashes=st.booleans())
def test_c_probe_equals_numpy_probe(n, count, cluster, vocab, seed, pass_hashes):
    rng = np.random.default_rng(seed)
    keys, queries = segment_case(rng, n, count, cluster, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "a.seg")
        values = rng.standard_normal((len(keys), n, 2)).astype(np.float16)
        seg = make_segment(path, keys, values)
        hashes = hash_keys(queries) if pass_hashes else None
        ref, got = both_paths(lambda: seg.probe(queries, hashes))
        np.testing.assert_array_equal(got, ref)
        assert got.dtype == ref.dtype == np.int64
        # the reference itself: every stored key is found at its own entry, the rest are absent
        where = {k.tobytes(): i for i, k in enumerate(keys)}
        assert got.tolist() == [where.get(q.tobytes(), -1) for q in queries]
        # the raw C call also hands back the hashes it computed
        out, h = np.empty(len(queries), np.int64), np.empty(len(queries), np.uint64)
        accel._compiled.probe(seg.index, seg.keys, n, seg.max_probe, queries, out, h, True)
        np.testing.assert_array_equal(out, ref)
        assert h.tolist() == [xxhash.xxh64_intdigest(q.astype("<u4").tobytes()) for q in queries]
        if count:
            seg.verify()  # verify probes every key through the index (C path here)


@needs_accel
def test_full_cluster_needs_max_probe_plus_one_slots():
    rng = np.random.default_rng(7)
    keys, _ = colliding_keys(rng, 30, 3, sg._capacity(30))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.seg")
        sg.write_segment(path, keys, np.zeros((30, 3, 1), np.float16))
        seg = sg.Segment(path)
        assert seg.max_probe == 29
        ref, got = both_paths(lambda: seg.probe(keys))
        assert got.tolist() == ref.tolist() == list(range(30))
        # a truncated probe budget must behave like the reference's: keys past it are not found
        seg.max_probe = 10
        ref, got = both_paths(lambda: seg.probe(keys))
        np.testing.assert_array_equal(got, ref)
        assert (got[:11] == np.arange(11)).all() and (got[11:] == -1).all()


@needs_accel
def test_probe_of_empty_segment_and_empty_query():
    with tempfile.TemporaryDirectory() as tmp:
        seg = make_segment(os.path.join(tmp, "e.seg"), np.zeros((0, 4), np.uint32), np.zeros((0, 4, 3), np.float16))
        seg.verify()
        q = np.arange(12, dtype=np.uint32).reshape(3, 4)
        ref, got = both_paths(lambda: seg.probe(q))
        assert got.tolist() == ref.tolist() == [-1, -1, -1]
        ref, got = both_paths(lambda: seg.probe(q[:0]))
        assert len(got) == len(ref) == 0
        out, h = np.empty(3, np.int64), np.empty(3, np.uint64)
        accel._compiled.probe(seg.index, seg.keys, 4, seg.max_probe, q, out, h, True)
        assert out.tolist() == [-1, -1, -1]


def rewrite_section(path, section, data):
    """Replace a section's bytes and fix its checksum and the header's: damage no checksum sees."""
    seg = sg.Segment(path)
    off, length, _ = seg.sections[section]
    i = sg.SECTIONS.index(section)
    seg.close()
    del seg
    with open(path, "r+b") as f:
        header = bytearray(f.read(sg.HEADER_SIZE))
        assert len(data) == length
        f.seek(off)
        f.write(data)
        sg._SECTION.pack_into(header, sg._HEAD.size + i * sg._SECTION.size, off, length, xxhash.xxh64_intdigest(data))
        struct.pack_into("<Q", header, sg.HEADER_SIZE - 8, xxhash.xxh64_intdigest(bytes(header[:sg.HEADER_SIZE - 8])))
        f.seek(0)
        f.write(header)


def record_identity(store_path, seg_path):
    """Make the manifest record the rewritten segment's identity: damage the identity check
    does not see either, so what comes after it is tested."""
    manifest = mf.load(store_path)
    manifest["files"][os.path.basename(seg_path)] = sg.Segment(seg_path).identity()
    with open(os.path.join(store_path, mf.current_name(store_path)), "wb") as f:
        f.write(mf.encode(manifest))


@needs_accel
def test_index_naming_a_missing_entry_is_an_error_not_a_crash(tmp_path):
    st_ = hkstore.create(tmp_path / "s", d=2, vocab_size=8)
    uni = np.zeros((8, 3), np.uint32)
    uni[:, 1] = np.arange(8)
    st_.add_segment("root", uni, np.ones((8, 3, 2), np.float16))
    seg = st_.snapshot().version_segments("root")[0]
    path = seg.path
    index = np.array(seg.index)
    st_.close()
    index[index != 0] = 1000  # every slot names entry 999 of 8
    rewrite_section(path, "index", index.astype("<u4").tobytes())
    record_identity(str(tmp_path / "s"), path)
    with accel.using(True):
        with pytest.raises(hkstore.CorruptError, match="past its 8 entries"):
            hkstore.open(tmp_path / "s").lookup("root", uni)
        with pytest.raises(hkstore.CorruptError, match="past its 8 entries"):
            sg.Segment(path).probe(uni)


# -- gather and row checks ---------------------------------------------------------------------


@needs_accel
@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_read_values_equal_and_checked_on_both_paths(tmp_path, dtype):
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(0, 50, (200, 3)).astype(np.uint32), axis=0)
    values = rng.standard_normal((len(keys), 3, 17)).astype(np.float32)
    path = str(tmp_path / "v.seg")
    sg.write_segment(path, keys, values, dtype=dtype)
    entries = rng.integers(0, len(keys), 500)
    hashes = hash_keys(keys[entries])
    ref, got = both_paths(lambda: sg.Segment(path).read_values(entries, hashes))
    assert got.dtype == ref.dtype == (np.float16 if dtype == "fp16" else np.float32)
    np.testing.assert_array_equal(got, ref)
    # out / out_rows: rows land where asked, the rest is untouched
    for enabled in (False, True):
        with accel.using(enabled):
            out = np.full((600, 3, 17), 7, dtype=ref.dtype)
            rows = rng.permutation(600)[:500]
            sg.Segment(path).read_values(entries, hashes, out=out, out_rows=rows)
            np.testing.assert_array_equal(out[rows], ref)
            rest = np.setdiff1d(np.arange(600), rows)
            assert (out[rest] == 7).all()
    # a damaged value row is caught on first return, on either path
    seg = sg.Segment(path)
    off = seg.sections["values"][0] + int(entries[0]) * seg.values[0].nbytes + 5
    del seg
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    for enabled in (False, True):
        with accel.using(enabled):
            with pytest.raises(hkstore.CorruptError, match=f"value row {entries[0]} fails"):
                sg.Segment(path).read_values(entries, hashes)
            with pytest.raises(hkstore.CorruptError, match=f"value row {entries[0]} fails"):
                sg.Segment(path).check_rows(entries)


# -- whole lookups -----------------------------------------------------------------------------


def build_store(path, rng, n, kind, dtype, pad, vocab, versions, segs_per_version, with_misses):
    """A random store: a root (uni-grams, bi-grams, full keys; some uni-grams missing when
    with_misses), a chain and a side branch of versions, several segments each, overrides and
    tombstones (root tombstones too, via add_segment)."""
    lo = (n - 1) // 2 if kind == "centered" else n - 1
    d = 3
    st_ = hkstore.create(path, d=d, vocab_size=vocab, n=n, window=kind, dtype=dtype, pad_id=pad)
    ids = np.array([t for t in range(vocab) if t != pad] + [pad], dtype=np.uint32)

    def rand_keys(count):
        k = rng.choice(ids, (count, n)).astype(np.uint32)
        # some keys padded on one side (the chain's lower orders)
        mask = rng.random((count, n)) < 0.35
        mask[:, lo] = False
        k[mask] = pad
        return np.unique(k, axis=0)

    uni = np.full((vocab, n), pad, dtype=np.uint32)
    uni[:, lo] = np.arange(vocab)
    if with_misses:
        uni = uni[rng.random(vocab) < 0.7]
    root = np.unique(np.concatenate([uni, rand_keys(30)]), axis=0)
    st_.add_segment("root", root, rng.standard_normal((len(root), n, d)))
    if segs_per_version > 1:
        extra = rand_keys(20)
        st_.add_segment("root", extra, rng.standard_normal((len(extra), n, d)),
                        tombstone=rng.random(len(extra)) < 0.3)
    names = ["root"]
    for v in range(1, versions):
        name = f"v{v}"
        st_.create_version(name, parent=names[-1] if v % 3 else "root")
        names.append(name)
        for _ in range(segs_per_version):
            k = rand_keys(int(rng.integers(1, 25)))
            st_.add_segment(name, k, rng.standard_normal((len(k), n, d)))
            if rng.random() < 0.6:
                own = k[rng.random(len(k)) < 0.4]
                st_.delete(name, np.concatenate([own, rand_keys(3)]))
    return st_, names, rand_keys


@needs_accel
@SETTINGS
@given(n=st.integers(2, 5), kind=st.sampled_from(["centered", "causal"]), dtype=st.sampled_from(["fp16", "int8"]),
       pad=st.sampled_from([0, 1]), vocab=st.integers(3, 9), versions=st.integers(1, 4),
       segs_per_version=st.integers(1, 3), with_misses=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_lookups_identical_with_and_without_accelerator(n, kind, dtype, pad, vocab, versions, segs_per_version,
                                                        with_misses, seed):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        st_, names, rand_keys = build_store(tmp + "/s", rng, n, kind, dtype, pad, vocab, versions, segs_per_version,
                                            with_misses)
        windows = np.concatenate([rand_keys(60), rng.integers(0, vocab, (40, n)).astype(np.uint32)])
        windows = windows[rng.permutation(len(windows))]
        for version in names:
            # fresh readers, so each path also does its own first-use checks
            ref, got = both_paths(lambda: hkstore.open(tmp + "/s").lookup(version, windows))
            assert got.values.dtype == ref.values.dtype
            assert got.values.shape == ref.values.shape == (len(windows), n, 3)
            np.testing.assert_array_equal(got.values.view(np.uint8), ref.values.view(np.uint8))
            np.testing.assert_array_equal(got.version, ref.version)
            np.testing.assert_array_equal(got.order, ref.order)
            assert got.version.dtype == ref.version.dtype and got.order.dtype == ref.order.dtype
            assert got.version_names == ref.version_names
            assert ((got.order == 0) == (got.version == -1)).all()
            assert (got.values[got.order == 0] == 0).all()
            # the same reader again: warm path, row checks already done
            st_.refresh()
            again, _ = both_paths(lambda: st_.lookup(version, windows))
            np.testing.assert_array_equal(again.values.view(np.uint8), ref.values.view(np.uint8))
        ref, got = both_paths(lambda: st_.lookup(names[-1], windows[:0]))
        assert got.values.shape == ref.values.shape == (0, n, 3)
        st_.close()


@needs_accel
def test_lookup_checks_only_the_segments_it_reaches(tmp_path):
    """FORMAT.md §3: a segment's index and keys are checked the first time a lookup probes it. A
    newer segment that serves every window leaves the older one unchecked, on both paths."""
    st_ = hkstore.create(tmp_path / "s", d=2, vocab_size=6)
    uni = np.zeros((6, 3), np.uint32)
    uni[:, 1] = np.arange(6)
    st_.add_segment("root", uni, np.ones((6, 3, 2)))
    st_.add_segment("root", uni, 2 * np.ones((6, 3, 2)))
    st_.close()
    for enabled in (False, True):
        with accel.using(enabled):
            r = hkstore.open(tmp_path / "s")
            res = r.lookup("root", uni)
            assert (res.values == 2).all()
            old, new = r.snapshot().version_segments("root")
            assert new._checked and not old._checked


@needs_accel
def test_bad_window_shape_is_rejected_on_both_paths(tmp_path):
    st_ = hkstore.create(tmp_path / "s", d=2, vocab_size=4)
    uni = np.zeros((4, 3), np.uint32)
    uni[:, 1] = np.arange(4)
    st_.add_segment("root", uni, np.ones((4, 3, 2)))
    for enabled in (False, True):
        with accel.using(enabled):
            with pytest.raises(ValueError, match="windows must have shape"):
                st_.lookup("root", np.zeros((3, 4), np.uint32))


# -- warm: every row checked up front ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_warm_checks_rows_like_first_return_on_both_paths(tmp_path, dtype):
    """Segment.warm marks exactly the rows a lookup would accept, on both paths; a damaged row
    stays unmarked, so a lookup that returns it still raises, and the other rows are served."""
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, 60, (300, 3)).astype(np.uint32), axis=0)
    values = rng.standard_normal((len(keys), 3, 19)).astype(np.float32)
    path = str(tmp_path / "w.seg")
    sg.write_segment(path, keys, values, dtype=dtype)
    bad = int(rng.integers(0, len(keys)))
    seg = sg.Segment(path)
    off = seg.sections["values"][0] + bad * seg.values[0].nbytes + 3
    ref = seg.read_values(np.arange(len(keys)), hash_keys(keys))  # before the damage
    del seg
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x04]))
    good = np.setdiff1d(np.arange(len(keys)), [bad])
    for enabled in ([False, True] if accel.BUILT else [False]):
        with accel.using(enabled):
            seg = sg.Segment(path)
            assert seg.warm(chunk=64) == 1
            assert seg._row_ok.sum() == len(keys) - 1 and not seg._row_ok[bad]
            assert seg.warm() == 1  # idempotent: checked rows are not checked again
            np.testing.assert_array_equal(seg.read_values(good, hash_keys(keys[good])), ref[good])
            with pytest.raises(hkstore.CorruptError, match=f"value row {bad} fails"):
                seg.read_values(np.array([bad]), hash_keys(keys[[bad]]))


def test_store_warm_then_lookups_identical(tmp_path):
    """Store.warm changes no answer: lookups after it equal the reference path's."""
    rng = np.random.default_rng(9)
    st_ = hkstore.create(tmp_path / "s", d=4, vocab_size=16)
    uni = np.zeros((16, 3), np.uint32)
    uni[:, 1] = np.arange(16)
    tri = np.unique(rng.integers(1, 16, (80, 3)).astype(np.uint32), axis=0)
    keys = np.concatenate([uni, tri])
    st_.add_segment("root", keys, rng.standard_normal((len(keys), 3, 4)).astype(np.float16))
    st_.close()
    windows = rng.integers(0, 16, (500, 3)).astype(np.uint32)
    with accel.using(False):
        ref = hkstore.open(tmp_path / "s").lookup("root", windows)
    for enabled in ([False, True] if accel.BUILT else [False]):
        with accel.using(enabled):
            s = hkstore.open(tmp_path / "s")
            assert s.warm() == 0
            got = s.lookup("root", windows)
            np.testing.assert_array_equal(got.values, ref.values)
            np.testing.assert_array_equal(got.order, ref.order)
            # in a thread, beside lookups
            s = hkstore.open(tmp_path / "s")
            t = s.warm(background=True)
            got = s.lookup("root", windows)
            t.join(30)
            assert not t.is_alive()
            assert s.snapshot().version_segments("root")[0]._row_ok.all()
            np.testing.assert_array_equal(got.values, ref.values)
            np.testing.assert_array_equal(s.lookup("root", windows).values, ref.values)


@needs_accel
@SETTINGS
@given(n=st.integers(2, 4), kind=st.sampled_from(["centered", "causal"]), pad=st.sampled_from([0, 1]),
       vocab=st.integers(3, 8), versions=st.integers(1, 3), with_misses=st.booleans(), pool=st.integers(1, 12),
       m=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_dedupe_of_repeated_windows_matches_reference(n, kind, pad, vocab, versions, with_misses, pool, m, seed):
    """The C resolve searches each distinct window once and copies its answer to the repeats: a
    batch drawn with heavy repetition (Zipf-like, hits, backoffs and misses alike) gets, window
    for window, the reference path's answer."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        st_, names, rand_keys = build_store(tmp + "/s", rng, n, kind, "fp16", pad, vocab, versions, 2, with_misses)
        distinct = np.concatenate([rand_keys(pool), rng.integers(0, vocab, (pool, n)).astype(np.uint32)])
        weights = 1.0 / np.arange(1, len(distinct) + 1) ** 1.1
        windows = distinct[rng.choice(len(distinct), m, p=weights / weights.sum())]
        for version in names:
            ref, got = both_paths(lambda: hkstore.open(tmp + "/s").lookup(version, windows))
            np.testing.assert_array_equal(got.values.view(np.uint8), ref.values.view(np.uint8))
            np.testing.assert_array_equal(got.version, ref.version)
            np.testing.assert_array_equal(got.order, ref.order)
        st_.close()


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 400), background=st.booleans())
def test_warm_huge_page_copies_change_no_answer(seed, m, background):
    """warm() moves a big segment's index and keys into huge-page memory: read-only copies, equal
    byte for byte, on a huge-page boundary; lookups after it (C and NumPy, repeats, backoffs and
    misses) equal the reference path's on the file mapping. The threshold and page size are
    shrunk so a small store takes the path."""
    from formats import hugepages

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(hugepages, "HUGE_PAGE", 4096)
        mp.setattr(hugepages, "available", lambda: True)
        st_ = hkstore.create(tmp + "/s", d=4, vocab_size=40)
        uni = np.zeros((30, 3), np.uint32)
        uni[:, 1] = np.arange(30)  # id 30..39 are stored nowhere: misses
        tri = np.unique(rng.integers(1, 30, (1500, 3)).astype(np.uint32), axis=0)
        keys = np.concatenate([uni, tri])
        st_.add_segment("root", keys, rng.standard_normal((len(keys), 3, 4)).astype(np.float16))
        st_.close()
        distinct = np.concatenate([tri[rng.integers(0, len(tri), 50)], rng.integers(0, 40, (50, 3)).astype(np.uint32)])
        windows = distinct[rng.zipf(1.3, m) % len(distinct)]
        with accel.using(False):
            ref = hkstore.open(tmp + "/s").lookup("root", windows)
        for enabled in ([False, True] if accel.BUILT else [False]):
            with accel.using(enabled):
                s = hkstore.open(tmp + "/s")
                seg = s.snapshot().version_segments("root")[0]
                index, keys_map = np.array(seg.index), np.array(seg.keys)
                if background:
                    s.warm(background=True).join(30)
                else:
                    assert s.warm() == 0
                assert seg._huge and not seg.index.flags.writeable and not seg.keys.flags.writeable
                assert seg.index.ctypes.data % 4096 == 0 and seg.keys.ctypes.data % 4096 == 0
                np.testing.assert_array_equal(seg.index, index)
                np.testing.assert_array_equal(seg.keys, keys_map)
                got = s.lookup("root", windows)
                np.testing.assert_array_equal(got.values.view(np.uint8), ref.values.view(np.uint8))
                np.testing.assert_array_equal(got.order, ref.order)
                np.testing.assert_array_equal(got.version, ref.version)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
@pytest.mark.parametrize("shares, reread, copied", [
    ([0.9], False, False),       # the file was already cached in huge folios
    ([0.0, 0.9], True, False),   # small folios, read again as huge ones
    ([0.0, 0.0], True, True),    # the kernel gives the file no huge pages: copy the search arrays
])
def test_warm_puts_the_file_mapping_in_huge_pages_before_copying(shares, reread, copied):
    """warm() prefers the segment's own file mapping in huge pages: it reads the file again only
    where the mapping is not huge yet, and copies the index and keys only where that fails.
    Whichever way, lookups give the reference path's answers."""
    from formats import hugepages

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(hugepages, "HUGE_PAGE", 4096)
        mp.setattr(hugepages, "available", lambda: True)
        st_ = hkstore.create(tmp + "/s", d=8, vocab_size=50)
        keys = np.unique(rng.integers(0, 50, (3000, 3)).astype(np.uint32), axis=0)
        keys = np.concatenate([np.stack([np.zeros(50, np.uint32), np.arange(50, dtype=np.uint32), np.zeros(50, np.uint32)], 1), keys])
        keys = np.unique(keys, axis=0)
        st_.add_segment("root", keys, rng.standard_normal((len(keys), 3, 8)).astype(np.float16))
        st_.close()
        windows = keys[rng.integers(0, len(keys), 500)]
        with accel.using(False):
            ref = hkstore.open(tmp + "/s").lookup("root", windows)
        reported, rereads = list(shares), []
        mp.setattr(hugepages, "pmd_share", lambda mm: reported.pop(0) if len(reported) > 1 else reported[0])
        real_reread = hugepages.reread
        mp.setattr(hugepages, "reread", lambda mm, path: (rereads.append(path), real_reread(mm, path)))
        s = hkstore.open(tmp + "/s")
        seg = s.snapshot().version_segments("root")[0]
        file_index = seg.index
        assert s.warm() == 0
        assert bool(rereads) == reread and (seg.index is not file_index) == copied
        if reread:
            assert rereads == [seg.path]
        got = s.lookup("root", windows)
        np.testing.assert_array_equal(got.values.view(np.uint8), ref.values.view(np.uint8))
        np.testing.assert_array_equal(got.order, ref.order)


def test_file_pmd_bytes_reads_the_mapping_that_holds_the_address():
    """The smaps parser takes FilePmdMapped from the one mapping whose range holds the address,
    not from a neighbour's, and 0 for an address no mapping holds."""
    from formats import hugepages

    smaps = """7f0000000000-7f0000400000 r--s 00000000 fd:00 12 /data/a.seg
Size:               4096 kB
FilePmdMapped:      2048 kB
VmFlags: rd sh mr mw me ms hg
7f0000400000-7f0000c00000 r--s 00000000 fd:00 13 /data/b.seg
Size:               8192 kB
FilePmdMapped:      6144 kB
VmFlags: rd sh mr mw me ms
""".splitlines(keepends=True)
    assert hugepages.file_pmd_bytes(smaps, 0x7F0000000000) == 2048 * 1024
    assert hugepages.file_pmd_bytes(smaps, 0x7F00003FFFFF) == 2048 * 1024
    assert hugepages.file_pmd_bytes(smaps, 0x7F0000400000) == 6144 * 1024
    assert hugepages.file_pmd_bytes(smaps, 0x7F0000C00000) == 0
