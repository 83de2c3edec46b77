"""The CPU executor's shared GEMMs through oneDNN, each weight packed once.

torch.addmm runs MKL's sgemm, which on AMD CPUs keeps to its AVX2 code whatever the CPU offers;
oneDNN picks its kernels by the CPU's features. Its GEMM on a pre-packed weight
(torch.ops.mkldnn._linear_pointwise, what torch.compile emits for CPU linears) ran the encoder's
shapes at 1.6-2.4x torch.addmm's rate on an AVX-512 AMD EPYC, and about 1.1x (FLOP-weighted)
with oneDNN held to AVX2. Outputs agree with addmm to about 1e-6 relative (the order of the
sums differs).
"""

import threading
import weakref

import torch
import torch.nn.functional as F


def available() -> bool:
    """Whether this torch build has oneDNN and its packed-weight linear."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


NONE = ("none", "")  # no post-op: the GEMM's output as it is


class PackedLinears:
    """y = x W^T + b, with each weight W packed into oneDNN's layout on first use and again
    whenever the tensor is written in place (a dedicated model's swap); a weight that is
    replaced is a new tensor, packed anew. With dtype=torch.bfloat16 the weights are packed in
    bf16: inputs must be bf16, outputs are bf16 (the bias may stay fp32), accumulation is fp32."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        # id(weight) -> (weak reference to it, its version when packed, packed weight); an entry
        # goes when its weight is collected, so packed copies never outlive the model
        self._packed = {}
        self._lock = threading.Lock()

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               post: tuple[str, str] = NONE) -> torch.Tensor:
        """post: oneDNN's elementwise op on the output, fused into the GEMM, as (name, algorithm):
        ("gelu", "tanh"), ("gelu", "none") (erf), ("relu", "")."""
        entry = self._packed.get(id(w))
        fresh = entry is None or entry[0]() is not w
        if fresh or entry[1] != w._version:
            with self._lock:
                entry = (weakref.ref(w), w._version,
                         torch.ops.mkldnn._reorder_linear_weight(w.detach().to(self.dtype), None))
                self._packed[id(w)] = entry
            if fresh:
                weakref.finalize(w, self._packed.pop, id(w), None)
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], b, post[0], [], post[1])


# One packer for the process: the executor, the exact level and the decode step share the base
# model's weights, so each is packed once.
SHARED = PackedLinears() if available() else None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           post: tuple[str, str] = NONE) -> torch.Tensor:
    """x W^T + b on SHARED's packed weights where torch has oneDNN, else F.linear (post, a
    fused post-op, needs oneDNN)."""
    return F.linear(x, w, b) if SHARED is None else SHARED.linear(x, w, b, post)
