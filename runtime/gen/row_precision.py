"""The precision each row of a decode step or prefill runs its shared GEMMs in: fp32, or bf16
on weights packed once in bf16 (oneDNN, fp32 accumulation; runtime.exec.precision).

    rp = RowPrecision.of("auto", [s.pet for s in seqs])
    y = rp.linear(x, lin.weight, lin.bias)        # (B, ...) fp32 in, fp32 out, each row at its precision

Only the GEMMs on the base model's weights change precision (the q, k, v, o and FFN projections
and the LM head: nearly all of a step's FLOPs); what a row adds of its own (LoRA), attention,
the norms, the residual stream, the KV pool and the logits stay fp32, so rows of both
precisions share a step. "fp32" and "bf16" set every row; "auto" takes each row's PET's
recorded precision (meta "precision"; fp32 without one, and for the base model's rows).
"""

from __future__ import annotations

import torch

from runtime.exec import onednn
from runtime.exec import precision as precisionlib
from runtime.model.decoder import _act


resolve = precisionlib.mode  # the step mode for a runtime's precision: "fp32", "bf16" or "auto"


class RowPrecision:
    def __init__(self, bf16_rows: torch.Tensor | None, all_bf16: bool):
        # all_bf16: every row bf16; else bf16_rows (indices) is None (all fp32) or the bf16 rows
        self.all_bf16, self.bf16_rows = all_bf16, bf16_rows
        if bf16_rows is not None:
            self._bf16 = precisionlib.shared_bf16()

    FP32: RowPrecision  # every row fp32 (set below)

    @classmethod
    def of(cls, mode: str, pets) -> RowPrecision:
        """The rows' precisions for a step in mode (resolve's) whose rows carry pets."""
        if mode == "fp32":
            return cls.FP32
        if mode == "bf16":
            return cls(torch.arange(len(pets)), True)
        rows = [b for b, p in enumerate(pets) if p is not None and precisionlib.row_bf16(p.meta)]
        if not rows:
            return cls.FP32
        return cls(torch.tensor(rows), len(rows) == len(pets))

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, post=onednn.NONE) -> torch.Tensor:
        """x W^T + b in fp32, each row (dim 0 of x) through its precision's packed GEMM (post:
        a oneDNN post-op fused into it, as linear_act gives)."""
        if self.bf16_rows is None:
            return _fp32(x, w, b, post)
        if self.all_bf16:
            return self._bf16_linear(x, w, b, post)
        y = x.new_empty(*x.shape[:-1], w.shape[0])
        fp = _complement(self.bf16_rows, x.shape[0])
        y[self.bf16_rows] = self._bf16_linear(x[self.bf16_rows], w, b, post)
        if len(fp):
            y[fp] = _fp32(x[fp], w, b, post)
        return y

    def linear_act(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str) -> torch.Tensor:
        """The activation act (runtime.model.decoder's names) of linear(x, w, b), fused into the
        GEMM as a oneDNN post-op where it has one (the activation was a separate pass over the
        FFN's widest tensor, several times a small GEMM's non-GEMM cost; in bf16 it now reads
        the fp32 accumulator, before the output's rounding)."""
        post = _POST_OPS.get(act)
        if post is None or onednn.SHARED is None:
            return _act(act, self.linear(x, w, b))
        return self.linear(x, w, b, post)

    def _bf16_linear(self, x, w, b, post):
        shape = x.shape
        y = self._bf16.linear(x.reshape(-1, shape[-1]).to(torch.bfloat16), w, b, post)
        return y.float().view(*shape[:-1], w.shape[0])


# the activations oneDNN fuses into a GEMM: its (post-op, algorithm) for each
_POST_OPS = {"gelu_tanh": ("gelu", "tanh"), "gelu": ("gelu", "none"), "relu": ("relu", "")}


def _fp32(x, w, b, post):
    shape = x.shape
    if len(shape) == 2:
        return onednn.linear(x, w, b, post)
    return onednn.linear(x.reshape(-1, shape[-1]), w, b, post).view(*shape[:-1], w.shape[0])


def _complement(rows: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    return keep.nonzero().flatten()


RowPrecision.FP32 = RowPrecision(None, False)
