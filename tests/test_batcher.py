"""runtime.gen.batcher: continuous batching gives every request what it gets alone; sequences
join and leave between steps; the KV budget makes requests wait or refuses them; cancellation."""

import pytest
import torch

import hkstore
from runtime.construct.plot import build_root
from runtime.gen.batcher import Batcher
from runtime.gen.plot_decode import PlotDecoder
from runtime.gen.sampling import SamplingParams
from runtime.model import pet as petlib
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.plot.causal import KeyValuer

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    dec = load_decoder(make_tiny_decoder(tmp / "m", TEXTS, d=32, layers=4, max_len=48), lower_layers=2)
    store = hkstore.create(tmp / "s", d=32, vocab_size=dec.config.vocab_size, n=3, window="causal", lower_layers=2,
                           architecture="decoder", pad_id=0, tokenizer_fingerprint=dec.tokenizer_fingerprint())
    build_root(store, KeyValuer(dec), dec.tokenize(TEXTS), progress=False)
    return PlotDecoder(store.snapshot(), "root", dec)


def _same(got, want):
    """Same tokens, text and ending; logprobs equal to float rounding (batched GEMMs sum in
    another order than one sequence's)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if "logprobs" not in k} == {k: v for k, v in w.items() if "logprobs" not in k}
        assert torch.allclose(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-4)
        assert [[t for t, _ in alt] for alt in g["top_logprobs"]] == [[t for t, _ in alt] for alt in w["top_logprobs"]]
    return True


def _pet(dec, seed):
    pet = petlib.create_pet(dec, "lora", "classification", ["lm"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in pet.tensors.values():
            t.add_(torch.randn(t.shape, generator=g) * 0.5)
    return pet


def _requests(gen):
    prompts = gen.decoder.tokenize(["the cat", "a dog ran", "storage", "the park and", "vectors"])
    pets = [None, _pet(gen.decoder, 1), _pet(gen.decoder, 2), None, _pet(gen.decoder, 1)]
    params = [SamplingParams(max_tokens=8), SamplingParams(temperature=1.2, seed=5, max_tokens=12),
              SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=5), SamplingParams(max_tokens=3, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=10)]
    return list(zip(prompts, params, pets))


def test_mixed_tenants_in_one_batch_get_what_they_get_alone(gen):
    reqs = _requests(gen)
    alone = [gen.generate(p, s, pet) for p, s, pet in reqs]
    b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=8)
    ids = [b.submit(p, s, pet) for p, s, pet in reqs]
    steps = 0
    while b.busy:
        b.step()
        steps += 1
    assert _same([b.result(i) for i in ids], alone)
    assert steps <= max(s.max_tokens for _, s, _ in reqs)  # all ran side by side


def test_sequences_join_between_steps_and_the_budget_makes_them_wait(gen):
    reqs = _requests(gen)
    alone = [gen.generate(p, s, pet) for p, s, pet in reqs]
    b = Batcher(gen, kv_budget_bytes=1, max_running=2)
    per_token = b.bytes_per_token
    # room for about two requests at a time
    b.budget = max((len(p) + s.max_tokens) * per_token for p, s, _ in reqs) * 2
    ids = [b.submit(*reqs[0]), b.submit(*reqs[1])]
    b.step()
    assert len(b.running) == 2 and not b.waiting
    ids += [b.submit(*r) for r in reqs[2:]]  # arrive while the first two run
    seen_running = set()
    while b.busy:
        b.step()
        seen_running.add(len(b.running))
        assert b.reserved <= b.budget and len(b.running) <= 2
    assert _same([b.result(i) for i in ids], alone)
    assert b.reserved == 0 and 2 in seen_running


def test_refusals_and_cancellation(gen):
    b = Batcher(gen, kv_budget_bytes=1000)
    with pytest.raises(ValueError, match="budget"):
        b.submit([2, 5], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="context"):
        Batcher(gen, 1 << 30).submit([2] * 40, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="temperature"):
        Batcher(gen, 1 << 30).submit([2], SamplingParams(temperature=-1))
    b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=1)
    first = b.submit([2, 5], SamplingParams(max_tokens=20))
    second = b.submit([2, 6], SamplingParams(max_tokens=20))
    b.step()
    assert b.cancel(second)  # still waiting
    assert b.cancel(first)  # running: ends at the next step
    events = b.step()
    assert [(e.id, e.finished, e.finish_reason) for e in events] == [(first, True, "cancelled")]
    assert not b.busy and b.result(second)["finish_reason"] == "cancelled" and b.reserved == 0


def _llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    from runtime.construct.decoder_store import build_decoder
    from runtime.model.tiny_decoder import make_tokenizer

    tok = make_tokenizer(TEXTS)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=3, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48, bos_token_id=2, eos_token_id=3))
    model.save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=tmp_path / "m", corpus_paths=[tmp_path / "c.txt"], n=3, lower_layers=1,
                  progress=False)
    st = hkstore.open(tmp_path / "s")
    dec = load_decoder(tmp_path / "m", lower_layers=1)
    return PlotDecoder(st.snapshot(), "root", dec), dec


def test_batched_step_equals_single_steps_on_a_llama_layout(tmp_path):
    """Rotary positions and grouped K/V heads in the batched decode step, mixed PETs."""
    gen, dec = _llama(tmp_path)
    prompts = dec.tokenize(["the cat sat on", "a dog", "storage engines keep tables"])
    pets = [None, _pet(dec, 3), _pet(dec, 3)]
    together = [gen.prefill(p, pet) for p, pet in zip(prompts, pets)]
    alone = [gen.prefill(p, pet) for p, pet in zip(prompts, pets)]
    for step in range(4):
        tokens = [int(s.logits.argmax()) for s in together]
        gen.append(together, tokens)
        for s, t in zip(alone, tokens):
            gen.append([s], [t])
        for a, b in zip(together, alone):
            assert (a.logits - b.logits).abs().max().item() <= 1e-4


def test_metrics(gen):
    b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=4)
    for p in gen.decoder.tokenize(["the cat", "a dog"]):
        b.submit(p, SamplingParams(max_tokens=5))
    first = b.metrics()
    assert first["waiting"] == 2 and first["tokens"] == 0 and first["time_to_first_token_s"] == {}
    b.run()
    m = b.metrics()
    made = sum(len(r.ids) for r in b.done.values())
    assert m["tokens"] == made and m["running"] == m["waiting"] == 0 and m["kv_reserved_bytes"] == 0
    assert len(b.ttft) == 2 and len(b.itl) == made - 2
    assert 0 < m["time_to_first_token_s"]["p50"] and m["inter_token_latency_s"]["p99"] > 0


def test_the_kv_pool_path_equals_each_sequence_with_its_own_cache(tmp_path):
    """The batcher's pooled attention (one gather per layer for every sequence; LoRA rows by
    BGMV, an adapter row through the per-group path) gives each prompt the greedy tokens it gets
    alone through its own KVCache, on a rotary, grouped-K/V layout; the pool is bounded by the
    budget and every page comes back."""
    gen, dec = _llama(tmp_path)
    adapter = petlib.create_pet(dec, "adapter", "classification", ["lm"], bottleneck=4)
    with torch.no_grad():
        for t in adapter.tensors.values():
            t.add_(torch.randn(t.shape) * 0.5)
    prompts = dec.tokenize(["the cat sat on", "a dog", "storage engines keep tables", "vectors"])
    for pets in ([None, _pet(dec, 3), _pet(dec, 4), _pet(dec, 3)], [None, _pet(dec, 3), adapter, None]):
        alone = [gen.greedy(p, 7, pet) for p, pet in zip(prompts, pets)]
        b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=3)  # the fourth joins when one ends
        ids = [b.submit(p, SamplingParams(max_tokens=7 - k), pet) for k, (p, pet) in enumerate(zip(prompts, pets))]
        b.run()
        eos = dec.config.eos_id
        want = [a[:7 - k][:a.index(eos)] if eos in a[:7 - k] else a[:7 - k] for k, a in enumerate(alone)]
        assert [b.result(i)["ids"] for i in ids] == want
        assert b.pool.available == b.pool.positions == 3 * dec.config.max_len
    small = Batcher(gen, kv_budget_bytes=40 * Batcher(gen, 1).bytes_per_token, max_running=8)
    small.submit(prompts[0], SamplingParams(max_tokens=3))
    small.step()
    assert small.pool.positions == 40 and small.pool.available == 40 - len(prompts[0]) - 3


@pytest.mark.parametrize("kinds", [("adapter", "bitfit", None, "lora"), ("adapter", "adapter", "diff", None)])
def test_every_pet_kind_is_prefilled_in_one_pass_per_pet_and_matches_alone(gen, kinds):
    """prefill_many takes any PET: the per-row LoRA pass plus one pass per other PET shared by
    its prompts (runtime.gen.batched_prefill shared_pet); greedy continuations equal each
    prompt's own single-sequence path (prefill + append, Decoder.upper with a KVCache)."""
    from runtime.gen import batched_prefill

    dec = gen.decoder
    pets = {}
    for j, kind in enumerate(kinds):
        if kind is not None and kind not in pets:
            p = petlib.create_pet(dec, kind, "lm", [], seed=10 + j)
            g = torch.Generator().manual_seed(10 + j)
            with torch.no_grad():
                for t in p.tensors.values():
                    if t.is_floating_point():
                        t.add_(torch.randn(t.shape, generator=g) * 0.3)
            pets[kind] = petlib.export(p) if kind == "diff" else p
    prompts = dec.tokenize(["the cat", "a dog ran in", "storage engines", "the park and the"])
    row_pets = [pets.get(k) for k in kinds]
    calls = []
    real = batched_prefill.prefill_batch

    def counting(*args, **kwargs):
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    batched_prefill.prefill_batch = counting
    try:
        b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=8)
        ids = [b.submit(p, SamplingParams(max_tokens=6, ignore_eos=True), pet) for p, pet in zip(prompts, row_pets)]
        b.run()
    finally:
        batched_prefill.prefill_batch = real
    others = {id(p) for p in row_pets if p is not None and p.meta.get("pet_type") != "lora"}
    assert sorted(calls) == sorted(([sum(1 for p in row_pets if p is None or p.meta["pet_type"] == "lora")]
                                    if any(p is None or p.meta["pet_type"] == "lora" for p in row_pets) else []) +
                                   [sum(1 for p in row_pets if p is not None and id(p) == o) for o in others])
    for rid, p, pet in zip(ids, prompts, row_pets):
        assert b.result(rid)["ids"] == gen.greedy(p, 6, pet)
