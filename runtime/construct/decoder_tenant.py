"""Decoder tenants: a PET on a decoder's upper layers fine-tuned with the causal LM loss on a
text corpus, on exactly the inputs generation serves (runtime.plot.retrieve of a decoder store).

    lm_tenant_create(store_path, "acme", train_path="acme.txt", pet_type="lora", epochs=3)
    pet = load_lm_pet(store, "acme", decoder)       # what generation applies for the tenant

The PET's meta has task "lm" and no head: the decoder's own LM head scores the vocabulary.
The record is stored like any tenant's (FORMAT.md §5), so pack ls / rm / gc treat it alike.
Its meta records the precision generation serves it at under a runtime at precision auto
(runtime.construct.precision): at auto, bf16 where the tenant's perplexity on a sample of its
training text, through the shared GEMMs generation runs, is at most 0.3% above fp32's.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

import hkstore
from runtime.model.stored import (
    ManagerError,
    load_lm_pet,
)

LM_PET_TYPES = ("lora", "adapter", "bitfit", "diff")
LOGIT_ROWS = 1024  # positions whose logits a perplexity computes at once
DEFAULT_LR = {"adapter": 1e-3, "lora": 1e-3, "bitfit": 3e-3, "diff": 3e-4}


def _batches(n: int, size: int, rng):
    order = rng.permutation(n)
    return [order[i:i + size] for i in range(0, n, size)]


def train_lm_pet(decoder, pet, inputs, seqs, *, epochs: int, lr: float, batch_size: int, seed: int,
                 progress: bool = False) -> list[float]:
    """AdamW on pet's tensors: next-token cross-entropy of the upper layers + LM head run on the
    precomputed inputs (one (L, d) tensor per sequence). Returns the loss of every step."""
    import torch
    import torch.nn.functional as F

    params = [t for t in pet.tensors.values() if t.is_floating_point()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    log = []
    for epoch in range(epochs):
        start = len(log)
        for pick in _batches(len(seqs), batch_size, rng):
            h, y, mask = _padded(decoder, [inputs[i] for i in pick], [seqs[i] for i in pick])
            logits = decoder.logits(decoder.upper(h, mask, pet))
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log.append(loss.item())
        if progress:
            print(f"epoch {epoch + 1}/{epochs}: loss {np.mean(log[start:]):.3f}", flush=True)
    return log


def _padded(decoder, inputs, seqs):
    """(h (B, L, d), next-token targets (B, L) with -100 where none, mask (B, L)) of sequences
    right-padded together (inputs: each one's (len, d) PLOT inputs)."""
    import torch

    L = max(len(s) for s in seqs)
    h = torch.zeros(len(seqs), L, decoder.config.d)
    y = torch.full((len(seqs), L), -100, dtype=torch.long)
    for b, (s, x) in enumerate(zip(seqs, inputs)):
        h[b, :len(s)] = x
        y[b, :len(s) - 1] = torch.tensor(s[1:])
    mask = torch.arange(L)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]
    return h, y, mask


def lm_tenant_create(store_path, tenant, *, train_path, version=None, pet_type: str = "lora", epochs: int = 3,
                     lr: float | None = None, batch_size: int = 8, max_len: int | None = None, rank: int = 8,
                     bottleneck: int = 64, seed: int = 0, replace: bool = False, corpus_format=None,
                     precision: str = "auto", progress: bool = True) -> dict:
    """Fine-tune an lm PET for `tenant` on PLOT inputs of `version` (default: the root) of a
    decoder store and store it; returns a summary (losses, perplexity on the training text
    before and after, the precision it serves at: precision, or for auto as measured)."""
    import torch

    from runtime.construct.data import read_corpora
    from runtime.construct.decoder_store import tokenize_decoder_corpus
    from runtime.construct.precision import check_asked, checked, training_sample
    from runtime.construct.train import loss_ends
    from runtime.model import pet as petlib
    from runtime.model.stored import base_decoder, is_decoder_store
    from runtime.plot.retrieve import retrieve_list

    t0 = time.perf_counter()
    hkstore.store.check_name("tenant", tenant)
    if pet_type not in LM_PET_TYPES:
        raise ValueError(f"a decoder tenant's PET is one of {', '.join(LM_PET_TYPES)}, not {pet_type!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    check_asked(precision)  # (bf16 on a CPU without it: refused before any training)
    with hkstore.open(store_path) as store:
        if not is_decoder_store(store.meta):
            raise ManagerError(f"{store_path}: an encoder store; lm tenants need a decoder store")
        snap = store.snapshot()
        version = version or snap.version_names[0]
        snap.version_index(version)
        if tenant in snap.pets and not replace:
            raise ManagerError(f"tenant {tenant!r} already exists (use replace)")
        dec = base_decoder(store)
        base_model = store.meta["base_model"]
        if pet_type == "bitfit" and not dec.config.bias:
            raise ValueError("bitfit needs projections with biases; this decoder has none")
        seqs = [s for s in tokenize_decoder_corpus(dec, read_corpora(train_path, corpus_format),
                                                   max_len or dec.config.max_len) if len(s) > 1]
        if not seqs:
            raise ValueError(f"{train_path}: no text to train on")
        inputs = retrieve_list(snap, version, seqs)
    pet = petlib.create_pet(dec, pet_type, "lm", [], rank=rank, bottleneck=bottleneck, seed=seed)
    with torch.no_grad():
        before = _ppl(dec, None, inputs, seqs)
    log = train_lm_pet(dec, pet, inputs, seqs, epochs=epochs, lr=lr or DEFAULT_LR[pet_type], batch_size=batch_size,
                       seed=seed, progress=progress)
    exported = petlib.export(pet)
    with torch.no_grad():
        after = _ppl(dec, exported, inputs, seqs)
    tensors = {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in exported.tensors.items()}
    served = petlib.load_pet(dec, tensors, petlib.pet_meta(exported.meta))  # as generation will load it
    sample, sample_inputs = training_sample(seqs, inputs, seed)  # (the sequences and their PLOT inputs)
    chosen = checked(precision, lambda: served_perplexities(dec, served, sample_inputs, sample), "perplexity",
                     len(sample), "training")
    meta = dict(exported.meta, tenant=tenant, base_model=base_model, version=version, **chosen,
                created=time.time(), train={"path": os.path.abspath(os.fspath(train_path)), "sequences": len(seqs),
                                            "epochs": epochs, "steps": len(log), "loss_last": log[-1]})
    record = hkstore.PetRecord(tenant=tenant, meta=meta, tensors=tensors)
    with hkstore.open(store_path, writable=True) as store:
        if tenant in store.snapshot().pets and not replace:
            raise ManagerError(f"tenant {tenant!r} already exists (use replace)")
        store.put_pet(record)
        size = store.snapshot().pets[tenant]["length"]
    return {"tenant": tenant, "version": version, "pet_type": pet_type, "task": "lm", "sequences": len(seqs),
            "steps": len(log), **loss_ends(log), "train_ppl_before": round(before, 2),
            "train_ppl_after": round(after, 2), "precision": chosen["precision"],
            "precision_check": chosen["precision_check"], "pet_bytes": int(size),
            "seconds": round(time.perf_counter() - t0, 3)}


def served_perplexities(dec, pet, inputs, seqs, batch: int = 8) -> tuple[dict, float]:
    """({"fp32": perplexity, "bf16": perplexity}, CPU seconds) of seqs (inputs: their PLOT
    inputs) under pet, through the arithmetic of generation's batched prefill at each precision
    (runtime.gen.batched_prefill.upper_batch: the shared GEMMs on packed weights, the LM head
    too), one precision after the other."""
    import torch
    import torch.nn.functional as F

    from runtime.gen.batched_prefill import upper_batch
    from runtime.gen.lora_batch import lora_only

    t0 = time.process_time()
    out = {}
    for precision in ("fp32", "bf16"):
        nll, count = 0.0, 0
        for start in range(0, len(seqs), batch):
            h, y, mask = _padded(dec, inputs[start:start + batch], seqs[start:start + batch])
            with torch.no_grad():
                hidden, rp = upper_batch(dec, h, mask, [pet] * len(h), None, not lora_only(pet), precision)
                scored = y >= 0
                hidden, y = hidden[scored], y[scored]
                for at in range(0, len(y), LOGIT_ROWS):  # (a batch's logits at once would be rows x vocabulary)
                    logits = dec.logits(hidden[at:at + LOGIT_ROWS], linear=rp.linear)
                    nll += F.cross_entropy(logits, y[at:at + LOGIT_ROWS], reduction="sum").item()
            count += len(y)
        out[precision] = round(math.exp(nll / count), 6)
    return out, time.process_time() - t0


def _ppl(dec, pet, inputs, seqs) -> float:
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    for h, s in zip(inputs, seqs):
        logits = dec.logits(dec.upper(h[None], pet=pet))[0, :-1]
        nll += F.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum").item()
        count += len(s) - 1
    return math.exp(nll / count)


def lm_tenant_eval(store_path, tenant, test_path, *, max_examples: int | None = None, corpus_format=None) -> dict:
    """Perplexity (per token) of a text file under the tenant and under the base model, both
    through the serving path (PLOT inputs of the tenant's version + the upper layers), and, on a
    CPU with native bf16, the tenant's through generation's GEMMs in fp32 and in bf16 beside the
    precision it records (what its choice costs on this text)."""
    import torch

    from runtime.construct.data import read_corpora
    from runtime.construct.decoder_store import tokenize_decoder_corpus
    from runtime.model.stored import base_decoder
    from runtime.plot.retrieve import retrieve_list

    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.pets:
            raise ManagerError(f"unknown tenant {tenant!r}")
        dec = base_decoder(store)
        pet = load_lm_pet(store, tenant, dec)
        meta = snap.read_pet(tenant).meta
        version = meta.get("version") or snap.version_names[0]
        seqs = [s for s in tokenize_decoder_corpus(dec, read_corpora(test_path, corpus_format), dec.config.max_len)
                if len(s) > 1][:max_examples]
        if not seqs:
            raise ValueError(f"{test_path}: no text to evaluate on")
        inputs = retrieve_list(snap, version, seqs)
    with torch.no_grad():
        tuned, base = _ppl(dec, pet, inputs, seqs), _ppl(dec, None, inputs, seqs)
    out = {"tenant": tenant, "version": version, "sequences": len(seqs), "tokens": sum(len(s) - 1 for s in seqs),
           "perplexity": round(tuned, 3), "base_perplexity": round(base, 3),
           "precision": meta.get("precision", "fp32")}
    from runtime.exec.precision import bf16_native

    if bf16_native() is not None:
        served, _ = served_perplexities(dec, pet, inputs, seqs)
        out["served_perplexity"] = {k: round(v, 3) for k, v in served.items()}
    return out
