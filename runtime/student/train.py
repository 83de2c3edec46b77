"""Boosting students on the teacher's final representation (SP Eq. 1-4).

Student j fits the residual the previous students leave, r_j = h_T - F_{j-1} (SP Eq. 1), where
h_T is the teacher's last hidden state and F_{j-1} the boosted sum so far; its multiplier is then
the line search's closed form for squared error, eta_j = <r_j, s_j> / <s_j, s_j> (Eq. 2). A
two-layer student also learns, in its middle layer, to reproduce F_{j-1} (stacking distillation,
Eq. 3-4, weight lam): what the earlier students know is stacked into the new one, whose second
layer then only has to add the correction. Students are added until the validation distance
to h_T improves by less than min_gain (relative) or max_students are trained.

Every real token's row is fitted, for classification too although its head reads only the
first token: with a few hundred labeled texts, the first token alone is too little signal
(tried: 600 rows left the students near their starting point), while every token's teacher
state is free extra supervision. Texts need no labels: unlabeled domain text helps the same way.
For classification the first token's error is added once more with the weight of all the
others together (tried without: the students matched ordinary tokens, distance 0.33 -> 0.10,
but not [CLS], 0.36 -> 0.30, and the pruning head then predicted the majority class only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.construct.train import TrainConfig, _fit, _pad_inputs, loss_ends
from runtime.model import pet as petlib
from runtime.model.student import init_student, student_forward


@dataclass(frozen=True)
class StudentConfig:
    max_students: int = 4
    layers: int = 1
    lam: float = 0.5  # stacking distillation weight (Eq. 4); only students with a middle layer
    epochs: int = 8  # 8 at 2e-3: chosen on dev (BENCHMARKS.md, Student Parallelism); 2 at 5e-4 left them far behind
    max_steps: int | None = None
    lr: float = 2e-3
    batch_size: int = 16
    min_gain: float = 0.01  # stop once a student improves the validation distance by less than 1%
    seed: int = 0
    progress: bool = True


def fit_loss(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, task: str) -> torch.Tensor:
    """Mean squared error over every real token, plus the first token's for classification."""
    loss = F.mse_loss(predicted[mask], target[mask])
    return loss + F.mse_loss(predicted[:, 0], target[:, 0]) if task == "classification" else loss


@torch.no_grad()
def teacher_states(encoder, pet, inputs: list[torch.Tensor], batch_size: int = 64) -> list[torch.Tensor]:
    """The teacher's last hidden state per example ((L, d) each): upper layers with the PET."""
    out = []
    for start in range(0, len(inputs), batch_size):
        x, mask = _pad_inputs(inputs[start:start + batch_size])
        h = encoder.upper(x, mask, pet)
        out += [h[b, :len(xi)] for b, xi in enumerate(inputs[start:start + batch_size])]
    return out


@torch.no_grad()
def teacher_logits(pet, states: list[torch.Tensor]) -> list[torch.Tensor]:
    return [petlib.head(pet, h[None])[0] for h in states]


@torch.no_grad()
def student_outputs(w: dict, inputs: list[torch.Tensor], heads: int, eps: float, batch_size: int = 64):
    """One student's output per example ((L, d) each)."""
    out = []
    for start in range(0, len(inputs), batch_size):
        x, mask = _pad_inputs(inputs[start:start + batch_size])
        h = student_forward(w, x, mask, heads, eps)[-1]
        out += [h[b, :len(xi)] for b, xi in enumerate(inputs[start:start + batch_size])]
    return out


def distance(a: list[torch.Tensor], b: list[torch.Tensor], task: str) -> float:
    """fit_loss over whole lists of (L, d) tensors."""
    d = float(torch.cat([x - y for x, y in zip(a, b)]).pow(2).mean())
    return d + float(torch.stack([x[0] - y[0] for x, y in zip(a, b)]).pow(2).mean()) if task == "classification" else d


def fit_student(encoder, inputs, targets, previous, task: str, cfg: StudentConfig, j: int):
    """Train student j (a fresh copy of the first upper layers) on residual targets; returns
    (its weights, eta, losses). previous: F_{j-1} per example (None for the first student)."""
    heads, eps = encoder.config.heads, encoder.config.eps
    w = {k: v.requires_grad_(True) for k, v in init_student(encoder, cfg.layers).items()}
    # The output is post-LayerNorm (size ~ sqrt(d)) while later residuals are small: a trainable
    # scale starts at the line search's value on the untrained student, so training begins
    # from the best multiple of the copied layers instead of from a huge error.
    with torch.no_grad():
        sample = list(range(min(64, len(inputs))))
        x, mask = _pad_inputs([inputs[i] for i in sample])
        s = student_forward(w, x, mask, heads, eps)[-1][mask]
        r = _pad_inputs([targets[i] for i in sample])[0][mask]
        scale = torch.tensor(float((r * s).sum() / (s * s).sum().clamp(min=1e-12)), requires_grad=True)

    def loss_of(batch):
        x, mask = _pad_inputs([inputs[i] for i in batch])
        outs = student_forward(w, x, mask, heads, eps)
        loss = fit_loss(scale * outs[-1], _pad_inputs([targets[i] for i in batch])[0], mask, task)
        if previous is not None and len(outs) > 1 and cfg.lam:
            loss = loss + cfg.lam * fit_loss(outs[0], _pad_inputs([previous[i] for i in batch])[0], mask, task)
        return loss

    tc = TrainConfig(lr=cfg.lr, epochs=cfg.epochs, max_steps=cfg.max_steps, batch_size=cfg.batch_size,
                     seed=cfg.seed + j, progress=cfg.progress)
    log = _fit([*w.values(), scale], len(inputs), loss_of, tc, f"student {j + 1}")
    w = {k: v.detach() for k, v in w.items()}
    s = student_outputs(w, inputs, heads, eps)
    # the line search of fit_loss's squared error (the first token counted twice for classification)
    first = sum(len(o) for o in s) / len(s) if task == "classification" else 0
    num = sum(float((r * o).sum()) + first * float(r[0] @ o[0]) for r, o in zip(targets, s))
    den = sum(float(o.pow(2).sum()) + first * float(o[0] @ o[0]) for o in s)
    return w, num / max(den, 1e-12), log, s


def boost(encoder, teacher_train, teacher_val, train_inputs, val_inputs, task: str, cfg: StudentConfig,
          start: list | None = None, on_student=None):
    """Students by boosting (module doc). start: [(weights, eta), ...] trained earlier (resume);
    on_student(students, history) is called after each accepted student (to store progress).
    Returns (students [(weights, eta)], history: one dict per trained student)."""
    heads, eps = encoder.config.heads, encoder.config.eps
    students, history = list(start or []), []
    F_train = [torch.zeros_like(h) for h in teacher_train]
    F_val = [torch.zeros_like(h) for h in teacher_val]
    for w, eta in students:  # replay the stored students' sums
        F_train = [f + eta * o for f, o in zip(F_train, student_outputs(w, train_inputs, heads, eps))]
        F_val = [f + eta * o for f, o in zip(F_val, student_outputs(w, val_inputs, heads, eps))]
    best = distance(F_val, teacher_val, task)
    while len(students) < cfg.max_students:
        j = len(students)
        residual = [t - f for t, f in zip(teacher_train, F_train)]
        w, eta, log, train_out = fit_student(encoder, train_inputs, residual, F_train if j else None, task, cfg, j)
        val_out = student_outputs(w, val_inputs, heads, eps)
        new_val = [f + eta * o for f, o in zip(F_val, val_out)]
        dist = distance(new_val, teacher_val, task)
        history.append({"student": j + 1, "eta": eta, **loss_ends(log),
                        "val_distance": dist, "val_distance_before": best})
        if dist > best * (1 - cfg.min_gain):
            history[-1]["kept"] = False
            break  # validation stopped improving: this student is dropped, the group is done
        history[-1]["kept"] = True
        students.append((w, eta))
        F_val = new_val
        F_train = [f + eta * o for f, o in zip(F_train, train_out)]
        best = dist
        if on_student is not None:
            on_student(students, history)
    return students, history
