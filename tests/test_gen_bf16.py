"""bf16 in hGPT's batched prefill and decode step (runtime.gen.row_precision): the shared GEMMs
on weights packed once in bf16 give the fp32 step's logits within bf16's rounding; under
"auto" each row takes its PET's recorded precision, rows of both precisions share a step and
each row gets what it gets in a step of its own precision; a precision the CPU lacks is refused
in one line."""

import dataclasses

import pytest
import torch

import hkstore
from runtime.construct.plot import build_root
from runtime.exec import precision as precisionlib
from runtime.gen.batcher import Batcher
from runtime.gen.plot_decode import PlotDecoder
from runtime.gen.row_precision import RowPrecision
from runtime.gen.sampling import SamplingParams
from runtime.model import pet as petlib
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.plot.causal import KeyValuer

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]

native = pytest.mark.skipif(precisionlib.bf16_native() is None, reason="this CPU has no native bf16")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genbf16")
    dec = load_decoder(make_tiny_decoder(tmp / "m", TEXTS, d=32, layers=4, max_len=48), lower_layers=2)
    store = hkstore.create(tmp / "s", d=32, vocab_size=dec.config.vocab_size, n=3, window="causal", lower_layers=2,
                           architecture="decoder", pad_id=0, tokenizer_fingerprint=dec.tokenizer_fingerprint())
    build_root(store, KeyValuer(dec), dec.tokenize(TEXTS), progress=False)
    return store, dec


def _pet(dec, seed, precision=None):
    pet = petlib.create_pet(dec, "lora", "classification", ["lm"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in pet.tensors.values():
            t.add_(torch.randn(t.shape, generator=g) * 0.5)
    if precision:
        pet = dataclasses.replace(pet, meta={**pet.meta, "precision": precision})
    return pet


def _logits(store, dec, precision, pets, steps=4):
    """Every sequence's logits after its prefill and each of `steps` forced decode steps."""
    gen = PlotDecoder(store.snapshot(), "root", dec, precision=precision)
    prompts = dec.tokenize(["the cat", "a dog ran in", "storage", "the park and the"])[:len(pets)]
    b = Batcher(gen, kv_budget_bytes=1 << 24, max_running=8)
    for p, pet in zip(prompts, pets):
        b.submit(p, SamplingParams(max_tokens=steps + 1), pet)
    b.step()  # the prefill (and the first token chosen)
    seqs = [r.seq for r in b.running]
    out = [torch.stack([s.logits for s in seqs])]
    forced = [[5 + k + b_ for b_ in range(len(seqs))] for k in range(steps)]  # the same tokens at both precisions
    for tokens in forced:
        gen.append(seqs, tokens, b.pool)
        out.append(torch.stack([s.logits for s in seqs]))
    return torch.stack(out)  # (steps + 1, B, vocab)


@native
def test_bf16_prefill_and_steps_match_fp32_within_bf16_rounding(made):
    store, dec = made
    pets = [None, _pet(dec, 1), _pet(dec, 2), _pet(dec, 1)]
    want, got = _logits(store, dec, "fp32", pets), _logits(store, dec, "bf16", pets)
    scale = want.abs().max()
    assert not torch.equal(got, want)  # the GEMMs did run in bf16
    assert (got - want).abs().max() <= 0.03 * scale  # bf16's 8-bit mantissa, summed in fp32
    top = want.topk(2, -1).values
    clear = (top[..., 0] - top[..., 1]) > 0.05 * scale  # where fp32's choice is not a near tie
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@native
def test_auto_runs_each_row_at_its_pets_precision_in_one_step(made):
    store, dec = made
    pets = [_pet(dec, 1, "bf16"), None, _pet(dec, 2, "fp32"), _pet(dec, 3, "bf16")]
    mixed = _logits(store, dec, "auto", pets)
    bf16 = _logits(store, dec, "bf16", pets)
    fp32 = _logits(store, dec, "fp32", pets)
    for b, pet in enumerate(pets):
        want = bf16 if pet is not None and pet.meta.get("precision") == "bf16" else fp32
        assert torch.allclose(mixed[:, b], want[:, b], atol=1e-5), b
    assert not torch.allclose(bf16[:, 0], fp32[:, 0], atol=1e-5)  # so the rows above tell the two apart


def test_row_precision_splits_rows_and_keeps_fp32_rows_exact():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 16), torch.randn(24, 16), torch.randn(24)
    assert torch.allclose(RowPrecision.FP32.linear(x, w, b), x @ w.T + b, atol=1e-5)
    if precisionlib.bf16_native() is None:
        return
    rp = RowPrecision.of("auto", [None, _Meta("bf16"), None, _Meta("bf16"), _Meta("fp32")])
    y = rp.linear(x, w, b)
    ref = x @ w.T + b
    assert torch.allclose(y[[0, 2, 4]], ref[[0, 2, 4]], atol=1e-5)
    assert not torch.allclose(y[[1, 3]], ref[[1, 3]], atol=1e-5)
    assert torch.allclose(y[[1, 3]], ref[[1, 3]], atol=0.05 * ref.abs().max())


class _Meta:
    def __init__(self, precision):
        self.meta = {"precision": precision}


def test_a_precision_the_cpu_lacks_is_refused_in_one_line(made, monkeypatch):
    store, dec = made
    with pytest.raises(ValueError, match="precision must be one of"):
        PlotDecoder(store.snapshot(), "root", dec, precision="fp8")
    monkeypatch.setattr(precisionlib, "bf16_native", lambda: None)
    with pytest.raises(precisionlib.PrecisionUnavailable, match="'bf16' needs a CPU") as err:
        PlotDecoder(store.snapshot(), "root", dec, precision="bf16")
    assert "\n" not in str(err.value)
    assert PlotDecoder(store.snapshot(), "root", dec, precision="auto").precision == "fp32"


def test_the_decoder_runtime_takes_its_precision_as_dtype(made, monkeypatch):
    from runtime.gen.api import DecoderRuntime

    store, dec = made
    with pytest.raises(ValueError, match="precision must be one of"):
        DecoderRuntime(store.path, dtype="fp16")
    rt = DecoderRuntime(store.path, decoder=dec, dtype="auto")
    try:
        assert rt.precision == ("auto" if precisionlib.bf16_native() else "fp32")
        assert rt.batcher(rt.store.snapshot(), "root").gen.precision == rt.precision
    finally:
        rt.close()
    monkeypatch.setattr(precisionlib, "bf16_native", lambda: None)
    with pytest.raises(precisionlib.PrecisionUnavailable):
        DecoderRuntime(store.path, dtype="bf16")
