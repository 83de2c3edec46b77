"""Windows, PLOT values and aggregation (FORMAT.md section 4) against naive per-position loops."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.encoder import load_encoder
from runtime.plot.window import aggregate, aggregate_batch, offsets, window_values, windowed_lower, windows

kinds = st.sampled_from(["centered", "causal"])
sizes = st.integers(2, 5)


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


def naive_windows(ids, n, kind, pad_id):
    left = (n - 1) // 2 if kind == "centered" else n - 1
    rows = []
    for i in range(len(ids)):
        rows.append([ids[i + o - left] if 0 <= i + o - left < len(ids) else pad_id for o in range(n)])
    return np.array(rows, dtype=np.uint32).reshape(len(ids), n)


def naive_aggregate(values, n, kind):
    """Token i: mean over windows j covering i of window j's vector at i's slot."""
    L = len(values)
    left = (n - 1) // 2 if kind == "centered" else n - 1
    out = torch.zeros(L, values.shape[-1])
    for i in range(L):
        covering = [values[j, i - j + left] for j in range(L) if 0 <= i - j + left < n]
        out[i] = torch.stack(covering).mean(0)
    return out


@given(st.lists(st.integers(1, 2**32 - 1), max_size=40), sizes, kinds, st.integers(0, 5))
def test_windows_match_naive_loop(ids, n, kind, pad_id):
    got = windows(np.array(ids, dtype=np.uint32), n, kind, pad_id)
    assert got.dtype == np.uint32 and got.shape == (len(ids), n)
    assert np.array_equal(got, naive_windows(ids, n, kind, pad_id))


def test_windows_spec_examples():
    a, b, c = 7, 8, 9
    assert windows(np.array([a, b, c]), 3, "centered", 0).tolist() == [[0, a, b], [a, b, c], [b, c, 0]]
    assert windows(np.array([a, b, c]), 3, "causal", 0).tolist() == [[0, 0, a], [0, a, b], [a, b, c]]
    assert offsets(5, "centered").tolist() == [-2, -1, 0, 1, 2]
    with pytest.raises(ValueError, match="window kind"):
        windows(np.array([a]), 3, "sideways", 0)


@settings(deadline=None)  # a shared CI machine can stall any example past the default 200 ms
@given(st.integers(1, 12), sizes, kinds, st.integers(0, 2**31 - 1))
def test_aggregate_matches_naive_loop(L, n, kind, seed):
    values = torch.randn(L, n, 4, generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(aggregate(values, n, kind), naive_aggregate(values, n, kind), atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=4), sizes, kinds)
def test_aggregate_batch_equals_per_sequence(lengths, n, kind):
    L = max(lengths)
    values = torch.randn(len(lengths), L, n, 3)
    got = aggregate_batch(values, lengths, n, kind)
    for b, length in enumerate(lengths):
        assert torch.allclose(got[b, :length], aggregate(values[b, :length], n, kind), atol=1e-6)
        assert not got[b, length:].any()


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(st.integers(999, 30000), min_size=5, max_size=5), min_size=1, max_size=4))
def test_all_real_window_equals_lower_on_the_window_alone(encoder, keys):
    keys = np.array(keys, dtype=np.uint32)
    ids = torch.from_numpy(keys.astype(np.int64))
    with torch.no_grad():
        expected = encoder.lower(ids, torch.ones_like(ids, dtype=torch.bool))
        assert torch.allclose(window_values(encoder, keys, batch_size=3), expected, atol=1e-5)


def test_pad_slots_are_masked_and_zeroed(encoder):
    a, b, c = 2003, 3526, 4372
    keys = np.array([[a, b, 0], [0, b, c], [0, b, 0]], dtype=np.uint32)
    with torch.no_grad():
        values = window_values(encoder, keys)
        right_cut = encoder.lower(torch.tensor([[a, b]]), torch.ones(1, 2, dtype=torch.bool))[0]
        # A left pad keeps the real tokens at their local positions 1 and 2.
        left_cut = encoder.lower(torch.tensor([[b, c]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([1, 2]))[0]
        unigram = encoder.lower(torch.tensor([[b]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([1]))[0]
    assert torch.allclose(values[0, :2], right_cut, atol=1e-5)
    assert torch.allclose(values[1, 1:], left_cut, atol=1e-5)
    assert torch.allclose(values[2, 1], unigram[0], atol=1e-5)
    assert not values[0, 2].any() and not values[1, 0].any() and not values[2, [0, 2]].any()


def test_windowed_lower_is_close_to_full_context(encoder):
    (ids,) = encoder.tokenize(["Naloxone reverses the antihypertensive effect of clonidine."])
    with torch.no_grad():
        full = encoder.lower(*encoder.pad([ids]))[0]
        windowed, single = windowed_lower(encoder, [ids, ids[:1]], 3, "centered")
    assert windowed.shape == full.shape
    assert torch.cosine_similarity(windowed, full, dim=-1).mean() > 0.5
    assert single.shape == (1, encoder.config.d)
