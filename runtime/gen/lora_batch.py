"""Every row of a decode step with its own tenant's LoRA, in batched ops (Punica's BGMV and
SGMV, CPU reference): the base projection runs once for all rows, the LoRA deltas are added
from the tenants' A and B stacked for the step.

    lb = LoraBatch([pet_of_row0, None, pet_of_row2, ...])     # None: the base model
    y = F.linear(x, W, b) + lb.delta(i, "q", x)                # == petlib.linear(pet_r, i, "q", x[r], lin)

- BGMV (every row its own adapter): A^T (B, d_in, r) and B^T (B, r, d_out) gathered per row
  once a batch composition, the delta is two batched matrix-vector products, one call each for all rows;
- SGMV (rows share few adapters): one GEMM pair per adapter on its rows (segments), for steps
  with at least SGMV_ROWS rows per adapter on average (a GEMM pays off over a gather there).

A decode step (one position a row) adds its deltas in place, lb.add_to(i, "q", x, y): one pass
over the rows reading each row's adapter from a table of the step's adapters
(runtime/gen/_decode.c's lora_add, built with the package: no per-row copy of the weights, no
delta tensor; the gathered BGMV bmm streamed a (B, d, r) copy per projection and was most of
the step's LoRA time); without the extension, delta then an add.

Ranks may differ (zero-padded to the step's largest; exact), as may the targets and layers a
LoRA covers (rows without that projection add nothing). Only pure-LoRA PETs (no LayerNorm
deltas, nothing else) take this path; runtime.gen.batched_step groups any other PET.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gen.kv_pool import _decode

SGMV_ROWS = 4


def lora_only(pet) -> bool:
    """Whether pet is None or a LoRA with nothing else (its norms are the base model's)."""
    # (a head, if any, is not applied in a decoder: its LM head serves every tenant)
    return pet is None or (pet.meta.get("pet_type") == "lora" and
                           all(".lora." in k or k.startswith("head.") for k in pet.tensors))


class LoraBatch:
    def __init__(self, pets: list, mode: str | None = None):
        self.B = len(pets)
        index: dict[int, int] = {}
        self.adapters: list = []
        row_adapter = []
        for pet in pets:
            if pet is not None and id(pet) not in index:
                index[id(pet)] = len(self.adapters)
                self.adapters.append(pet)
            row_adapter.append(-1 if pet is None else index[id(pet)])
        self.row_adapter = torch.tensor(row_adapter, dtype=torch.long)
        G = len(self.adapters)
        self.mode = mode or ("sgmv" if G and self.B >= SGMV_ROWS * G else "bgmv")
        # SGMV: the rows of each adapter (a segment); BGMV: per (layer, target) the gathered stacks.
        self.segments = [torch.nonzero(self.row_adapter == g).flatten() for g in range(G)]
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._edited: dict[tuple[int, str], torch.Tensor | None] = {}
        self._tables: dict[tuple[int, str], tuple | None] = {}

    @property
    def empty(self) -> bool:
        return not self.adapters

    def _stack(self, i: int, target: str):
        """(A^T (B, d_in, r), scaled B^T (B, r, d_out)), zeros for rows without this projection's LoRA."""
        key = (i, target)
        if key not in self._stacks:
            a_name, b_name = f"layers.{i}.lora.{target}.A", f"layers.{i}.lora.{target}.B"
            have = [p for p in self.adapters if a_name in p.tensors]
            if not have:
                self._stacks[key] = None
                return None
            r = max(p.tensors[a_name].shape[0] for p in have)
            d_in, d_out = have[0].tensors[a_name].shape[1], have[0].tensors[b_name].shape[0]
            A = torch.zeros(len(self.adapters) + 1, r, d_in)  # the last one: rows without it
            Bm = torch.zeros(len(self.adapters) + 1, d_out, r)
            for g, p in enumerate(self.adapters):
                if a_name in p.tensors:
                    k = p.tensors[a_name].shape[0]
                    A[g, :k] = p.tensors[a_name]
                    Bm[g, :, :k] = p.tensors[b_name] * p.meta["scale"]
            rows = torch.where(self.row_adapter < 0, len(self.adapters), self.row_adapter)
            # stored as the bmm reads them, (B, d_in, r) and (B, r, d_out), contiguous
            self._stacks[key] = (A[rows].transpose(1, 2).contiguous(), Bm[rows].transpose(1, 2).contiguous())
        return self._stacks[key]

    def edited(self, i: int, target: str) -> torch.Tensor | None:
        """Which rows' LoRA edits projection `target` of layer i ((B,) bool), None for no row."""
        key = (i, target)
        if key not in self._edited:
            name = f"layers.{i}.lora.{target}.A"
            by_adapter = torch.tensor([name in p.tensors for p in self.adapters] + [False])
            rows = by_adapter[self.row_adapter]  # row_adapter -1 (the base model): the False at the end
            self._edited[key] = rows if bool(rows.any()) else None
        return self._edited[key]

    def _table(self, i: int, target: str):
        """(A (G, r, d_in), scaled B^T (G, r, d_out), each row's index in them or -1 (int64)) of
        the adapters that edit this projection, ranks zero-padded to the largest; None if none does."""
        key = (i, target)
        if key not in self._tables:
            a_name, b_name = f"layers.{i}.lora.{target}.A", f"layers.{i}.lora.{target}.B"
            have = [g for g, p in enumerate(self.adapters) if a_name in p.tensors]
            if not have:
                self._tables[key] = None
                return None
            tensors = [self.adapters[g].tensors for g in have]
            r = max(t[a_name].shape[0] for t in tensors)
            d_in, d_out = tensors[0][a_name].shape[1], tensors[0][b_name].shape[0]
            A, Bt = torch.zeros(len(have), r, d_in), torch.zeros(len(have), r, d_out)
            for j, g in enumerate(have):
                k = tensors[j][a_name].shape[0]
                A[j, :k] = tensors[j][a_name]
                Bt[j, :k] = (tensors[j][b_name] * self.adapters[g].meta["scale"]).T
            at = torch.full((len(self.adapters) + 1,), -1, dtype=torch.long)  # the last: rows of the base model
            at[torch.tensor(have)] = torch.arange(len(have))
            self._tables[key] = (A, Bt, at[self.row_adapter].contiguous())
        return self._tables[key]

    def add_to(self, i: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA part of projection `target` of layer i (delta's), in place; y (B, d_out)
        may be a column range of a wider output (q of a fused q, k, v GEMM)."""
        if self.empty:
            return
        if _decode is not None and x.dim() == 2 and y.dim() == 2 and x.dtype == y.dtype == torch.float32 and \
                x.stride(1) == 1 and y.stride(1) == 1 and x.shape[0] == y.shape[0] == self.B:
            table = self._table(i, target)
            if table is None:
                return
            A, Bt, rows = table
            if A.shape[2] == x.shape[1] and Bt.shape[2] == y.shape[1]:
                _decode.lora_add(x.data_ptr(), A.data_ptr(), Bt.data_ptr(), rows.data_ptr(), y.data_ptr(), self.B,
                                 A.shape[2], A.shape[1], Bt.shape[2], A.shape[0], max(x.stride(0), x.shape[1]),
                                 max(y.stride(0), y.shape[1]))
                return
        d = self.delta(i, target, x)
        if d is not None:
            y.add_(d)

    def delta(self, i: int, target: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA part of projection `target` of layer i for every row of x (B, d_in) or
        (B, T, d_in) (a prefill: row b's T positions with row b's LoRA), or None when no
        row's PET edits it."""
        if self.empty:
            return None
        if self.mode == "sgmv":
            a_name, b_name = f"layers.{i}.lora.{target}.A", f"layers.{i}.lora.{target}.B"
            out = None
            for p, rows in zip(self.adapters, self.segments):
                if a_name not in p.tensors:
                    continue
                whole = len(rows) == self.B
                # (the scale on the rank-r middle: r numbers a row instead of d_out)
                d = F.linear(F.linear(x if whole else x[rows], p.tensors[a_name]) * p.meta["scale"], p.tensors[b_name])
                if whole:  # one adapter on every row: its delta is the answer, nothing to scatter
                    return d
                if out is None:
                    out = x.new_zeros(*x.shape[:-1], d.shape[-1])
                out[rows] += d
            return out
        stack = self._stack(i, target)
        if stack is None:
            return None
        At, Bt = stack
        x3 = x[:, None] if x.dim() == 2 else x
        out = torch.bmm(torch.bmm(x3, At), Bt)
        return out[:, 0] if x.dim() == 2 else out
