"""Tabi's level 2 as an input source: the full-context lower layers of a PLOT version.

A context row's upper-layer inputs are what the encoder its version stands for
(runtime.model.stored.context_encoder) computes in its lower layers over the whole text, in
place of the PLOT's window lookups; the upper layers, the PET and the head then run as for
any row of the batch.
"""

from __future__ import annotations

import threading

import torch

from runtime.exec import onednn


class ContextInputs:
    def __init__(self, store, encoder):
        self.store = store
        self.encoder = encoder
        self._lowers: dict = {}
        self._lock = threading.Lock()

    def lower(self, version):
        """The full-context encoder for PLOT version `version` (loaded once)."""
        from runtime.model.stored import context_encoder

        with self._lock:
            if version not in self._lowers:
                self._lowers[version] = context_encoder(self.store, version, self.encoder)
            return self._lowers[version]

    @torch.no_grad()
    def inputs(self, version, seqs) -> torch.Tensor:
        """(B, L, d) lower-layer outputs of token id sequences, right-padded."""
        enc = self.lower(version)
        ids, mask = enc.pad(seqs)
        return enc.lower(ids, mask, gemm=onednn.linear)  # the GEMMs the executor runs (runtime/exec/onednn.py)
