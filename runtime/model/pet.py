"""Parameter-efficient modules (PETs): a tenant's task knowledge, applied inside the upper layers.

A PET is a flat dict of tensors under the unified names below plus a JSON-able meta dict, so
the store can pack it without knowing the type. Layer indices are absolute (3, 4, 5 are the
upper layers of a 6-layer model split 3/3). Exported names:

    layers.{i}.adapter.{target}.down.weight (b, d)  .down.bias (b)  .up.weight (d, b)  .up.bias (d)
    layers.{i}.lora.{target}.A (r, d_in)  .B (d_out, r)      with meta["scale"]
    layers.{i}.bias.{target} (d_out)                         bitfit bias delta
    layers.{i}.diff.{target}.index int32  .value             W' = W + delta at flat indices
    layers.{i}.mask.{target}.index int32                     W' = W with those entries zeroed
    layers.{i}.norm.{ln}.weight (d)  .bias (d)               LayerNorm gain/shift deltas
    head.weight (labels, d)  head.bias (labels)

Flat indices run over the row-major (d_out, d_in) weight. Targets are the six projections
q, k, v, o, ffn_in, ffn_out; an adapter wraps the output of o or ffn_out (Houlsby: both), the
projections whose output joins the residual stream. Any PET may also carry LayerNorm deltas
(meta `norms`: ln_attn, ln_ffn): Houlsby et al. train the LayerNorms with their adapters, so an
adapter PET has both by default (BENCHMARKS.md, accuracy: the LayerNorm ablation). While training,
diff and mask hold dense tensors instead (`.delta`: the weight delta, `.score`: keep-scores);
`export` turns them into index form.
Every PET carries a task head: classification reads the first token ([CLS]), tagging every
token. A "head" PET is a head alone (the head-only baseline).

A *full-depth* PET (meta ``level: "full"``) may also edit the lower layers: it is trained and
served on the base encoder's embeddings through every layer (Encoder.full), reading no PLOT,
so nothing it edits is precomputed. Only such a PET may name lower layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# PET math takes the encoder as a plain nn.Module (runtime.model.encoder.Encoder, which applies
# PETs and so imports this module): no import back, so no cycle.
Encoder = torch.nn.Module

TARGETS = ("q", "k", "v", "o", "ffn_in", "ffn_out")
PET_TYPES = ("adapter", "lora", "bitfit", "diff", "mask", "head")
TASKS = ("classification", "tagging", "lm")  # lm: a decoder tenant; no head (the decoder's LM head)
ADAPTER_TARGETS = ("o", "ffn_out")
NORMS = ("ln_attn", "ln_ffn")
# Default targets per type: LoRA's paper setting (q, v); Houlsby's two adapters a layer (after
# attention and after the FFN: +5.6 F1 over the attention one alone on NCBI-disease, see
# BENCHMARKS.md); the rest edit every projection.
DEFAULT_TARGETS = {"lora": ("q", "v"), "adapter": ADAPTER_TARGETS, "bitfit": TARGETS, "diff": TARGETS,
                   "mask": TARGETS}
# A mask score starts above the keep threshold (0), so a fresh mask PET keeps every weight;
# small, so that a few optimizer steps can push a score below it.
MASK_INIT = 1e-2
FULL = "full"  # meta["level"] of a full-depth PET


@dataclass
class Pet:
    tensors: dict[str, torch.Tensor]
    meta: dict


# -- applying a PET (called from Encoder.layer) -------------------------------------------------


def linear(pet: Pet | None, i: int, target: str, x: torch.Tensor, lin: torch.nn.Linear, drop=None,
           gemm=F.linear) -> torch.Tensor:
    """x W'^T + b' for projection `target` of layer i, W' and b' being lin's with pet's edits.
    drop (training only): drop("lora", x) is what a LoRA branch reads, as PEFT's lora_dropout.
    gemm(x, w, b) runs an unedited projection (serving passes packed GEMMs, runtime.exec.onednn)."""
    w, b = lin.weight, lin.bias
    if pet is None:
        return gemm(x, w, b)
    t, p = pet.tensors, f"layers.{i}."
    if (k := f"{p}bias.{target}") in t:
        b = t[k] if b is None else b + t[k]  # BitFit on a bias-free projection (Llama) adds one
    if (k := f"{p}diff.{target}.delta") in t:
        w = w + t[k]
    if (k := f"{p}diff.{target}.index") in t:
        w = w.flatten().index_add(0, t[k].long(), t[f"{p}diff.{target}.value"]).view_as(w)
    if (k := f"{p}mask.{target}.score") in t:
        w = w * _straight_through(t[k])
    if (k := f"{p}mask.{target}.index") in t:
        w = w.flatten().index_fill(0, t[k].long(), 0.0).view_as(w)
    y = F.linear(x, w, b)
    if (k := f"{p}lora.{target}.A") in t:
        lx = x if drop is None else drop("lora", x)
        y = y + pet.meta["scale"] * F.linear(F.linear(lx, t[k]), t[f"{p}lora.{target}.B"])
    if (k := f"{p}adapter.{target}.") + "down.weight" in t:
        # Houlsby's bottleneck on the (edited) projection output: y + up(relu(down(y))).
        down = F.relu(F.linear(y, t[k + "down.weight"], t[k + "down.bias"]))
        y = y + F.linear(down, t[k + "up.weight"], t[k + "up.bias"])
    return y


def layer_norm(pet: Pet | None, i: int, name: str, x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    """LayerNorm `name` of layer i on x, its gain and shift plus pet's deltas."""
    w, b = ln.weight, ln.bias
    if pet is not None and (k := f"layers.{i}.norm.{name}.") + "weight" in pet.tensors:
        w, b = w + pet.tensors[k + "weight"], b + pet.tensors[k + "bias"]
    return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


def head(pet: Pet, h: torch.Tensor) -> torch.Tensor:
    """Logits from the upper-layer output h (B, L, d): (B, labels) or (B, L, labels)."""
    if pet.meta["task"] == "classification":
        h = h[:, 0]
    return F.linear(h, pet.tensors["head.weight"], pet.tensors["head.bias"])


def _straight_through(score: torch.Tensor) -> torch.Tensor:
    """The binary keep-mask (score > 0) forward; the identity gradient to score backward."""
    keep = (score > 0).to(score.dtype)
    return keep + score - score.detach()


# -- creating, exporting, loading -----------------------------------------------------------

# The meta fields each type adds to pet_type, task, labels, layers (FORMAT.md section 5).
TYPE_META = {
    "adapter": ("bottleneck", "targets"),
    "lora": ("rank", "scale", "targets"),
    "bitfit": ("targets",),
    "diff": ("targets", "density"),
    "mask": ("targets", "density"),
    "head": (),
}


def pet_meta(meta: dict) -> dict:
    """The fields of a stored record's meta that describe its PET (FORMAT.md section 5),
    without the record's own (version, tenant, training log)."""
    # precision: what the level is served at (an executor at precision auto reads it per row)
    keep = ("pet_type", "task", "labels", "layers", "norms", "precision", *TYPE_META.get(meta.get("pet_type"), ()))
    out = {k: meta[k] for k in keep if k in meta}
    if is_full(meta):  # what lets its lower-layer tensors load
        out["level"] = FULL
    return out


def is_full(pet_or_meta) -> bool:
    """Whether a PET (or its meta) is full-depth: meta level "full"."""
    meta = getattr(pet_or_meta, "meta", pet_or_meta)
    return meta.get("level") == FULL


def create_pet(
    encoder: Encoder,
    pet_type: str,
    task: str,
    labels: list[str],
    *,
    level: str | None = None,
    layers: list[int] | None = None,
    targets: tuple[str, ...] | None = None,
    rank: int = 8,
    scale: float = 2.0,
    bottleneck: int = 64,
    density: float = 0.005,
    norms: tuple[str, ...] | None = None,
    seed: int = 0,
) -> Pet:
    """A trainable PET (tensors require grad) that leaves the upper layers unchanged:
    adapter up = 0, LoRA B = 0, bias/diff/norm deltas = 0, mask scores > 0; only the head is
    random. level "full" makes a full-depth PET (meta level "full"), whose layers default to
    all of the encoder's and may include lower ones; otherwise layers default to the encoder's
    upper layers. scale is LoRA's alpha / rank; norms default to both LayerNorms for an
    adapter, none otherwise."""
    if pet_type not in PET_TYPES:
        raise ValueError(f"unknown PET type {pet_type!r}; expected one of {', '.join(PET_TYPES)}")
    options = {"bottleneck": bottleneck, "rank": rank, "scale": scale, "density": density,
               "targets": list(targets or DEFAULT_TARGETS.get(pet_type, ()))}
    if level not in (None, FULL):
        raise ValueError(f"unknown PET level {level!r}; expected {FULL!r} or none")
    if layers is None:
        layers = range(0 if level else encoder.lower_layers, encoder.config.num_layers)
    meta = {"pet_type": pet_type, "task": task, "labels": list(labels), "layers": list(layers)}
    if level:
        meta["level"] = level
    meta |= {k: options[k] for k in TYPE_META[pet_type]}
    if norms := list(NORMS if norms is None and pet_type == "adapter" else norms or ()):
        meta["norms"] = norms
    _check_meta(meta, encoder)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, g) for name, shape in _layout(meta, encoder.config).items()}
    return Pet(tensors, meta)


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name == "head.weight":  # BERT's initializer_range for a fresh classifier
        v = torch.randn(shape, generator=g) * 0.02
    elif name.endswith((".A", ".down.weight")):
        # nn.Linear's range +-1/sqrt(fan_in): nonzero, so the zero-initialized B/up get gradient.
        v = (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(shape[1])
    elif name.endswith(".score"):
        v = torch.full(shape, MASK_INIT)
    else:
        v = torch.zeros(shape)
    return v.requires_grad_(True)


def _layout(meta: dict, c) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a trainable PET described by meta."""
    shapes = {} if meta["task"] == "lm" else {"head.weight": (len(meta["labels"]), c.d),
                                              "head.bias": (len(meta["labels"]),)}
    kind = meta["pet_type"]
    for i in meta["layers"]:
        p = f"layers.{i}."
        for ln in meta.get("norms", ()):
            shapes |= {f"{p}norm.{ln}.weight": (c.d,), f"{p}norm.{ln}.bias": (c.d,)}
        for target in meta.get("targets", ()):
            d_out, d_in = _shape(c, target)
            b, a = meta.get("bottleneck"), f"{p}adapter.{target}."
            shapes |= {
                "adapter": {a + "down.weight": (b, d_out), a + "down.bias": (b,), a + "up.weight": (d_out, b),
                            a + "up.bias": (d_out,)},
                "lora": {f"{p}lora.{target}.A": (meta.get("rank"), d_in), f"{p}lora.{target}.B": (d_out, meta.get("rank"))},
                "bitfit": {f"{p}bias.{target}": (d_out,)},
                "diff": {f"{p}diff.{target}.delta": (d_out, d_in)},
                "mask": {f"{p}mask.{target}.score": (d_out, d_in)},
            }[kind]
    return shapes


def _served_layout(meta: dict, c) -> dict[str, tuple[int, ...] | int]:
    """Name -> shape of an exported PET's tensors; for the variable-length 1-D index lists
    (and diff values) an int instead: the number of weights they index, d_out * d_in. Shared
    by every PET of one shape (a tenant's first use pays no layout of its own): do not modify."""
    try:
        key = (c, meta["pet_type"], meta["task"] == "lm", len(meta.get("labels") or ()), tuple(meta["layers"]),
               tuple(meta.get("norms", ())), tuple(meta.get("targets", ())), meta.get("bottleneck"), meta.get("rank"))
        layout = _SERVED.get(key)
    except TypeError:  # an unhashable config or meta value: no cache
        return _served_layout_of(meta, c)
    if layout is None:
        if len(_SERVED) >= 64:
            _SERVED.clear()
        layout = _SERVED[key] = _served_layout_of(meta, c)
    return layout


_SERVED: dict = {}


def _served_layout_of(meta: dict, c) -> dict:
    served = {}
    for name, shape in _layout(meta, c).items():
        stem, _, suffix = name.rpartition(".")
        if suffix == "delta":
            served |= {stem + ".index": math.prod(shape), stem + ".value": math.prod(shape)}
        elif suffix == "score":
            served[stem + ".index"] = math.prod(shape)
        else:
            served[name] = shape
    return served


def l1_penalty(pet: Pet) -> torch.Tensor:
    """Sum of |delta| over a training diff PET's dense deltas (0 for other types): it pushes
    the entries the task does not need toward zero, so export's top-k loses little."""
    deltas = [v for k, v in pet.tensors.items() if k.endswith(".delta")]
    return sum((d.abs().sum() for d in deltas), torch.tensor(0.0))


def export(pet: Pet) -> Pet:
    """The serving form: detached tensors; a diff keeps its top-k |delta| per target and a mask
    zeroes at most density of each target's weights (those with the lowest scores <= 0),
    k = ceil(density * d_out * d_in). Indices are sorted."""
    out = {}
    for name, v in pet.tensors.items():
        stem, _, suffix = name.rpartition(".")
        flat = v.detach().flatten()
        k = math.ceil(pet.meta.get("density", 0) * flat.numel())
        if suffix == "delta":
            index = flat.abs().topk(k).indices.sort().values
            out |= {stem + ".index": index.to(torch.int32), stem + ".value": flat[index].clone()}
        elif suffix == "score":
            dropped = (flat <= 0).nonzero().flatten()
            out[stem + ".index"] = dropped[flat[dropped].argsort()[:k]].sort().values.to(torch.int32)
        else:
            out[name] = v.detach().clone()
    return Pet(out, dict(pet.meta))


def load_pet(encoder: Encoder, tensors: dict, meta: dict, *, half: bool = False) -> Pet:
    """Check an exported PET (torch tensors or NumPy arrays) against its meta and the encoder:
    exactly the tensors the meta implies, with their shapes; ValueError if not. Floating
    tensors come back as fp32 (packs may hold fp16); with half, fp16 ones stay fp16: a serving
    host cache holds them so (half the bytes) and its executors compute in fp32 (only they
    may take such a PET: this module's functions compute in the dtype they are given)."""
    _check_meta(meta, encoder)
    expected = _served_layout(meta, encoder.config)
    if missing := sorted(expected.keys() - tensors.keys()):
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"PET lacks tensor {missing[0]}{more}")
    loaded = {}
    keep = (torch.float32, torch.float16) if half else (torch.float32,)
    for name, v in tensors.items():
        # Pack readers hand back NumPy arrays: shared, not copied (the CPU executor's blocks
        # can be the record's own memory: a tenant's first use need not copy its PET at all)
        v = torch.from_numpy(v) if type(v) is np.ndarray else torch.as_tensor(v)
        want = expected.get(name)
        if want is None:
            raise ValueError(f"PET tensor {name!r} is not part of a {meta['pet_type']} PET on layers {meta['layers']}")
        if type(want) is int:
            _check_index_list(name, v, want, tensors)
        elif v.shape != want:
            raise ValueError(f"PET tensor {name} has shape {tuple(v.shape)}, expected {want}")
        if name.endswith(".index"):
            loaded[name] = v.to(torch.int32)
        else:
            loaded[name] = v if v.dtype in keep else v.float()
    return Pet(loaded, dict(meta))


def _check_index_list(name: str, v: torch.Tensor, size: int, tensors: dict) -> None:
    stem, _, suffix = name.rpartition(".")
    if v.ndim != 1:
        raise ValueError(f"PET tensor {name} must be 1-D, has shape {tuple(v.shape)}")
    if suffix == "index" and v.numel() and not 0 <= int(v.min()) <= int(v.max()) < size:
        raise ValueError(f"PET tensor {name} holds indices outside [0, {size})")
    if suffix == "value" and len(v) != len(tensors[stem + ".index"]):
        raise ValueError(f"PET tensor {name} has {len(v)} values for {len(tensors[stem + '.index'])} indices")


def _check_meta(meta: dict, encoder: Encoder) -> None:
    kind = meta.get("pet_type")
    if kind not in PET_TYPES:
        raise ValueError(f"PET meta has unknown pet_type {kind!r}; expected one of {', '.join(PET_TYPES)}")
    if meta.get("task") not in TASKS:
        raise ValueError(f"PET meta has unknown task {meta.get('task')!r}; expected classification or tagging")
    if meta["task"] == "lm" and (kind == "head" or not getattr(encoder, "is_decoder", False)):
        raise ValueError("an lm PET edits a decoder's upper layers (and has no head of its own)")
    if meta["task"] != "lm" and not meta.get("labels"):
        raise ValueError("PET meta has no labels")
    if missing := [k for k in ("layers", *TYPE_META[kind]) if k not in meta]:
        raise ValueError(f"{kind} PET meta lacks {', '.join(missing)}")
    allowed_layers = range(0 if is_full(meta) else encoder.lower_layers, encoder.config.num_layers)
    if not all(i in allowed_layers for i in meta["layers"]):
        # PLOT tables replace the lower layers, so only a full-depth PET (which reads no PLOT) may edit them.
        which = "layers of the encoder" if is_full(meta) else "upper layers (only a full-depth PET edits lower ones)"
        raise ValueError(f"PET layers {meta['layers']} are not all {which} "
                         f"({allowed_layers.start}..{allowed_layers.stop - 1})")
    allowed = ADAPTER_TARGETS if kind == "adapter" else TARGETS
    if unknown := set(meta.get("targets", ())) - set(allowed):
        raise ValueError(f"unknown {kind} targets {sorted(unknown)}; expected some of {', '.join(allowed)}")
    norms = meta.get("norms", [])
    if not isinstance(norms, list) or set(norms) - set(NORMS) or len(set(norms)) != len(norms):
        raise ValueError(f"PET meta norms must be a list of distinct names from {', '.join(NORMS)}, got {norms!r}")


def _shape(c, target: str) -> tuple[int, int]:
    """(d_out, d_in) of a target projection."""
    if hasattr(c, "kv_heads"):  # a decoder (runtime.model.decoder_config): grouped K/V heads, head_dim
        attn = c.heads * c.head_dim
        return {"q": (attn, c.d), "k": (c.kv_heads * c.head_dim, c.d), "v": (c.kv_heads * c.head_dim, c.d),
                "o": (c.d, attn), "ffn_in": (c.ffn, c.d), "ffn_out": (c.d, c.ffn)}[target]
    return {"ffn_in": (c.ffn, c.d), "ffn_out": (c.d, c.ffn)}.get(target, (c.d, c.d))
