"""A tenant's students and its teacher scored on a labeled file (`hkstore students eval`).

Both read the same PLOT inputs (runtime.plot.retrieve); the students run virtually stacked
(runtime.exec.students), every k read off one forward, the teacher through the upper
layers with its PET. The metric is tenant_eval's: accuracy, or entity-level F1 for tagging.
"""

from __future__ import annotations

import torch

import hkstore
from runtime.construct.manager import _subsample, encode_eval, load_tenant, read_task
from runtime.model import pet as petlib
from runtime.model.stored import base_encoder
from runtime.plot.retrieve import retrieve
from runtime.exec import students as stack
from runtime.model import student as model
from runtime.student.build import _scorer
from runtime.student.record import load_group


def students_eval(store_path, tenant, test_path, *, max_examples: int | None = None, batch_size: int = 32,
                  seed: int = 0) -> dict:
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        encoder = base_encoder(store)
        meta, pet = load_tenant(store, tenant, encoder)
        group = load_group(snap, tenant, encoder.config.d)
        task, labels, version = meta["task"], list(meta["labels"]), group.meta["version"]
        data, _ = read_task(test_path, task)
        pick = _subsample(len(data[0]), max_examples, seed)
        data = ([data[0][i] for i in pick], [data[1][i] for i in pick])
        max_len = (meta.get("train") or {}).get("max_len", 128)
        ids, targets = encode_eval(encoder, data, task, labels, max_len)
        by_k = {k: [] for k in range(1, group.size + 1)}
        teacher = []
        with torch.no_grad():
            for start in range(0, len(ids), batch_size):
                x, mask, _ = retrieve(snap, version, ids[start:start + batch_size])
                lengths = mask.sum(1).tolist()
                teacher += _argmax(petlib.head(pet, encoder.upper(x, mask, pet)), task, lengths)
                # one stacked forward of all M students; F_k for every k is a running sum of it
                w = {n: v for n, v in group.tensors.items() if n.startswith("layers.")}
                out = stack.forward(w, x.expand(group.size, *x.shape), mask, group.meta["heads"], group.meta["eps"])
                sums = (group.tensors["multiplier"][:, None, None, None] * out).cumsum(0)
                for k in by_k:
                    by_k[k] += _argmax(model.head(group, sums[k - 1]), task, lengths)
    score = _scorer(task, labels, targets, data)
    return {"tenant": tenant, "version": version, "metric": "accuracy" if task == "classification" else "entity_f1",
            "examples": len(ids), "teacher": score(teacher), "students": {k: score(p) for k, p in by_k.items()},
            "best_k": group.meta.get("best_k")}


def _argmax(logits: torch.Tensor, task: str, lengths: list[int]) -> list:
    p = logits.argmax(-1)
    return p.tolist() if task == "classification" else [row[:n] for row, n in zip(p.tolist(), lengths)]
