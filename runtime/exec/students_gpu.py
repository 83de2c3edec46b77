"""Virtual stacking on the GPU executor's device (runtime.exec.students's math, CuPy).

Under the GPU executor a tenant's first k students run on the device as one batched
computation: their weights, uploaded once per group and kept (transposed so every projection
is one batched GEMM over the student axis P), the tenant's PLOT inputs expanded along P,
attention one batched matmul over P x batch x heads, LayerNorm per student with its own gain
and shift, the erf GELU of the fused kernel (runtime.exec.ops_gpu.bias_gelu), the boosted sum
F_k = sum_p multiplier[p] * s_p(x) and the pruning head. Equal to stack.ensemble + model.head
within fp32 rounding (tests/test_student.py, on the CUDA-on-CPU emulation).

    dev = DeviceStudents(gpu_executor)
    logits = dev.logits(group, k, x, mask)        # host (B, labels) or (B, L, labels)
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from runtime.model.student import LINEARS, Group

_F32_MIN = float(np.finfo(np.float32).min)


class DeviceStudents:
    def __init__(self, executor):
        self.ex = executor
        self.cp, self.ops = executor.cp, executor.ops
        # id(group) -> device tensors, dropped when the group is (a reloaded group replaces its old one)
        self._weights: dict[int, dict] = {}

    def _upload(self, group: Group) -> dict:
        entry = self._weights.get(id(group))
        if entry is None:
            cp, out = self.cp, {}
            for name, t in group.tensors.items():
                a = t.detach().float().numpy()
                if name.startswith("layers.") and name.endswith(".weight") and name.split(".")[2] in LINEARS:
                    a = np.ascontiguousarray(a.transpose(0, 2, 1))  # (P, d_in, d_out): x @ W^T as one matmul
                out[name] = cp.asarray(np.ascontiguousarray(a))
            entry = self._weights[id(group)] = out
            weakref.finalize(group, self._weights.pop, id(group), None)
        return entry

    def _linear(self, w, name, x):
        return self.cp.matmul(x, w[name + ".weight"]) + w[name + ".bias"][:, None, :]

    def _norm(self, w, name, x, eps):
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) * (x - mu)).mean(axis=-1, keepdims=True)
        return (x - mu) / (var + np.float32(eps)) ** 0.5 * w[name + ".weight"][:, None, :] + w[name + ".bias"][:, None, :]

    def _layer(self, w, l, h, keys, heads, eps):
        """Layer l of P stacked students on h (P, B, L, d); keys (P * B, 1, 1, L) bool."""
        cp = self.cp
        P, B, L, d = h.shape
        p, dh = f"layers.{l}.", d // heads
        flat = h.reshape(P, B * L, d)
        q, k, v = (self._linear(w, p + t, flat).reshape(P * B, L, heads, dh).transpose(0, 2, 1, 3)
                   for t in ("q", "k", "v"))
        scores = cp.matmul(q, k.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(dh))
        scores = cp.where(keys, scores, np.float32(_F32_MIN))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = cp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = cp.ascontiguousarray(cp.matmul(probs, v).transpose(0, 2, 1, 3)).reshape(P, B * L, d)
        flat = self._norm(w, p + "ln_attn", flat + self._linear(w, p + "o", ctx), eps)
        f = self._linear(w, p + "ffn_in", flat)
        f = self.ops.bias_gelu(f, cp.zeros(f.shape[-1], dtype=f.dtype))
        flat = self._norm(w, p + "ln_ffn", flat + self._linear(w, p + "ffn_out", f), eps)
        return flat.reshape(P, B, L, d)

    def logits(self, group: Group, k: int, x, mask) -> np.ndarray:
        """The pruning head's logits (host) on F_k of inputs x (B, L, d) with mask (B, L)."""
        cp = self.cp
        with self.ex._device(), self.ex.compute_stream:
            w = self._upload(group)
            meta = group.meta
            x = cp.asarray(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
            m = cp.asarray(np.asarray(mask, dtype=bool))
            B, L = x.shape[:2]
            h = x[None].repeat(k, axis=0)  # (P, B, L, d): each student reads the tenant's inputs
            keys = m[None].repeat(k, axis=0).reshape(k * B, 1, 1, L)
            sliced = {name: t[:k] for name, t in w.items() if name.startswith("layers.")}
            for layer in range(meta["layers"]):
                h = self._layer(sliced, layer, h, keys, meta["heads"], meta["eps"])
            F = (w["multiplier"][:k, None, None, None] * h).sum(axis=0)  # (B, L, d)
            if meta["task"] == "classification":
                F = F[:, 0]
            out = cp.matmul(F, w["head.weight"].T) + w["head.bias"]
            return cp.asnumpy(out)

