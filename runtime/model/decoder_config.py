"""What a decoder checkpoint directory says about its model, read without torch.

A Hugging Face causal-LM directory (config.json + model.safetensors + a tokenizer) names its
architecture in config.json's "model_type". Three layouts are understood:

    gpt2   learned positions, pre-LN LayerNorm, fused Conv1D q/k/v, gelu (tanh), tied LM head
    opt    learned positions offset by 2, pre-LN LayerNorm, relu FFN, tied LM head
    llama  rotary positions, RMSNorm, gated SiLU FFN (gate * up -> down), grouped K/V heads

`read_config` turns any of them into one DecoderConfig; `decoder_meta` is the store metadata of
such a directory (hkstore.model_meta's counterpart for decoders).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ARCHITECTURES = ("gpt2", "opt", "llama")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")


@dataclass(frozen=True)
class DecoderConfig:
    arch: str
    vocab_size: int
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    num_layers: int
    max_len: int
    eps: float
    # The id that stands for "no token" in PLOT keys. A checkpoint without a pad token gets
    # vocab_size: an id no text can hold (the model never embeds it).
    pad_id: int
    bos_id: int | None
    eos_id: int | None
    act: str  # "gelu_tanh", "gelu", "relu" or "silu"
    norm: str  # "layer" or "rms"
    rotary: bool
    rope_theta: float
    pos_offset: int  # OPT stores position p at row p + 2 of its table
    bias: bool  # attention and FFN projections carry biases
    gated: bool  # FFN is down(act(gate(x)) * up(x))
    tied: bool  # the LM head is the word embedding


def _first_id(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value


_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
         "relu": "relu", "silu": "silu", "swish": "silu"}


def read_config(path) -> DecoderConfig:
    """DecoderConfig of a checkpoint directory; ValueError (one line) for anything unsupported."""
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not a model directory (no config.json)") from None
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{file}: not valid JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: not a JSON object")
    arch = raw.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: model_type {arch!r} is not a supported decoder ({', '.join(ARCHITECTURES)})")
    try:
        if arch == "gpt2":
            d, heads = raw["n_embd"], raw["n_head"]
            act = raw.get("activation_function", "gelu_new")
            if raw.get("scale_attn_by_inverse_layer_idx") or not raw.get("scale_attn_weights", True):
                raise ValueError(f"{file}: only GPT-2's default attention scaling is supported")
            common = dict(d=d, heads=heads, kv_heads=heads, head_dim=d // heads, ffn=raw.get("n_inner") or 4 * d,
                          num_layers=raw["n_layer"], max_len=raw["n_positions"], eps=raw.get("layer_norm_epsilon", 1e-5),
                          norm="layer", rotary=False, rope_theta=0.0, pos_offset=0, bias=True, gated=False,
                          tied=raw.get("tie_word_embeddings", True))
        elif arch == "opt":
            d, heads = raw["hidden_size"], raw["num_attention_heads"]
            act = raw.get("activation_function", "relu")
            if not raw.get("do_layer_norm_before", True) or raw.get("_remove_final_layer_norm", False):
                raise ValueError(f"{file}: only pre-LayerNorm OPT models (not OPT-350m's post-LN) are supported")
            if raw.get("word_embed_proj_dim", d) != d:
                raise ValueError(f"{file}: word_embed_proj_dim != hidden_size (projected embeddings) is not supported")
            if not raw.get("layer_norm_elementwise_affine", True):
                raise ValueError(f"{file}: LayerNorms without weights are not supported")
            common = dict(d=d, heads=heads, kv_heads=heads, head_dim=d // heads, ffn=raw["ffn_dim"],
                          num_layers=raw["num_hidden_layers"], max_len=raw["max_position_embeddings"], eps=1e-5,
                          norm="layer", rotary=False, rope_theta=0.0, pos_offset=2, bias=raw.get("enable_bias", True),
                          gated=False, tied=raw.get("tie_word_embeddings", True))
        else:
            d, heads = raw["hidden_size"], raw["num_attention_heads"]
            act = raw.get("hidden_act", "silu")
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"{file}: only default rotary positions are supported (no rope scaling)")
            if raw.get("attention_bias", False) or raw.get("mlp_bias", False):
                raise ValueError(f"{file}: Llama projections with biases are not supported")
            common = dict(d=d, heads=heads, kv_heads=raw.get("num_key_value_heads") or heads,
                          head_dim=raw.get("head_dim") or d // heads, ffn=raw["intermediate_size"],
                          num_layers=raw["num_hidden_layers"], max_len=raw["max_position_embeddings"],
                          eps=raw.get("rms_norm_eps", 1e-6), norm="rms", rotary=True,
                          rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), pos_offset=0,
                          bias=False, gated=True, tied=raw.get("tie_word_embeddings", False))
        if act not in _ACTS:
            raise ValueError(f"{file}: activation {act!r} is not supported")
        vocab = int(raw["vocab_size"])
        pad = raw.get("pad_token_id")
        return DecoderConfig(arch=arch, vocab_size=vocab, act=_ACTS[act], pad_id=vocab if pad is None else int(pad),
                             bos_id=_first_id(raw.get("bos_token_id")), eos_id=_first_id(raw.get("eos_token_id")),
                             **common)
    except KeyError as e:
        raise ValueError(f"{file}: missing field {e}") from None


def is_decoder_dir(path) -> bool:
    """Whether config.json names a supported decoder model_type (no other checks)."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            return json.load(f).get("model_type") in ARCHITECTURES
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_file(path) -> str:
    """The file the tokenizer is read from (its bytes fingerprint the vocabulary)."""
    for name in TOKENIZER_FILES:
        file = os.path.join(os.fspath(path), name)
        if os.path.isfile(file):
            return file
    raise ValueError(f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)})")


def decoder_meta(path) -> dict:
    """Store metadata of a decoder directory: hkstore.model_meta's fields plus architecture."""
    from formats.xxh64 import checksum

    c = read_config(path)
    with open(tokenizer_file(path), "rb") as f:
        fingerprint = f"{checksum(f.read()):016x}"
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            name = json.load(f).get("_name_or_path")
    except (OSError, ValueError):
        name = None
    return {"base_model": name or os.path.basename(os.path.abspath(path)), "d": c.d, "vocab_size": c.vocab_size,
            "pad_id": c.pad_id, "num_layers": c.num_layers, "tokenizer_fingerprint": fingerprint,
            "architecture": "decoder", "model_type": c.arch}
