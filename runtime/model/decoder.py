"""A plain PyTorch reference of a causal decoder (GPT-2, OPT, Llama layouts), split like the
encoder into lower layers (what causal PLOT tables replace) and upper layers (per tenant).

    dec = load_decoder(path, lower_layers=2)
    h = dec.lower(ids)                       # (B, L, d): embeddings + layers [0, lower_layers)
    h = dec.upper(h, pet=pet, kv_cache=c)    # layers [lower_layers, num_layers), pre final norm
    logits = dec.logits(h)                   # final norm + LM head: (B, L, vocab)

Everything is fp32, batch-first and dropout-free. `mask` (B, L) bool marks real tokens; a token
sits at position "number of real tokens before it" and attends to real tokens at or before it,
so a left-padded row (a causal PLOT key like [pad, b, c]) is computed exactly as the short
sequence [b, c] on its own, and a right-padded batch row as its unpadded self.

The upper layers can keep a KVCache: keys and values of every position already run, so a
decode step runs only the new tokens. Names of the per-layer weights follow the encoder's
(q, k, v, o, ffn_in, ffn_out, ln_attn, ln_ffn; plus ffn_gate for gated FFNs) so the PETs of
runtime.model.pet apply to decoder layers unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash
from torch import nn

from runtime.model import pet as petlib
from runtime.model.decoder_config import DecoderConfig, read_config, tokenizer_file
from runtime.model.encoder import frozen_with, read_checkpoint, right_pad

# -- pieces -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _norm(pet, i: int, name: str, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """LayerNorm or RMSNorm `name` of layer i, with pet's gain (and shift) deltas if it has any."""
    if isinstance(norm, nn.LayerNorm):
        return petlib.layer_norm(pet, i, name, x, norm)
    if pet is not None and (k := f"layers.{i}.norm.{name}.weight") in pet.tensors:
        return norm(x, norm.weight + pet.tensors[k])
    return norm(x)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    return F.silu(x)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x (B, H, L, hd) at positions (B, L): the half-split
    convention (first half of each head paired with the second)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, L, hd/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class KVCache:
    """Keys and values (B, kv_heads, T, hd) per layer index of every position already run,
    and which of those T positions are real tokens (B, T). One cache per batch of sequences
    that advance together (a single sequence: B = 1)."""

    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # (B,) the next position of each row

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]


class Block(nn.Module):
    """One pre-norm decoder layer's weights; the computation lives in Decoder.layer."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        kv = c.kv_heads * c.head_dim
        self.q = nn.Linear(c.d, c.heads * c.head_dim, bias=c.bias)
        self.k = nn.Linear(c.d, kv, bias=c.bias)
        self.v = nn.Linear(c.d, kv, bias=c.bias)
        self.o = nn.Linear(c.heads * c.head_dim, c.d, bias=c.bias)
        self.ffn_in = nn.Linear(c.d, c.ffn, bias=c.bias)
        if c.gated:
            self.ffn_gate = nn.Linear(c.d, c.ffn, bias=c.bias)
        self.ffn_out = nn.Linear(c.ffn, c.d, bias=c.bias)
        norm = (lambda: nn.LayerNorm(c.d, eps=c.eps)) if c.norm == "layer" else (lambda: RMSNorm(c.d, c.eps))
        self.ln_attn, self.ln_ffn = norm(), norm()


# -- the model ----------------------------------------------------------------------------------


class Decoder(nn.Module):
    is_decoder = True

    def __init__(self, config: DecoderConfig, tokenizer=None, tokenizer_bytes: bytes = b"", lower_layers: int = 2):
        super().__init__()
        if not 0 <= lower_layers <= config.num_layers:
            raise ValueError(f"lower_layers={lower_layers} is outside 0..{config.num_layers}")
        self.config = config
        self.lower_layers = lower_layers
        self.tokenizer = tokenizer
        self._fingerprint = xxhash.xxh64(tokenizer_bytes).hexdigest()
        c = config
        self.word = nn.Embedding(c.vocab_size, c.d)
        if not c.rotary:
            self.position = nn.Embedding(c.max_len + c.pos_offset, c.d)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.ln_final = nn.LayerNorm(c.d, eps=c.eps) if c.norm == "layer" else RMSNorm(c.d, c.eps)
        if not c.tied:
            self.lm_head = nn.Parameter(torch.zeros(c.vocab_size, c.d))

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, texts: list[str], max_len: int | None = None) -> list[list[int]]:
        """Token ids of each text, with the special tokens its tokenizer.json adds (a BOS for
        most decoders), truncated to max_len (default: config.max_len)."""
        max_len = max_len or self.config.max_len
        return [list(e.ids)[:max_len] for e in self.tokenizer.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def tokenizer_fingerprint(self) -> str:
        """XXH64 (hex) of the tokenizer file, so a store refuses ids from another vocabulary."""
        return self._fingerprint

    def pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad id lists into (ids (B, L) int64, mask (B, L) bool)."""
        return right_pad(seqs, self.config.pad_id)

    # -- the network ------------------------------------------------------------------------

    @staticmethod
    def positions_of(mask: torch.Tensor, start=0) -> torch.Tensor:
        """Position of each slot: start + the number of real tokens before it (pads get the
        position of the next real token; they are masked out anyway)."""
        return (torch.cumsum(mask.long(), -1) - mask.long()) + torch.as_tensor(start).reshape(-1, 1)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Word (+ learned position) embeddings; pad ids (possibly outside the vocabulary) embed as 0's row."""
        c = self.config
        h = self.word(torch.where(ids < c.vocab_size, ids, 0))
        if not c.rotary:
            h = h + self.position((positions + c.pos_offset).clamp(max=self.position.num_embeddings - 1))
        return h

    def layer(self, i: int, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, pet=None,
              cache: KVCache | None = None) -> torch.Tensor:
        """Decoder layer i on h (B, T, d) at positions (B, T); with a cache, attends to the
        cached positions too and appends this step's keys and values to it."""
        blk, c = self.layers[i], self.config
        B, T, _ = h.shape
        x = _norm(pet, i, "ln_attn", h, blk.ln_attn)
        q = petlib.linear(pet, i, "q", x, blk.q).view(B, T, c.heads, c.head_dim).transpose(1, 2)
        k = petlib.linear(pet, i, "k", x, blk.k).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = petlib.linear(pet, i, "v", x, blk.v).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.rotary:
            q, k = _rotate(q, positions, c.rope_theta), _rotate(k, positions, c.rope_theta)
        keys_mask = mask
        if cache is not None:
            if i in cache.k:
                k, v = torch.cat([cache.k[i], k], 2), torch.cat([cache.v[i], v], 2)
            cache.k[i], cache.v[i] = k, v
            keys_mask = torch.cat([cache.mask, mask], 1) if cache.mask is not None else mask
        if c.kv_heads != c.heads:
            k, v = (t.repeat_interleave(c.heads // c.kv_heads, 1) for t in (k, v))
        S = k.shape[2]
        # Query t sits at key index S - T + t: it sees keys up to there that are real tokens.
        causal = torch.arange(S)[None, :] <= (torch.arange(T) + S - T)[:, None]
        allowed = causal[None, None] & keys_mask[:, None, None, :]
        scores = q @ k.transpose(-2, -1) / math.sqrt(c.head_dim)
        # finfo.min rather than -inf: a pad query with no real key before it stays finite.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, c.heads * c.head_dim)
        h = h + petlib.linear(pet, i, "o", ctx, blk.o)
        x = _norm(pet, i, "ln_ffn", h, blk.ln_ffn)
        if c.gated:
            f = _act(c.act, F.linear(x, blk.ffn_gate.weight, blk.ffn_gate.bias)) * petlib.linear(pet, i, "ffn_in", x,
                                                                                                   blk.ffn_in)
        else:
            f = _act(c.act, petlib.linear(pet, i, "ffn_in", x, blk.ffn_in))
        return h + petlib.linear(pet, i, "ffn_out", f, blk.ffn_out)

    def _run(self, layers, h, mask, positions, pet, cache):
        B, T = h.shape[:2]
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool)
        if positions is None:
            start = cache.positions if cache is not None and cache.positions is not None else 0
            positions = self.positions_of(mask, start)
        for i in layers:
            h = self.layer(i, h, positions, mask, pet, cache)
        if cache is not None:
            cache.mask = mask if cache.mask is None else torch.cat([cache.mask, mask], 1)
            cache.positions = positions[:, -1] + mask[:, -1].long() if T else cache.positions
        return h

    def lower(self, ids: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache: KVCache | None = None) -> torch.Tensor:
        """Embeddings + layers [0, lower_layers): what a causal PLOT table stores. With a
        cache (the full decoder's generation loop) the lower layers keep their own."""
        if mask is None:
            mask = torch.ones(ids.shape, dtype=torch.bool)
        if positions is None:
            start = cache.positions if cache is not None and cache.positions is not None else 0
            positions = self.positions_of(mask, start)
        h = self.embed(ids, positions)
        return self._run(range(self.lower_layers), h, mask, positions, None, cache)

    def upper(self, h: torch.Tensor, mask: torch.Tensor | None = None, pet=None, kv_cache: KVCache | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Layers [lower_layers, num_layers), the per-tenant part; output before the final norm.
        Positions default to the mask's (offset by what kv_cache already holds)."""
        return self._run(range(self.lower_layers, self.config.num_layers), h, mask, positions, pet, kv_cache)

    def logits(self, h: torch.Tensor, pet=None, linear=F.linear) -> torch.Tensor:
        """Final norm + LM head: (..., vocab_size); `linear(x, w)` runs the head's GEMM."""
        w = self.word.weight if self.config.tied else self.lm_head
        return linear(self.ln_final(h), w)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, pet=None) -> torch.Tensor:
        """Logits (B, L, vocab) of the whole decoder."""
        return self.logits(self.upper(self.lower(ids, mask), mask, pet), pet)

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, pet=None, stop: int | None = None) -> list[int]:
        """The reference greedy continuation of one prompt (full decoder, one cache for the
        lower layers and one for the upper): the new token ids, at most max_new_tokens."""
        lower_cache, upper_cache = KVCache(), KVCache()
        x = torch.tensor([ids], dtype=torch.long)
        out = []
        for _ in range(max_new_tokens):
            if upper_cache.length + x.shape[1] > self.config.max_len and not self.config.rotary:
                break
            h = self.upper(self.lower(x, cache=lower_cache), pet=pet, kv_cache=upper_cache)
            token = int(self.logits(h[:, -1], pet).argmax(-1))
            out.append(token)
            if token == stop:
                break
            x = torch.tensor([[token]])
        return out

    def lower_parameters(self) -> list[nn.Parameter]:
        emb = [*self.word.parameters()] + ([] if self.config.rotary else [*self.position.parameters()])
        return emb + list(self.layers[: self.lower_layers].parameters())

    def upper_parameters(self) -> list[nn.Parameter]:
        return list(self.layers[self.lower_layers:].parameters())


# -- loading ------------------------------------------------------------------------------------


def load_decoder(path: str | Path, lower_layers: int = 2) -> Decoder:
    """Load an HF causal-LM directory (gpt2, opt or llama model_type): config.json,
    model.safetensors, and tokenizer.json (or vocab.txt, or GPT-2's vocab.json + merges.txt).
    Weights come back frozen (requires_grad False) and in eval mode."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such model directory")
    config = read_config(path)
    tokenizer, tokenizer_bytes = read_tokenizer(path)
    return frozen_with(Decoder(config, tokenizer, tokenizer_bytes, lower_layers), _read_weights(path, config), path)


def read_tokenizer(path: Path):
    """(tokenizers.Tokenizer, the bytes of its file) of a model directory."""

    file = Path(tokenizer_file(path))
    if file.name == "vocab.json":
        merges = path / "merges.txt"
        if not merges.is_file():
            raise ValueError(f"{path}: vocab.json without merges.txt")
        from tokenizers.implementations import ByteLevelBPETokenizer

        tokenizer = ByteLevelBPETokenizer(str(file), str(merges))
        return tokenizer, file.read_bytes()
    from runtime.model.encoder import _read_tokenizer

    return _read_tokenizer(path)


def _gpt2_weights(hf: dict, c: DecoderConfig) -> dict:
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    w = {"word.weight": hf["wte.weight"], "position.weight": hf["wpe.weight"],
         "ln_final.weight": hf["ln_f.weight"], "ln_final.bias": hf["ln_f.bias"]}
    for i in range(c.num_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        # Conv1D keeps weights as (in, out): transpose to nn.Linear's (out, in).
        qkv_w, qkv_b = hf[p + "attn.c_attn.weight"].t(), hf[p + "attn.c_attn.bias"]
        for j, t in enumerate("qkv"):
            w[q + t + ".weight"] = qkv_w[j * c.d:(j + 1) * c.d]
            w[q + t + ".bias"] = qkv_b[j * c.d:(j + 1) * c.d]
        for ours, theirs in (("o", "attn.c_proj"), ("ffn_in", "mlp.c_fc"), ("ffn_out", "mlp.c_proj")):
            w[q + ours + ".weight"], w[q + ours + ".bias"] = hf[p + theirs + ".weight"].t(), hf[p + theirs + ".bias"]
        for ours, theirs in (("ln_attn", "ln_1"), ("ln_ffn", "ln_2")):
            w[q + ours + ".weight"], w[q + ours + ".bias"] = hf[p + theirs + ".weight"], hf[p + theirs + ".bias"]
    return w


def _opt_weights(hf: dict, c: DecoderConfig) -> dict:
    hf = {k.removeprefix("model.").removeprefix("decoder."): v for k, v in hf.items()}
    w = {"word.weight": hf["embed_tokens.weight"], "position.weight": hf["embed_positions.weight"],
         "ln_final.weight": hf["final_layer_norm.weight"], "ln_final.bias": hf["final_layer_norm.bias"]}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
             "ffn_in": "fc1", "ffn_out": "fc2", "ln_attn": "self_attn_layer_norm", "ln_ffn": "final_layer_norm"}
    for i in range(c.num_layers):
        for ours, theirs in names.items():
            for s in ("weight", "bias") if c.bias or ours.startswith("ln") else ("weight",):
                w[f"layers.{i}.{ours}.{s}"] = hf[f"layers.{i}.{theirs}.{s}"]
    return w


def _llama_weights(hf: dict, c: DecoderConfig) -> dict:
    lm_head = hf.get("lm_head.weight")
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    w = {"word.weight": hf["embed_tokens.weight"], "ln_final.weight": hf["norm.weight"]}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "ffn_in": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_out": "mlp.down_proj",
             "ln_attn": "input_layernorm", "ln_ffn": "post_attention_layernorm"}
    for i in range(c.num_layers):
        for ours, theirs in names.items():
            w[f"layers.{i}.{ours}.weight"] = hf[f"layers.{i}.{theirs}.weight"]
    if not c.tied:
        if lm_head is None:
            raise KeyError("lm_head.weight")
        w["lm_head"] = lm_head
    return w


def _read_weights(path: Path, c: DecoderConfig) -> dict[str, torch.Tensor]:
    file, hf = read_checkpoint(path)
    read = {"gpt2": _gpt2_weights, "opt": _opt_weights, "llama": _llama_weights}[c.arch]
    try:
        weights = read(hf, c)
    except KeyError as e:
        raise ValueError(f"{file}: not a {c.arch} checkpoint (no {e.args[0]})") from None
    if not c.tied and "lm_head" not in weights:
        if "lm_head.weight" not in hf:
            raise ValueError(f"{file}: config.json says the LM head is not tied, but there is no lm_head.weight")
        weights["lm_head"] = hf["lm_head.weight"]
    return {k: v.float().contiguous() for k, v in weights.items()}
