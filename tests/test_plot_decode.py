"""Greedy generation through the PLOT path (runtime.gen.plot_decode): lookups + the upper layers
with a per-sequence KV cache, checked against the full decoder and the store-free hGPT."""

import pytest
import torch

import hkstore
from runtime.construct.plot import build_root
from runtime.gen.plot_decode import PlotDecoder
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.plot.causal import KeyValuer, windowed_lower

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs .", "the dog sat on the cat ."]
PROMPTS = ["the cat", "storage engines keep", "a dog ran in the park"]


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    return load_decoder(make_tiny_decoder(tmp_path_factory.mktemp("dec") / "m", TEXTS, d=32, layers=4),
                        lower_layers=2)


def _store(path, dec, seqs, n):
    meta = {"d": dec.config.d, "vocab_size": dec.config.vocab_size, "pad_id": dec.config.pad_id,
            "tokenizer_fingerprint": dec.tokenizer_fingerprint()}
    store = hkstore.create(path, n=n, window="causal", lower_layers=dec.lower_layers, architecture="decoder",
                           num_layers=dec.config.num_layers, **meta)
    build_root(store, KeyValuer(dec), seqs, progress=False)
    return store


def _windowed_greedy(dec, prompt, n, steps):
    """hGPT without a store or a cache: every step recomputes every window's lower layers."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            h = windowed_lower(dec, [ids], n)[0][None]
            token = int(dec.logits(dec.upper(h))[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def test_short_sequences_match_the_full_decoders_greedy(dec, tmp_path):
    """n = 5 and prompt + continuation within 5 tokens: every window is the whole prefix."""
    n = 5
    cases = [(p, n - len(p) + 1) for p in dec.tokenize(PROMPTS[:2])]  # the last token is never looked up
    reference = [dec.greedy(p, k) for p, k in cases]
    store = _store(tmp_path / "s", dec, [p + r for (p, _), r in zip(cases, reference)], n)
    gen = PlotDecoder(store.snapshot(), "root", dec)
    for (p, k), r in zip(cases, reference):
        assert gen.greedy(p, k) == r


@pytest.mark.parametrize("n", [2, 3])
def test_long_continuations_match_store_free_hgpt_at_full_coverage(dec, tmp_path, n):
    steps = 12
    prompts = dec.tokenize(PROMPTS)
    reference = [_windowed_greedy(dec, p, n, steps) for p in prompts]
    # full coverage: the store holds every window of every prompt + continuation
    store = _store(tmp_path / "s", dec, [p + r for p, r in zip(prompts, reference)], n)
    gen = PlotDecoder(store.snapshot(), "root", dec)
    for p, r in zip(prompts, reference):
        assert gen.greedy(p, steps) == r
    # batched steps: one lookup per step for all sequences, each with its own cache
    seqs = [gen.prefill(p) for p in prompts]
    for _ in range(steps - 1):
        gen.step(seqs)
    for s, r in zip(seqs, reference):
        assert s.generated == r[:steps - 1]
        assert s.orders == [min(i + 1, n) for i in range(len(s.ids))]  # every window a full hit


def test_decode_step_equals_prefill_of_the_longer_sequence(dec, tmp_path):
    """A token appended through the cache gets the logits a fresh prefill gives it."""
    seqs = dec.tokenize(TEXTS)
    store = _store(tmp_path / "s", dec, seqs, 3)
    gen = PlotDecoder(store.snapshot(), "root", dec)
    s = gen.prefill(seqs[1][:4])
    for t in seqs[1][4:]:
        gen.append([s], [t])
    fresh = gen.prefill(seqs[1])
    assert (s.logits - fresh.logits).abs().max().item() <= 1e-4


def test_refusals(dec, tmp_path):
    enc_store = hkstore.create(tmp_path / "enc", d=dec.config.d, vocab_size=dec.config.vocab_size)
    with pytest.raises(ValueError, match="decoder store"):
        PlotDecoder(enc_store.snapshot(), "root", dec)
    store = _store(tmp_path / "s", dec, dec.tokenize(TEXTS), 3)
    gen = PlotDecoder(store.snapshot(), "root", dec)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.prefill([])
    with pytest.raises(ValueError, match="context"):
        gen.prefill([2] * (dec.config.max_len + 1))


@pytest.mark.parametrize("pet_type", ["lora", "adapter", "bitfit"])
def test_a_tenants_pet_applies_in_the_upper_layers(dec, tmp_path, pet_type):
    """The encoder's PETs apply to decoder layers unchanged (same projection names); the PLOT
    path with a PET equals store-free hGPT with it."""
    from runtime.model import pet as petlib

    seqs = dec.tokenize(TEXTS)
    store = _store(tmp_path / "s", dec, seqs, 3)
    pet = petlib.create_pet(dec, pet_type, "classification", ["lm"], seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in pet.tensors.values():
            t.add_(torch.randn(t.shape, generator=g) * 0.3)
    gen = PlotDecoder(store.snapshot(), "root", dec)
    s = gen.prefill(seqs[1][:5], pet=pet)
    for t in seqs[1][5:9]:
        gen.append([s], [t])
    with torch.no_grad():
        h = windowed_lower(dec, [seqs[1][:9]], 3)[0][None]
        want = dec.logits(dec.upper(h, pet=pet))[0, -1]
        plain = dec.logits(dec.upper(h))[0, -1]
    assert (s.logits - want).abs().max().item() <= 3e-3 * want.abs().max().item()  # fp16 values
    assert (plain - want).abs().max().item() > 1e-2
