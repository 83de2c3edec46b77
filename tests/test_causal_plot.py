"""Causal PLOT for decoder stores: construction with the encoder stores' code, retrieval of the
upper layers' inputs (runtime.plot.causal), exactness at full coverage."""

import numpy as np
import pytest
import torch

import hkstore
from hkstore.errors import StoreError
from runtime.construct.decoder_store import base_decoder, build_decoder
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.model.stored import is_decoder_store
from runtime.plot.causal import causal_values, windowed_lower
from runtime.plot.retrieve import retrieve

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs .", "the dog sat on the cat ."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_decoder(tmp_path_factory.mktemp("dec") / "m", TEXTS, d=32, layers=4)


@pytest.fixture(scope="module", params=[2, 3, 5])
def store(request, model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"n{request.param}")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out = build_decoder(tmp / "s", model_path=model, corpus_paths=[corpus], n=request.param, lower_layers=2,
                        position=False, progress=False)
    assert out["architecture"] == "decoder" and out["window"] == "causal"
    return hkstore.open(tmp / "s")


def _close(a, b, tol=2e-3):
    """fp16 storage: equal to a relative 2e-3 of the largest magnitude."""
    return (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1.0)


def test_meta_records_a_decoder_store(store):
    meta = store.meta
    assert meta["architecture"] == "decoder" and meta["window"] == "causal" and is_decoder_store(meta)
    assert not is_decoder_store({"n": 3})  # an old store: an encoder store
    dec = base_decoder(store)
    assert dec.lower_layers == 2


def test_full_coverage_inputs_equal_the_windowed_lower_layers(store, model):
    dec = load_decoder(model, lower_layers=2)
    n = store.meta["n"]
    seqs = dec.tokenize(TEXTS)
    inputs, mask, served = retrieve(store.snapshot(), "root", seqs)
    exact = windowed_lower(dec, seqs, n)
    for b, seq in enumerate(seqs):
        L = len(seq)
        assert _close(inputs[b, :L], exact[b])
        # every window is a full hit: its order is the number of real tokens in it
        assert served.order[b, :L].tolist() == [min(i + 1, n) for i in range(L)]
        # the first n - 1 positions see their whole prefix: exactly the full decoder's lower layers
        with torch.no_grad():
            full = dec.lower(torch.tensor([seq]))[0]
        assert _close(inputs[b, :n - 1], full[:n - 1])
        assert not _close(inputs[b, n:L], full[n:]) or L <= n  # further on, the window is a truncation
    assert (inputs[~mask] == 0).all()


def test_backoff_drops_the_farthest_left_token(store, model):
    dec = load_decoder(model, lower_layers=2)
    n, pad = store.meta["n"], store.meta["pad_id"]
    # "mat cat dog" never occurs: the window ending at "dog" backs off to [.., cat, dog]?
    # No: "cat dog" never occurs either, so it ends at the uni-gram of "dog".
    seq = dec.tokenize(["park vectors the cat"])[0]
    inputs, _, served = retrieve(store.snapshot(), "root", [seq])
    # position of "the" (index 3): window [.., park, vectors, the] unseen; "the" alone is a uni-gram
    i = 3
    assert served.order[0, i] == 1
    key = np.full((1, n), pad, dtype=np.uint32)
    key[0, -1] = seq[i]
    with torch.no_grad():
        uni = causal_values(dec, key)[0, -1]
    assert _close(inputs[0, i], uni)
    # "the cat" occurs: the window ending at "cat" backs off to the bi-gram [.., the, cat]
    assert served.order[0, 4] == 2
    key = np.full((1, n), pad, dtype=np.uint32)
    key[0, -2:] = seq[3:5]
    with torch.no_grad():
        bi = causal_values(dec, key)[0, -1]
    assert _close(inputs[0, 4], bi)


def test_hgpt_equals_the_decoder_on_sequences_no_longer_than_n(store, model):
    dec = load_decoder(model, lower_layers=2)
    n = store.meta["n"]
    seqs = [s[:n] for s in dec.tokenize(TEXTS)]
    inputs, mask, _ = retrieve(store.snapshot(), "root", seqs)
    with torch.no_grad():
        hgpt = dec.logits(dec.upper(inputs, mask))
        x, m = dec.pad(seqs)
        full = dec(x, m)
    assert _close(hgpt[mask], full[m], tol=5e-3)


def test_a_decoder_store_needs_causal_windows(tmp_path):
    with pytest.raises(StoreError, match="causal"):
        hkstore.create(tmp_path / "s", d=4, vocab_size=5, window="centered", architecture="decoder")
    with pytest.raises(StoreError, match="architecture"):
        hkstore.create(tmp_path / "t", d=4, vocab_size=5, architecture="seq2seq")


def test_rebuild_with_other_settings_is_refused(store, model, tmp_path):
    from runtime.model.stored import ManagerError

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS))
    with pytest.raises(ManagerError, match="other settings"):
        build_decoder(store.path, model_path=model, corpus_paths=[corpus], n=store.meta["n"], lower_layers=1,
                      position=False, progress=False)


def test_hkstore_build_makes_a_decoder_store_from_a_decoder_model(model, tmp_path):
    import json

    from click.testing import CliRunner

    from tools.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS))
    r = CliRunner().invoke(main, ["build", str(tmp_path / "s"), "--corpus", str(corpus), "--model", model, "--n", "3",
                                  "--lower-layers", "1", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["architecture"] == "decoder"
    with hkstore.open(tmp_path / "s") as st:
        assert st.meta["architecture"] == "decoder" and st.meta["window"] == "causal"
        assert st.snapshot().position("root") is not None  # fitted by default
    r = CliRunner().invoke(main, ["build", str(tmp_path / "s2"), "--corpus", str(corpus), "--model", model,
                                  "--lower-layers", "5", "--quiet"])
    assert r.exit_code == 1 and r.output.strip() == "Error: --lower-layers 5 is outside 0..4: the model has 4 layers"


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_other_layouts_and_a_checkpoint_without_pad_token(arch, tmp_path):
    """OPT and Llama decoder stores; Llama has no pad token, so PLOT keys use vocab_size as
    the empty slot (an id no text holds)."""
    transformers = pytest.importorskip("transformers")
    from runtime.model.tiny_decoder import make_tokenizer

    tok = make_tokenizer(TEXTS)
    V = tok.get_vocab_size()
    torch.manual_seed(0)
    if arch == "opt":
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=48, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=2, eos_token_id=3))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=48, pad_token_id=None, bos_token_id=2, eos_token_id=3))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    model.save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=tmp_path / "m", corpus_paths=[corpus], n=3, lower_layers=1,
                  progress=False, position=False)
    with hkstore.open(tmp_path / "s") as st:
        assert st.meta["pad_id"] == (V if arch == "llama" else 0)
        dec = base_decoder(st)
        seqs = dec.tokenize(TEXTS)
        inputs, mask, served = retrieve(st.snapshot(), "root", seqs)
        for b, v in enumerate(windowed_lower(dec, seqs, 3)):
            assert _close(inputs[b, :len(v)], v)
            assert served.order[b, :len(v)].tolist() == [min(i + 1, 3) for i in range(len(v))]


def test_a_domain_branch_compaction_and_diff_on_a_decoder_store(model, tmp_path):
    """The version tree works for decoder stores as for encoder ones: a branch (alpha rule) of
    a domain corpus, valued by a decoder with changed lower layers, serves its own windows and
    backs off through the root; compaction keeps every answer; diff sees the changed keys."""
    from hkstore.diff import diff_versions
    from runtime.construct.plot import build_branch
    from runtime.plot.causal import KeyValuer

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=model, corpus_paths=[corpus], n=3, lower_layers=2, position=False,
                  progress=False)
    dec = load_decoder(model, lower_layers=2)
    domain = load_decoder(model, lower_layers=2)
    with torch.no_grad():
        domain.layers[0].ffn_out.bias.add_(0.5)  # "domain-tuned" lower layers
    domain_seqs = dec.tokenize(TEXTS[2:])
    with hkstore.open(tmp_path / "s", writable=True) as st:
        out = build_branch(st, "storage", "root", KeyValuer(domain), domain_seqs, alpha=100)
        assert out["ngrams_kept"] > 0
        snap = st.snapshot()
        seqs = dec.tokenize(TEXTS)
        inputs, mask, served = retrieve(snap, "storage", seqs)
        own = windowed_lower(domain, domain_seqs, 3)
        assert _close(inputs[2, :len(own[0])], own[0])  # the branch's own windows
        root_inputs, _, _ = retrieve(snap, "root", seqs)
        names = served.version_names
        assert {names[v] for v in served.version[0, :len(seqs[0])]} >= {"root"}  # "the cat sat ..." backs off to root
        assert not _close(inputs[2, :len(own[0])], root_inputs[2, :len(own[0])])
        changed = diff_versions(snap, "root", snap, "storage")
        assert changed
        hkstore.compact(st, "storage")
        again, _, _ = retrieve(st.snapshot(), "storage", seqs)
        assert torch.equal(again, inputs)


def test_window_distillation_of_a_decoder_store(model, tmp_path):
    """distill_steps: the lower layers learn to give, on a window alone, the full-context output;
    the store's values come from the distilled layers (saved in the store)."""
    from runtime.model.stored import load_lower

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS * 4))
    out = build_decoder(tmp_path / "s", model_path=model, corpus_paths=[corpus], n=2, lower_layers=2, position=False,
                        distill_steps=40, distill_lr=3e-3, distill_batch=4, progress=False)
    assert out["distill"]["loss_last"] < out["distill"]["loss_first"]
    dec = load_decoder(model, lower_layers=2)
    seqs = dec.tokenize(TEXTS)
    with hkstore.open(tmp_path / "s") as st:
        entry = st.snapshot().versions[0]["info"]["lower_weights"]
        student = load_lower(st.path, entry, dec)
        inputs, mask, _ = retrieve(st.snapshot(), "root", seqs)
    with torch.no_grad():
        for b, (v, w) in enumerate(zip(windowed_lower(student, seqs, 2), windowed_lower(dec, seqs, 2))):
            assert _close(inputs[b, :len(v)], v)
            full = dec.lower(torch.tensor([seqs[b]]))[0]
            assert (v - full).pow(2).mean() < (w - full).pow(2).mean()  # closer to the full context
