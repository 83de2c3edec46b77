"""The optional int8 path of the CPU executor: the shared projections as int8 GEMMs; the PETs,
attention, LayerNorm and GELU stay fp32, and the PET edits apply to the fp32 output as on the
fp32 path, so a tenant's own weights never lose precision.

Weights are quantized once, symmetric per output channel; activations per call. Schemes:

* ``row``: activations symmetric int8 per row (per token), weights 7-bit per output channel,
  oneDNN's s8·s8 -> s32 GEMM (``torch._int_mm``), fp32 out = acc * row scale * channel scale +
  bias. The weights are 7-bit because without VNNI (AVX2) oneDNN adds 128 to the activations
  and sums u8·s8 pairs in int16 (vpmaddubsw): 2 * 255 * 63 fits, 2 * 255 * 127 saturates.
  A token's scale is its own, so one outlier token no longer coarsens every other token.
* ``tensor``: PyTorch's dynamic quantized linear (fbgemm): activations per call per tensor,
  7-bit (reduce_range, fbgemm's int16 pairs on AVX2), weights 8-bit.
* ``smooth``: SmoothQuant: per input channel j, x_j / s_j and W_:j * s_j with
  s_j = absmax(x_j)^a / absmax(W_:j)^(1-a), then ``tensor`` (activation outliers moved into the
  weights); needs calibrated per-channel absmax (``Recorder``).
* ``outlier``: LLM.int8-style: the calibrated outlier input channels (absmax above a
  threshold) as a small fp32 GEMM, the others through ``tensor``.
* ``row-outlier``: the same split, the others through ``row`` (the outlier channels no longer
  set every token's scale).

``dtype="int8"`` runs ``row`` (it needs no calibration). No scheme keeps every task within
0.3 points of fp32 on dev (docs/history/benchmarks-log.md, Optional int8 executor), so int8 is off by default;
``smooth`` is the worst there: the outliers it moves into W_:j set their output channels'
weight scales and so coarsen every other weight of those channels.

``Int8Shared`` re-quantizes a projection when its fp32 weights changed in place (the tensors'
version counters), so a model whose weights are swapped in place (a dedicated tenant's) is
never served from stale int8 copies.
"""

from __future__ import annotations

import threading
import warnings

import torch

TARGETS = ("q", "k", "v", "o", "ffn_in", "ffn_out")
SCHEMES = ("row", "row-outlier", "tensor", "smooth", "outlier")
CALIBRATED = ("row-outlier", "smooth", "outlier")
ROW_WEIGHT_MAX = 63  # 7-bit weights: oneDNN's AVX2 u8·s8 pairs stay inside int16
SMOOTH_ALPHA = 0.5
OUTLIER_THRESHOLD = 6.0  # LLM.int8's magnitude threshold
TINY = 1e-12


def pack(lin: torch.nn.Linear, w: torch.Tensor | None = None):
    """fbgemm's packed int8 weight (per output channel, symmetric) of w (default lin's) + lin's fp32 bias."""
    w = lin.weight.detach().float() if w is None else w
    scale = (w.abs().amax(1) / 127.0).clamp_min(TINY).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, still the x86 kernel
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
    bias = None if lin.bias is None else lin.bias.detach().float()
    return torch.ops.quantized.linear_prepack(qw, bias)


def row_weights(w: torch.Tensor):
    """(int8 W^T (d_in, d_out) in [-63, 63], fp32 per-output-channel scales) of fp32 w (d_out, d_in)."""
    scale = (w.abs().amax(1) / ROW_WEIGHT_MAX).clamp_min(TINY)
    q = torch.round(w / scale[:, None]).clamp_(-ROW_WEIGHT_MAX, ROW_WEIGHT_MAX)
    # a fresh (d_in, d_out) tensor: .t().contiguous() of a 1-column w keeps strides (1, 1),
    # which oneDNN reads as a leading dimension of 1
    qwt = torch.empty(w.shape[1], w.shape[0], dtype=torch.int8)
    return qwt.copy_(q.t()), scale


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 step of x (rows,): absmax / 127 (a zero row gets a tiny step)."""
    if x.shape[1] == 0:
        return torch.full((x.shape[0],), TINY)
    return torch.maximum(x.amax(1), x.amin(1).neg_()).clamp_min_(TINY).div_(127.0)


def smooth_factors(absmax: torch.Tensor, w: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's s (d_in,): activation range^alpha / weight range^(1-alpha) per input channel,
    at least 1: a channel is only ever shrunk, so one quiet while calibrating is never amplified
    past the range it may reach when served."""
    s = absmax.clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
    return s.clamp_min(1.0)


def _stamp(lin) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in (lin.weight, lin.bias) if p is not None)


class Int8Shared:
    """The int8 forms of an encoder's shared projections on `layers`, kept current.

    absmax: {(layer, target): per-input-channel absmax (d_in,)} from ``Recorder`` (the
    calibrated schemes need it)."""

    def __init__(self, encoder, layers, scheme: str = "row", absmax: dict | None = None):
        if scheme not in SCHEMES:
            raise ValueError(f"int8 scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        if scheme in CALIBRATED and absmax is None:
            raise ValueError(f"int8 scheme {scheme!r} needs calibrated activation ranges (int8.Recorder)")
        self.encoder, self.scheme, self.absmax = encoder, scheme, absmax
        self._packed = {}
        self._local = threading.local()  # per calling thread: reused quantization buffers
        for i in layers:
            for t in TARGETS:
                self._pack(i, t)

    def _pack(self, i, target):
        lin = getattr(self.encoder.layers[i], target)
        w = lin.weight.detach().float()
        bias = None if lin.bias is None else lin.bias.detach().float()
        if self.scheme == "row":
            form = (*row_weights(w), bias)
        elif self.scheme == "tensor":
            form = (pack(lin),)
        elif self.scheme == "smooth":
            s = smooth_factors(self.absmax[(i, target)], w)
            form = (pack(lin, w * s), 1.0 / s)
        else:
            idx = torch.nonzero(self.absmax[(i, target)] > OUTLIER_THRESHOLD).flatten()
            rest = w.index_fill(1, idx, 0.0)
            rest = (*row_weights(rest), bias) if self.scheme == "row-outlier" else (pack(lin, rest),)
            form = (rest, idx, w[:, idx].t().contiguous())
        self._packed[(i, target)] = (_stamp(lin), form)

    def _buffer(self, name, shape, dtype) -> torch.Tensor:
        # reused across calls: a fresh 50 MB tensor per projection is paid for in page faults
        bufs = self._local.__dict__.setdefault("buffers", {})
        b = bufs.get(name)
        if b is None or b.numel() < shape[0] * shape[1] or b.dtype != dtype:
            b = bufs[name] = torch.empty(shape[0] * shape[1], dtype=dtype)
        return b[: shape[0] * shape[1]].view(shape)

    @torch.no_grad()
    def linear(self, i, target, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b of layer i's projection `target` through the int8 GEMM: fp32 (rows, d_out)
        (the row scheme writes it into `out` when given). x is left as it was (the PETs read it)."""
        stamp, form = self._packed[(i, target)]
        if stamp != _stamp(getattr(self.encoder.layers[i], target)):
            self._pack(i, target)
            form = self._packed[(i, target)][1]
        x = x.contiguous()
        if self.scheme == "row":
            y = self._row(x, *form, out)
        elif self.scheme == "tensor":
            y = torch.ops.quantized.linear_dynamic(x, form[0], True)
        elif self.scheme == "smooth":
            packed, inv = form
            y = torch.ops.quantized.linear_dynamic(torch.mul(x, inv, out=self._buffer("xs", x.shape, x.dtype)),
                                                   packed, True)
        else:
            rest_form, idx, w_out = form
            rest = self._buffer("xr", x.shape, x.dtype).copy_(x).index_fill_(1, idx, 0.0)
            if self.scheme == "row-outlier":
                y = self._row(rest, *rest_form, out)
            else:
                y = torch.ops.quantized.linear_dynamic(rest, rest_form[0], True)
            if len(idx):
                y.addmm_(x.index_select(1, idx), w_out)
        return y

    def _row(self, x, qwt, w_scale, bias, out):
        rows, d_out = x.shape[0], qwt.shape[1]
        sx = row_scales(x)
        qf = torch.div(x, sx[:, None], out=self._buffer("xs", x.shape, x.dtype)).round_()
        q = self._buffer("xq", x.shape, torch.int8).copy_(qf)
        acc = torch._int_mm(q, qwt, out=self._buffer("acc", (rows, d_out), torch.int32))
        y = torch.empty(rows, d_out) if out is None else out
        y.copy_(acc).mul_(w_scale)
        if bias is None:
            return y.mul_(sx[:, None])
        return torch.addcmul(bias, y, sx[:, None], out=y)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self.encoder.layers[i], t).weight.numel() for i, t in self._packed)


class Recorder:
    """Stands in for ``Int8Shared`` while calibrating: fp32 GEMMs, and the running absmax of
    every input channel per (layer, target): what ``smooth`` and ``outlier`` are built from."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.absmax: dict = {}

    @torch.no_grad()
    def linear(self, i, target, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        seen = x.abs().amax(0) if len(x) else torch.zeros(x.shape[1])
        key = (i, target)
        self.absmax[key] = seen if key not in self.absmax else torch.maximum(self.absmax[key], seen)
        lin = getattr(self.encoder.layers[i], target)
        y = torch.empty(len(x), lin.out_features) if out is None else out
        return torch.addmm(lin.bias, x, lin.weight.t(), out=y)
