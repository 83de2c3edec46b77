"""A random BERT checkpoint in the Hugging Face layout, small enough that building a store and
training tenants on it take milliseconds: the model of the tests and of `benchmarks.loadgen
--quick`. Its vocabulary is made from the given texts (their words, and every single
character as a word and a "##" piece, so any of that text tokenizes without [UNK]).
"""

from __future__ import annotations

import json
import math
import os
import re


def words_of(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, the way the tiny vocabulary splits text."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


def make_tiny_model(path, texts, d: int = 32, layers: int = 6, seed: int = 0) -> str:
    """Write config.json, vocab.txt and model.safetensors (random weights) to `path`."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    chars = sorted({c for t in texts for c in t.lower() if not c.isspace()})
    words = sorted({w for t in texts for w in words_of(t)})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += list(dict.fromkeys(chars + words + ["##" + c for c in chars]))
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    config = {"hidden_size": d, "num_attention_heads": 4, "intermediate_size": 2 * d, "num_hidden_layers": layers,
              "max_position_embeddings": 64, "vocab_size": len(vocab), "pad_token_id": 0, "layer_norm_eps": 1e-12,
              "hidden_act": "gelu", "_name_or_path": "tiny-bert"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    w = {"embeddings.word_embeddings.weight": rnd(len(vocab), d),
         "embeddings.position_embeddings.weight": rnd(64, d),
         "embeddings.token_type_embeddings.weight": rnd(2, d),
         "embeddings.LayerNorm.weight": torch.ones(d), "embeddings.LayerNorm.bias": torch.zeros(d)}
    shapes = {"attention.self.query": (d, d), "attention.self.key": (d, d), "attention.self.value": (d, d),
              "attention.output.dense": (d, d), "intermediate.dense": (2 * d, d), "output.dense": (d, 2 * d)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name, shape in shapes.items():
            # Scaled up so that attention is far from uniform: windows and full context differ.
            w[p + name + ".weight"] = rnd(*shape) / math.sqrt(shape[1]) * 5
            w[p + name + ".bias"] = torch.zeros(shape[0])
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + ln + ".weight"], w[p + ln + ".bias"] = torch.ones(d), torch.zeros(d)
    save_file(w, os.path.join(path, "model.safetensors"))
    return str(path)
