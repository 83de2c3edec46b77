"""Retrieval for a batch whose items may need different PLOT versions (both executors use it)."""

from __future__ import annotations

import numpy as np
import torch


def retrieve_mixed(snapshot, seqs: list, versions: list):
    """Upper-layer inputs of a batch whose items may need different PLOT versions: one
    runtime.plot.retrieve per version, assembled into (inputs (B, L, d) float32, mask (B, L),
    served) with served[b] = (version index, order) arrays of item b's windows."""
    from runtime.plot.retrieve import retrieve

    B = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    L, d = int(lengths.max()), snapshot.meta["d"]
    by_version: dict = {}
    for b, v in enumerate(versions):
        by_version.setdefault(v, []).append(b)
    if len(by_version) == 1:
        (v, _), = by_version.items()
        inputs, mask, served = retrieve(snapshot, v, seqs)
        return inputs, mask, [(served.version[b, :lengths[b]], served.order[b, :lengths[b]]) for b in range(B)]
    inputs = torch.zeros(B, L, d)
    mask = torch.zeros(B, L, dtype=torch.bool)
    info = [None] * B
    for v, items in by_version.items():
        x, m, served = retrieve(snapshot, v, [seqs[b] for b in items])
        inputs[items, : x.shape[1]] = x
        mask[items, : m.shape[1]] = m
        for j, b in enumerate(items):
            info[b] = (served.version[j, :lengths[b]], served.order[j, :lengths[b]])
    return inputs, mask, info
