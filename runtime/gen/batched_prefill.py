"""The prefill of every request a batcher step admits, in one pass of the upper layers: the
prompts right-padded into (B, T, d), the base projections once for all of them, each prompt's
own LoRA by per-sequence batched matmuls (runtime.gen.lora_batch), the keys and values written
straight into the sequences' KV pool pages.

    logits = prefill_batch(decoder, h, mask, seqs, pool)   # (B, vocab): after each prompt's last token

Equal to each prompt's own prefill (runtime.gen.plot_decode.PlotDecoder.prefill: Decoder.upper
with a KVCache) to float rounding: a prompt's padding is masked out of every other position
and never written to the pool. Rows with pure-LoRA PETs (or none) go in one call; rows sharing
any other PET go in one call per PET (shared_pet: runtime.gen.plot_decode.prefill_many).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gen.batched_step import ffn_in_act, qkv
from runtime.gen.lora_batch import LoraBatch
from runtime.gen.row_precision import RowPrecision
from runtime.model import pet as petlib
from runtime.model.decoder import _act, _norm, _rotate


@torch.no_grad()
def prefill_batch(decoder, h: torch.Tensor, mask: torch.Tensor, seqs, pool, shared_pet=False,
                  precision: str = "fp32") -> torch.Tensor:
    """Upper layers over h (B, T, d) (mask (B, T): real tokens, right-padded) with each row's
    LoRA (seqs[b].pet); keys and values of the real positions go to seqs[b].slots in pool,
    whose kv_len becomes its prompt's length. Returns the last real position's logits.
    shared_pet: every row has the same PET, of any kind (runtime.model.pet applies it whole:
    adapters, BitFit, diff, norm deltas), instead of per-row LoRAs. precision: the shared GEMMs'
    (runtime.gen.row_precision.resolve's mode; a projection the shared PET edits runs fp32)."""
    B, T, _ = h.shape
    lengths = mask.sum(1)
    pages = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        pages[b, :int(lengths[b])] = s.slots[:int(lengths[b])]
    h, rp = upper_batch(decoder, h, mask, [s.pet for s in seqs], (pool, pages), shared_pet, precision)
    for b, s in enumerate(seqs):
        s.kv_len = int(lengths[b])
        s.cache = None
    return decoder.logits(h[torch.arange(B), lengths - 1], linear=rp.linear)


@torch.no_grad()
def upper_batch(decoder, h: torch.Tensor, mask: torch.Tensor, pets, kv=None, shared_pet=False,
                precision: str = "fp32"):
    """(the upper layers' output over every position of h, the rows' RowPrecision): prefill's
    arithmetic, each row with its PET (pets[b]) at its precision. kv: (pool, pages (B, T)) that
    the real positions' keys and values are written to, or None (a tenant's perplexity at a
    precision is measured through this, runtime.construct.decoder_tenant)."""
    c = decoder.config
    B, T, _ = h.shape
    pet = pets[0] if shared_pet else None
    lb = LoraBatch([None] * B if shared_pet else list(pets))
    rp = RowPrecision.of(precision, pets)
    positions = decoder.positions_of(mask)
    allowed = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None, None] & mask[:, None, None, :]
    hd, H, KV = c.head_dim, c.heads, c.kv_heads

    def lin(i, target, x):
        lin_ = getattr(decoder.layers[i], target)
        if pet is not None:
            return petlib.linear(pet, i, target, x, lin_, gemm=rp.linear)
        y = rp.linear(x, lin_.weight, lin_.bias)
        d = lb.delta(i, target, x)
        return y if d is None else y + d

    for i in range(decoder.lower_layers, c.num_layers):
        blk = decoder.layers[i]
        x = _norm(pet, i, "ln_attn", h, blk.ln_attn)
        q, k, v = qkv(i, blk, x, rp.linear, lb) if pet is None else (lin(i, "q", x), lin(i, "k", x), lin(i, "v", x))
        q, k, v = (t.reshape(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        if c.rotary:
            q, k = _rotate(q, positions, c.rope_theta), _rotate(k, positions, c.rope_theta)
        if kv is not None:
            pool, pages = kv
            pool.k[i - pool.first, pages[mask]] = k.transpose(1, 2)[mask]
            pool.v[i - pool.first, pages[mask]] = v.transpose(1, 2)[mask]
        if KV != H:
            k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        # (every query has a real key, position 0, so no row of the mask is empty)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(B, T, H * hd)
        h = h + lin(i, "o", ctx)
        x = _norm(pet, i, "ln_ffn", h, blk.ln_ffn)
        if c.gated:
            f = _act(c.act, rp.linear(x, blk.ffn_gate.weight, blk.ffn_gate.bias)) * lin(i, "ffn_in", x)
        elif pet is None:
            f = ffn_in_act(rp, lb, i, blk, x, c.act, lambda: _act(c.act, lin(i, "ffn_in", x)))
        else:
            f = _act(c.act, lin(i, "ffn_in", x))
        h = h + lin(i, "ffn_out", f)
    return h, rp
