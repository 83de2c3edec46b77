"""A random GPT-2-layout decoder small enough that building a causal store and decoding with it
take milliseconds: the model of the decoder tests. Written without transformers (config.json,
model.safetensors, tokenizer.json), so it is read by runtime.model.decoder.load_decoder like any
checkpoint. Its vocabulary is the words of the given texts (runtime.model.tiny.words_of).
"""

from __future__ import annotations

import json
import os

from runtime.model.tiny import words_of

SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]  # ids 0..3


def make_tokenizer(texts, bos: bool = True):
    """A word-level tokenizers.Tokenizer over the words of texts: lower-cased, split into words
    and punctuation, [BOS] prepended to every encoding when bos."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab = {t: i for i, t in enumerate(SPECIALS + sorted({w for t in texts for w in words_of(t)}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated")])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    tok.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    return tok


def make_tiny_decoder(path, texts, d: int = 32, layers: int = 4, heads: int = 4, max_len: int = 64,
                      seed: int = 0, scale: float = 3.0) -> str:
    """Write a random GPT-2 checkpoint (config.json, model.safetensors, tokenizer.json) to path.
    Projections are scaled up (`scale`) so attention is far from uniform and a truncated window
    differs from the full context."""
    import math

    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(texts)
    tok.save(os.path.join(path, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_embd": d,
              "n_head": heads, "n_layer": layers, "n_positions": max_len, "n_inner": None,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "pad_token_id": 0, "bos_token_id": 2,
              "eos_token_id": 3, "tie_word_embeddings": True, "_name_or_path": "tiny-gpt2"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w = {"transformer.wte.weight": rnd(vocab, d), "transformer.wpe.weight": rnd(max_len, d),
         "transformer.ln_f.weight": torch.ones(d), "transformer.ln_f.bias": torch.zeros(d)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        for name, (n_in, n_out) in {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, 4 * d),
                                    "mlp.c_proj": (4 * d, d)}.items():
            w[p + name + ".weight"] = rnd(n_in, n_out, std=scale / math.sqrt(n_in))  # Conv1D: (in, out)
            w[p + name + ".bias"] = rnd(n_out, std=0.02)
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"], w[p + ln + ".bias"] = torch.ones(d), torch.zeros(d)
    save_file(w, os.path.join(path, "model.safetensors"))
    return str(path)
