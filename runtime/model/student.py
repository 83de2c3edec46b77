"""A student and a group of students (SP §3): the reference math, one student at a time.

A student is `layers` post-LN BERT layers of the base model's width, fed the tenant's PLOT
inputs (so it skips the lower layers like the teacher does). A group holds M students with
every weight stacked along a leading student axis (FORMAT.md section 5, students records):

    layers.{l}.{q,k,v,o}.weight (M, d, d)   .bias (M, d)
    layers.{l}.ffn_in.weight (M, ffn, d)    .bias (M, ffn)
    layers.{l}.ffn_out.weight (M, d, ffn)   .bias (M, d)
    layers.{l}.{ln_attn,ln_ffn}.weight (M, d)  .bias (M, d)
    multiplier (M,)                          the boosting multipliers (line search, SP Eq. 2)
    head.weight (labels, d)  head.bias (labels)   the pruning head (SP Alg. 2), any k

The group's representation with its first k students is F_k = sum_{j<k} multiplier[j] * s_j(x);
the head reads F_k as the teacher's head reads the teacher's last hidden state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LINEARS = ("q", "k", "v", "o", "ffn_in", "ffn_out")
NORMS = ("ln_attn", "ln_ffn")


@dataclass
class Group:
    tensors: dict[str, torch.Tensor]
    meta: dict  # task, labels, layers, heads, eps, version, students, ...

    @property
    def size(self) -> int:
        return int(self.tensors["multiplier"].shape[0])

    def student(self, j: int) -> dict[str, torch.Tensor]:
        """Student j's own weights (no student axis)."""
        return {k: v[j] for k, v in self.tensors.items() if k.startswith("layers.")}


def init_student(encoder, layers: int) -> dict[str, torch.Tensor]:
    """A fresh student: copies of the base model's first `layers` upper layers (SP starts its
    students from the teacher's own layers), so it begins close to what the teacher computes."""
    out = {}
    for l in range(layers):
        blk = encoder.layers[encoder.lower_layers + l]
        for name in (*LINEARS, *NORMS):
            mod = getattr(blk, name)
            out[f"layers.{l}.{name}.weight"] = mod.weight.detach().clone()
            out[f"layers.{l}.{name}.bias"] = mod.bias.detach().clone()
    return out


def layer(w: dict, l: int, h: torch.Tensor, mask: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """Layer l of one student on h (B, L, d): runtime.model.encoder.Encoder.layer's math."""
    B, L, d = h.shape
    p = f"layers.{l}."

    def lin(name, x):
        return F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"])

    def norm(name, x):
        return F.layer_norm(x, (d,), w[p + name + ".weight"], w[p + name + ".bias"], eps)

    q, k, v = (lin(t, h).view(B, L, heads, d // heads).transpose(1, 2) for t in ("q", "k", "v"))
    scores = q @ k.transpose(-2, -1) / math.sqrt(d // heads)
    scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, d)
    h = norm("ln_attn", h + lin("o", ctx))
    return norm("ln_ffn", h + lin("ffn_out", F.gelu(lin("ffn_in", h))))


def student_forward(w: dict, x: torch.Tensor, mask: torch.Tensor, heads: int, eps: float) -> list[torch.Tensor]:
    """Every layer's output of one student (the last is its output, the first its middle layer
    when it has two: stacking distillation reads that one)."""
    outs, h = [], x
    for l in range(num_layers(w)):
        h = layer(w, l, h, mask, heads, eps)
        outs.append(h)
    return outs


def num_layers(w: dict) -> int:
    return len({k.split(".")[1] for k in w if k.startswith("layers.")})


def ensemble(group: Group, x: torch.Tensor, mask: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """F_k (B, L, d) by the Python loop over students: the reference virtual stacking must equal."""
    k = group.size if k is None else k
    heads, eps = group.meta["heads"], group.meta["eps"]
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + group.tensors["multiplier"][j] * student_forward(group.student(j), x, mask, heads, eps)[-1]
    return out


def head(group: Group, h: torch.Tensor, task: str | None = None) -> torch.Tensor:
    """Logits from a representation (B, L, d): classification reads the first token."""
    if (task or group.meta["task"]) == "classification":
        h = h[..., 0, :]
    return F.linear(h, group.tensors["head.weight"], group.tensors["head.bias"])


def stack_students(students: list[dict], multipliers: list[float], head_w: torch.Tensor, head_b: torch.Tensor,
                   meta: dict) -> Group:
    """A Group from per-student weight dicts (the order is the boosting order)."""
    tensors = {k: torch.stack([s[k] for s in students]) for k in students[0]}
    tensors["multiplier"] = torch.tensor(multipliers, dtype=torch.float32)
    tensors["head.weight"], tensors["head.bias"] = head_w, head_b
    return Group(tensors, dict(meta, students=len(students)))


def check_group(tensors: dict, meta: dict, d: int) -> None:
    """A stored group's tensors against its meta (ValueError, one line): every layer tensor of
    every student, with the model's width."""
    m, layers = meta.get("students"), meta.get("layers")
    if not isinstance(m, int) or m < 1 or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"students meta needs students >= 1 and layers >= 1, got {m!r}, {layers!r}")
    ffn = meta.get("ffn")
    want = {"multiplier": (m,), "head.weight": (len(meta["labels"]), d), "head.bias": (len(meta["labels"]),)}
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "ffn_in": (ffn, d), "ffn_out": (d, ffn)}
    for l in range(layers):
        for name, (o, i) in shapes.items():
            want |= {f"layers.{l}.{name}.weight": (m, o, i), f"layers.{l}.{name}.bias": (m, o)}
        for name in NORMS:
            want |= {f"layers.{l}.{name}.weight": (m, d), f"layers.{l}.{name}.bias": (m, d)}
    if missing := sorted(want.keys() - tensors.keys()):
        raise ValueError(f"students record lacks tensor {missing[0]}")
    for name, v in tensors.items():
        if name not in want:
            raise ValueError(f"students record has an unknown tensor {name!r}")
        if tuple(v.shape) != want[name]:
            raise ValueError(f"students tensor {name} has shape {tuple(v.shape)}, expected {want[name]}")
