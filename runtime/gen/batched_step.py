"""One decode step of the upper layers for many sequences at once (CPU reference of the batched
decode path): the projections run as one GEMM per group of sequences sharing a PET (all
base-model rows together; SGMV-like grouping, nothing merged into the base weights), attention
runs per sequence against its own KV cache (caches have different lengths).

    logits = upper_step(decoder, seqs, h)     # h (B, d): each sequence's newest token's input

When every PET of the step is a pure LoRA (or none), the base projections run once for all rows
(q, k and v as one GEMM) and each row's LoRA is added by BGMV / SGMV (runtime.gen.lora_batch):
no per-group loop. The shared GEMMs run in fp32 or bf16 per row (runtime.gen.row_precision),
the FFN's activation fused into its first GEMM where no row's LoRA edits that projection.

Equal to running runtime.model.decoder.Decoder.upper on each sequence alone with its cache and
PET (tests/test_batcher.py checks the generated text), with one weight read per group instead
of one per sequence.
"""

from __future__ import annotations

import math

import torch

from runtime.gen.lora_batch import LoraBatch, lora_only
from runtime.gen.row_precision import RowPrecision
from runtime.model import pet as petlib
from runtime.model.decoder import _act, _norm, _rotate


def _groups(seqs) -> list[tuple[object, torch.Tensor]]:
    """(pet, row indices) per distinct PET (None: the base model), in first-seen order."""
    rows: dict[int, list[int]] = {}
    pets: dict[int, object] = {}
    for b, s in enumerate(seqs):
        rows.setdefault(id(s.pet), []).append(b)
        pets[id(s.pet)] = s.pet
    return [(pets[k], torch.tensor(v)) for k, v in rows.items()]


def _grouped(groups, out_dim: int, x: torch.Tensor, fn) -> torch.Tensor:
    """fn(pet, x[rows], gemm) for every group (pet, rows, gemm), scattered back into (B, out_dim)."""
    if len(groups) == 1:
        return fn(groups[0][0], x, groups[0][-1])
    y = x.new_empty(x.shape[0], out_dim)
    for pet, rows, gemm in groups:
        y[rows] = fn(pet, x[rows], gemm)
    return y


# (row PETs' ids, LoraBatch) of the latest step: reused while the batch stays the same (its
# stacks hold the PETs, so equal ids are the same PETs); one tuple, swapped whole, for threads.
_last_lora: tuple = ((), None)


def _lora_batch(pets) -> LoraBatch:
    global _last_lora
    key, last = tuple(id(p) for p in pets), _last_lora
    if last[0] == key:
        return last[1]
    lb = LoraBatch(pets)
    _last_lora = (key, lb)
    return lb


@torch.no_grad()
def upper_step(decoder, seqs, h: torch.Tensor, pool=None, precision: str = "fp32") -> torch.Tensor:
    """Run the upper layers on one new position per sequence (h (B, d)), appending to each
    sequence's cache (its pages of pool, a runtime.gen.kv_pool.KVPool: attention for all rows
    at once; else its own KVCache, one sequence after another); returns the next-token
    logits (B, vocab). precision: the shared GEMMs' (runtime.gen.row_precision.resolve's mode)."""
    c = decoder.config
    B = h.shape[0]
    pets = [s.pet for s in seqs]
    rp = RowPrecision.of(precision, pets)
    if all(lora_only(p) for p in pets):  # base projections once, LoRA by BGMV / SGMV (runtime.gen.lora_batch)
        lb = _lora_batch(pets)
        groups = [(None, None, None)]

        def _lin(i, target, x, lin_):
            y = rp.linear(x, lin_.weight, lin_.bias)
            lb.add_to(i, target, x, y)
            return y
    else:
        # (a group shares one PET, so one precision; an edited projection runs fp32 whatever it is)
        groups = [(pet, rows, RowPrecision.of(precision, [pet]).linear) for pet, rows in _groups(seqs)]
        _lin = None
    if pool is not None:  # every position of a pooled sequence is a real token: position = length
        positions = torch.tensor([s.kv_len for s in seqs])
        pages = pool.pages(seqs)
    else:
        positions = torch.stack([s.cache.positions.reshape(()) for s in seqs])  # (B,)
    hd, H, KV = c.head_dim, c.heads, c.kv_heads
    for i in range(decoder.lower_layers, c.num_layers):
        blk = decoder.layers[i]

        def norm(name, x, blk=blk, i=i):
            if _lin is not None:  # (pure LoRAs leave the norms as they are: the base model's for every row)
                return _norm(None, i, name, x, getattr(blk, name))
            return _grouped(groups, c.d, x, lambda pet, xs, _: _norm(pet, i, name, xs, getattr(blk, name)))

        def lin(target, x, out_dim, blk=blk, i=i):
            if _lin is not None:
                return _lin(i, target, x, getattr(blk, target))
            return _grouped(groups, out_dim, x, lambda pet, xs, gemm: petlib.linear(pet, i, target, xs, getattr(blk, target),
                                                                                   gemm=gemm))

        x = norm("ln_attn", h)
        if _lin is not None:
            q, k, v = qkv(i, blk, x, rp.linear, lb)
        else:
            q, k, v = lin("q", x, H * hd), lin("k", x, KV * hd), lin("v", x, KV * hd)
        q, k, v = q.view(B, H, 1, hd), k.view(B, KV, 1, hd), v.view(B, KV, 1, hd)
        if c.rotary:
            q, k = _rotate(q, positions[:, None], c.rope_theta), _rotate(k, positions[:, None], c.rope_theta)
        if pool is not None:
            ctx = pool.attend(i, seqs, pages, q.view(B, H, hd), k.view(B, KV, hd), v.view(B, KV, hd))
        else:
            ctx = _attend_each(i, seqs, q, k, v, c)
        h = h + lin("o", ctx, c.d)
        x = norm("ln_ffn", h)
        if c.gated:
            f = _act(c.act, rp.linear(x, blk.ffn_gate.weight, blk.ffn_gate.bias)) * lin("ffn_in", x, c.ffn)
        elif _lin is not None:
            f = ffn_in_act(rp, lb, i, blk, x, c.act, lambda: _act(c.act, lin("ffn_in", x, c.ffn)))
        else:
            f = _act(c.act, lin("ffn_in", x, c.ffn))
        h = h + lin("ffn_out", f, c.d)
    for s in seqs:
        if pool is not None:
            s.kv_len += 1
        else:
            s.cache.mask = torch.cat([s.cache.mask, s.cache.mask.new_ones(1, 1)], 1)
            s.cache.positions = s.cache.positions + 1
    return decoder.logits(h, linear=rp.linear)


def ffn_in_act(rp: RowPrecision, lb: LoraBatch, i: int, blk, x: torch.Tensor, act: str, unfused):
    """The activation of layer i's ffn_in on x with every row's LoRA: fused into the GEMM (no
    pass over the FFN's widest tensor) for the rows whose LoRA leaves ffn_in alone, unfused()
    (the delta must come before the activation) for the others. Fused and unfused round
    differently, so each row's path hangs on its own tenant only, never on its batch-mates'."""
    edited = lb.edited(i, "ffn_in")
    if edited is None:
        return rp.linear_act(x, blk.ffn_in.weight, blk.ffn_in.bias, act)
    f = unfused()
    if bool(edited.all()):
        return f
    fused = rp.linear_act(x, blk.ffn_in.weight, blk.ffn_in.bias, act)
    return torch.where(edited.view(-1, *(1,) * (f.dim() - 1)), f, fused)


def qkv(i: int, blk, x: torch.Tensor, linear, lb: LoraBatch):
    """Layer i's q, k and v of x (..., d) with every row's LoRA: one GEMM on the three weights
    side by side (a third of the calls, each wider: the better rate at a step's few rows),
    each row's LoRA deltas added into its parts of the output."""
    w, b = fused_qkv(blk)
    q, k, v = linear(x, w, b).split([blk.q.out_features, blk.k.out_features, blk.v.out_features], -1)
    for target, part in (("q", q), ("k", k), ("v", v)):
        lb.add_to(i, target, x, part)
    return q, k, v


def fused_qkv(blk) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W, b) of blk's q, k and v stacked, made once and again whenever one of them is written
    in place (one tensor kept on the block: the packed GEMMs pack each weight tensor once)."""
    parts = (blk.q, blk.k, blk.v)
    versions = tuple(p.weight._version for p in parts) + tuple(id(p.weight) for p in parts)
    made = getattr(blk, "_fused_qkv", None)
    if made is None or made[0] != versions:
        w = torch.cat([p.weight.detach() for p in parts])
        b = None if blk.q.bias is None else torch.cat([p.bias.detach() for p in parts])
        made = blk._fused_qkv = (versions, w, b)
    return made[1], made[2]


def _attend_each(i, seqs, q, k, v, c) -> torch.Tensor:
    """Attention of each sequence against its own KVCache (appending this step's k, v)."""
    B, H, KV, hd = q.shape[0], c.heads, c.kv_heads, c.head_dim
    ctx = q.new_empty(B, H * hd)
    for b, s in enumerate(seqs):
        kb, vb = torch.cat([s.cache.k[i], k[b:b + 1]], 2), torch.cat([s.cache.v[i], v[b:b + 1]], 2)
        s.cache.k[i], s.cache.v[i] = kb, vb
        if KV != H:
            kb, vb = kb.repeat_interleave(H // KV, 1), vb.repeat_interleave(H // KV, 1)
        scores = q[b:b + 1] @ kb.transpose(-2, -1) / math.sqrt(hd)
        real = torch.cat([s.cache.mask, s.cache.mask.new_ones(1, 1)], 1)  # (1, S): the new token is real
        scores = scores.masked_fill(~real[:, None, None, :], torch.finfo(scores.dtype).min)
        ctx[b] = (scores.softmax(-1) @ vb).reshape(H * hd)
    return ctx
