"""A tenant's full-depth PET (level "full", FORMAT.md): a PET on every encoder layer, trained on
exact inputs (the base encoder's token embeddings -> all its layers with the PET -> head).

The base model loaded with lower_layers=0 has every layer "upper", so create_pet places the PET
on all of them and Encoder.upper(embed(ids), mask, pet) is the whole encoder's forward with it;
the embeddings are frozen, so they are computed once per example and runtime.construct.train's
train_pet trains the PET unchanged. The model is the store's base model, not a domain version's
lower layers: serving runs a full row's lower layers with the base weights.

    trained = fit_full_level(store, task, labels, ids, targets, seed=0)
    record = full_level_record(pet_record, trained, ids)  # Store.put_pets([pet_record, record])

The record stores the PET's layer tensors in float16 (FORMAT.md, Full-depth PET): a tenant's
full-depth PET is most of what a tenant costs the host, and the serving path keeps it in float16
and computes in float32. Training stays float32; what a trained PET is scored with (held_out)
is the PET rounded as its record stores it (``rounded``), so the score is the served one's.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from runtime.construct import recipe as recipes

LAYER_DTYPE = np.float16  # a full-depth record's layer tensors; the head stays float32 (small: labels hinge on it)


def stored_tensors(tensors: dict) -> dict:
    """A full-depth PET's tensors (torch or NumPy) as its record stores them: every float
    tensor of a layer in LAYER_DTYPE, the head float32, index lists unchanged."""
    out = {}
    for name, v in tensors.items():
        a = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v)
        if a.dtype.kind == "f":
            a = a.astype(LAYER_DTYPE if name.startswith("layers.") else np.float32)
        out[name] = np.ascontiguousarray(a)
    return out


def rounded(pet):
    """The PET (runtime.model.pet.Pet) with its layer tensors rounded as its record stores
    them, held in float32: what serving its record computes."""
    import torch

    from runtime.model.pet import Pet

    return Pet({k: torch.from_numpy(v).float() if v.dtype.kind == "f" else torch.from_numpy(v)
                for k, v in stored_tensors(pet.tensors).items()}, dict(pet.meta))


def whole_encoder(store):
    """The store's base model with every layer a PET may edit (lower_layers 0), checked
    against the store as base_encoder is."""
    from runtime.model.stored import check_encoder, default_model_path, load_model

    encoder = load_model(store.meta.get("model_path") or default_model_path(), 0)
    check_encoder(dict(store.meta, lower_layers=0), encoder)
    return encoder


def embeddings(encoder, seqs, batch: int = 64):
    """Frozen embedding output, one (L, d) tensor per sequence: the full-depth PET's input."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(seqs), batch):
            part = seqs[start:start + batch]
            h = encoder.embed(encoder.pad(part)[0])
            out += [h[b, :len(s)].clone() for b, s in enumerate(part)]
    return out


def train_full(whole, task, labels, ids, targets, *, pet_type: str = recipes.FULL_PET_TYPE, seed: int = 0,
               progress: bool = True, **overrides):
    """(exported PET, losses, TrainConfig) of a full-depth PET trained by its recipe (overrides:
    runtime.construct.recipe.settings's) on ids."""
    from runtime.construct.train import train_pet
    from runtime.model.pet import create_pet

    options, cfg = recipes.settings(pet_type, "full", seed=seed, progress=progress, **overrides)
    pet = create_pet(whole, pet_type, task, labels, level="full", seed=seed, **options)
    exported, log = train_pet(whole, pet, embeddings(whole, ids), targets, cfg)
    return exported, log, cfg


def continue_full(whole, record, ids, targets, cfg):
    """(exported PET, losses) of a stored full-depth PET trained further under cfg."""
    from runtime.construct.train import train_pet, trainable
    from runtime.model.pet import load_pet, pet_meta

    model = trainable(whole, load_pet(whole, record.tensors, pet_meta(record.meta)))
    return train_pet(whole, model, embeddings(whole, ids), targets, cfg)


def full_logits(whole, pet, seqs, batch: int = 32) -> list:
    """Per example the PET's logits through the whole encoder: (labels,) for classification,
    (tokens, labels) for tagging."""
    import torch

    from runtime.model.pet import head

    out = []
    with torch.no_grad():
        for start in range(0, len(seqs), batch):
            part = seqs[start:start + batch]
            ids, real = whole.pad(part)
            logits = head(pet, whole.upper(whole.embed(ids), real, pet))
            for b, s in enumerate(part):
                out.append((logits[b] if pet.meta["task"] == "classification" else logits[b, :len(s)]).numpy())
    return out


def full_record(pet_record, exported, extra: dict):
    """The full-depth record of the tenant whose PET record is pet_record (its tenant, version
    and base model; pet_created its created): meta level "full"."""
    from formats.pack import PetRecord

    meta = dict(exported.meta)
    meta.update({k: v for k, v in extra.items() if k not in ("tenant", "version", "created", "level")})
    meta.update(level="full", tenant=pet_record.tenant, base_model=pet_record.meta["base_model"],
                version=pet_record.meta["version"], created=time.time(), pet_created=pet_record.meta["created"])
    return PetRecord(tenant=pet_record.tenant, meta=meta, tensors=stored_tensors(exported.tensors))


def is_stale(full_meta: dict, pet_meta: dict) -> bool:
    """A full record trained with an earlier PET of the tenant: never served."""
    return full_meta.get("pet_created") != pet_meta.get("created")


class FullTrained(NamedTuple):
    """A full-depth PET trained for a tenant, before its record exists (the record names the
    tenant's PET record, which `tenant create --corpus` trains after it: the full-depth level
    labels the corpus that PET learns from)."""
    pet: object  # the exported PET, rounded as its record stores it
    log: list
    cfg: object  # the TrainConfig it ran under
    stall: dict | None  # the stalled first run, if any (runtime.construct.train.unstalled)
    whole: object  # the encoder it runs on (whole_encoder)


def fit_full_level(store, task, labels, ids, targets, *, epochs=None, batch_size=None, seed: int = 0,
                   progress: bool = True) -> FullTrained:
    """A tenant's full-depth PET trained on ids by the full-depth recipe. A run that never leaves
    its starting loss is trained once more as the PLOT level's is (runtime.construct.train.stalled:
    half the rate, the next seed)."""
    from runtime.construct.train import unstalled

    whole = whole_encoder(store)
    _, cfg = recipes.settings(recipes.FULL_PET_TYPE, "full", epochs=epochs, batch_size=batch_size, seed=seed,
                              progress=progress)
    exported, log, cfg, stall = unstalled(
        lambda c: train_full(whole, task, labels, ids, targets, epochs=c.epochs, batch_size=c.batch_size,
                             seed=c.seed, lr=c.lr, progress=progress)[:2], cfg)
    return FullTrained(rounded(exported), log, cfg, stall, whole)


def full_level_record(pet_record, trained: FullTrained, ids, held=None):
    """The full-depth record of trained beside the tenant's new PET record (its training file and
    max_len; ``train.stalled`` keeps a stalled first run's rate, seed and losses); held: the
    held-out (ids, targets) its PET was calibrated on."""
    extra = {"train": _train_meta(pet_record.meta, trained.cfg, ids, trained.log, 0)}
    if trained.stall:
        extra["train"]["stalled"] = trained.stall
    if held:
        extra["held_out"] = held_out(trained.whole, trained.pet, *held, pet_record.meta)
    return full_record(pet_record, trained.pet, extra)


def update_full_level(store, pet_record, old, ids, targets, held=None, *, epochs=1, batch_size=None, seed: int = 0,
                      progress: bool = True):
    """(full-depth record, losses): the tenant's stored full-depth record `old` trained further
    (its own learning rate) on the examples its PET was just updated on."""
    whole = whole_encoder(store)
    train = old.meta.get("train") or {}
    _, cfg = recipes.settings(old.meta["pet_type"], "full", lr=train.get("lr"), epochs=epochs, batch_size=batch_size,
                              seed=seed, progress=progress)
    exported, log = continue_full(whole, old, ids, targets, cfg)
    exported = rounded(exported)
    keep = {k: v for k, v in old.meta.items() if k not in exported.meta and k not in ("pet_created", "held_out")}
    extra = dict(keep, train=_train_meta(pet_record.meta, cfg, ids, log, int(train.get("updates", 0)) + 1))
    if held:
        extra["held_out"] = held_out(whole, exported, *held, pet_record.meta)
    return full_record(pet_record, exported, extra), log


def _train_meta(pet_meta: dict, cfg, ids, log, updates: int) -> dict:
    train = pet_meta.get("train") or {}
    return {"path": train.get("path"), "max_len": train.get("max_len"), "examples": len(ids), "epochs": cfg.epochs,
            "lr": cfg.lr, "warmup": cfg.warmup, "batch_size": cfg.batch_size, "loss_last": log[-1],
            "updates": updates}


def held_out(whole, pet, ids, targets, pet_meta: dict) -> dict:
    """The full-depth PET's score on the examples its tenant's PET held out for calibration."""
    from runtime.construct.calibration import held_score, metric_name

    task = pet_meta["task"]
    score = held_score(full_logits(whole, pet, ids), targets, task, list(pet_meta["labels"]))
    return {"metric": metric_name(task), "score": round(score, 6), "examples": len(ids),
            "share": (pet_meta.get("calibration") or {}).get("share")}
