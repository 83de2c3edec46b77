"""Virtual stacking (SP §4): all students of a batch run as ONE computation.

The students' weights are stacked along a leading axis P (model.Group holds them so), and every
projection is one batched GEMM (torch.baddbmm) over P, attention one batched matmul over
P x batch x heads: no Python loop over students. One tenant's k students share its inputs
(expanded along P); students of many tenants run in one step too (`ensembles`), each (tenant,
student) pair a slice of P with its tenant's inputs, padded to the longest batch and text. The
result equals model.ensemble's loop over students (tests/test_student.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime.model.student import Group


def _linear(w: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """x (P, N, d_in) @ W (P, d_out, d_in)^T + b (P, d_out)."""
    return torch.baddbmm(w[name + ".bias"][:, None, :], x, w[name + ".weight"].transpose(1, 2))


def _norm(w: dict, name: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=eps) * w[name + ".weight"][:, None, :] + w[name + ".bias"][:, None, :]


def layer(w: dict, l: int, h: torch.Tensor, mask: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """Layer l of P stacked students on h (P, B, L, d) with mask (P, B, L) or (B, L)."""
    P, B, L, d = h.shape
    p, dh = f"layers.{l}.", d // heads
    flat = h.reshape(P, B * L, d)
    q, k, v = (_linear(w, p + t, flat).view(P * B, L, heads, dh).transpose(1, 2) for t in ("q", "k", "v"))
    scores = q @ k.transpose(-2, -1) / math.sqrt(dh)
    keys = mask.expand(P, B, L).reshape(P * B, 1, 1, L)
    scores = scores.masked_fill(~keys, torch.finfo(scores.dtype).min)
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(P, B * L, d)
    flat = _norm(w, p + "ln_attn", flat + _linear(w, p + "o", ctx), eps)
    flat = _norm(w, p + "ln_ffn", flat + _linear(w, p + "ffn_out", F.gelu(_linear(w, p + "ffn_in", flat))), eps)
    return flat.view(P, B, L, d)


def forward(w: dict, x: torch.Tensor, mask: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """Outputs (P, B, L, d) of P stacked students (w: their layer tensors, axis 0 = P)."""
    layers = len({k.split(".")[1] for k in w if k.startswith("layers.")})
    for l in range(layers):
        x = layer(w, l, x, mask, heads, eps)
    return x


def ensemble(group: Group, x: torch.Tensor, mask: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """F_k (B, L, d) of one tenant's first k students, stacked: the sum of one batched forward."""
    k = group.size if k is None else k
    w = {name: v[:k] for name, v in group.tensors.items() if name.startswith("layers.")}  # views, no copy
    out = forward(w, x.expand(k, *x.shape), mask, group.meta["heads"], group.meta["eps"])
    return torch.einsum("p,pbld->bld", group.tensors["multiplier"][:k], out)


def ensembles(parts: list[tuple[Group, int, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """F_k of many tenants, in ONE stacked forward per student depth (1- and 2-layer groups
    cannot share one): parts are (group, k, x (B_t, L_t, d), mask), results in their order.
    Groups share the width (every tenant of a store does)."""
    by_depth: dict = {}
    for j, part in enumerate(parts):
        by_depth.setdefault(part[0].meta["layers"], []).append(j)
    results = [None] * len(parts)
    for idx in by_depth.values():
        for j, h in zip(idx, _stacked([parts[j] for j in idx])):
            results[j] = h
    return results


def _stacked(parts) -> list[torch.Tensor]:
    """ensembles for groups of one depth: the inputs zero-padded to the largest B and L (padded
    keys are masked out, padded rows dropped). One tenant alone runs on views of its weights
    and inputs: copying a group's weights per batch cost 8% of a server's time under a burst."""
    if len(parts) == 1:
        group, k, x, mask = parts[0]
        return [ensemble(group, x, mask, k)]
    B = max(x.shape[0] for _, _, x, _ in parts)
    L = max(x.shape[1] for _, _, x, _ in parts)
    d = parts[0][2].shape[2]
    names = [n for n in parts[0][0].tensors if n.startswith("layers.")]
    w = {n: torch.cat([g.tensors[n][:k] for g, k, _, _ in parts]) for n in names}
    P = sum(k for _, k, _, _ in parts)
    xs = torch.zeros(P, B, L, d)
    masks = torch.zeros(P, B, L, dtype=torch.bool)
    at = 0
    for _, k, x, mask in parts:
        xs[at:at + k, :x.shape[0], :x.shape[1]] = x
        masks[at:at + k, :x.shape[0], :x.shape[1]] = mask
        at += k
    meta = parts[0][0].meta
    out = forward(w, xs, masks, meta["heads"], meta["eps"])
    results, at = [], 0
    for g, k, x, _ in parts:
        mult = g.tensors["multiplier"][:k]
        results.append(torch.einsum("p,pbld->bld", mult, out[at:at + k, :x.shape[0], :x.shape[1]]))
        at += k
    return results
