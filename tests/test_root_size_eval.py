"""experiments.root_size_eval serves a store as if its root had been built from less text: with the
root reduced to a smaller corpus's keys, every answer (order, served version, values) equals
that of a store whose root was really built from the smaller corpus. Tiny random BERT."""

import os

import numpy as np
import pytest
from test_manager import make_data

import hkstore
from formats.xxh64 import hash_keys
from runtime.construct import manager
from runtime.construct.plot import root_keys
from runtime.model import stored
from runtime.model.tiny import make_tiny_model
from runtime.plot.window import corpus_windows
from experiments.root_size_eval import kept_root


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rootsize"))
    data = make_data(root)
    model = make_tiny_model(os.path.join(root, "model"), data["texts"])
    # No window distillation: both roots are valued by the same (base) lower layers.
    big, small = os.path.join(root, "big"), os.path.join(root, "small")
    manager.build(big, model_path=model, corpus_paths=[data["corpus"]], max_len=32, distill_steps=0, progress=False)
    manager.build(small, model_path=model, corpus_paths=[data["more"]], max_len=32, distill_steps=0, progress=False)
    with hkstore.open(small) as s, open(data["more"]) as f, open(data["corpus"]) as g:
        enc = stored.base_encoder(s)
        small_seqs = manager.tokenize_corpus(enc, f.read().splitlines(), 32)
        probe = manager.tokenize_corpus(enc, g.read().splitlines() + ["an unseen line of words about paths"], 32)
    return big, small, small_seqs, probe


def test_a_reduced_root_answers_like_a_root_built_from_the_smaller_corpus(stores):
    big, small, small_seqs, probe = stores
    with hkstore.open(small) as s:
        meta = s.meta
        wins, _ = corpus_windows(probe, meta["n"], meta["window"], meta["pad_id"])
        want = s.lookup("root", wins)
        keys, _ = root_keys(small_seqs, meta["n"], meta["window"], meta["pad_id"], meta["vocab_size"])
    with hkstore.open(big) as b:
        full = b.lookup("root", wins)
        reduced = kept_root(np.unique(hash_keys(keys)))(b.snapshot(), "root", wins)
    assert (np.asarray(full.order) > np.asarray(want.order)).any()  # the bigger root does serve more
    np.testing.assert_array_equal(reduced.order, want.order)
    np.testing.assert_array_equal(reduced.version, want.version)
    np.testing.assert_allclose(np.asarray(reduced.values, np.float32), np.asarray(want.values, np.float32), atol=1e-3)
