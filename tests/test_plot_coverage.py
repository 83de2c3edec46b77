"""experiments.plot_coverage computes served orders from key sets alone; they must equal what the
storage engine serves for a root built from the same corpus (hypothesis, tiny vocabularies)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import hkstore
from runtime.construct.plot import root_keys
from runtime.plot.window import corpus_windows
from experiments.plot_coverage import _rows, coverage, served_order

VOCAB, PAD = 9, 0
seqs = st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(corpus=seqs, probe=seqs, n=st.sampled_from([2, 3, 5]))
def test_served_order_equals_the_store_lookup(tmp_path_factory, corpus, probe, n):
    keys, _ = root_keys(corpus, n, "centered", PAD, VOCAB)
    with hkstore.create(tmp_path_factory.mktemp("cov") / "s", d=2, vocab_size=VOCAB, n=n, pad_id=PAD) as s:
        s.add_segment("root", keys, np.zeros((len(keys), n, 2), dtype=np.float16))
        wins, _ = corpus_windows(probe, n, "centered", PAD)
        expect = s.snapshot().lookup("root", wins).order
    np.testing.assert_array_equal(served_order(np.sort(_rows(keys)), wins, "centered", PAD), expect)


@settings(max_examples=25, deadline=None)
@given(corpus=seqs, probe=seqs)
def test_the_right_bigram_chain_only_raises_orders_and_only_from_one_to_two(corpus, probe):
    keys, _ = root_keys(corpus, 3, "centered", PAD, VOCAB)
    held = np.sort(_rows(keys))
    wins, _ = corpus_windows(probe, 3, "centered", PAD)
    plain = served_order(held, wins, "centered", PAD)
    either = served_order(held, wins, "centered", PAD, right_bigram=True)
    changed = plain != either
    assert (plain[changed] == 1).all() and (either[changed] == 2).all()
    # ... and exactly where [_ b c] is held while [a b _] is not
    right = wins.copy()
    right[:, 0] = PAD
    assert set(np.flatnonzero(changed)) <= set(np.flatnonzero(np.isin(_rows(right), held)))


@settings(max_examples=15, deadline=None)
@given(corpus=seqs, probe=seqs)
def test_holding_right_bigrams_never_lowers_coverage(corpus, probe):
    plain = coverage(corpus, probe, 3, "centered", PAD, VOCAB)
    either = coverage(corpus, probe, 3, "centered", PAD, VOCAB, right_bigram=True)
    assert either["exact"] >= plain["exact"] and either["keys"] >= plain["keys"]
    assert either["by_order"]["1"] <= plain["by_order"]["1"]
    assert either["by_order"]["3"] == plain["by_order"]["3"]
