"""Construction of a tenant's students over a store path (`hkstore students create`).

    students_create(store, "acme", dev_path="dev.jsonl", students=4)

The record names its teacher: `teacher_created` is the `created` of the PET it was distilled
from, so a later `tenant update` makes the group stale (runtime.student.record) until it is
distilled again (`hkstore students create STORE TENANT` again; without --dev it reuses the
stored group's settings: recorded_settings).

Reads the tenant's PET (the teacher) and its training file (as `tenant create` recorded it), the
PLOT inputs of both splits through runtime.plot.retrieve (the serving path), boosts students
(runtime.student.train), trains the pruning head (runtime.student.prune) and stores the group as
the tenant's students record (FORMAT.md section 5). After every accepted student an unfinished
record (meta complete: false) is committed, so a killed run resumes from the students it had.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import hkstore
from formats.pack import PetRecord
from hkstore.errors import UnknownTenant
from runtime.construct.data import accuracy, entity_f1, word_tags
from runtime.construct.train import loss_ends
from runtime.construct.manager import (
    ManagerError,
    _subsample,
    encode_eval,
    encode_task,
    load_tenant,
    read_corpora,
    read_task,
    tokenize_corpus,
)
from runtime.model.stored import base_encoder
from runtime.plot.retrieve import retrieve_list
from runtime.model.student import LINEARS, NORMS
from runtime.student.prune import best_k, cumulative, scores_by_k, train_head
from runtime.student.train import StudentConfig, boost, teacher_logits, teacher_states


def students_create(store_path, tenant, *, dev_path, students: int = 4, layers: int = 1, lam: float = 0.5,
                    epochs: int = 8, lr: float = 2e-3, batch_size: int = 16, max_examples: int | None = None,
                    min_gain: float = 0.01, head_epochs: int = 20, corpus_paths=(), max_corpus: int = 2000,
                    resume: bool = True, seed: int = 0, progress: bool = True) -> dict:
    """Train and store `tenant`'s students; returns a JSON-able summary (module doc).
    corpus_paths: unlabeled in-domain text (at most max_corpus pieces) that the students and
    the pruning head also learn from: both only need the teacher's outputs."""
    t0 = time.perf_counter()
    if students < 1 or layers < 1:
        raise ValueError(f"students and layers must be at least 1, got {students} and {layers}")
    cfg = StudentConfig(max_students=students, layers=layers, lam=lam, epochs=epochs, lr=lr, batch_size=batch_size,
                        min_gain=min_gain, seed=seed, progress=progress)
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.pets:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        encoder = base_encoder(store)
        meta, pet = load_tenant(store, tenant, encoder)
        if meta["task"] not in ("classification", "tagging"):
            raise ManagerError(f"tenant {tenant!r} is an {meta['task']} tenant; students serve encoder tasks")
        task, labels, version = meta["task"], list(meta["labels"]), meta["version"]
        train = meta.get("train") or {}
        if not train.get("path"):
            raise ManagerError(f"tenant {tenant!r} records no training file")
        max_len = train.get("max_len", 128)
        data, _ = read_task(train["path"], task)
        ids, _ = encode_task(encoder, data, task, labels, max_len, _subsample(len(data[0]), max_examples, seed))
        dev, _ = read_task(dev_path, task)
        dev_ids, dev_targets = encode_eval(encoder, dev, task, labels, max_len)
        if corpus_paths:
            pieces = tokenize_corpus(encoder, read_corpora(list(corpus_paths)), max_len)
            ids = ids + [pieces[i] for i in _subsample(len(pieces), max_corpus, seed)]
        x_train = retrieve_list(snap, version, ids)
        x_dev = retrieve_list(snap, version, dev_ids)
        start, resumed = _resumable(snap, tenant, layers, resume)
    h_train, h_dev = teacher_states(encoder, pet, x_train), teacher_states(encoder, pet, x_dev)
    base = {"tenant": tenant, "base_model": meta["base_model"], "version": version, "task": task, "labels": labels,
            "layers": layers, "heads": encoder.config.heads, "eps": encoder.config.eps, "ffn": encoder.config.ffn,
            "teacher_created": meta.get("created"),
            "train": {"path": os.path.abspath(train["path"]), "dev": os.path.abspath(dev_path), "examples": len(ids),
                      "epochs": epochs, "lr": lr, "lam": lam, "min_gain": min_gain, "max_students": students,
                      "corpus": [os.path.abspath(p) for p in corpus_paths]}}
    head_w, head_b = pet.tensors["head.weight"], pet.tensors["head.bias"]

    def save(group_students, history, **more):
        record = _record(tenant, group_students, head_w, head_b, dict(base, history=history, **more))
        with hkstore.open(store_path, writable=True) as st:
            st.put_students(record)
        return record

    trained, history = boost(encoder, h_train, h_dev, x_train, x_dev, task, cfg, start=start,
                             on_student=lambda s, h: save(s, h, complete=False))
    score = _scorer(task, labels, dev_targets, dev)
    heads, eps = encoder.config.heads, encoder.config.eps
    cums_train = cumulative(trained, x_train, heads, eps, task)
    head_w, head_b, head_log = train_head(head_w, head_b, cums_train, teacher_logits(pet, h_train), epochs=head_epochs, seed=seed,
                                          progress=progress)
    scores = scores_by_k(head_w, head_b, cumulative(trained, x_dev, heads, eps, task), task, score)
    teacher_score = score([int(t.argmax()) if task == "classification" else t.argmax(-1).tolist()
                           for t in teacher_logits(pet, h_dev)])
    k = best_k(scores)
    record = save(trained, history, complete=True, scores=scores, best_k=k, teacher_score=teacher_score,
                  metric="accuracy" if task == "classification" else "entity_f1",
                  head={"epochs": head_epochs, **loss_ends(head_log)})
    with hkstore.open(store_path) as store:
        size = store.snapshot().students[tenant]["length"]
    return {"tenant": tenant, "version": version, "students": len(trained), "layers": layers, "resumed": resumed,
            "best_k": k, "scores": scores, "teacher_score": teacher_score, "metric": record.meta["metric"],
            "history": history, "bytes": int(size), "seconds": round(time.perf_counter() - t0, 3)}


def recorded_settings(store_path, tenant) -> dict:
    """students_create's settings of the tenant's stored group (to distill it again after
    `tenant update` made it stale); {} when it has none."""
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.students:
            return {}
        meta = snap.read_students(tenant).meta
    train = meta.get("train") or {}
    out = {"dev_path": train.get("dev"), "students": train.get("max_students"), "layers": meta.get("layers"),
           "lam": train.get("lam"), "epochs": train.get("epochs"), "lr": train.get("lr"),
           "min_gain": train.get("min_gain"), "corpus_paths": tuple(train.get("corpus") or ())}
    return {k: v for k, v in out.items() if v is not None}


def _resumable(snap, tenant, layers, resume):
    """([(weights, eta)] of an unfinished students record with the same shape, resumed?)."""
    if not resume or tenant not in snap.students:
        return [], False
    record = snap.read_students(tenant)
    if record.meta.get("complete") or record.meta.get("layers") != layers:
        return [], False
    t = {k: torch.from_numpy(np.array(v)) for k, v in record.tensors.items()}
    M = int(record.meta["students"])
    return [({k: v[j] for k, v in t.items() if k.startswith("layers.")}, float(t["multiplier"][j])) for j in range(M)], True


def _record(tenant, trained, head_w, head_b, meta) -> PetRecord:
    tensors = {}
    names = [f"layers.{l}.{n}.{p}" for l in range(meta["layers"]) for n in (*LINEARS, *NORMS) for p in ("weight", "bias")]
    for name in names:
        tensors[name] = np.ascontiguousarray(torch.stack([w[name] for w, _ in trained]).numpy(), dtype=np.float32)
    tensors["multiplier"] = np.array([eta for _, eta in trained], dtype=np.float32)
    tensors["head.weight"] = head_w.detach().numpy().astype(np.float32)
    tensors["head.bias"] = head_b.detach().numpy().astype(np.float32)
    meta = dict(meta, pet_type="students", students=len(trained), created=time.time())
    return PetRecord(tenant=tenant, meta=meta, tensors=tensors)


def _scorer(task, labels, targets, data):
    """The task metric of predictions on a split, scored as tenant_eval scores the teacher."""
    if task == "classification":
        return lambda predicted: accuracy(targets, predicted)
    words, tags = data
    gold = [[t if t in labels else "O" for t in ts] for ts in tags]
    return lambda predicted: entity_f1(gold, [word_tags(p, t, labels, len(w)) for p, t, w in zip(predicted, targets, words)])
