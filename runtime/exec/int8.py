"""The optional int8 path of the CPU executor: the shared upper-layer projections as
dynamically quantized GEMMs; the PETs, attention, LayerNorm and GELU stay fp32.

Weights are quantized once, symmetric int8 per output channel; activations are quantized per
call (dynamic quantization, PyTorch's x86 quantized engine: fbgemm on AVX2, int32
accumulation, fp32 out with the bias added). The PET edits then apply to the fp32 output as
on the fp32 path, so a tenant's own weights never lose precision.

``Int8Upper`` re-quantizes a projection when its fp32 weights changed in place (the tensors'
version counters), so a model whose weights are swapped in place (a dedicated tenant's) is
never served from stale int8 copies.
"""

from __future__ import annotations

import warnings

import torch

TARGETS = ("q", "k", "v", "o", "ffn_in", "ffn_out")


def pack(lin: torch.nn.Linear):
    """fbgemm's packed int8 weight (per output channel, symmetric) + fp32 bias of lin."""
    w = lin.weight.detach().float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, still the x86 kernel
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
    bias = None if lin.bias is None else lin.bias.detach().float()
    return torch.ops.quantized.linear_prepack(qw, bias)


def _stamp(lin) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in (lin.weight, lin.bias) if p is not None)


class Int8Upper:
    """Packed int8 weights of an encoder's upper-layer projections, kept current."""

    def __init__(self, encoder, layers):
        self.encoder = encoder
        self._packed = {}
        for i in layers:
            for t in TARGETS:
                self._pack(i, t)

    def _pack(self, i, target):
        lin = getattr(self.encoder.layers[i], target)
        self._packed[(i, target)] = (_stamp(lin), pack(lin))

    def linear(self, i, target, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b of layer i's projection `target`, int8 GEMM, fp32 (rows, d_out) out."""
        stamp, packed = self._packed[(i, target)]
        if stamp != _stamp(getattr(self.encoder.layers[i], target)):
            self._pack(i, target)
            packed = self._packed[(i, target)][1]
        # reduce_range: 7-bit activations, as fbgemm needs on AVX2 (no int16 overflow in vpmaddubsw)
        return torch.ops.quantized.linear_dynamic(x, packed, True)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self.encoder.layers[i], t).weight.numel() for i, t in self._packed)
