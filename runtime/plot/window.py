"""The model side of FORMAT.md section 4: windows, their PLOT values, and aggregation.

A window is the n ids around position i at offsets -l .. n-1-l (centered: l = (n-1)//2,
causal: l = n-1); positions outside the sequence hold pad_id. A window's value is the lower
layers run on the window alone at local positions 0..n-1, pad slots masked out of attention
and stored as zeros. The "normalized" aggregate of token i is the mean, over the c_i
in-sequence windows that cover i, of the vector at i's slot; the upper layers' input adds the
version's position table to it (runtime.plot.retrieve).
"""

from __future__ import annotations

import numpy as np
import torch

from formats import backoff
from formats.backoff import offsets
from runtime.model.encoder import Encoder


def windows(ids: np.ndarray, n: int, kind: str = "centered", pad_id: int = 0) -> np.ndarray:
    """The (L, n) uint32 keys of a sequence's L windows (the store's own rule)."""
    return backoff.windows(ids, n, kind, pad_id)


def window_values(encoder: Encoder, keys: np.ndarray, batch_size: int = 4096) -> torch.Tensor:
    """PLOT values (m, n, d) of keys (m, n): lower layers per key, pad slots zeroed.

    Differentiable (window distillation trains through it); wrap in torch.no_grad() to
    build tables.
    """
    keys = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    if keys.ndim != 2:
        raise ValueError(f"keys must be (m, n), got shape {tuple(keys.shape)}")
    real = keys != encoder.config.pad_id
    single = real.sum(1) == 1
    if single.any() and not single.all():
        # Keys with one real slot (the uni-grams: most of a root) attend only to themselves:
        # run that token alone at its slot's position, 1/n of the work, same values.
        out = torch.zeros(*keys.shape, encoder.config.d)
        out[single] = window_values(encoder, keys[single].numpy(), batch_size)
        out[~single] = window_values(encoder, keys[~single].numpy(), batch_size)
        return out
    values = []
    for chunk in keys.split(batch_size):
        mask = chunk != encoder.config.pad_id
        if single.all():
            slot = mask.float().argmax(1)
            token = chunk.gather(1, slot[:, None])
            h = encoder.lower(token, torch.ones_like(token, dtype=torch.bool), slot[:, None])
            v = torch.zeros(*chunk.shape, h.shape[-1], dtype=h.dtype)
            v[torch.arange(len(chunk)), slot] = h[:, 0]
            values.append(v)
        else:
            values.append(encoder.lower(chunk, mask) * mask[..., None])
    return torch.cat(values) if values else torch.zeros(*keys.shape, encoder.config.d)


def aggregate(values: torch.Tensor, n: int, kind: str = "centered") -> torch.Tensor:
    """Upper-layer inputs (L, d) of one sequence from its windows' values (L, n, d)."""
    return aggregate_batch(torch.as_tensor(values)[None], [len(values)], n, kind)[0]


def aggregate_batch(values: torch.Tensor, lengths, n: int, kind: str = "centered") -> torch.Tensor:
    """aggregate for right-padded sequences: values (B, L, n, d), lengths (B,) -> (B, L, d).

    Only windows at positions < length count; positions >= length come out zero.
    """
    values = torch.as_tensor(values).float()
    B, L, width, d = values.shape
    if width != n:
        raise ValueError(f"values hold {width} slots per window, expected n={n}")
    real = torch.arange(L)[None, :] < torch.as_tensor(lengths)[:, None]
    total = torch.zeros(B, L, d)
    count = torch.zeros(B, L)
    # Token i sits in slot s of window i - o(s); loop over the n slots, vectorized over tokens.
    for s, o in enumerate(offsets(n, kind).tolist()):
        lo, hi = max(0, o), min(L, L + o)
        if lo >= hi:  # |o| >= L: no in-sequence window puts a token in this slot
            continue
        covers = real[:, lo:hi] & real[:, lo - o : hi - o]
        total[:, lo:hi] += values[:, lo - o : hi - o, s] * covers[..., None]
        count[:, lo:hi] += covers
    return total / count.clamp(min=1)[..., None]


def windowed_lower(encoder: Encoder, seqs: list[list[int]], n: int, kind: str = "centered") -> list[torch.Tensor]:
    """Upper-layer inputs, (L, d) per sequence, when every window hits its full n-gram:
    aggregate(window_values(windows(ids))), all sequences' windows in one batch. The
    store-free path of window distillation and of accuracy checks."""
    keys = [windows(np.asarray(ids), n, kind, encoder.config.pad_id) for ids in seqs]
    values = window_values(encoder, np.concatenate(keys)).split([len(k) for k in keys])
    return [aggregate(v, n, kind) for v in values]


def corpus_windows(seqs, n: int, kind: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows (sum of lengths, n) uint32, lengths (B,) int64) of every sequence, in order.

    Vectorized: runtime.plot.window.windows over the concatenation of the sequences with runs of
    pad_id between them long enough that no window reaches across, keeping the rows of real
    positions. Identical to concatenating windows(seq) per sequence.
    """
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    if not len(seqs) or not lengths.sum():
        return np.zeros((0, n), dtype=np.uint32), lengths
    off = offsets(n, kind)
    gap = int(max(-off.min(), off.max(), 0))
    parts, keep = [], []
    pad_run = np.full(gap, pad_id, dtype=np.int64)
    for s in seqs:
        parts.append(np.asarray(s, dtype=np.int64).reshape(-1))
        keep.append(np.ones(len(parts[-1]), dtype=bool))
        parts.append(pad_run)
        keep.append(np.zeros(gap, dtype=bool))
    flat = np.concatenate(parts)
    if len(flat) and (flat.min() < 0 or flat.max() >= 2**32):
        raise ValueError("token ids must fit in uint32")
    return windows(flat, n, kind, pad_id)[np.concatenate(keep)], lengths
