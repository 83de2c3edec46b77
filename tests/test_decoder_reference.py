"""runtime.model.decoder matches transformers on the same weights: GPT-2, OPT and Llama layouts,
tiny random configurations that transformers builds and saves offline."""

import numpy as np
import pytest
import torch

from runtime.model.decoder import KVCache, load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder, make_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]


def _hf_model(arch: str, vocab: int):
    t = transformers
    common = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    if arch == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=48, **common))
    if arch == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4,
                                            max_position_embeddings=48, word_embed_proj_dim=32, **common))
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, num_hidden_layers=4, intermediate_size=48,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                            **common))


@pytest.fixture(scope="module", params=["gpt2", "opt", "llama"])
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    tok = make_tokenizer(TEXTS)
    model = _hf_model(request.param, tok.get_vocab_size()).eval()
    with torch.no_grad():  # larger weights than the init's 0.02: far from uniform attention
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return model, load_decoder(path, lower_layers=2)


def test_logits_match_transformers(pair):
    model, dec = pair
    ids = dec.tokenize(TEXTS)
    assert all(s[0] == 2 for s in ids)  # the tokenizer.json's [BOS]
    for seq in ids:
        x = torch.tensor([seq])
        with torch.no_grad():
            theirs = model(x).logits
            ours = dec(x)
        assert theirs.abs().max() > 1.0  # not a degenerate comparison
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_right_padded_batch_matches_rows(pair):
    _, dec = pair
    ids = dec.tokenize(TEXTS)
    x, mask = dec.pad(ids)
    with torch.no_grad():
        batch = dec(x, mask)
        for b, seq in enumerate(ids):
            alone = dec(torch.tensor([seq]))[0]
            assert (batch[b, :len(seq)] - alone).abs().max().item() <= 1e-4


def test_left_padded_row_is_the_short_sequence(pair):
    """A causal PLOT key [pad, pad, b, c] is valued as the sequence [b, c] alone."""
    _, dec = pair
    pad = dec.config.pad_id
    seq = dec.tokenize(TEXTS[:1])[0][:4]
    x = torch.tensor([[pad, pad, *seq]])
    with torch.no_grad():
        padded = dec.lower(x, x != pad)[0, 2:]
        alone = dec.lower(torch.tensor([seq]))[0]
    assert (padded - alone).abs().max().item() <= 1e-5


def test_kv_cache_steps_match_full_pass(pair):
    _, dec = pair
    seq = dec.tokenize(TEXTS[1:2])[0]
    with torch.no_grad():
        full = dec(torch.tensor([seq]))[0]
        lower_c, upper_c = KVCache(), KVCache()
        parts = [seq[:5]] + [[t] for t in seq[5:]]
        steps = []
        for part in parts:
            x = torch.tensor([part])
            steps.append(dec.logits(dec.upper(dec.lower(x, cache=lower_c), kv_cache=upper_c))[0])
    assert (torch.cat(steps) - full).abs().max().item() <= 1e-4


def test_greedy_matches_transformers_generate(pair):
    model, dec = pair
    for prompt in dec.tokenize(["the cat", "storage engines keep"]):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, min_new_tokens=10)[0, len(prompt):].tolist()
        ours = dec.greedy(prompt, 10)
        assert ours == theirs


def test_split_is_lower_then_upper(pair):
    _, dec = pair
    assert len(dec.lower_parameters()) and len(dec.upper_parameters())
    n_all = sum(p.numel() for p in dec.parameters())
    head = 0 if dec.config.tied else dec.lm_head.numel()
    n_split = sum(p.numel() for p in dec.lower_parameters() + dec.upper_parameters()) + dec.ln_final.weight.numel()
    n_split += getattr(dec.ln_final, "bias", torch.zeros(0)).numel() + head
    assert n_split == n_all


def test_tiny_decoder_loads(tmp_path):
    dec = load_decoder(make_tiny_decoder(tmp_path / "m", TEXTS), lower_layers=1)
    ids = dec.tokenize(TEXTS)
    assert dec.decode(ids[0][1:]) == TEXTS[0]
    with torch.no_grad():
        out = dec(torch.tensor([ids[0]]))
    assert out.shape == (1, len(ids[0]), dec.config.vocab_size) and np.isfinite(out.numpy()).all()


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "not a supported decoder"),
    ({"activation_function": "mish"}, "activation"),
    ({"n_embd": 48}, "does not match config.json"),
])
def test_bad_checkpoints_are_refused(tmp_path, change, message):
    import json

    path = make_tiny_decoder(tmp_path / "m", TEXTS)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_decoder(path)
