"""The decode step's kernels (runtime/gen/_decode.c) against their references: attention over
the KV pool's pages (KVPool.attend's gather + ATen attention) and each row's LoRA added in place
(LoraBatch.delta, then an add); each row's bits its own; greedy tokens unchanged end to end."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.gen import kv_pool, lora_batch, sampling
from runtime.gen.kv_pool import KVPool
from runtime.gen.lora_batch import LoraBatch
from runtime.model.pet import Pet

needs_decode = pytest.mark.skipif(kv_pool._decode is None, reason="runtime.gen._decode not built")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pool(layers, kv_heads, head_dim, positions, seed):
    dec = SimpleNamespace(config=SimpleNamespace(num_layers=layers + 1, kv_heads=kv_heads, head_dim=head_dim),
                          lower_layers=1)
    pool = KVPool(dec, positions)
    g = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def _step(lengths, H, KV, hd, seed, shuffle):
    """A pool holding sequences of these lengths (pages scattered when shuffle) and one step's
    q, k, v as column ranges of one (B, (H + 2 KV) hd) output, as the fused q, k, v GEMM gives."""
    B = len(lengths)
    pool = _pool(2, KV, hd, sum(lengths) + 2 * B + 3, seed)
    if shuffle:  # pages anywhere in the pool, in any order
        pool._free = torch.randperm(pool.positions, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs = [SimpleNamespace(kv_len=n, slots=pool.alloc(n + 2)) for n in lengths]
    g = torch.Generator().manual_seed(seed + 1)
    out = torch.randn(B, (H + 2 * KV) * hd, generator=g) * 2
    q, k, v = out.split([H * hd, KV * hd, KV * hd], -1)
    return pool, seqs, q.view(B, H, hd), k.view(B, KV, hd), v.view(B, KV, hd)


def _reference(pool, seqs, q, k, v):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kv_pool, "_decode", None)
        return pool.attend(2, seqs, pool.pages(seqs), q, k, v)


@st.composite
def steps(draw):
    KV = draw(st.integers(1, 3))
    return (draw(st.lists(st.integers(0, 40), min_size=1, max_size=6)), KV * draw(st.sampled_from([1, 2, 3])), KV,
            draw(st.sampled_from([8, 24, 37, 64])))  # no, partial and whole 16-lane blocks


@needs_decode
@SETTINGS
@given(case=steps(), seed=st.integers(0, 2**31 - 1), shuffle=st.booleans())
def test_kernel_attention_is_the_reference(case, seed, shuffle):
    """Same keys and values written (bit for bit) and the same attention to fp32 rounding, for
    grouped heads, any head size, empty and long histories and pages scattered over the pool."""
    lengths, H, KV, hd = case
    pool, seqs, q, k, v = _step(lengths, H, KV, hd, seed, shuffle)
    ref_pool = _pool(2, KV, hd, pool.positions, 0)
    ref_pool.k.copy_(pool.k), ref_pool.v.copy_(pool.v)
    want = _reference(ref_pool, seqs, q, k, v)
    got = pool.attend(2, seqs, pool.pages(seqs), q, k, v)
    assert got.shape == want.shape == (len(lengths), H * hd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.k, ref_pool.k) and torch.equal(pool.v, ref_pool.v)


@needs_decode
@SETTINGS
@given(case=steps(), seed=st.integers(0, 2**31 - 1))
def test_kernel_attention_of_a_row_is_its_own(case, seed):
    """A sequence attended alone gets the bits it gets beside any others (batch invariance)."""
    lengths, H, KV, hd = case
    pool, seqs, q, k, v = _step(lengths, H, KV, hd, seed, True)
    k0, v0 = pool.k.clone(), pool.v.clone()
    together = pool.attend(2, seqs, pool.pages(seqs), q, k, v)
    for b, s in enumerate(seqs):
        pool.k.copy_(k0), pool.v.copy_(v0)
        alone = pool.attend(2, [s], pool.pages([s]), q[b:b + 1], k[b:b + 1], v[b:b + 1])
        assert torch.equal(alone[0], together[b])


@needs_decode
def test_kernel_checks_the_pages_it_reads():
    pool, seqs, q, k, v = _step([3, 5], 2, 2, 8, 0, False)
    pages = pool.pages(seqs)
    pages[1, 2] = pool.positions  # one past the pool
    with pytest.raises(IndexError, match="reads page"):
        pool.attend(2, seqs, pages, q, k, v)


def _pets(g, d_in, d_out, specs):
    pets = []
    for r, targets in specs:
        t = {}
        for target in targets:
            t[f"layers.3.lora.{target}.A"] = torch.randn(r, d_in, generator=g)
            t[f"layers.3.lora.{target}.B"] = torch.randn(d_out, r, generator=g)
        pets.append(Pet(t, {"pet_type": "lora", "scale": 0.5 + r}))
    return pets


@needs_decode
@SETTINGS
@given(rows=st.lists(st.integers(-1, 3), min_size=1, max_size=9), d=st.sampled_from([8, 24, 37, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_lora_add_is_delta_then_add_and_a_rows_own(rows, d, seed):
    """add_to equals delta + add to fp32 rounding (ranks 1 to 8, adapters without the target),
    leaves the base model's rows and the output's other columns untouched bit for bit, and a
    row's bits do not depend on its batch-mates."""
    g = torch.Generator().manual_seed(seed)
    adapters = _pets(g, d, 24, [(1, ["q"]), (8, ["q", "v"]), (3, ["v"]), (5, ["q"])])
    pets = [None if r < 0 else adapters[r] for r in rows]
    x = torch.randn(len(rows), d, generator=g)
    wide = torch.randn(len(rows), 72, generator=g)
    for target in ("q", "v", "k"):
        got = wide.clone()
        LoraBatch(pets).add_to(3, target, x, got[:, 24:48])
        want = wide.clone()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(lora_batch, "_decode", None)
            LoraBatch(pets).add_to(3, target, x, want[:, 24:48])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[:, :24], wide[:, :24]) and torch.equal(got[:, 48:], wide[:, 48:])
        untouched = [b for b, p in enumerate(pets) if p is None or f"layers.3.lora.{target}.A" not in p.tensors]
        assert torch.equal(got[untouched], wide[untouched])
        for b in range(len(rows)):
            alone = wide[b:b + 1].clone()
            LoraBatch([pets[b]]).add_to(3, target, x[b:b + 1], alone[:, 24:48])
            assert torch.equal(alone[0], got[b])


@needs_decode
def test_greedy_tokens_are_those_of_the_reference_paths(tmp_path, monkeypatch):
    """End to end through the batcher (a llama layout: rotary, grouped K/V heads; LoRA tenants on
    every projection and the base model side by side, sequences joining and leaving): the kernels
    leave every fp32 greedy token as the reference attention and LoRA choose it."""
    from test_batcher import _llama, _pet

    from runtime.gen.batcher import Batcher
    from runtime.gen.sampling import SamplingParams

    gen, dec = _llama(tmp_path)
    pets = [None, _pet(dec, 3), _pet(dec, 4)]
    prompts = dec.tokenize(["the cat sat on", "a dog", "storage engines keep tables", "the park", "vectors and"])

    def run():
        b = Batcher(gen, kv_budget_bytes=1 << 24, max_running=3)
        rids = [b.submit(p, SamplingParams(max_tokens=6 + 3 * j, ignore_eos=True), pets[j % 3])
                for j, p in enumerate(prompts)]
        b.run()
        return [b.result(r)["ids"] for r in rids]

    got = run()
    with monkeypatch.context() as m:
        m.setattr(kv_pool, "_decode", None)
        m.setattr(lora_batch, "_decode", None)
        want = run()
    assert got == want and [len(t) for t in got] == [6 + 3 * j for j in range(5)]


def test_reference_attention_is_sdpa_over_each_sequences_positions():
    """The reference path itself: each sequence's attention over exactly its own positions,
    this step's key and value at its next page, query head h on K/V head h // (H / KV)."""
    pool, seqs, q, k, v = _step([0, 4, 9], 4, 2, 8, 3, True)
    got = _reference(pool, seqs, q, k, v)
    for b, s in enumerate(seqs):
        n = s.kv_len
        assert torch.equal(pool.k[1, s.slots[n]], k[b]) and torch.equal(pool.v[1, s.slots[n]], v[b])
        keys = pool.k[1, s.slots[:n + 1]].transpose(0, 1)  # (KV, n + 1, hd)
        values = pool.v[1, s.slots[:n + 1]].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b].view(2, 2, 8), keys, values)  # (KV, H / KV, hd)
        torch.testing.assert_close(got[b], want.reshape(-1), rtol=1e-5, atol=1e-5)


@st.composite
def step_logits(draw):
    """A step's logits (n, vocab): normal values, ties to the row's top, and now and then a NaN,
    an inf or a row of -inf (the reference's rules must hold there); some as a row subset's copy."""
    n, vocab, seed = draw(st.integers(1, 5)), draw(st.integers(1, 100)), draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * draw(st.sampled_from([0.1, 5.0, 80.0]))
    if draw(st.booleans()):  # ties: copies of the top at later columns
        for b in range(n):
            x[b, torch.randint(vocab, (3,), generator=g)] = x[b].max()
    special = draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf"), "all -inf"]))
    if special == "all -inf":
        x[draw(st.integers(0, n - 1))] = float("-inf")
    elif special is not None:
        x[draw(st.integers(0, n - 1)), draw(st.integers(0, vocab - 1))] = special
    return x[:, : draw(st.integers(1, vocab))] if draw(st.booleans()) else x  # (rows strided: a column slice)


def _same_floats(a, b, tol):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool((((a - b).abs() <= tol * (1 + b.abs())) | (a.isnan() & b.isnan()) | (a == b)).all())


@needs_decode
@SETTINGS
@given(step_logits())
def test_greedy_kernel_equals_the_reference(logits):
    tokens, logprobs = sampling.greedy(logits)
    want_tokens, want_logprobs = sampling.greedy_reference(logits)
    assert tokens == want_tokens
    assert _same_floats(logprobs, want_logprobs, 2e-6)


@needs_decode
def test_greedy_kernel_row_is_its_own():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50257, generator=g) * 4
    tokens, logprobs = sampling.greedy(logits)
    for b in range(9):
        assert sampling.greedy(logits[b:b + 1]) == ([tokens[b]], [logprobs[b]])
