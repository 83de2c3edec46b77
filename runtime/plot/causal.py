"""Causal PLOT for decoder stores (hGPT, HMI §3.2): the upper layers' input of token i is the
value of the window ending at i, at i's own slot.

A decoder store (meta["architecture"] == "decoder") has causal windows [x(i-n+1) ... x(i)]:
its lower layers are causal, so a window's last slot depends on exactly those n tokens, and
no window that starts after i may contribute to token i (it would not exist yet while
generating). So where an encoder store averages the n windows covering a token
(runtime.plot.window.aggregate), a decoder store takes one:

    input(i) = value(window ending at i)[n - 1] + P_v[i]

A key's value is the lower layers run on its real tokens alone, at positions 0 .. k-1 (k real
tokens; left pad slots are masked out and stored as zeros: runtime.model.decoder's
mask-derived positions), so the first n - 1 tokens of a sequence are served exactly what
the full decoder computes there. Backoff drops the farthest-left token first
(formats/backoff.py: [a, b, c] -> [pad, b, c] -> [pad, pad, c]).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.plot.window import windows

ARCHITECTURES = ("encoder", "decoder")


def last_slot(values: torch.Tensor, lengths) -> torch.Tensor:
    """Upper-layer inputs (B, L, d) from right-padded window values (B, L, n, d): each
    position's own window's last slot; positions >= length come out zero."""
    values = torch.as_tensor(values).float()
    B, L = values.shape[:2]
    real = torch.arange(L)[None, :] < torch.as_tensor(lengths)[:, None]
    return values[:, :, -1] * real[..., None]


def causal_values(decoder, keys: np.ndarray, batch_size: int = 4096) -> torch.Tensor:
    """PLOT values (m, n, d) of causal keys (m, n): the decoder's lower layers on each key's real
    tokens alone at positions 0 .. k-1 (the mask-derived positions of runtime.model.decoder),
    pad slots zeroed. Keys with one real token (the uni-grams, most of a root) run that token
    alone: 1/n of the work, the same values. Differentiable; wrap in torch.no_grad() to build."""
    keys = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    if keys.ndim != 2:
        raise ValueError(f"keys must be (m, n), got shape {tuple(keys.shape)}")
    real = keys != decoder.config.pad_id
    out = torch.zeros(*keys.shape, decoder.config.d)
    single = real.sum(1) == 1
    rows = single.nonzero().flatten()
    for chunk in rows.split(batch_size):
        slot = real[chunk].float().argmax(1)
        h = decoder.lower(keys[chunk, slot][:, None])[:, 0]
        out = out.index_put((chunk, slot), h)
    rows = (~single).nonzero().flatten()
    for chunk in rows.split(batch_size):
        mask = real[chunk]
        out = out.index_put((chunk,), decoder.lower(keys[chunk], mask) * mask[..., None])
    return out


class KeyValuer:
    """A decoder seen by the encoder stores' construction code (runtime.construct.plot: build_root,
    build_branch; runtime.plot.window.window_values): everything is the decoder's, except that
    lower() ignores the local slot positions that code passes, so a causal key's real tokens
    always sit at 0 .. k-1 (its mask decides). With it the shared code values decoder keys by
    this module's rule."""

    is_decoder = True

    def __init__(self, decoder):
        self.decoder = decoder

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def lower(self, ids, mask=None, positions=None):
        return self.decoder.lower(ids, mask)


def windowed_lower(decoder, seqs: list[list[int]], n: int) -> list[torch.Tensor]:
    """The exact windowed computation a full-coverage causal store serves: (L, d) per
    sequence, row i the decoder's lower layers on [x(i-n+1) .. x(i)] alone, at x(i)."""
    pad = decoder.config.pad_id
    keys = [windows(np.asarray(ids), n, "causal", pad) for ids in seqs]
    values = causal_values(decoder, np.concatenate(keys)).split([len(k) for k in keys])
    return [v[:, -1] for v in values]
