"""A serving loop for tenants with students: length-aware buffer -> pruning policy -> compute.

    engine = StudentEngine("STORE", ["acme", "globex"], mode="adaptive", target_s=0.25)
    answer = engine.submit("acme", ids).result()      # answer.students: how many students answered

Callers submit from any thread; one engine thread takes a batch from the length-aware buffer,
asks the policy how to serve it (mode "adaptive": runtime.student.policy; "teacher": always
the teacher; an int k: always the first k students) and computes it: the PLOT inputs of each
tenant's requests (runtime.plot.retrieve), then either the teacher (upper layers + PET + head)
or every tenant's students in ONE virtually stacked step (runtime.exec.students.ensembles) and
the pruning head. The engine steps, the policy decides, stack computes. `timeline` records
(time, level, queued requests, batch size) per batch for the benchmark's figure.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

import hkstore
from runtime.construct.manager import load_tenant
from runtime.model import pet as petlib
from runtime.model.stored import base_encoder
from runtime.plot.retrieve import retrieve
from runtime.exec import students as stack
from runtime.model import student as model
from runtime.student.buffer import LengthBuffer
from runtime.student.policy import PruningPolicy
from runtime.student.record import load_group, stale


@dataclass
class Answer:
    tenant: str
    prediction: object  # classification: label index; tagging: one index per token
    students: int  # how many students answered; 0: the teacher did
    latency_s: float
    batch_size: int


@dataclass
class _Waiting:
    tenant: str
    ids: list
    future: Future
    t0: float


class StudentEngine:
    def __init__(self, store_path, tenants, *, mode="adaptive", target_s: float = 0.25, max_batch: int = 32,
                 bin_width: int = 8, fifo: bool = False, use_teacher: bool = True):
        self.store = hkstore.open(store_path)
        snap = self.store.snapshot()
        self.encoder = base_encoder(self.store)
        self.pets, self.groups = {}, {}
        for t in tenants:
            meta, pet = load_tenant(self.store, t, self.encoder)
            self.pets[t] = (meta, pet)
            self.groups[t] = load_group(snap, t, self.encoder.config.d)
            if stale(self.groups[t].meta, meta):
                raise ValueError(f"tenant {t!r}'s students are stale (distilled from an earlier PET); "
                                 "run hkstore students create again")
        self.mode, self.max_batch = mode, max_batch
        # a group answers with at most its best k (chosen on dev): more students cost more and
        # did not score better there
        self.best = {t: int(g.meta.get("best_k") or g.size) for t, g in self.groups.items()}
        m = max(self.best.values())
        self.policy = PruningPolicy((["teacher"] if use_teacher else []) + list(range(m, 0, -1)), target_s)
        self.buffer = LengthBuffer(bin_width, fifo)
        self.timeline: list = []
        self.padding = [0, 0]  # padded tokens computed, real tokens
        self._cv = threading.Condition()
        self._closed = False
        self.torch_threads = torch.get_num_threads()  # OpenMP counts are per thread: take the caller's
        self._thread = threading.Thread(target=self._loop, name="students", daemon=True)
        self._thread.start()

    def submit(self, tenant: str, ids: list) -> Future:
        if tenant not in self.groups:
            raise KeyError(f"tenant {tenant!r} is not served by this engine")
        w = _Waiting(tenant, ids, Future(), time.perf_counter())
        with self._cv:
            self.buffer.add(len(ids), w)
            self.policy.arrived(len(ids), w.t0)
            self._cv.notify()
        return w.future

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _loop(self):
        torch.set_num_threads(self.torch_threads)
        while True:
            with self._cv:
                while not len(self.buffer) and not self._closed:
                    self._cv.wait()
                if self._closed and not len(self.buffer):
                    return
                now = time.perf_counter()
                queued = len(self.buffer)
                if self.mode == "adaptive":
                    level = self.policy.choose(self.buffer.tokens(), now - self.buffer.items[0][1].t0, now)
                else:
                    level = self.mode
                batch = self.buffer.pop(self.max_batch)
            t0 = time.perf_counter()
            try:
                predictions = self.compute(batch, level)
            except Exception as e:  # noqa: BLE001 - every waiting caller hears of it; the loop goes on
                for w in batch:
                    w.future.set_exception(e)
                continue
            done = time.perf_counter()
            lengths = [len(w.ids) for w in batch]
            self.policy.observe(level, len(batch) * max(lengths), done - t0, tokens=sum(lengths))
            self.padding[0] += len(batch) * max(lengths)
            self.padding[1] += sum(lengths)
            self.timeline.append((done, level, queued, len(batch)))
            students = 0 if level == "teacher" else level
            for w, p in zip(batch, predictions):
                w.future.set_result(Answer(w.tenant, p, min(students, self.best[w.tenant]), done - w.t0,
                                           len(batch)))

    @torch.no_grad()
    def compute(self, batch: list, level) -> list:
        """Predictions of a batch's requests (mixed tenants) served at `level`."""
        snap = self.store.snapshot()
        by_tenant: dict = {}
        for i, w in enumerate(batch):
            by_tenant.setdefault(w.tenant, []).append(i)
        inputs = {}
        for t, idx in by_tenant.items():
            x, mask, _ = retrieve(snap, self.pets[t][0]["version"], [batch[i].ids for i in idx])
            inputs[t] = (x, mask)
        if level == "teacher":
            logits = {t: petlib.head(self.pets[t][1], self.encoder.upper(x, mask, self.pets[t][1]))
                      for t, (x, mask) in inputs.items()}
        else:
            parts = [(self.groups[t], min(level, self.best[t]), x, mask) for t, (x, mask) in inputs.items()]
            sums = stack.ensembles(parts)
            logits = {t: model.head(self.groups[t], h) for t, h in zip(inputs, sums)}
        out = [None] * len(batch)
        for t, idx in by_tenant.items():
            p = logits[t].argmax(-1).tolist()
            for row, i in zip(p, idx):
                out[i] = row if isinstance(row, int) else row[:len(batch[i].ids)]
        return out
