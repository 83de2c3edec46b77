"""Decoder stores keep only each key's last slot (segment format 2, meta value_slots 1): the
same answers as the full layout at 1/n of the value bytes; old full-layout decoder stores still
open and serve the same generation."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
from formats.errors import CorruptError, FormatError
from formats.segment import FORMAT_LAST_SLOT, HEADER_SIZE, Segment, write_segment
from hkstore.errors import StoreError

D, VOCAB, PAD = 8, 12, 0


def _pair(tmp, n, dtype):
    """A last-slot decoder store and a full-layout one (value_slots n: the pre-format-2 layout)."""
    kw = {"d": D, "vocab_size": VOCAB, "n": n, "window": "causal", "architecture": "decoder", "pad_id": PAD,
          "dtype": dtype}
    return hkstore.create(tmp / "last", **kw), hkstore.create(tmp / "full", value_slots=n, **kw)


@st.composite
def _entries(draw):
    n = draw(st.integers(2, 4))
    count = draw(st.integers(1, 25))
    keys = draw(st.lists(st.tuples(*[st.integers(0, VOCAB - 1)] * n), min_size=count, max_size=count, unique=True))
    seed = draw(st.integers(0, 2**16))
    return n, np.array(keys, dtype=np.uint32), seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_entries(), st.sampled_from(["fp16", "int8"]), st.integers(0, 2**16))
def test_last_slot_store_answers_as_the_full_layout(tmp_path_factory, entries, dtype, qseed):
    """Random entries in a root (uni-grams for every id) and a branch, random query windows
    (hits, backoffs, tombstones): the same served version and order, and values equal to the full
    layout's last slot (int8: one scale per vector, so the last vector quantizes alike)."""
    n, keys, seed = entries
    tmp = tmp_path_factory.mktemp("slots")
    rng = np.random.default_rng(seed)
    last, full = _pair(tmp, n, dtype)
    uni = np.full((VOCAB, n), PAD, dtype=np.uint32)
    uni[:, n - 1] = np.arange(VOCAB)
    uni_values = rng.normal(size=(VOCAB, n, D)).astype(np.float32)
    values = rng.normal(size=(len(keys), n, D)).astype(np.float32)
    branch = keys[rng.random(len(keys)) < 0.5]
    branch_values = rng.normal(size=(len(branch), n, D)) if len(branch) else None
    for s in (last, full):
        s.add_segment("root", uni, uni_values)
        s.add_segment("root", keys, values)
        s.create_version("b", "root", keys=branch if len(branch) else None, values=branch_values)
    gone = keys[:1]
    for s in (last, full):
        s.delete("b", gone)
    q = np.random.default_rng(qseed).integers(0, VOCAB, size=(40, n)).astype(np.uint32)
    q = np.concatenate([q, keys, gone])
    for version in ("root", "b"):
        a, b = last.lookup(version, q), full.lookup(version, q)
        assert a.values.shape == (len(q), 1, D) and b.values.shape == (len(q), n, D)
        np.testing.assert_array_equal(a.version, b.version)
        np.testing.assert_array_equal(a.order, b.order)
        np.testing.assert_array_equal(a.values, b.values[:, -1:])
    for s in (last, full):
        s.close()


def test_segment_format_2_on_disk(tmp_path):
    keys = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.uint32)
    values = np.arange(2 * 1 * 4, dtype=np.float32).reshape(2, 1, 4)
    write_segment(tmp_path / "a.seg", keys, values)
    seg = Segment(tmp_path / "a.seg")
    raw = (tmp_path / "a.seg").read_bytes()
    assert int.from_bytes(raw[8:12], "little") == FORMAT_LAST_SLOT
    assert (seg.n, seg.slots, seg.d) == (3, 1, 4)
    seg.verify()
    np.testing.assert_array_equal(seg.read_values(np.array([1, 0]), _hashes(seg, [1, 0])),
                                  values[[1, 0]].astype(np.float16))
    # all n slots: format 1, as written before format 2 (no slot count in the header)
    write_segment(tmp_path / "b.seg", keys, np.zeros((2, 3, 4), np.float32))
    raw1 = (tmp_path / "b.seg").read_bytes()
    assert int.from_bytes(raw1[8:12], "little") == 1 and not any(raw1[192:248])
    with pytest.raises(FormatError):  # two of three slots is no format
        write_segment(tmp_path / "c.seg", keys, np.zeros((2, 2, 4), np.float32))
    # a flipped slot count is caught by the header checksum, never read as a shape
    bad = bytearray(raw)
    bad[192] = 3
    (tmp_path / "d.seg").write_bytes(bytes(bad))
    with pytest.raises(CorruptError):
        Segment(tmp_path / "d.seg")
    assert HEADER_SIZE == 256


def _hashes(seg, entries):
    from formats.xxh64 import hash_keys

    return hash_keys(np.asarray(seg.keys[entries]))


def test_store_refuses_mismatched_layouts(tmp_path):
    with pytest.raises(StoreError, match="value_slots"):
        hkstore.create(tmp_path / "e", d=D, vocab_size=VOCAB, value_slots=1)  # an encoder store keeps every slot
    with pytest.raises(StoreError, match="value_slots"):
        hkstore.create(tmp_path / "f", d=D, vocab_size=VOCAB, n=3, window="causal", architecture="decoder",
                       value_slots=2)
    s = hkstore.create(tmp_path / "g", d=D, vocab_size=VOCAB, n=3, window="causal", architecture="decoder")
    with pytest.raises(StoreError, match="values must have shape"):
        s.add_segment("root", np.zeros((1, 3), np.uint32), np.zeros((1, 2, D), np.float32))
    s.add_segment("root", np.zeros((1, 3), np.uint32), np.ones((1, 1, D), np.float32))  # the stored form is fine
    s.close()
    # a full-layout segment dropped into a last-slot store is damage, not a shape to guess
    other = hkstore.create(tmp_path / "h", d=D, vocab_size=VOCAB, n=3, window="causal", architecture="decoder",
                           value_slots=3)
    other.add_segment("root", np.zeros((1, 3), np.uint32), np.ones((1, 3, D), np.float32))
    other.close()
    (seg_g,) = os.listdir(tmp_path / "g" / "segments")
    (seg_h,) = os.listdir(tmp_path / "h" / "segments")
    os.replace(tmp_path / "h" / "segments" / seg_h, tmp_path / "g" / "segments" / seg_g)
    with pytest.raises(CorruptError, match="slots"):  # when read: the store itself still opens
        hkstore.open(tmp_path / "g").lookup("root", np.zeros((1, 3), np.uint32))


def test_decoder_store_bytes_and_generation_against_the_old_layout(tmp_path):
    """The same decoder store built in both layouts: about 1/n of the segment bytes, the same
    greedy generation, and compaction / diff / verify work on the new one."""
    from runtime.construct.plot import build_root
    from runtime.gen.plot_decode import PlotDecoder
    from runtime.model.decoder import load_decoder
    from runtime.model.tiny_decoder import make_tiny_decoder
    from runtime.plot.causal import KeyValuer

    texts = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
             "storage engines keep tables of vectors , versions and packs ."]
    dec = load_decoder(make_tiny_decoder(tmp_path / "m", texts, d=32, layers=4, max_len=48), lower_layers=2)
    out = {}
    for name, slots in (("new", None), ("old", 3)):
        st_ = hkstore.create(tmp_path / name, d=32, vocab_size=dec.config.vocab_size, n=3, window="causal",
                             lower_layers=2, architecture="decoder", pad_id=0, value_slots=slots,
                             tokenizer_fingerprint=dec.tokenizer_fingerprint())
        build_root(st_, KeyValuer(dec), dec.tokenize(texts), progress=False)
        seg_bytes = sum(os.path.getsize(os.path.join(tmp_path / name / "segments", f))
                        for f in os.listdir(tmp_path / name / "segments"))
        gen = PlotDecoder(st_.snapshot(), "root", dec)
        prompts = dec.tokenize(["the cat", "a dog ran in", "storage"])
        out[name] = (seg_bytes, [gen.greedy(p, 8) for p in prompts], st_)
    assert "value_slots" not in out["old"][2].meta and out["new"][2].meta["value_slots"] == 1
    assert out["new"][1] == out["old"][1]
    assert out["new"][0] < 0.5 * out["old"][0]  # n = 3: values are most of a segment
    new = out["new"][2]
    keys = np.array(dec.tokenize(["the cat sat on"])[0][:3], dtype=np.uint32)[None]
    new.create_version("b", "root", keys=keys, values=np.ones((1, 3, 32), np.float32))
    new.add_segment("b", keys, 2 * np.ones((1, 3, 32), np.float32))
    before = new.lookup("b", keys)
    hkstore.compact(new, "b")
    after = new.lookup("b", keys)
    np.testing.assert_array_equal(before.values, after.values)
    assert float(after.values[0, 0, 0]) == 2.0
    assert hkstore.verify(str(tmp_path / "new"))["ok"]
    snap = new.snapshot()
    plot = hkstore.diff(snap, "root", snap, "b")["plot"]  # the branch's one key overrides the root's trigram
    assert plot["changed"] == 1 or plot.get("overridden") == 1, plot
    for _, _, s in out.values():
        s.close()
