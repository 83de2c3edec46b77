"""The one retrieval path (HMI §3.4, FORMAT.md §4): PLOT lookups + aggregation -> upper-layer inputs.

    inputs, mask, served = retrieve(snapshot, "biology", seqs)

`retrieve` is what training (runtime.construct) and serving call alike, so a PET is trained on exactly
the inputs it will be served with: the windows of every sequence, one batched lookup for the whole
batch, then the normalized aggregation of runtime.plot.window plus the version's position table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.model.stored import is_decoder_store
from runtime.plot.causal import last_slot
from runtime.plot.unseen import unseen_windows
from runtime.plot.window import aggregate_batch, corpus_windows


@dataclass
class Served:
    """Per-window provenance of a retrieve() batch, right-padded like the inputs."""

    windows: np.ndarray  # (B, L, n) uint32: the window around each position (pad rows past length)
    version: np.ndarray  # (B, L) int16: served version index, -1 past a sequence's end (and on a miss)
    order: np.ndarray  # (B, L) int8: order of the served key, 0 past the end (and on a miss)
    lengths: np.ndarray  # (B,) int64
    version_names: list = field(default_factory=list)

    def summary(self) -> dict:
        """Counts of served windows per version name and per order (for analysts)."""
        real = np.arange(self.version.shape[1])[None, :] < self.lengths[:, None]
        v, o = self.version[real], self.order[real]
        return {
            "windows": int(real.sum()),
            "by_version": {self.version_names[i] if i >= 0 else "miss": int((v == i).sum()) for i in np.unique(v)},
            "by_order": {int(k): int((o == k).sum()) for k in np.unique(o)},
        }


def retrieve(snapshot, version, seqs, unseen: float = 0.0, rng=None) -> tuple[torch.Tensor, torch.Tensor, Served]:
    """Upper-layer inputs of token id sequences served by PLOT `version` of `snapshot` (a
    hkstore Snapshot or Store): (inputs float32 (B, L, d), mask bool (B, L), served).

    Windows of every sequence, ONE lookup for the whole batch, then runtime.plot.window's
    normalized aggregation (a decoder store: runtime.plot.causal's last slot) plus the version's
    position table (snapshot.position); positions past a sequence's length are zero and masked out.
    unseen > 0 (training only): windows served as if the version had never seen them
    (runtime.plot.unseen, drawn from the numpy Generator rng).
    """
    meta = snapshot.meta
    n, kind, pad_id, d = meta["n"], meta["window"], meta["pad_id"], meta["d"]
    if not len(seqs):
        raise ValueError("retrieve needs at least one sequence")
    wins, lengths = corpus_windows(seqs, n, kind, pad_id)
    vocab = meta.get("vocab_size")
    ids = wins[wins != pad_id]  # a decoder's pad_id may be vocab_size (runtime.model.decoder_config)
    if vocab and len(ids) and int(ids.max()) >= vocab:
        raise ValueError(f"token id {int(ids.max())} is outside the store's vocabulary of {vocab}")
    if unseen:
        wins = unseen_windows(wins, unseen, rng if rng is not None else np.random.default_rng(), kind, pad_id)
    result = snapshot.lookup(version, wins)
    B, L = len(seqs), int(lengths.max())
    real = np.arange(L)[None, :] < lengths[:, None]
    values = np.zeros((B, L, result.values.shape[1], d), dtype=np.float32)  # a decoder store may keep 1 slot
    values[real] = result.values
    if is_decoder_store(meta):  # runtime.plot.causal: the window ending at each token, its last slot
        inputs = last_slot(torch.from_numpy(values), torch.from_numpy(lengths))
    else:
        inputs = aggregate_batch(torch.from_numpy(values), torch.from_numpy(lengths), n, kind)
    add_position(inputs, real, snapshot.position(version))
    served_windows = np.full((B, L, n), pad_id, dtype=np.uint32)
    served_windows[real] = wins
    served_version = np.full((B, L), -1, dtype=np.int16)
    served_version[real] = result.version
    served_order = np.zeros((B, L), dtype=np.int8)
    served_order[real] = result.order
    served = Served(served_windows, served_version, served_order, lengths, list(result.version_names))
    return inputs, torch.from_numpy(real), served


def add_position(inputs: torch.Tensor, real: np.ndarray, table) -> None:
    """Add a version's position table (FORMAT.md section 4) to aggregated inputs (B, L, d) in
    place, at real positions only; rows past the table's end add nothing."""
    if table is None:
        return
    rows = min(inputs.shape[1], len(table))
    inputs[:, :rows] += torch.from_numpy(np.array(table[:rows])) * torch.from_numpy(real[:, :rows, None])


def retrieve_list(snapshot, version, seqs, batch_size: int = 256, unseen: float = 0.0, rng=None) -> list[torch.Tensor]:
    """retrieve() in batches, returned as one (length, d) tensor per sequence: the
    precomputed-inputs form runtime.construct.train's loops take. Rows are exactly retrieve()'s."""
    out = []
    for start in range(0, len(seqs), batch_size):
        batch = seqs[start:start + batch_size]
        inputs, _, served = retrieve(snapshot, version, batch, unseen, rng)
        out += [inputs[b, :length].clone() for b, length in enumerate(served.lengths.tolist())]
    return out

