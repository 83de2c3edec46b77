"""Batching and pipelining shared by the CPU and GPU executors (HMI §6, PetS, Punica).

Three pieces:

* **Serving PETs.** ``prepare_pet`` turns an exported PET (``runtime.pet.Pet``) into the form
  the executors stack: fp32 tensors grouped into *parts* ``(kind, layer, target)`` with kind
  ``lora``, ``bias`` (BitFit), ``diff`` (diff pruning; mask PETs become diffs whose values are
  minus the base weights they zero) and ``adapter``, plus the head. ``PetCache`` keeps them
  per tenant on the host (LRU bounded by bytes), each decoded once from the pack.
* **Batch plans.** ``plan_batch`` lays out one mixed-tenant batch: requests are reordered so
  the requests of one tenant are contiguous (``perm``), which gives one segment per tenant
  (SGMV's segment table, in request units: multiply by the padded length L for rows); every
  part that some tenant of the batch has becomes a ``Group`` naming the tenants that carry it
  (stacked index t) and, per segment, which t applies (-1: none). LoRA groups whose tenants
  each serve a single request run as BGMV (every request its own LoRA), the rest as SGMV.
  ``stack_group`` builds the stacked weights of a group with torch (ranks and bottlenecks
  zero-padded to the group's largest, which changes nothing).
* **The scheduler.** Callers ``submit`` items from any thread; a preparation thread drains
  the submission queue into batches of at most ``max_batch`` items and runs the executor's
  ``prepare`` (retrieval + plan + host-to-device staging) while a compute thread runs
  ``compute`` on the previous batch (``pipeline=True``). With ``pipeline=False`` one thread
  does both in turn. Each item's future receives an ``Output``: its logits and the timings.
  Torch's OpenMP thread counts are per thread: the compute thread takes the count of the
  thread that made the scheduler, helper threads (retrieval, prefetch) run single-threaded so
  they never start thread teams that fight the compute thread's for the cores.

Executors implement ``prepare(snapshot, items) -> Prepared`` and ``compute(prepared) ->
list[np.ndarray]`` (logits per item, in item order); ``retrieve_mixed`` is the retrieval both
use: runtime.plot.retrieve once per PLOT version present in the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime import pet as petlib

KINDS = ("lora", "bias", "diff", "adapter", "norm")


# -- serving PETs -----------------------------------------------------------------------------


@dataclass
class ServingPet:
    """A PET in executor form. ``tensors`` maps part -> tuple of fp32 (index: int32) tensors:

    * ``("lora", i, t)``: (A (r, d_in), B (d_out, r)), scaled by ``scale``
    * ``("bias", i, t)``: (delta (d_out),)
    * ``("diff", i, t)``: (flat index int32 (k) nondecreasing, value (k))
    * ``("adapter", i, target)``: (down (b, d), down_bias (b), up (d, b), up_bias (d))
    * ``("norm", i, ln)``: (gain delta (d), shift delta (d)) of LayerNorm ln (ln_attn, ln_ffn)
    """

    key: object  # what identifies the tenant in a batch (tenant name, or any hashable)
    meta: dict
    parts: dict
    head_weight: torch.Tensor
    head_bias: torch.Tensor
    scale: float = 1.0
    version: str | None = None  # PLOT version the PET was trained on (from its meta)
    token: object = None  # changes when the tenant's record changes (device caches key on it)

    @property
    def task(self) -> str:
        return self.meta["task"]

    @property
    def labels(self) -> list:
        return self.meta["labels"]

    @property
    def nbytes(self) -> int:
        total = self.head_weight.numel() * 4 + self.head_bias.numel() * 4
        for arrays in self.parts.values():
            total += sum(a.numel() * a.element_size() for a in arrays)
        return total


def prepare_pet(encoder, pet: petlib.Pet, key=None, token=None) -> ServingPet:
    """ServingPet of an exported (index-form) PET on `encoder` (see the class doc)."""
    t, meta = pet.tensors, pet.meta
    parts = {}
    for name, value in t.items():
        bits = name.split(".")
        if bits[0] != "layers":
            continue
        i, kind = int(bits[1]), bits[2]
        if kind == "lora" and bits[4] == "A":
            target = bits[3]
            parts[("lora", i, target)] = (_f32(value), _f32(t[f"layers.{i}.lora.{target}.B"]))
        elif kind == "bias":
            parts[("bias", i, bits[3])] = (_f32(value),)
        elif kind == "diff" and bits[4] == "index":
            target = bits[3]
            parts[("diff", i, target)] = _sorted_delta(value, t[f"layers.{i}.diff.{target}.value"])
        elif kind == "mask":
            target = bits[3]
            weight = getattr(encoder.layers[i], target).weight.detach().float().flatten()
            index = torch.unique(torch.as_tensor(value).long())  # sorted, no repeats
            parts[("diff", i, target)] = (index.to(torch.int32).contiguous(), (-weight[index]).contiguous())
        elif kind == "adapter" and bits[4:] == ["down", "weight"]:
            p = f"layers.{i}.adapter.{bits[3]}."
            parts[("adapter", i, bits[3])] = tuple(
                _f32(t[p + n]) for n in ("down.weight", "down.bias", "up.weight", "up.bias"))
        elif kind == "norm" and bits[4] == "weight":
            parts[("norm", i, bits[3])] = (_f32(value), _f32(t[f"layers.{i}.norm.{bits[3]}.bias"]))
    if "head.weight" not in t:
        raise ValueError("PET has no head (head.weight)")
    return ServingPet(key=key, meta=dict(meta), parts=parts, head_weight=_f32(t["head.weight"]),
                      head_bias=_f32(t["head.bias"]), scale=float(meta.get("scale", 1.0)),
                      version=meta.get("version"), token=token)


def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v).detach().float().contiguous()


def _sorted_delta(index, value):
    index = torch.as_tensor(index).long()
    order = torch.argsort(index, stable=True)
    return index[order].to(torch.int32).contiguous(), _f32(value)[order].contiguous()


class PetCache:
    """Host LRU of ServingPets keyed by (tenant, token), bounded by bytes; thread-safe.

    ``get(key, token, load)`` returns the cached entry or calls ``load()`` (outside the lock,
    so one slow decode does not stall other tenants) and keeps the result.
    """

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key, token, load):
        with self._lock:
            entry = self._entries.get((key, token))
            if entry is not None:
                self._entries.move_to_end((key, token))
                self.hits += 1
                return entry
            self.misses += 1
        entry = load()
        with self._lock:
            if (key, token) not in self._entries:
                self._entries[(key, token)] = entry
                self._bytes += entry.nbytes
                while self._bytes > self.max_bytes and len(self._entries) > 1:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.nbytes
                    self.evictions += 1
            return self._entries[(key, token)]

    def __len__(self):
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}


# -- batch plans ------------------------------------------------------------------------------


@dataclass
class Group:
    """One part (kind, layer, target) across the batch's tenants that carry it."""

    kind: str
    layer: int
    target: str | None
    members: list  # plan.tenants indices; member t is stacked index t
    seg_ids: np.ndarray  # (S,) int64: stacked index of each plan segment, -1 = none
    request_ids: np.ndarray  # (B,) int64: stacked index of each executed request, -1 = none
    bgmv: bool = False  # LoRA only: run per row (BGMV) instead of per segment (SGMV)


@dataclass
class BatchPlan:
    perm: np.ndarray  # (B,) executed position -> item index
    tenants: list  # distinct ServingPets, in executed order
    request_tenant: np.ndarray  # (B,) executed position -> plan.tenants index
    seg_starts: np.ndarray  # (S+1,) in requests; segment s = tenant s
    groups: dict  # (kind, layer, target) -> Group
    lengths: np.ndarray | None = None  # (B,) executed order, when known

    @property
    def size(self) -> int:
        return len(self.perm)

    def layer_groups(self, layer: int) -> list:
        return [g for (kind, i, _), g in self.groups.items() if i == layer]



def plan_batch(pets: list, keys: list | None = None, lora_kernel: str = "auto") -> BatchPlan:
    """Lay out a mixed-tenant batch: pets[b] (ServingPet) serves item b; keys[b] (default
    pets[b].key, or the object itself) says which items share a tenant. lora_kernel: "sgmv",
    "bgmv" or "auto" (BGMV when every LoRA tenant of the batch has a single request)."""
    if lora_kernel not in ("auto", "sgmv", "bgmv"):
        raise ValueError(f"lora_kernel must be auto, sgmv or bgmv, got {lora_kernel!r}")
    if not pets:
        raise ValueError("an empty batch")
    if keys is None:
        keys = [p.key if p.key is not None else id(p) for p in pets]
    first: dict = {}
    tenants = []
    for b, k in enumerate(keys):
        if k not in first:
            first[k] = len(tenants)
            tenants.append(pets[b])
    tenant_of = np.array([first[k] for k in keys], dtype=np.int64)
    perm = np.argsort(tenant_of, kind="stable")
    request_tenant = tenant_of[perm]
    counts = np.bincount(request_tenant, minlength=len(tenants))
    seg_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    parts: dict = {}
    for ti, p in enumerate(tenants):
        for part in p.parts:
            parts.setdefault(part, []).append(ti)
    groups = {}
    for part in sorted(parts, key=lambda k: (k[1], KINDS.index(k[0]), k[2] or "")):
        members = parts[part]
        index = np.full(len(tenants), -1, dtype=np.int64)
        index[members] = np.arange(len(members))
        kind = part[0]
        bgmv = kind == "lora" and (lora_kernel == "bgmv" or (lora_kernel == "auto" and bool((counts[members] == 1).all())))
        groups[part] = Group(kind, part[1], part[2], list(members), index, index[request_tenant], bgmv)
    return BatchPlan(perm, tenants, request_tenant, seg_starts, groups)


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim)


def stack_group(plan: BatchPlan, group: Group, dtype=torch.float32) -> dict:
    """Stacked torch weights of a group, as the ops_cpu functions take them."""
    arrays = [plan.tenants[m].parts[(group.kind, group.layer, group.target)] for m in group.members]
    if group.kind == "lora":
        r = max(a[0].shape[0] for a in arrays)
        A = torch.stack([_pad_to(a[0], 0, r) for a in arrays]).to(dtype)
        B = torch.stack([_pad_to(a[1], 1, r) for a in arrays]).to(dtype)
        scales = torch.tensor([plan.tenants[m].scale for m in group.members], dtype=torch.float32)
        return {"A": A, "B": B, "scales": scales}
    if group.kind == "bias":
        return {"delta": torch.stack([a[0] for a in arrays]).to(dtype)}
    if group.kind == "diff":
        sizes = [len(a[0]) for a in arrays]
        return {"index": torch.cat([a[0] for a in arrays]), "value": torch.cat([a[1] for a in arrays]).to(dtype),
                "offsets": torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)}
    if group.kind == "adapter":
        b = max(a[0].shape[0] for a in arrays)
        return {"down": torch.stack([_pad_to(a[0], 0, b) for a in arrays]).to(dtype),
                "down_bias": torch.stack([_pad_to(a[1], 0, b) for a in arrays]).to(dtype),
                "up": torch.stack([_pad_to(a[2], 1, b) for a in arrays]).to(dtype),
                "up_bias": torch.stack([a[3] for a in arrays]).to(dtype)}
    if group.kind == "norm":
        return {"weight": torch.stack([a[0] for a in arrays]).to(dtype),
                "bias": torch.stack([a[1] for a in arrays]).to(dtype)}
    raise ValueError(f"unknown part kind {group.kind!r}")


# -- retrieval --------------------------------------------------------------------------------


def retrieve_mixed(snapshot, seqs: list, versions: list):
    """Upper-layer inputs of a batch whose items may need different PLOT versions: one
    runtime.plot.retrieve per version, assembled into (inputs (B, L, d) float32, mask (B, L),
    served) with served[b] = (version index, order) arrays of item b's windows."""
    from runtime.plot import retrieve

    B = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    L, d = int(lengths.max()), snapshot.meta["d"]
    by_version: dict = {}
    for b, v in enumerate(versions):
        by_version.setdefault(v, []).append(b)
    if len(by_version) == 1:
        (v, _), = by_version.items()
        inputs, mask, served = retrieve(snapshot, v, seqs)
        return inputs, mask, [(served.version[b, :lengths[b]], served.order[b, :lengths[b]]) for b in range(B)]
    inputs = torch.zeros(B, L, d)
    mask = torch.zeros(B, L, dtype=torch.bool)
    info = [None] * B
    for v, items in by_version.items():
        x, m, served = retrieve(snapshot, v, [seqs[b] for b in items])
        inputs[items, : x.shape[1]] = x
        mask[items, : m.shape[1]] = m
        for j, b in enumerate(items):
            info[b] = (served.version[j, :lengths[b]], served.order[j, :lengths[b]])
    return inputs, mask, info


# -- the scheduler ----------------------------------------------------------------------------


@dataclass
class Item:
    """One request as the scheduler sees it (the runtime fills it in)."""

    ids: list  # token ids, [CLS] .. [SEP]
    pet: ServingPet
    version: str  # PLOT version name to serve it from
    tag: object = None  # whatever the caller wants back


@dataclass
class Output:
    logits: np.ndarray  # (labels,) or (length, labels)
    timings: dict
    served: tuple | None = None  # (versions (length,), orders (length,))
    batch_size: int = 0


@dataclass
class Prepared:
    """What an executor's prepare hands to its compute."""

    items: list
    timings: dict = field(default_factory=dict)
    payload: object = None
    served: list | None = None


_STOP = object()


def _per_thread_torch_threads() -> bool:
    """True when torch.set_num_threads only affects the calling thread (the OpenMP backend)."""
    try:
        return "parallel backend: OpenMP" in torch.__config__.parallel_info()
    except Exception:  # an unexpected build: assume a global setting
        return False


PER_THREAD = _per_thread_torch_threads()


def helper_thread_setup():
    """Run at the start of a helper thread (retrieval, PET stacking): one torch thread, so the
    helpers' small tensor ops never start OpenMP teams that fight the compute thread's for the
    cores. Without per-thread settings (non-OpenMP builds) nothing is changed."""
    if PER_THREAD:
        torch.set_num_threads(1)


class Scheduler:
    """Submission queue -> preparation (retrieval, plan, staging) -> compute, see module doc."""

    def __init__(self, executor, snapshot_fn, *, max_batch: int = 64, pipeline: bool = True, name: str = "hkstore"):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.executor = executor
        self.snapshot_fn = snapshot_fn
        self.max_batch = int(max_batch)
        self.pipeline = bool(pipeline)
        # OpenMP thread counts are per thread and new threads start from the default: the
        # compute thread takes the caller's setting (e.g. a server's torch.set_num_threads).
        self.torch_threads = torch.get_num_threads()
        # One inbox entry per submit (a list of items), so the items of one call cannot be
        # split across batches by a worker that wakes up between two of them.
        self._inbox: queue.Queue = queue.Queue()
        self._carry: list = []  # entries of a submit that did not fit the previous batch
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._closed = False
        self._lock = threading.Lock()
        self.batches = 0
        self.items = 0
        self._threads = [threading.Thread(target=self._prepare_loop, name=f"{name}-prepare", daemon=True)]
        if self.pipeline:
            self._threads.append(threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, items: list) -> list:
        """Queue items; returns one Future per item (resolves to an Output). Thread-safe."""
        futures = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the runtime is closed")
            now = time.perf_counter()
            entries = []
            for item in items:
                f: Future = Future()
                futures.append(f)
                entries.append((item, f, now))
            if entries:
                self._inbox.put(entries)
        return futures

    def run(self, items: list) -> list:
        """submit + wait: Outputs in item order (raises the first failure)."""
        return [f.result() for f in self.submit(items)]

    def close(self, timeout: float = 10.0):
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- worker loops --------------------------------------------------------------------

    def _next_batch(self):
        batch, self._carry = self._carry, []
        if not batch:
            batch = self._inbox.get()
            if batch is _STOP:
                return None
        while len(batch) < self.max_batch:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                self._inbox.put(_STOP)  # seen again after this batch
                break
            batch = batch + nxt
        batch, self._carry = batch[: self.max_batch], batch[self.max_batch:]
        return batch

    def _prepare(self, batch):
        t0 = time.perf_counter()
        prepared = self.executor.prepare(self.snapshot_fn(), [item for item, _, _ in batch])
        prepared.timings.setdefault("retrieval", time.perf_counter() - t0)
        prepared.timings.setdefault("transfer", 0.0)
        return prepared

    def _finish(self, batch, prepared):
        t0 = time.perf_counter()
        logits = self.executor.compute(prepared)
        compute = time.perf_counter() - t0
        timings = dict(prepared.timings)
        timings.setdefault("compute", compute)
        end = time.perf_counter()
        self.batches += 1
        self.items += len(batch)
        for j, (_, f, submitted) in enumerate(batch):
            served = prepared.served[j] if prepared.served else None
            out = Output(logits[j], dict(timings, total=end - submitted), served, len(batch))
            f.set_result(out)

    @staticmethod
    def _fail(batch, exc):
        for _, f, _ in batch:
            if not f.done():
                f.set_exception(exc)

    def _prepare_loop(self):
        if self.pipeline:
            helper_thread_setup()
        else:  # this thread computes too
            torch.set_num_threads(self.torch_threads)
        while True:
            batch = self._next_batch()
            if batch is None:
                if self.pipeline:
                    self._ready.put(_STOP)
                return
            try:
                prepared = self._prepare(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the callers
                self._fail(batch, exc)
                continue
            if self.pipeline:
                self._ready.put((batch, prepared))
            else:
                self._compute_one(batch, prepared)

    def _compute_loop(self):
        torch.set_num_threads(self.torch_threads)
        while True:
            got = self._ready.get()
            if got is _STOP:
                return
            self._compute_one(*got)

    def _compute_one(self, batch, prepared):
        try:
            self._finish(batch, prepared)
        except BaseException as exc:  # noqa: BLE001
            self._fail(batch, exc)


def pad_ids(seqs: list, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, L) ids and lengths."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    ids = np.full((len(seqs), int(lengths.max())), pad_id, dtype=np.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    return ids, lengths


__all__ = ["Group", "BatchPlan", "Item", "KINDS", "Output", "PetCache", "Prepared", "Scheduler", "ServingPet",
           "pad_ids", "plan_batch", "prepare_pet", "retrieve_mixed", "stack_group"]
