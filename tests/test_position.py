"""Position tables (FORMAT.md section 4): the store's side (commit, inheritance, integrity,
gc) and the runtime's (retrieve adds the table in force; fit_position's least-squares rows)."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hkstore
from runtime.construct import plot
from runtime.plot.retrieve import retrieve
from runtime.plot.window import windowed_lower
from test_plot import tiny  # noqa: F401  (the fixture: a tiny random BERT and its corpus)
from test_store_durability import D, V, make_store


def small_store(path):
    """A root with every uni-gram, "dom" under it and "sub" under "dom"."""
    store = make_store(path)
    store.create_version("sub", "dom")
    return store


def table(seed, rows=6):
    return np.random.default_rng(seed).standard_normal((rows, D)).astype(np.float32)


def test_tables_are_inherited_overridden_and_dropped(tmp_path):
    store = small_store(tmp_path / "s")
    assert store.snapshot().position("sub") is None
    store.set_position("root", table(1))
    before = store.snapshot()
    store.set_position("dom", table(2, rows=9))
    snap = store.snapshot()
    np.testing.assert_array_equal(snap.position("root"), table(1))
    np.testing.assert_array_equal(snap.position("dom"), table(2, rows=9))
    np.testing.assert_array_equal(snap.position("sub"), table(2, rows=9))  # nearest ancestor's
    np.testing.assert_array_equal(before.position("sub"), table(1))  # snapshots do not move
    store.set_position("dom", None)
    np.testing.assert_array_equal(store.snapshot().position("sub"), table(1))
    store.close()
    reopened = hkstore.open(tmp_path / "s")
    np.testing.assert_array_equal(reopened.snapshot().position("dom"), table(1))
    assert hkstore.verify(tmp_path / "s")["checked"]["positions"] == 1


def test_bad_tables_are_refused(tmp_path):
    store = small_store(tmp_path / "s")
    for bad in (np.zeros((4, D + 1)), np.zeros((0, D)), np.zeros(D), np.full((2, D), np.nan)):
        with pytest.raises(hkstore.StoreError):
            store.set_position("root", bad)
    with pytest.raises(hkstore.UnknownVersion):
        store.set_position("nope", table(0))
    with pytest.raises(hkstore.StoreError, match="read-only"):
        hkstore.open(tmp_path / "s").set_position("root", table(0))


def _pos_file(path, store, version):
    return os.path.join(path, "positions", store.snapshot().versions[store.snapshot().version_index(version)]["position"]["file"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_damaged_table_is_an_error_never_an_answer(tmp_path, damage):
    store = small_store(tmp_path / "s")
    store.set_position("dom", table(3))
    path = _pos_file(str(tmp_path / "s"), store, "dom")
    store.close()
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[:-4]
    else:
        data += b"\0\0\0\0"
    open(path, "wb").write(bytes(data))
    with pytest.raises(hkstore.CorruptError, match="position table"):
        hkstore.open(tmp_path / "s").snapshot().position("sub")
    report = hkstore.verify(tmp_path / "s")
    assert not report["ok"] and any("position table" in p for p in report["problems"])


def test_gc_removes_replaced_tables_but_an_old_snapshot_still_reads_its_own(tmp_path):
    store = small_store(tmp_path / "s")
    store.set_position("dom", table(4))
    old_file = _pos_file(str(tmp_path / "s"), store, "dom")
    old = store.snapshot()
    store.set_position("dom", table(5))
    out = hkstore.gc(store)
    assert os.path.join("positions", os.path.basename(old_file)) in out["removed"]
    assert not os.path.exists(old_file)
    np.testing.assert_array_equal(old.position("dom"), table(4))  # opened before gc ran
    np.testing.assert_array_equal(store.snapshot().position("dom"), table(5))
    assert hkstore.gc(store)["removed"] == []


# -- the runtime side --------------------------------------------------------------------------


@given(st.lists(st.lists(st.integers(1, V - 1), min_size=1, max_size=9), min_size=1, max_size=4),
       st.integers(1, 12), st.sampled_from(["root", "dom", "sub"]))
@settings(max_examples=40, deadline=None)
def test_retrieve_adds_the_table_in_force_at_real_positions(tmp_path_factory, seqs, rows, version):
    path = tmp_path_factory.mktemp("p") / "s"
    store = small_store(path)
    plain, mask, _ = retrieve(store.snapshot(), version, seqs)
    store.set_position("dom", table(6, rows))
    got, _, _ = retrieve(store.snapshot(), version, seqs)
    expected = plain.clone()
    if version != "root":  # root has no table; dom and sub use dom's
        for b, s in enumerate(seqs):
            for i in range(min(len(s), rows)):
                expected[b, i] += torch.from_numpy(table(6, rows)[i])
    torch.testing.assert_close(got, expected)
    assert not got[~mask].any()
    store.close()


def test_fit_position_is_the_mean_residual_and_brings_inputs_closer(tmp_path, tiny):
    model_path, enc, seqs = tiny
    meta = hkstore.model_meta(model_path)
    store = hkstore.create(tmp_path / "s", d=meta["d"], vocab_size=meta["vocab_size"], pad_id=meta["pad_id"])
    plot.build_root(store, enc, seqs, progress=False)
    out = plot.fit_position(store, "root", enc, seqs, min_count=3)
    # Reference: every corpus window is in the root at full order, so the served input is
    # windowed_lower; the row is the plain mean of full-context minus that, per position.
    full = [enc.lower(*enc.pad([s]))[0] for s in seqs]
    windowed = windowed_lower(enc, seqs, 3, "centered")
    got = store.snapshot().position("root")
    assert got.shape == (enc.config.max_len, enc.config.d)
    longest = max(len(s) for s in seqs)
    for i in range(longest):
        rows = [f[i] - w[i] for f, w in zip(full, windowed) if len(f) > i]
        if len(rows) >= 3:
            # fp16 values in the store vs the fp32 reference
            np.testing.assert_allclose(got[i], torch.stack(rows).mean(0).numpy(), atol=2e-2)
    seen = max(i for i in range(longest) if sum(len(s) > i for s in seqs) >= 3)
    np.testing.assert_array_equal(got[seen + 1:], np.repeat(got[seen:seen + 1], len(got) - seen - 1, 0))
    assert out["cosine_after"] > out["cosine_before"]
    # A second fit on the same text changes (almost) nothing: the residual is already zero.
    plot.fit_position(store, "root", enc, seqs, min_count=3)
    np.testing.assert_allclose(store.snapshot().position("root"), got, atol=1e-4)
