"""Level-1 and level-2 items in the same mixed-tenant batches (the CPU or the GPU executor).

``LevelExecutor`` wraps the runtime's executor for the scheduler (on the GPU executor the
inputs it builds are staged to the device like the executor's own). An item whose ``tag``
is a ``LevelTag`` says how it is served:

* level 1: its upper-layer inputs come from the PLOT (runtime.plot.mixed.retrieve_mixed), as
  always; with ``gate`` set, its coverage (share of windows served at full order) is measured
  from that lookup and, below the gate, the item moves to level 2 in this same batch;
  with ``attention`` set, the executor also returns the attention each token received
  (BatchPlan.received, accumulated while attention is computed);
* level 2: its inputs are the full-context lower layers of the encoder its PLOT version
  stands for (runtime.model.stored.context_encoder), computed here in the preparation step.

Either way the upper layers, the PETs and the heads run once for the whole batch, whatever
the mix of tenants and levels. A batch of plain items goes to the wrapped executor unchanged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from runtime.exec.plan import BatchPlan, Prepared
from runtime.level.dispatch import coverage
from runtime.plot.mixed import retrieve_mixed


@dataclass
class LevelTag:
    level: int = 1
    gate: float = 0.0  # coverage below which a level-1 item moves to level 2 (0: never)
    attention: bool = False  # return the attention each token receives (level 1)
    coverage: float | None = None  # set by prepare (gated items)
    received: np.ndarray | None = None  # set by compute (attention): (length,)


class LevelExecutor:
    def __init__(self, inner, store, encoder):
        self.inner = inner
        self.store = store
        self.encoder = encoder
        self._lowers: dict = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):  # load_pet, plan, stats, memory, profile, ...
        return getattr(self.inner, name)

    def close(self):
        self.inner.close()

    def lower(self, version):
        """The full-context encoder for PLOT version `version` (loaded once)."""
        from runtime.model.stored import context_encoder

        with self._lock:
            if version not in self._lowers:
                self._lowers[version] = context_encoder(self.store, version, self.encoder)
            return self._lowers[version]

    def prepare(self, snapshot, items) -> Prepared:
        tags = [it.tag if isinstance(it.tag, LevelTag) else None for it in items]
        if not any(t is not None and (t.level == 2 or t.gate > 0 or t.attention) for t in tags):
            return self.inner.prepare(snapshot, items)
        t0 = time.perf_counter()
        B = len(items)
        lengths = [len(it.ids) for it in items]
        L, d = max(lengths), snapshot.meta["d"]
        inputs = torch.zeros(B, L, d)
        mask = torch.from_numpy(np.arange(L)[None, :] < np.array(lengths)[:, None])
        served = [None] * B
        first = [b for b, t in enumerate(tags) if t is None or t.level == 1]
        if first:
            x, _, info = retrieve_mixed(snapshot, [items[b].ids for b in first], [items[b].version for b in first])
            n = snapshot.meta["n"]
            for j, b in enumerate(first):
                t = tags[b]
                if t is not None and t.gate > 0:
                    t.coverage = coverage(info[j][1], n)
                    if t.coverage < t.gate:
                        t.level = 2
                        continue
                served[b] = info[j]
                inputs[b, :x.shape[1]] = x[j]
        t1 = time.perf_counter()
        by_version: dict = {}
        for b, t in enumerate(tags):
            if t is not None and t.level == 2:
                by_version.setdefault(items[b].version, []).append(b)
        with torch.no_grad():
            for version, rows in by_version.items():
                enc = self.lower(version)
                ids, m = enc.pad([items[b].ids for b in rows])
                h = enc.lower(ids, m)
                for j, b in enumerate(rows):
                    inputs[b, :lengths[b]] = h[j, :lengths[b]]
        plan = self.inner.plan([it.pet for it in items])
        if any(t is not None and t.level == 1 and t.attention for t in tags):
            plan.received = torch.zeros(B, L)
        timings = {"retrieval": t1 - t0, "lower": time.perf_counter() - t1, "transfer": 0.0}
        if hasattr(self.inner, "stage"):  # the GPU executor: the inputs go to the device as its own do
            with self.inner._device():
                staged, timings["transfer"] = self.inner.stage(inputs.numpy())
            staged["lengths"] = np.array(lengths, dtype=np.int64)
            return Prepared(items, timings, (staged, plan), served)
        return Prepared(items, timings, (inputs, mask, plan), served)

    def compute(self, prepared: Prepared) -> list:
        logits = self.inner.compute(prepared)
        payload = prepared.payload
        plan = payload[-1] if isinstance(payload, tuple) and isinstance(payload[-1], BatchPlan) else None
        if plan is not None and getattr(plan, "received", None) is not None:
            received = plan.received.numpy() / max(len(self.inner.layers), 1)
            for j, b in enumerate(plan.perm.tolist()):
                item = prepared.items[b]
                t = item.tag
                if isinstance(t, LevelTag) and t.attention and t.level == 1:
                    t.received = received[j, :len(item.ids)].copy()
        return logits
