"""The GPU executor (CuPy): runtime.exec.cpu's computation on one CUDA device.

Same interface as ``CpuExecutor`` (``load_pet``, ``plan``, ``gather``/``prepare``/``compute`` of a
batch plan's rows for the engine, ``run`` for a batch in hand) and the same results within fp32 rounding (fp16:
within 1e-2 relative; tests/test_executor_gpu.py). What is different:

* **Shared weights resident on the device** (fp32 or fp16), transposed once so that every
  dense projection is one cuBLAS GEMM (``x @ W^T`` through cupy.matmul) for the whole batch.
* **Custom ops** from runtime.exec.ops_gpu: SGMV / BGMV (LoRA), segmented adapters, bias gather
  (BitFit), sparse add (diff and mask PETs), fused bias + GELU and residual + LayerNorm,
  aggregation of window values and the PLOT hot tier's probe and gather.
* **Three streams.** ``compute`` runs the layers; ``inputs`` carries the retrieval results
  host -> device; ``pets`` carries PET weights (uploads of cache misses and the per-batch
  stacking). Streams are ordered with events only (no device-wide synchronisation): the
  compute stream waits for the input copy's event, the input stream waits until the compute
  stream has consumed the buffer it is about to overwrite.
* **PET operator lanes** (``lanes`` > 1, PetS Alg. 2): a stage's edit operators (BitFit,
  diff, LoRA of each target; kinds that share rows stay one operator) are placed by their
  roofline time onto ``lanes`` extra streams, compute- and memory-bound ones alternating;
  events order the lanes after the stage's GEMMs and the compute stream after the lanes.
* **Pinned, preallocated, reused host buffers** (cupy.cuda.alloc_pinned_memory), two of them
  in turn, so the retrieval of batch i+1 is copied while batch i computes (the engine runs
  ``prepare`` on its own thread when pipelining).
* **Layer-wise prefetch** (``prefetch=True``): the stacked PET weights of layer i+1 are built
  (and, for tenants not resident, uploaded) on the pets stream while layer i computes;
  ``prefetch=False`` builds each layer's on the compute stream just before it runs.
* **Full rows** (runtime.exec.rows: a tenant's full-depth PET, from the base embeddings): their
  embeddings go to the device with the batch's inputs; the base lower layers' weights are
  uploaded when the first full row comes; the lower layers run for the full rows alone (their
  own plan, the same layer function and kernels), whose output then replaces those rows'
  inputs at the first upper layer.
* **A device PET cache** (``DevicePetCache``): per (tenant, record, layer) entries, LRU
  bounded by ``pet_cache_bytes``; the hot tenants stay resident, the others live in the host
  cache (runtime.sched.pet_cache.PetCache) and are uploaded on demand.
* **A GPU-resident PLOT hot tier** (``HotTier``, ``hot_tier_rows`` > 0): the served values
  of the most frequent (window, version) keys live on the device in a FORMAT.md §3 hash
  table probed by the device-side XXH64 probe; only misses go to the host store lookup.
  Counters give the hit rate; the tier is rebuilt from the observed key frequencies every
  ``hot_rebuild_every`` batches and dropped when the store's manifest changes.

Memory safety of the asynchronous design rests on two rules: every device or pinned buffer a
batch touches is referenced by the batch until its logits are copied back (the final
synchronisation), and CuPy's device pool keeps one free list per stream, so memory freed on
one stream is never handed to another stream while work on the first may still read it.

CuPy is imported lazily; ``_cupy``/``_ops`` may replace the CuPy module and runtime.exec.ops_gpu
(tests run this executor's logic on the CPU that way).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time

import numpy as np
import torch

from runtime.exec.device_cache import DevicePetCache
from runtime.exec.hot_tier import HotTier
from runtime.exec.plan import BatchPlan, plan_batch, prepare_pet
from runtime.exec.rows import (FullInputs, Gathered, Prepared, assemble, attention_rows, full_inputs, gather_host,
                               received_rows, student_logits)
from runtime.exec.students_gpu import DeviceStudents

_F32_MIN = float(np.finfo(np.float32).min)
# Alg. 2's roofline for the lanes (fp32, H100-class): only the ridge point and the order matter
_PEAK_FLOPS, _BANDWIDTH = 5e13, 3e12


def cuda_available() -> bool:
    """Whether CuPy imports and sees a CUDA device (what device="auto" picks the GPU by)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ImportError("the GPU executor needs CuPy: pip install 'hkstore[gpu]'") from exc
    return cupy


class GpuExecutor:
    device = "cuda"

    def __init__(self, encoder, *, dtype: str = "fp32", pet_cache_bytes: int = 512 << 20, prefetch: bool = True,
                 hot_tier_rows: int = 65536, hot_rebuild_every: int = 32, max_batch: int = 64, max_len: int = 128,
                 lora_kernel: str = "auto", device_id: int | None = None, lanes: int = 1, context=None, _cupy=None,
                 _ops=None):
        if dtype not in ("fp32", "fp16"):
            raise ValueError(f"dtype must be fp32 or fp16, got {dtype!r}")
        if lora_kernel not in ("auto", "sgmv", "bgmv"):
            raise ValueError(f"lora_kernel must be auto, sgmv or bgmv, got {lora_kernel!r}")
        if int(lanes) < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes!r}")
        self.cp = cp = _cupy or _import_cupy()
        if _ops is None:
            from runtime.exec import ops_gpu as _ops
        self.ops = _ops
        self.encoder = encoder
        self.context = context  # level 2's input source (runtime.exec.context.ContextInputs), for context rows
        self.students = None  # runtime.exec.students_gpu.DeviceStudents, made for the first students row
        self.config = c = encoder.config
        self.dtype = np.float32 if dtype == "fp32" else np.float16
        self.prefetch = bool(prefetch)
        self.lora_kernel = lora_kernel
        self.layers = list(range(encoder.lower_layers, c.num_layers))
        self.device_id = cp.cuda.runtime.getDevice() if device_id is None else int(device_id)
        with self._device():
            self.compute_stream = cp.cuda.Stream(non_blocking=True)
            self.input_stream = cp.cuda.Stream(non_blocking=True)
            self.pet_stream = cp.cuda.Stream(non_blocking=True)
            # PetS Alg. 2: a stage's PET operators spread over these streams (lanes > 1)
            self.lane_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(int(lanes))] if lanes > 1 else []
            with self.compute_stream:
                self.weights = self._upload_weights()
                self.compute_stream.synchronize()
            self._alloc_buffers(max_batch * max_len)
        self.pet_cache = DevicePetCache(self, pet_cache_bytes)
        self.hot = HotTier(self, hot_tier_rows, hot_rebuild_every) if hot_tier_rows > 0 else None
        self._positions_dev = self._positions_generation = None  # see _add_position
        self.transfer_seconds = 0.0

    # -- device plumbing -------------------------------------------------------------------

    def _device(self):
        return self.cp.cuda.Device(self.device_id)

    def _upload_weights(self) -> dict:
        """Upper-layer weights on the device: W^T (d_in, d_out) and biases in the compute dtype."""
        return {i: self._upload_layer(i) for i in self.layers}

    def _upload_layer(self, i) -> dict:
        cp, blk, w = self.cp, self.encoder.layers[i], {}
        for t in ("q", "k", "v", "o", "ffn_in", "ffn_out"):
            lin = getattr(blk, t)
            w[t] = cp.ascontiguousarray(cp.asarray(lin.weight.detach().numpy().T.astype(self.dtype)))
            w[t + ".b"] = cp.asarray(lin.bias.detach().numpy().astype(self.dtype))
        for ln in ("ln_attn", "ln_ffn"):
            m = getattr(blk, ln)
            w[ln + ".g"] = cp.asarray(m.weight.detach().numpy().astype(self.dtype))
            w[ln + ".b"] = cp.asarray(m.bias.detach().numpy().astype(self.dtype))
            w[ln + ".eps"] = float(m.eps)
        return w

    def _alloc_buffers(self, tokens: int):
        """Two pinned host buffers and two device buffers of `tokens` x d fp32 inputs."""
        cp, d = self.cp, self.config.d
        self.capacity = int(tokens)
        count = self.capacity * d
        self._pinned_mem = [cp.cuda.alloc_pinned_memory(count * 4) for _ in range(2)]
        self.pinned = [np.frombuffer(m, np.float32, count) for m in self._pinned_mem]
        self.staged = [cp.empty(count, dtype=np.float32) for _ in range(2)]
        self.copy_done = [cp.cuda.Event() for _ in range(2)]
        self.consumed = [cp.cuda.Event() for _ in range(2)]
        # Host-side order on top of the events: a slot is staged again only after the
        # compute thread has *enqueued* the consumption of its previous batch (a stream waits
        # on an event's latest record at the time of the wait, so that record must exist).
        self.slot_free = [threading.Semaphore(1) for _ in range(2)]
        self._slot = 0

    def _ensure_capacity(self, tokens: int):
        if tokens > self.capacity:  # only outside the engine (run): nothing is in flight
            with self._device():
                for s in (self.compute_stream, self.input_stream, self.pet_stream):
                    s.synchronize()
                self._alloc_buffers(tokens)

    def copy_h2d(self, dst, src: np.ndarray, stream):
        """Asynchronous copy of a pinned host array into a device array on `stream`."""
        dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), src.nbytes, stream)

    def upload(self, host, stream, keep):
        """A new device array holding `host`, copied asynchronously on `stream` through a
        pinned staging buffer that is appended to `keep` (hold it until the stream passed)."""
        if host is None:
            return None
        cp = self.cp
        host = np.ascontiguousarray(host)
        mem = cp.cuda.alloc_pinned_memory(max(host.nbytes, 1))
        staging = np.frombuffer(mem, host.dtype, host.size).reshape(host.shape)
        staging[...] = host
        with stream:
            dev = cp.empty(host.shape, dtype=host.dtype)
        if host.nbytes:
            self.copy_h2d(dev, staging, stream)
        keep.append((mem, staging))
        return dev

    def to_host(self, dev, stream) -> np.ndarray:
        stream.synchronize()
        return self.cp.asnumpy(dev)

    # -- PETs and plans --------------------------------------------------------------------

    def load_pet(self, pet, key=None, token=None):
        return prepare_pet(self.encoder, pet, key, token)

    def plan(self, pets, keys=None) -> BatchPlan:
        return plan_batch(pets, keys, self.lora_kernel)

    # -- a batch plan's rows (runtime.exec.rows) -----------------------------------------

    def gather(self, snapshot, rows) -> Gathered:
        """The PLOT lookups: a plan of plain plot rows is looked up through the hot tier and its
        inputs copied to the device here (the staging overlaps the previous batch's compute);
        any other plan reads the host store, and prepare stages what it assembles."""
        if self.hot is not None and all(r.source == "plot" and not r.gate and not r.attention for r in rows):
            with self._device():
                staged, served, timings = self._retrieve_hot(snapshot, [r.ids for r in rows],
                                                             [r.version for r in rows])
            return Gathered(list(range(len(rows))), staged, served, timings)
        return gather_host(snapshot, rows)

    def prepare(self, gathered: Gathered, rows) -> Prepared:
        """The PET plan, and the host-assembled inputs (level 2's included) staged to the device
        (async, input stream); runs on the engine's preparation thread."""
        if isinstance(gathered.inputs, dict):  # staged by the hot tier
            plan = self.plan([r.pet for r in rows])
            return Prepared(rows, dict(gathered.timings), (list(range(len(rows))), gathered.inputs, plan, []),
                            gathered.served)
        t0 = time.perf_counter()
        teacher, inputs, lengths, parts, lower = assemble(gathered, rows, self.context, self.config.d)
        timings = dict(gathered.timings, transfer=0.0, lower=lower)
        staged = plan = None
        if teacher:
            full = full_inputs(rows, teacher, self.encoder)
            full_plan = None if full is None else self.plan(full.pets)
            plan = self.plan([rows[b].pet for b in teacher])  # before staging: nothing can fail after it
            if attention_rows(rows, teacher):
                plan.received = torch.zeros(inputs.shape[:2])
            with self._device():
                staged, timings["transfer"] = self.stage(inputs.numpy())
                if full is not None:
                    staged["full"] = self._stage_full(full, full_plan, staged["keep"])
            staged["lengths"] = lengths
        timings["retrieval"] += time.perf_counter() - t0 - lower - timings["transfer"]
        return Prepared(rows, timings, (teacher, staged, plan, parts), gathered.served)

    def compute(self, prepared: Prepared) -> list:
        teacher, staged, plan, parts = prepared.payload
        out = [None] * len(prepared.rows)
        if teacher:
            for b, y in zip(teacher, self.forward(staged, plan)):
                out[b] = y
            if plan.received is not None:
                prepared.received = received_rows(prepared.rows, teacher, plan, len(self.layers))
        if parts and self.students is None:
            self.students = DeviceStudents(self)
        for group, k, idx, x, mask in parts:  # one batched computation per tenant's k students
            logits = self.students.logits(group, k, x.numpy(), mask.numpy())
            for j, b in enumerate(idx):
                out[b] = student_logits(group, logits, mask, j)
        return out

    def stage(self, inputs: np.ndarray):
        """Copy (B, L, d) fp32 host inputs into the next pinned buffer and on to the device
        (async, input stream). Returns (staged, host seconds spent)."""
        cp = self.cp
        t0 = time.perf_counter()
        B, L, d = inputs.shape
        count = B * L * d
        self._ensure_capacity(B * L)
        k = self._slot
        self._slot ^= 1
        self.slot_free[k].acquire()  # released by forward() once the slot's batch is consumed
        self.copy_done[k].synchronize()  # the previous copy out of this pinned buffer is done
        self.pinned[k][:count] = inputs.reshape(-1)
        stream = self.input_stream
        with stream:
            stream.wait_event(self.consumed[k])  # the compute stream is done with this device buffer
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            self.copy_h2d(self.staged[k][:count], self.pinned[k][:count], stream)
            end.record(stream)
            self.copy_done[k].record(stream)
        return {"slot": k, "shape": (B, L, d), "events": (start, end), "array": None, "keep": []}, \
            time.perf_counter() - t0

    def _stage_full(self, full: FullInputs, plan: BatchPlan, keep) -> tuple:
        """The full rows' embeddings to the device (async, input stream): (full, plan, device
        embeddings, the copy's event)."""
        stream = self.input_stream
        with stream:
            emb = self.upload(full.embeddings.numpy(), stream, keep)
            done = self.cp.cuda.Event(disable_timing=True)
            done.record(stream)
        return full, plan, emb, done

    def _lower_full(self, staged_full, keep):
        """Layers [0, lower_layers) on the full rows' embeddings with their full-depth PETs, on
        the compute stream (the same layer function and stacking as the upper layers, over a
        plan of the full rows alone): (F, L_full, d) in the compute dtype, in that plan's
        executed order."""
        cp = self.cp
        full, plan, emb, done = staged_full
        self.compute_stream.wait_event(done)
        F_, L, d = emb.shape
        lower = range(self.encoder.lower_layers)
        for i in lower:  # the base lower layers, on the device once the first full row comes
            if i not in self.weights:
                self.weights[i] = self._upload_layer(i)
        x = emb[cp.asarray(plan.perm.astype(np.int64))].reshape(F_ * L, d).astype(self.dtype)
        mask = cp.asarray(np.arange(L)[None, :] < full.lengths[plan.perm][:, None])
        seg_rows = plan.seg_starts * L
        x = self._layers(plan, L, keep, x, lambda i, x, groups: self._layer(i, x, mask, F_, L, groups, seg_rows),
                         layers=list(lower))
        return x.reshape(F_, L, d)

    def _join_full(self, x, B, L, plan, staged_full, keep):
        """x (B*L, d), the teacher rows in plan's executed order, with the full rows' inputs
        replaced by their lower layers' output."""
        full, full_plan = staged_full[0], staged_full[1]
        hidden = self._lower_full(staged_full, keep)
        where = np.empty(plan.size, dtype=np.int64)
        where[plan.perm] = np.arange(plan.size)  # teacher row -> its executed position
        dst = where[np.asarray(full.at, dtype=np.int64)[full_plan.perm]]
        n = hidden.shape[1]
        x.reshape(B, L, -1)[self.cp.asarray(dst), :n] = hidden
        return x

    def _retrieve_hot(self, snapshot, seqs, versions):
        """Hot-tier retrieval: probe on the device, host lookup of the misses only, gather
        + scatter + aggregation on the device (see HotTier)."""
        from runtime.plot.window import corpus_windows

        cp, ops, hot = self.cp, self.ops, self.hot
        meta = snapshot.meta
        n, d, kind, pad = meta["n"], meta["d"], meta["window"], meta["pad_id"]
        t0 = time.perf_counter()
        wins, lengths = corpus_windows(seqs, n, kind, pad)
        vocab = meta.get("vocab_size")
        if vocab and len(wins) and int(wins.max()) >= vocab:
            raise ValueError(f"token id {int(wins.max())} is outside the store's vocabulary of {vocab}")
        vidx = np.repeat(np.array([snapshot.version_index(v) for v in versions], dtype=np.uint32), lengths)
        qkeys = np.concatenate([wins, vidx[:, None]], axis=1)
        stream, keep = self.input_stream, []
        with stream:
            if hot.due():
                hot.rebuild(snapshot, stream, keep)
            rows_dev, rows = hot.probe(snapshot, qkeys, stream, keep)
            miss = np.flatnonzero(rows < 0)
            hit = len(rows) - len(miss)
            hot.hits += hit
            hot.misses += len(miss)
            t1 = time.perf_counter()
            values, version, order = HotTier.lookup(snapshot, wins[miss], vidx[miss])
            hot.lookup_seconds += time.perf_counter() - t1
            if hit:  # provenance of hits from the tier's host-side record
                hit_rows = rows[rows >= 0]
                served_version = np.empty(len(rows), dtype=np.int16)
                served_order = np.empty(len(rows), dtype=np.int8)
                served_version[rows >= 0] = hot.row_version[hit_rows]
                served_order[rows >= 0] = hot.row_order[hit_rows]
                served_version[miss], served_order[miss] = version, order
            else:
                served_version, served_order = version, order
            retrieval = time.perf_counter() - t0
            t2 = time.perf_counter()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            m = len(wins)
            vals = cp.empty((m, n, d), dtype=np.float16)
            if len(miss):
                dev_miss = self.upload(values, stream, keep)
                if hit:
                    vals[self.upload(miss.astype(np.int64), stream, keep)] = dev_miss
                else:
                    vals = dev_miss
            if hit:
                ops.hot_gather(hot.values, rows_dev, vals)
            B, L = len(seqs), int(lengths.max())
            pos = (np.repeat(np.arange(B, dtype=np.int64) * L, lengths)
                   + np.arange(m, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths))
            padded = cp.zeros((B * L, n, d), dtype=np.float16)
            padded[self.upload(pos, stream, keep)] = vals
            inputs = ops.aggregate(padded, lengths.astype(np.int32), kind)
            self._add_position(inputs, snapshot, versions, lengths, stream, keep)
            end.record(stream)
            done = cp.cuda.Event()
            done.record(stream)
            keep += [vals, padded, rows_dev]
            transfer = time.perf_counter() - t2
        hot.observe(qkeys)
        split = np.cumsum(lengths)[:-1]
        served = list(zip(np.split(served_version, split), np.split(served_order, split)))
        staged = {"slot": None, "shape": (B, L, d), "events": (start, end), "array": inputs, "done": done,
                  "keep": keep, "lengths": lengths}
        return staged, served, {"retrieval": retrieval, "transfer": transfer}

    def _add_position(self, inputs, snapshot, versions, lengths, stream, keep):
        """runtime.plot.retrieve.add_position on the device: the versions' tables are uploaded once per
        manifest generation and gathered per row, so a batch moves no table bytes."""
        generation = snapshot.manifest.get("generation")
        if generation != self._positions_generation:
            tables = [snapshot.position(v) for v in range(len(snapshot.versions))]
            rows = max((len(t) for t in tables if t is not None), default=0)
            self._positions_dev = None
            if rows:
                host = np.zeros((len(tables), rows, inputs.shape[2]), dtype=np.float32)
                for v, table in enumerate(tables):
                    if table is not None:
                        host[v, :len(table)] = table
                self._positions_dev = self.upload(host, stream, keep)
            self._positions_generation = generation
        if self._positions_dev is None:
            return
        B, L, _ = inputs.shape
        rows = min(L, self._positions_dev.shape[1])
        vidx = self.upload(np.array([snapshot.version_index(v) for v in versions], dtype=np.int64), stream, keep)
        real = self.upload((np.arange(rows)[None, :] < lengths[:, None]).astype(np.float32)[..., None], stream, keep)
        inputs[:, :rows] += self._positions_dev[vidx, :rows] * real

    # -- the computation -------------------------------------------------------------------

    def run(self, inputs, mask, pets, keys=None) -> list:
        """Logits per request (NumPy) for host inputs (B, L, d) and mask (B, L): the same
        contract as CpuExecutor.run (mask must be a prefix mask: real tokens first)."""
        inputs = np.ascontiguousarray(np.asarray(inputs, dtype=np.float32))
        mask = np.asarray(mask, dtype=bool)
        lengths = mask.sum(1)
        if not (mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all():
            raise ValueError("the GPU executor takes right-padded batches (mask = a prefix per row)")
        pets = [p if hasattr(p, "parts") else self.load_pet(p) for p in pets]
        plan = self.plan(pets, keys)
        with self._device():
            staged, _ = self.stage(inputs)
        staged["lengths"] = lengths
        return self.forward(staged, plan)

    def forward(self, staged, plan: BatchPlan) -> list:
        cp = self.cp
        B, L, d = staged["shape"]
        if plan.size != B:
            raise ValueError(f"a plan for {plan.size} requests, inputs for {B}")
        keep = list(staged.get("keep", []))
        t0 = time.perf_counter()
        stream = self.compute_stream
        slot = staged["slot"]
        try:
            with self._device(), stream:
                if slot is not None:
                    stream.wait_event(self.copy_done[slot])
                    x_in = self.staged[slot][: B * L * d].reshape(B, L, d)
                else:
                    stream.wait_event(staged["done"])
                    x_in = staged["array"]
                perm = cp.asarray(plan.perm.astype(np.int64))
                x = x_in[perm].reshape(B * L, d).astype(self.dtype)  # a new array: the buffer is free again
                if slot is not None:
                    self.consumed[slot].record(stream)
        finally:
            if slot is not None:
                self.slot_free[slot].release()
        with self._device(), stream:
            self.pet_cache.new_batch()
            if staged.get("full") is not None and self.encoder.lower_layers:
                x = self._join_full(x, B, L, plan, staged["full"], keep)
            lengths = np.asarray(staged["lengths"], dtype=np.int64)
            mask = cp.asarray(np.arange(L)[None, :] < lengths[plan.perm][:, None])
            seg_rows = plan.seg_starts * L
            # opt-in (runtime.level's word pruning): the attention each token receives, summed
            # over real queries and averaged over heads, accumulated while attention runs
            received = cp.zeros((B, L), dtype=np.float32) if plan.received is not None else None
            x = self._layers(plan, L, keep, x, lambda i, x, groups: self._layer(i, x, mask, B, L, groups, seg_rows,
                                                                                 received))
            logits = self._heads(x.reshape(B, L, d), plan, keep)
            host = [cp.asnumpy(a) for a in logits]  # synchronises the compute stream
            if received is not None:
                plan.received += torch.from_numpy(cp.asnumpy(received)[:, :plan.received.shape[1]])
            stream.synchronize()
        start, end = staged["events"]
        try:
            transfer = cp.cuda.get_elapsed_time(start, end) / 1e3
        except Exception:  # events without timing
            transfer = 0.0
        self.transfer_seconds += transfer
        self.last_compute_seconds = time.perf_counter() - t0
        keep.clear()
        return self._unpermute(host, plan, lengths)

    def _layers(self, plan, L, keep, x, layer, layers=None):
        """x through every upper layer, or `layers` (layer(i, x, groups) -> x on the compute
        stream), each layer's stacked PET weights issued one layer ahead (prefetch) or just
        before it."""
        layers = self.layers if layers is None else layers
        pending = self._issue(plan, layers[0], L, keep)
        for idx, i in enumerate(layers):
            groups, event = pending
            if idx + 1 < len(layers):
                pending = self._issue(plan, layers[idx + 1], L, keep)
            if event is not None:
                self.compute_stream.wait_event(event)
            x = layer(i, x, groups)
        return x

    def _issue(self, plan, layer, L, keep):
        """Stack layer `layer`'s PET weights: on the pets stream (prefetch) with an event the
        compute stream waits for, or on the compute stream in order (no prefetch)."""
        stream = self.pet_stream if self.prefetch else self.compute_stream
        with stream:
            groups = {}
            for g in plan.layer_groups(layer):
                groups[(g.kind, g.target)] = (g, self._stack(plan, g, L, stream, keep))
            event = None
            if self.prefetch:
                event = self.cp.cuda.Event(disable_timing=True)
                event.record(stream)
        return groups, event

    def _stack(self, plan, g, L, stream, keep) -> dict:
        """Stacked device weights of one group (ranks / bottlenecks zero-padded) in the compute
        dtype (the cache may hold a PET's fp16), plus its segment or row tables on the device."""
        cp = self.cp
        part = (g.kind, g.layer, g.target)
        arrays = [self.pet_cache.get(plan.tenants[m], g.layer, stream, keep)[part] for m in g.members]
        keep.append(arrays)
        out = {}
        if g.kind == "lora":
            out["A"] = self._stack_padded([a[0] for a in arrays], 0)
            out["B"] = self._stack_padded([a[1] for a in arrays], 1)
            out["scales"] = cp.asarray(np.array([plan.tenants[m].scale for m in g.members], dtype=np.float32))
        elif g.kind == "bias":
            out["delta"] = self._stack_padded([a[0] for a in arrays])
        elif g.kind == "diff":
            sizes = [int(a[0].shape[0]) for a in arrays]
            out["index"] = cp.concatenate([a[0] for a in arrays]) if sum(sizes) else cp.zeros(0, dtype=np.int32)
            out["value"] = (cp.concatenate([a[1] for a in arrays]).astype(self.dtype, copy=False) if sum(sizes)
                            else cp.zeros(0, dtype=self.dtype))
            out["offsets"] = cp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
        elif g.kind == "adapter":
            out["down"] = self._stack_padded([a[0] for a in arrays], 0)
            out["down_bias"] = self._stack_padded([a[1] for a in arrays], 0)
            out["up"] = self._stack_padded([a[2] for a in arrays], 1)
            out["up_bias"] = self._stack_padded([a[3] for a in arrays])
        elif g.kind == "norm":
            out["weight"] = self._stack_padded([a[0] for a in arrays])
            out["bias"] = self._stack_padded([a[1] for a in arrays])
        out["seg_starts"] = cp.asarray((plan.seg_starts * L).astype(np.int32))
        out["seg_ids"] = cp.asarray(g.seg_ids.astype(np.int32))
        if g.bgmv:
            out["row_ids"] = cp.asarray(np.repeat(g.request_ids, L).astype(np.int32))
        keep.append(out)
        return out

    def _stack_padded(self, arrays, dim=None):
        """cp.stack(arrays) in the compute dtype, dimension dim zero-padded to the largest."""
        cp = self.cp
        size = None if dim is None else max(int(a.shape[dim]) for a in arrays)
        if dim is None or all(int(a.shape[dim]) == size for a in arrays):
            return cp.stack(arrays).astype(self.dtype, copy=False)
        shape = list(arrays[0].shape)
        shape[dim] = size
        out = cp.zeros((len(arrays), *shape), dtype=self.dtype)
        for t, a in enumerate(arrays):
            if dim == 0:
                out[t, : a.shape[0]] = a
            else:
                out[t, :, : a.shape[1]] = a
        return out

    def _edit_ops(self, ys, x, groups) -> list:
        """The tenants' edits of one stage's projection outputs ys {target: y} as operators:
        [(FLOPs, bytes, [(kind, target, y)])]; kinds of one target that share a segment stay
        in one operator, in the reference order (bias, diff, LoRA)."""
        ops = []
        for target, y in ys.items():
            chains = []  # [(segments touched, operators in order)]
            for kind in ("bias", "diff", "lora"):
                if (kind, target) not in groups:
                    continue
                active = groups[(kind, target)][0].seg_ids >= 0
                hit = [c for c in chains if (c[0] & active).any()]  # the same rows: order matters
                for c in hit:
                    chains.remove(c)
                    active = active | c[0]
                chains.append((active, [op for c in hit for op in c[1]] + [(kind, target, y)]))
            for _, chain in chains:
                flops = nbytes = 0.0
                for kind, t, yy in chain:
                    f, b = self._op_cost(kind, groups[(kind, t)], x, yy)
                    flops, nbytes = flops + f, nbytes + b
                ops.append((flops, nbytes, chain))
        return ops

    @staticmethod
    def _op_cost(kind, group, x, y) -> tuple:
        """(FLOPs, bytes) of one PET operator, from host-side shapes (no device reads)."""
        g, w = group
        rows = float(y.shape[0]) * float((g.seg_ids >= 0).mean()) if len(g.seg_ids) else 0.0
        d_in, d_out = x.shape[1], y.shape[1]
        if kind == "lora":
            r = w["A"].shape[1]
            return 2.0 * rows * r * (d_in + d_out), 4.0 * rows * (d_in + 2 * d_out)
        if kind == "bias":
            return rows * d_out, 8.0 * rows * d_out
        nnz = float(w["value"].shape[0]) / max(len(g.members), 1)
        return 2.0 * nnz * rows / max(d_out, 1), 4.0 * rows * (d_in + 2 * d_out) + 8.0 * nnz

    def _run_edits(self, ys, x, groups):
        """Run a stage's edit operators: in order on the compute stream, or (lanes > 1, PetS
        Alg. 2) placed by roofline time onto the lane streams, compute- and memory-bound
        operators alternating; the lanes start after the stage's GEMMs (an event) and the
        compute stream goes on once every lane is done (events; no host synchronisation)."""
        ops = self._edit_ops(ys, x, groups)
        if len(self.lane_streams) < 2 or len(ops) < 2:
            for _, _, chain in ops:
                for kind, target, y in chain:
                    self._edit(kind, y, x, groups[(kind, target)])
            return
        from types import SimpleNamespace

        from runtime.exec.pet_lanes import assign_lanes

        cp = self.cp
        placed = assign_lanes([SimpleNamespace(flops=f, bytes=b, chain=c) for f, b, c in ops], len(self.lane_streams),
                              peak_flops=_PEAK_FLOPS, bandwidth=_BANDWIDTH)
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(self.compute_stream)
        done = []
        for lane, stream in zip(placed, self.lane_streams):
            if not lane:
                continue
            with stream:
                stream.wait_event(ready)
                for op in lane:
                    for kind, target, y in op.chain:
                        self._edit(kind, y, x, groups[(kind, target)])
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(stream)
                done.append(ev)
        for ev in done:
            self.compute_stream.wait_event(ev)

    def _edit(self, kind, y, x, group):
        """One edit operator (bias, diff or LoRA) of a projection's output y from its input x."""
        ops = self.ops
        g, w = group
        if kind == "bias":
            ops.bias_gather(y, w["delta"], w["seg_starts"], w["seg_ids"])
        elif kind == "diff":
            ops.sparse_add(y, x, w["index"], w["value"], w["offsets"], w["seg_starts"], w["seg_ids"])
        elif g.bgmv:
            ops.bgmv(y, x, w["A"], w["B"], w["row_ids"], w["scales"])
        else:
            ops.sgmv(y, x, w["A"], w["B"], w["seg_starts"], w["seg_ids"], w["scales"])
        return y

    def _proj(self, w, targets, x, groups, gelu=False) -> list:
        """One stage's projections of x (the q/k/v stage has three): the shared GEMMs, the
        tenants' edits (_run_edits), the bias (+ GELU) and the adapters."""
        cp = self.cp
        ys = {t: cp.matmul(x, w[t]) for t in targets}  # cuBLAS: (rows, d_in) @ (d_in, d_out)
        self._run_edits(ys, x, groups)
        out = []
        for target, y in ys.items():
            if gelu:
                out.append(self.ops.bias_gelu(y, w[target + ".b"], out=y))
                continue
            if w[target + ".b"] is not None:  # (a bias-free projection: the GPU decoder's Llama layers)
                y += w[target + ".b"]
            if ("adapter", target) in groups:  # on the biased output, as runtime.model.pet.linear
                _, aw = groups[("adapter", target)]
                self.ops.segmented_adapter(y, aw["down"], aw["down_bias"], aw["up"], aw["up_bias"], aw["seg_starts"],
                                           aw["seg_ids"], out=y)
            out.append(y)
        return out

    def _layer(self, i, x, mask, B, L, groups, seg_rows, received=None):
        cp, c = self.cp, self.config
        w = self.weights[i]
        d, H = c.d, c.heads
        dh = d // H
        q, k, v = (y.reshape(B, L, H, dh).transpose(0, 2, 1, 3) for y in self._proj(w, ("q", "k", "v"), x, groups))
        scores = cp.matmul(q, k.transpose(0, 1, 3, 2)).astype(np.float32) * np.float32(1.0 / math.sqrt(dh))
        scores = cp.where(mask[:, None, None, :], scores, np.float32(_F32_MIN))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = cp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        if received is not None:
            received += (probs * mask[:, None, :, None]).sum(axis=2).mean(axis=1)
        ctx = cp.matmul(probs.astype(self.dtype), v)  # (B, H, L, dh)
        ctx = cp.ascontiguousarray(ctx.transpose(0, 2, 1, 3)).reshape(B * L, d)
        a, = self._proj(w, ("o",), ctx, groups)
        h = self._norm(w, "ln_attn", a, x, groups, out=None)
        f, = self._proj(w, ("ffn_in",), h, groups, gelu=True)
        out, = self._proj(w, ("ffn_out",), f, groups)
        return self._norm(w, "ln_ffn", out, h, groups, out=out)

    def _norm(self, w, name, y, residual, groups, out):
        """LayerNorm(y + residual), segmented when a tenant of the batch edits its gain/shift."""
        g, b, eps = w[name + ".g"], w[name + ".b"], w[name + ".eps"]
        if ("norm", name) not in groups:
            return self.ops.residual_layernorm(y, residual, g, b, eps, out=out)
        _, nw = groups[("norm", name)]
        return self.ops.segmented_layernorm(y, residual, g, b, nw["weight"], nw["bias"], nw["seg_starts"],
                                            nw["seg_ids"], eps, out=out)

    def _heads(self, h, plan, keep) -> list:
        """fp32 head GEMMs per tenant: (requests of the tenant, labels) or (.., L, labels)."""
        cp = self.cp
        out = []
        for s, p in enumerate(plan.tenants):
            a, b = int(plan.seg_starts[s]), int(plan.seg_starts[s + 1])
            W, bias = self.pet_cache.get(p, -1, self.compute_stream, keep)["head"]
            x = h[a:b, 0] if p.task == "classification" else h[a:b]
            out.append(cp.matmul(x.astype(np.float32), W.T) + bias)
        return out

    @staticmethod
    def _unpermute(host, plan, lengths) -> list:
        out = [None] * plan.size
        for s, p in enumerate(plan.tenants):
            a, b = int(plan.seg_starts[s]), int(plan.seg_starts[s + 1])
            for j in range(a, b):
                item = int(plan.perm[j])
                y = host[s][j - a]
                out[item] = y if p.task == "classification" else y[: int(lengths[item])]
        return out

    # -- reporting -------------------------------------------------------------------------

    def memory(self) -> dict:
        shared = sum(a.nbytes for w in self.weights.values() for a in w.values() if hasattr(a, "nbytes"))
        return {"shared_bytes": int(shared), "device_pet_bytes": int(self.pet_cache.bytes),
                "hot_tier_bytes": 0 if self.hot is None else self.hot.stats()["bytes"],
                "buffer_bytes": int(sum(b.nbytes for b in self.staged))}

    def stats(self) -> dict:
        out = {"device_pet_cache": self.pet_cache.stats(), "transfer_seconds": self.transfer_seconds}
        if self.hot is not None:
            out["hot_tier"] = self.hot.stats()
        return out

    def close(self):
        with self._device():
            for s in (self.compute_stream, self.input_stream, self.pet_stream):
                s.synchronize()
