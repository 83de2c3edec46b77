"""Mixed-tenant batch plans (HMI §6, PetS, Punica): PETs in executor form and the layout of one batch.

* **Serving PETs.** ``prepare_pet`` turns an exported PET (``runtime.model.pet.Pet``) into the form
  the executors stack: float tensors (fp16 ones kept fp16, as a full-depth record stores them:
  the host cache holds half the bytes; the rest fp32) grouped into *parts* ``(kind, layer, target)`` with kind
  ``lora``, ``bias`` (BitFit), ``diff`` (diff pruning; mask PETs become diffs whose values are
  minus the base weights they zero), ``adapter`` and ``norm``, plus the head.
* **Batch plans.** ``plan_batch`` lays out one mixed-tenant batch: requests are reordered so
  the requests of one tenant are contiguous (``perm``), which gives one segment per tenant
  (SGMV's segment table, in request units: multiply by the padded length L for rows); every
  part that some tenant of the batch has becomes a ``Group`` naming the tenants that carry it
  (stacked index t) and, per segment, which t applies (-1: none). LoRA groups whose tenants
  each serve a single request run as BGMV (every request its own LoRA), the rest as SGMV.
  ``stack_group`` builds the stacked weights of a group with torch (ranks and bottlenecks
  zero-padded to the group's largest, which changes nothing) in fp32: the executors compute in fp32
  whatever dtype a PET is held in.

Executors run a batch plan's rows (runtime.exec.rows); the engine (runtime.engine) drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.model import pet as petlib

KINDS = ("lora", "bias", "diff", "adapter", "norm")


@dataclass
class ServingPet:
    """A PET in executor form. ``parts`` maps part -> tuple of float (index: int32) tensors,
    fp32 or fp16 as the PET was loaded (executors upcast fp16 when they stack a batch); the head is fp32:

    * ``("lora", i, t)``: (A (r, d_in), B (d_out, r)), scaled by ``scale``
    * ``("bias", i, t)``: (delta (d_out),)
    * ``("diff", i, t)``: (flat index int32 (k) nondecreasing, value (k))
    * ``("adapter", i, target)``: (down (b, d), down_bias (b), up (d, b), up_bias (d))
    * ``("norm", i, ln)``: (gain delta (d), shift delta (d)) of LayerNorm ln (ln_attn, ln_ffn)
    """

    key: object  # what identifies the tenant in a batch (tenant name, or any hashable)
    meta: dict
    parts: dict
    head_weight: torch.Tensor | None  # None: a decoder (lm) PET, scored by the decoder's LM head
    head_bias: torch.Tensor | None
    scale: float = 1.0
    version: str | None = None  # PLOT version the PET was trained on (from its meta)
    token: object = None  # changes when the tenant's record changes (device caches key on it)
    # layer -> (one block, fp16 when they all are, layout) that this PET's float parts of the layer are views
    # into (runtime.exec.cpu_batched.pack_layers): a batch stacks a layer with one copy
    blocks: dict = field(default_factory=dict)

    @property
    def task(self) -> str:
        return self.meta["task"]

    @property
    def labels(self) -> list:
        return self.meta["labels"]

    @property
    def nbytes(self) -> int:
        """Bytes held, in the dtypes held (a host cache's accounting)."""
        head = () if self.head_weight is None else (self.head_weight, self.head_bias)
        return sum(a.nbytes for a in head) + sum(a.nbytes for arrays in self.parts.values() for a in arrays)


def prepare_pet(encoder, pet: petlib.Pet, key=None, token=None) -> ServingPet:
    """ServingPet of an exported (index-form) PET on `encoder` (see the class doc). A
    full-depth PET keeps its lower-layer parts (the executors run them for its rows); any
    other PET with a lower-layer tensor is refused."""
    t, meta = pet.tensors, pet.meta
    parts = {}
    for name, value in t.items():
        bits = name.split(".")
        if bits[0] != "layers":
            continue
        i, kind = int(bits[1]), bits[2]
        if i < encoder.lower_layers and not petlib.is_full(meta):
            raise ValueError(f"PET tensor {name} edits lower layer {i}: only a full-depth PET (meta level "
                             f"\"full\") may, and this one is upper-only")
        if bits[-1] in ("delta", "score"):  # would be read as an index list below
            raise ValueError(f"PET tensor {name} is in training form: serve runtime.model.pet.export(pet)")
        if kind == "lora" and bits[4] == "A":
            target = bits[3]
            parts[("lora", i, target)] = (_float(value), _float(t[f"layers.{i}.lora.{target}.B"]))
        elif kind == "bias":
            parts[("bias", i, bits[3])] = (_float(value),)
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
                _float(t[p + n]) for n in ("down.weight", "down.bias", "up.weight", "up.bias"))
        elif kind == "norm" and bits[4] == "weight":
            parts[("norm", i, bits[3])] = (_float(value), _float(t[f"layers.{i}.norm.{bits[3]}.bias"]))
    if "head.weight" in t:
        # copies: a pack's tensors are views into the record's buffer, which the small head alone
        # would otherwise keep alive in the host cache where the rest was copied out of it
        head = _f32(t["head.weight"]).clone(), _f32(t["head.bias"]).clone()
    elif meta.get("task") == "lm":  # a decoder tenant: the decoder's own LM head scores the vocabulary
        head = None, None
    else:
        raise ValueError("PET has no head (head.weight)")
    return ServingPet(key=key, meta=dict(meta), parts=parts, head_weight=head[0], head_bias=head[1],
                      scale=float(meta.get("scale", 1.0)), version=meta.get("version"), token=token)


def tenant_key(pet: ServingPet):
    """What identifies pet's tenant in a batch plan and a device cache: its key (the object
    itself without one), and apart from that tenant's ordinary PET when full-depth (a tenant may
    have rows of both in one batch)."""
    key = pet.key if pet.key is not None else id(pet)
    return ("full", key) if petlib.is_full(pet.meta) else key


def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v).detach().float().contiguous()


def _float(v) -> torch.Tensor:
    """fp16 stays fp16 (what the host cache saves); any other float dtype becomes fp32."""
    # each step only where it changes something: a PET has ~100 tensors and this runs on a
    # tenant's first use
    if not isinstance(v, torch.Tensor):
        v = torch.as_tensor(v)
    if v.requires_grad:
        v = v.detach()
    if v.dtype != torch.float16 and v.dtype != torch.float32:
        v = v.float()
    return v if v.is_contiguous() else v.contiguous()


def _sorted_delta(index, value):
    index = torch.as_tensor(index).long()
    order = torch.argsort(index, stable=True)
    return index[order].to(torch.int32).contiguous(), _float(value)[order].contiguous()


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
    # Opt-in (runtime.level's word pruning): a zeroed (B, L) float tensor, executed order; the
    # executor adds the attention each token receives in every upper layer (summed over
    # queries, averaged over heads) while it computes attention. None: not asked for.
    received: torch.Tensor | None = None
    # The CPU executor's per-row precision (precision "auto"): requests at executed positions >=
    # bf16_from are bf16 rows, the ones before fp32 (its plan sorts each precision into one range).
    # None: no bf16 row.
    bf16_from: int | None = None

    @property
    def size(self) -> int:
        return len(self.perm)

    def layer_groups(self, layer: int) -> list:
        return [g for (kind, i, _), g in self.groups.items() if i == layer]


def plan_batch(pets: list, keys: list | None = None, lora_kernel: str = "auto") -> BatchPlan:
    """Lay out a mixed-tenant batch: pets[b] (ServingPet) serves item b; keys[b] (default
    tenant_key(pets[b])) says which items share a tenant. lora_kernel: "sgmv",
    "bgmv" or "auto" (BGMV when every LoRA tenant of the batch has a single request)."""
    if lora_kernel not in ("auto", "sgmv", "bgmv"):
        raise ValueError(f"lora_kernel must be auto, sgmv or bgmv, got {lora_kernel!r}")
    if not pets:
        raise ValueError("an empty batch")
    if keys is None:
        keys = [tenant_key(p) for p in pets]
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
    """Stacked torch weights of a group, as the ops_cpu functions take them (floats in dtype)."""
    part = (group.kind, group.layer, group.target)  # each float cast once, before it is stacked
    arrays = [tuple(a.to(dtype) if a.is_floating_point() else a for a in plan.tenants[m].parts[part])
              for m in group.members]
    if group.kind == "lora":
        r = max(a[0].shape[0] for a in arrays)
        A = torch.stack([_pad_to(a[0], 0, r) for a in arrays])
        B = torch.stack([_pad_to(a[1], 1, r) for a in arrays])
        scales = torch.tensor([plan.tenants[m].scale for m in group.members], dtype=torch.float32)
        return {"A": A, "B": B, "scales": scales}
    if group.kind == "bias":
        return {"delta": torch.stack([a[0] for a in arrays])}
    if group.kind == "diff":
        sizes = [len(a[0]) for a in arrays]
        return {"index": torch.cat([a[0] for a in arrays]), "value": torch.cat([a[1] for a in arrays]),
                "offsets": torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)}
    if group.kind == "adapter":
        b = max(a[0].shape[0] for a in arrays)
        return {"down": torch.stack([_pad_to(a[0], 0, b) for a in arrays]),
                "down_bias": torch.stack([_pad_to(a[1], 0, b) for a in arrays]),
                "up": torch.stack([_pad_to(a[2], 1, b) for a in arrays]),
                "up_bias": torch.stack([a[3] for a in arrays])}
    if group.kind == "norm":
        return {"weight": torch.stack([a[0] for a in arrays]),
                "bias": torch.stack([a[1] for a in arrays])}
    raise ValueError(f"unknown part kind {group.kind!r}")


def pad_ids(seqs: list, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, L) ids and lengths."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    ids = np.full((len(seqs), int(lengths.max())), pad_id, dtype=np.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    return ids, lengths
