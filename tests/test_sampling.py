"""runtime.gen.sampling and PlotDecoder.generate: greedy, temperature, top-k, top-p, seeds,
stop sequences, logprobs, and one-line refusals of bad parameters."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hkstore
from runtime.construct.plot import build_root
from runtime.gen.plot_decode import PlotDecoder
from runtime.gen.sampling import Chooser, SamplingParams, find_stop, generator_seed
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.plot.causal import KeyValuer

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    assert Chooser(SamplingParams())(logits)[0] == best
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=3), SamplingParams(temperature=2.0, top_p=1e-6),
                   SamplingParams(temperature=1.0, top_p=5e-324)):
        assert {Chooser(params)(logits)[0] for _ in range(5)} == {best}


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draw = [Chooser(SamplingParams(temperature=1.0, seed=7))(logits)[0] for _ in range(3)]
    assert len(set(draw)) == 1
    chooser = Chooser(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([chooser(logits)[0] for _ in range(4000)]), minlength=4).float() / 4000
    assert (counts - logits.softmax(-1)).abs().max() < 0.03
    # top_k = 2 keeps the two most likely; top_p = 0.7 keeps tokens 0 and 1 (0.64 < 0.7)
    for params in (SamplingParams(temperature=1.0, top_k=2, seed=1), SamplingParams(temperature=1.0, top_p=0.7, seed=1)):
        chooser = Chooser(params)
        assert {chooser(logits)[0] for _ in range(300)} == {0, 1}


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 1e-9, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    """Below 1e-5, as vLLM: float32 logits / 1e-9 overflowed to inf, / 5e-324 (0 in float32) gave
    NaN, and torch.multinomial refused the softmax (a 500 on the HTTP routes)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 10
    for params in (SamplingParams(temperature=temperature, seed=2), SamplingParams(temperature=temperature, top_p=0.5),
                   SamplingParams(temperature=temperature, top_k=3)):
        assert Chooser(params)(logits)[0] == int(logits.argmax())


def test_logprobs_are_of_the_unmodified_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0])
    token, logprob, top = Chooser(SamplingParams(temperature=0.5, top_k=1, logprobs=2, seed=0))(logits)
    assert token == 0 and math.isclose(logprob, float(torch.log_softmax(logits, -1)[0]), rel_tol=1e-6)
    assert [t for t, _ in top] == [0, 1]


@pytest.mark.parametrize("change, message", [
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop": "x"}, "stop"), ({"logprobs": 99}, "logprobs"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_parameters_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**change).check()


def test_find_stop():
    assert find_stop("a cat. and", [".", "and"]) == 5 and find_stop("abc", ["x"]) == -1
    assert find_stop("a cat. and", [".", "and"], 6) == 7


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(1 << 200), max_value=1 << 200))
def test_any_integer_seed_is_taken_modulo_2_64(seed):
    """OpenAI's API takes any integer seed; torch.Generator only 64 bits. A seed is used modulo
    2**64: one in [0, 2**64) as it is, any other as its residue, the same draws every time."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = {Chooser(SamplingParams(temperature=1.0, seed=s))(logits)[0] for s in (seed, seed + (5 << 64))}
    assert len(draws) == 1 and 0 <= generator_seed(seed) < 1 << 64
    assert generator_seed(seed % (1 << 64)) == seed % (1 << 64)


def test_the_campaign_seed_draws():
    chooser = Chooser(SamplingParams(temperature=1.0, seed=1180591620717411303424))  # 2**70: overflowed torch
    assert chooser.generator.initial_seed() == 0


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    dec = load_decoder(make_tiny_decoder(tmp / "m", TEXTS, d=32, layers=4, max_len=32), lower_layers=2)
    store = hkstore.create(tmp / "s", d=32, vocab_size=dec.config.vocab_size, n=3, window="causal", lower_layers=2,
                           architecture="decoder", pad_id=0, tokenizer_fingerprint=dec.tokenizer_fingerprint())
    build_root(store, KeyValuer(dec), dec.tokenize(TEXTS), progress=False)
    return PlotDecoder(store.snapshot(), "root", dec)


def test_generate_greedy_equals_greedy_and_reports_usage(gen):
    prompt = gen.decoder.tokenize(["the cat"])[0]
    out = gen.generate(prompt, SamplingParams(max_tokens=6, logprobs=1))
    eos = gen.decoder.config.eos_id
    want = gen.greedy(prompt, 6, stop=eos)
    assert out["ids"] == [t for t in want if t != eos]
    # the text in the prompt's context: the space before the first word kept
    assert gen.decoder.decode(prompt) + out["text"] == gen.decoder.decode(prompt + out["ids"])
    assert out["text"].startswith(" ")
    assert out["finish_reason"] == ("stop" if eos in want else "length")
    assert out["prompt_tokens"] == len(prompt) and out["completion_tokens"] == len(out["ids"])
    assert all(lp <= 0 for lp in out["logprobs"]) and all(len(t) == 1 for t in out["top_logprobs"])


def test_ignore_eos_runs_to_max_tokens_through_eos(gen):
    """vLLM's ignore_eos: the greedy continuation to max_tokens through EOS (made EOS here: the
    greedy's 4th token), where the plain request stops before it."""
    prompt = gen.decoder.tokenize(["the cat"])[0]
    want = gen.greedy(prompt, 20)
    config = gen.decoder.config
    gen.decoder.config = config.__class__(**{**config.__dict__, "eos_id": want[3]})
    try:
        out = gen.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        stopped = gen.generate(prompt, SamplingParams(max_tokens=20))
    finally:
        gen.decoder.config = config
    assert out["ids"] == want and out["finish_reason"] == "length"
    assert stopped["ids"] == want[:want.index(want[3])] and stopped["finish_reason"] == "stop"


def test_generate_with_a_seed_is_reproducible_and_stops_at_a_stop_sequence(gen):
    prompt = gen.decoder.tokenize(["a dog"])[0]
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=11, max_tokens=10)
    first, again = gen.generate(prompt, params), gen.generate(prompt, params)
    assert first == again
    words = first["text"].split()
    if len(words) >= 2:
        cut = gen.generate(prompt, SamplingParams(temperature=1.5, top_p=0.95, seed=11, max_tokens=10,
                                                   stop=[" " + words[1]]))
        assert cut["finish_reason"] == "stop" and cut["text"] == " " + words[0]


def test_max_tokens_beyond_the_context_is_refused(gen):
    with pytest.raises(ValueError, match="context"):
        gen.generate([2] * 30, SamplingParams(max_tokens=3))


def test_hkstore_generate(tmp_path):
    import json

    from click.testing import CliRunner

    from tools.cli import main
    from runtime.construct.decoder_store import build_decoder

    model = make_tiny_decoder(tmp_path / "m", TEXTS, d=32, layers=4, max_len=32)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=model, corpus_paths=[corpus], n=3, lower_layers=2, progress=False)
    r = CliRunner().invoke(main, ["generate", str(tmp_path / "s"), "the cat", "--max-tokens", "5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prompt_tokens"] == 3 and out["completion_tokens"] <= 5
    streamed = CliRunner().invoke(main, ["generate", str(tmp_path / "s"), "the cat", "--max-tokens", "5"])
    assert streamed.exit_code == 0 and streamed.output.strip() == out["text"].strip()
    bad = CliRunner().invoke(main, ["generate", str(tmp_path / "s"), "the cat", "--max-tokens", "50"])
    assert bad.exit_code == 1 and "context" in bad.output and "Traceback" not in bad.output
    no_gpu = CliRunner().invoke(main, ["generate", str(tmp_path / "s"), "the cat", "--device", "cuda"])
    assert no_gpu.exit_code == 1 and "--device cuda" in no_gpu.output and "Traceback" not in no_gpu.output


# -- detokenization in context (runtime.gen.detok) ----------------------------------------------

DETOK_TEXTS = TEXTS + ["naïve café — 東京 ☃ 😀 emoji", "don't stop, won't stop!", "  spaces\tand\nlines  "]


def _tokenizers():
    """Decoders that lose text when a completion is decoded alone: word-level joined by spaces
    (the tests' tiny models), GPT-2's byte level (a character can span tokens), SentencePiece's
    metaspace (the first word's space is dropped), Llama's byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from runtime.model.tiny_decoder import make_tokenizer

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(DETOK_TEXTS * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    metaspace.train_from_iterator(DETOK_TEXTS * 5, trainers.BpeTrainer(vocab_size=200,
                                                                      special_tokens=["<unk>", "<s>", "</s>"]))
    fallback = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    fallback.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)])
    fallback.train_from_iterator(DETOK_TEXTS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    return {"word": make_tokenizer(DETOK_TEXTS), "byte-level": byte_level, "metaspace": metaspace,
            "byte-fallback": fallback}


TOKENIZERS = _tokenizers()


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_deltas_are_the_completion_decoded_in_context(name, data):
    """For any prompt and completion tokens (special ones, pieces of characters and all), the
    deltas as the tokens arrive, then the flush, concatenate to decode(prompt + completion)
    less decode(prompt): the completion's text in its context."""
    from runtime.gen.detok import IncrementalText

    tok = TOKENIZERS[name]
    ids = st.integers(0, tok.get_vocab_size() - 1)
    prompt, completion = data.draw(st.lists(ids, max_size=10)), data.draw(st.lists(ids, max_size=16))
    text = IncrementalText(tok.decode, prompt)
    deltas = [text.add(t) for t in completion] + [text.flush()]
    assert "".join(deltas) == tok.decode(prompt + completion)[len(tok.decode(prompt)):]
    assert all("\ufffd" not in d for d in deltas[:-1] if d) or "\ufffd" in tok.decode(prompt + completion)


def test_a_completion_keeps_the_space_after_its_prompt():
    """The bug: "The archive is" + "a string." (the completion decoded alone)."""
    from runtime.gen.detok import IncrementalText

    tok = TOKENIZERS["word"]
    prompt, completion = tok.encode("the cat sat").ids, tok.encode("on the mat .", add_special_tokens=False).ids
    text = IncrementalText(tok.decode, prompt)
    assert "".join(text.add(t) for t in completion) + text.flush() == " on the mat ."


@settings(max_examples=25, deadline=None)
@given(words=st.lists(st.sampled_from(sorted({w for t in TEXTS for w in t.split()})), min_size=1, max_size=5),
       seed=st.integers(0, 1 << 70), max_tokens=st.integers(1, 12))
def test_batcher_events_are_the_completion_in_context(gen, words, seed, max_tokens):
    """Through the batcher (sampled, through EOS): each event's text extends the one before, and
    the last is decode(prompt + ids) less decode(prompt)."""
    from runtime.gen.batcher import Batcher

    dec = gen.decoder
    prompt = dec.tokenize([" ".join(words)])[0]
    if len(prompt) + max_tokens > dec.config.max_len:
        return
    b = Batcher(gen, 1 << 30)
    rid = b.submit(prompt, SamplingParams(temperature=1.5, seed=seed, max_tokens=max_tokens, ignore_eos=True))
    texts = []
    while b.busy:
        texts += [e.text for e in b.step() if e.id == rid]
    out = b.result(rid)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == out["text"] == dec.decode(prompt + out["ids"])[len(dec.decode(prompt)):]


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(1e-5), st.floats(1e-5, 100)),
       top_p=st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 1.0]), st.floats(5e-324, 1.0)),
       top_k=st.integers(0, 60), scale=st.sampled_from([0.1, 1.0, 30.0, 1e3]), seed=st.integers(0, 2**64 - 1))
def test_any_valid_sampling_params_choose_a_kept_token(temperature, top_p, top_k, scale, seed):
    """Whatever the params the API accepts (a denormal top_p once dropped every token: a 500),
    the token drawn is among the top_k most likely, and the most likely one always stays."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    token, _, _ = Chooser(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))(logits)
    if top_k:
        assert logits[token] >= logits.topk(min(top_k, 50)).values[-1]
    if top_p <= 1e-30:  # float32's nucleus is the most likely token alone
        assert token == int(logits.argmax())
