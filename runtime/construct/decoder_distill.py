"""Window distillation for decoder stores: train a copy of the decoder's lower layers so that
each token's causal window value (runtime.plot.causal.windowed_lower: the lower layers on
[x(i-n+1) .. x(i)] alone) matches the original decoder's full-context lower output at i.

The same idea as runtime.construct.train.distill_windows for encoders, with the causal rule: the
target is fixed at the start (the upper layers were trained on full-context features) and a
per-position table trains alongside so the layers are not pushed to encode absolute position
(discarded afterwards: the build refits it on the store's lookups).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from runtime.construct.train import TrainConfig, _fit
from runtime.plot.causal import windowed_lower


def distill_causal_windows(decoder, docs: list[list[int]], n: int, cfg: TrainConfig, student=None):
    """(a trained copy of student (default: decoder), losses)."""
    docs = [d for d in docs if 0 < len(d) <= decoder.config.max_len]
    with torch.no_grad():
        targets = [decoder.lower(torch.tensor([doc]))[0] for doc in docs]
        student = copy.deepcopy(student if student is not None else decoder)
        position = torch.zeros(decoder.config.max_len, decoder.config.d)
        count = torch.zeros(decoder.config.max_len, 1)
        for doc, target, x in zip(docs[:512], targets, windowed_lower(student, docs[:512], n)):
            position[:len(doc)] += target - x
            count[:len(doc)] += 1
        position = (position / count.clamp(min=1)).requires_grad_(True)

    def loss_of(batch):
        predicted = torch.cat([x + position[:len(x)] for x in windowed_lower(student, [docs[j] for j in batch], n)])
        return F.mse_loss(predicted, torch.cat([targets[j] for j in batch]))

    params = [p.requires_grad_(True) for p in student.lower_parameters()] + [position]
    log = _fit(params, len(docs), loss_of, cfg, "causal window distillation")
    return student.requires_grad_(False).eval(), log
