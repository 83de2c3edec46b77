"""Adaptive student pruning (SP Alg. 2): one head that works for the first k students, any k.

The head starts as the teacher's and is trained on F_k, the sum of the first k students, with k
drawn anew for every example of every batch, against the teacher's soft labels (temperature T,
KL divergence scaled by T^2, Hinton et al.). Serving may then drop the last students of a group
under load and keep using the same head. The validation score of every k is recorded; the best
k (ties: fewer students) is the group's default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.construct.train import TrainConfig, _fit
from runtime.student.train import student_outputs


@torch.no_grad()
def cumulative(students: list, inputs: list[torch.Tensor], heads: int, eps: float, task: str) -> list[torch.Tensor]:
    """Per example, F_1..F_M stacked (M, rows, d): the rows the head reads (first token for
    classification, every token for tagging)."""
    per_student = [student_outputs(w, inputs, heads, eps) for w, _ in students]
    out = []
    for i in range(len(inputs)):
        terms = torch.stack([eta * outs[i] for (_, eta), outs in zip(students, per_student)])
        sums = terms.cumsum(0)
        out.append(sums[:, :1] if task == "classification" else sums)
    return out


def train_head(head_w: torch.Tensor, head_b: torch.Tensor, cums: list[torch.Tensor], teacher: list[torch.Tensor],
               *, temperature: float = 2.0, lr: float = 1e-3, epochs: int = 20, batch_size: int = 32, seed: int = 0,
               progress: bool = True):
    """Alg. 2's head: (weight, bias, losses). teacher: the teacher's logits per example, (labels,)
    or (rows, labels), rows matching cums'."""
    w = head_w.detach().clone().requires_grad_(True)
    b = head_b.detach().clone().requires_grad_(True)
    M = cums[0].shape[0]
    g = torch.Generator().manual_seed(seed + 7919)
    T = temperature

    def loss_of(batch):
        ks = torch.randint(M, (len(batch),), generator=g)
        x = torch.cat([cums[i][k] for i, k in zip(batch, ks.tolist())])
        t = torch.cat([teacher[i].reshape(-1, teacher[i].shape[-1]) for i in batch])
        logp = F.log_softmax(F.linear(x, w, b) / T, -1)
        return F.kl_div(logp, F.log_softmax(t / T, -1), log_target=True, reduction="batchmean") * T * T

    cfg = TrainConfig(lr=lr, epochs=epochs, batch_size=batch_size, seed=seed, progress=progress, weight_decay=0.0)
    log = _fit([w, b], len(cums), loss_of, cfg, "pruning head")
    return w.detach(), b.detach(), log


@torch.no_grad()
def predictions(head_w, head_b, cums: list[torch.Tensor], k: int, task: str) -> list:
    """argmax predictions with the first k students: an int (classification) or a list per example."""
    out = []
    for c in cums:
        p = F.linear(c[k - 1], head_w, head_b).argmax(-1)
        out.append(int(p[0]) if task == "classification" else p.tolist())
    return out


def scores_by_k(head_w, head_b, cums, task: str, score) -> list[float]:
    """score(predictions) for k = 1..M (score: the task metric on validation data)."""
    return [float(score(predictions(head_w, head_b, cums, k, task))) for k in range(1, cums[0].shape[0] + 1)]


def best_k(scores: list[float]) -> int:
    """The k with the best score; ties go to fewer students (cheaper at equal quality)."""
    return max(range(len(scores)), key=lambda j: (scores[j], -j)) + 1
