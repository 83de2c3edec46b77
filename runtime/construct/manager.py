"""The manager (HMI §3.4, §5): construction of PLOT versions and tenant PETs over a store path.

    build(store, corpus_paths=[...])                              root PLOT (+ window distillation)
    domain_create(store, "biology", [...], alpha=50)              MLM the lower layers (+ window distillation),
                                                                  top-alpha% branch
    domain_update(store, "biology", "biology-2", [...])           continue MLM, a new sibling version
    tenant_create(store, "t1", version="biology", train_path=...)  PET + head on retrieve() inputs, and a
                                                                  full-depth PET on exact inputs (levels)
    tenant_update(store, "t1", train_path=...)                    continue from the stored PET(s)
    tenant_rm(store, "t1")
    tenant_ls(store), tenant_info(store, "t1")                    levels, scores, precisions, bytes (tenant_info.py)
    tenant_precision(store, "t1", "dev.jsonl")                    each level's precision measured again on dev

Every function returns a JSON-able dict describing what it did. Bad input raises a StoreError
(ManagerError, UnknownVersion, UnknownTenant, ...) or ValueError whose message is one line.

Weights. The runtime needs only the base model's upper layers (the store's meta["model_path"])
plus PLOT values; the lower-layer weights that produced a version's values (distilled root,
MLM-trained domains) are kept in STORE/models/<version>.safetensors, named with their XXH64 in
the version's info["lower_weights"], for construction (domain updates) and explanation. A
window-distilled domain also keeps the full-context layers its values stand for (the MLM
result: the target of its distillation and position table, and what a domain update
continues pre-training) in STORE/models/<version>.context.safetensors, info["context_weights"].
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import numpy as np

import hkstore
from formats.pack import PetRecord
from hkstore.errors import UnknownTenant
from runtime.construct import recipe as recipes
from runtime.construct.branch import branch_from, new_version_checks, update_plan
from runtime.construct.data import read_corpora
from runtime.construct.precision import check_asked as check_precision
from runtime.construct.tenant_info import tenant_info, tenant_ls
from runtime.model.stored import (
    ManagerError,
    base_encoder,
    context_encoder,
    default_model_path,
    is_decoder_store,
    is_distilled,
    load_lower,
    load_model,
    save_lower,
    version_encoder,
)


def tokenize_corpus(encoder, docs: list[str], max_len: int) -> list[list[int]]:
    """Token ids of documents, each cut into pieces of at most max_len ids ([CLS] ... [SEP]
    each), so no text of a long document is lost to truncation."""
    if max_len < 3:
        raise ValueError(f"max_len={max_len} is too small (at least 3)")
    cls, sep = (encoder.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]"))
    out = []
    for ids in encoder.tokenize(docs, max_len=1 << 30):
        inner = ids[1:-1] if len(ids) >= 2 and ids[0] == cls and ids[-1] == sep else ids
        step = max_len - 2
        for start in range(0, max(len(inner), 1), step):
            out.append([cls, *inner[start:start + step], sep])
    return out


def _subsample(n_items: int, max_examples: int | None, seed: int) -> list[int]:
    if max_examples is None or n_items <= max_examples:
        return list(range(n_items))
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n_items, size=max_examples, replace=False).tolist())


def read_task(path, task: str):
    """(examples, label names found) of a task file: classification JSON lines -> (texts,
    labels); tagging CoNLL -> (word lists, tag lists)."""
    from runtime.construct.data import read_classification, read_conll

    if task == "classification":
        texts, labels = read_classification(path)
        return (texts, labels), sorted(set(labels))
    if task == "tagging":
        sentences, tags = read_conll(path)
        names = sorted({t for ts in tags for t in ts})
        return (sentences, tags), names
    raise ValueError(f"unknown task {task!r}; expected classification or tagging")


def encode_task(encoder, data, task: str, label_names: list[str], max_len: int, pick=None):
    """(ids, targets) for training: targets an int per example or an int list per token."""
    from runtime.construct.data import encode_tagging

    x, y = data
    if pick is not None:
        x, y = [x[i] for i in pick], [y[i] for i in pick]
    if task == "classification":
        index = {name: j for j, name in enumerate(label_names)}
        if unknown := sorted(set(y) - index.keys()):
            raise ValueError(f"labels {unknown} are not among the head's labels {label_names}")
        return encoder.tokenize(x, max_len), [index[label] for label in y]
    if unknown := sorted({t for ts in y for t in ts} - set(label_names)):
        raise ValueError(f"tags {unknown} are not among the head's labels {label_names}")
    return encode_tagging(encoder, x, y, label_names, max_len)


def _open_writable(store_path):
    return hkstore.open(store_path, writable=True)


def build(store_path, *, model_path=None, corpus_paths, n: int = 3, kind: str = "centered", lower_layers: int = 3,
          dtype: str = "fp16", distill_steps: int = 0, max_len: int = 128, chunk: int = 50_000,
          batch_size: int = 2048, distill_lr: float = 1e-4, distill_batch: int = 16, corpus_format=None,
          seed: int = 0, progress: bool = True, on_chunk=None) -> dict:
    """Create the store (or resume an unfinished build of it) and fill its root PLOT.

    With distill_steps > 0 the lower layers are first window-distilled on the corpus
    (runtime.construct.train.distill_windows) and saved in STORE/models/root.safetensors. Last, the
    root's position table is fitted (runtime.construct.plot.fit_position).
    """
    from runtime.construct import plot

    t0 = time.perf_counter()
    model_path = os.path.abspath(model_path or default_model_path())
    meta = hkstore.model_meta(model_path)
    if not 0 <= lower_layers <= meta["num_layers"]:
        raise ManagerError(f"--lower-layers {lower_layers} is outside 0..{meta['num_layers']}: the model has "
                           f"{meta['num_layers']} layers")
    if distill_steps < 0:
        raise ValueError(f"distill_steps must be >= 0, got {distill_steps}")
    docs = read_corpora(corpus_paths, corpus_format)
    encoder = base = load_model(model_path, lower_layers)
    seqs = tokenize_corpus(encoder, docs, max_len)
    wanted = {"n": n, "window": kind, "lower_layers": lower_layers, "dtype": dtype, "d": meta["d"],
              "vocab_size": meta["vocab_size"], "tokenizer_fingerprint": meta["tokenizer_fingerprint"]}
    if os.path.exists(os.path.join(store_path, "CURRENT")):
        store = _open_writable(store_path)
        differs = [k for k, v in wanted.items() if store.meta.get(k) != v]
        if differs:
            store.close()
            raise ManagerError(f"{store_path}: a store with other settings exists here ({', '.join(differs)} differ)")
        resumed = True
    else:
        store = hkstore.create(store_path, d=meta["d"], vocab_size=meta["vocab_size"], n=n, window=kind,
                               lower_layers=lower_layers, dtype=dtype, pad_id=meta["pad_id"],
                               base_model=meta["base_model"], tokenizer_fingerprint=meta["tokenizer_fingerprint"],
                               model_path=model_path, num_layers=meta["num_layers"])
        resumed = False
    try:
        root = store.snapshot().version_names[0]
        info = store.snapshot().versions[0]["info"]
        distill = None
        if distill_steps:
            previous = info.get("distill")
            if previous and previous.get("steps") == distill_steps and info.get("lower_weights"):
                encoder = load_lower(store.path, info["lower_weights"], encoder)
                distill = previous
            else:
                encoder, distill = _distill(encoder, None, seqs, n, kind, distill_steps, distill_lr, distill_batch,
                                            seed, progress)
                store.set_version_info(root, lower_weights=save_lower(store.path, root, encoder), distill=distill)
        corpus = {"corpus": [os.path.abspath(p) for p in _as_list(corpus_paths)], "documents": len(docs),
                  "sequences": len(seqs), "max_len": max_len}
        stats = plot.build_root(store, encoder, seqs, chunk=chunk, batch_size=batch_size, progress=progress,
                                on_chunk=on_chunk, info=corpus)
        position = store.snapshot().versions[0]["info"].get("position")
        if not store.snapshot().versions[0].get("position"):
            # The target is the base model's full-context output even for a distilled root:
            # the upper layers were trained on those.
            position = plot.fit_position(store, root, base, seqs, seed=seed)
            store.set_version_info(root, position=position)
        return {"store": os.fspath(store_path), "version": root, "resumed": resumed, "distill": distill, **corpus,
                **stats, "position": position, "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        store.close()


def _as_list(paths):
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def _mlm(encoder, seqs, mlm_steps, lr, batch_size, seed, progress):
    from runtime.construct.train import TrainConfig, loss_ends, train_mlm

    seqs = [s for s in seqs if len(s) <= encoder.config.max_len]
    if mlm_steps <= 0:
        return encoder, None
    cfg = TrainConfig(lr=lr, epochs=max(1, -(-mlm_steps * batch_size // len(seqs))), max_steps=mlm_steps,
                      batch_size=batch_size, seed=seed, progress=progress)
    trained, log = train_mlm(encoder, seqs, cfg)
    return trained, {"steps": len(log), "lr": lr, **loss_ends(log)}


def _distill(teacher, start, seqs, n, kind, steps, lr, batch_size, seed, progress):
    """Window-distill `start` (default the teacher itself) toward the teacher's full-context
    outputs on seqs; (student, info) or (None, None) when steps is 0."""
    from runtime.construct.train import TrainConfig, distill_windows, loss_ends

    if not steps:
        return None, None
    if steps < 0:
        raise ValueError(f"distill_steps must be >= 0, got {steps}")
    seqs = [s for s in seqs if len(s) <= teacher.config.max_len]
    cfg = TrainConfig(lr=lr, epochs=max(1, -(-steps * batch_size // len(seqs))), max_steps=steps,
                      batch_size=batch_size, seed=seed, progress=progress)
    student, log = distill_windows(teacher, seqs, n, kind, cfg, student=start)
    return student, {"steps": len(log), "lr": lr, **loss_ends(log)}


def _domain_encoders(store, source, seqs, mlm_steps, lr, distill_steps, distill_lr, batch_size, seed, progress):
    """(teacher, student, info): the source version's full-context layers further pre-trained
    (MLM) on the domain, then - with distill_steps - window-distilled toward that teacher,
    starting from the source's own window-distilled layers if it has them (they are already
    used to windows, so a few hundred steps suffice). student is None without distillation:
    the teacher values the branch itself."""
    teacher, mlm = _mlm(context_encoder(store, source), seqs, mlm_steps, lr, batch_size, seed, progress)
    start = version_encoder(store, source) if is_distilled(store, source) else None
    student, distill = _distill(teacher, start, seqs, store.meta["n"], store.meta["window"], distill_steps, distill_lr,
                                batch_size, seed, progress)
    return teacher, student, {"mlm": mlm, "distill": distill}


def _decoder_store(store_path) -> bool:
    with hkstore.open(store_path) as store:
        return is_decoder_store(store.meta)


def domain_create(store_path, name, corpus_paths, *, parent: str = "root", alpha: float = 50, mlm_steps: int = 100,
                  lr: float = 5e-5, distill_steps: int = 0, distill_lr: float = 1e-4, batch_size: int = 16,
                  max_len: int = 128, corpus_format=None, seed: int = 0, progress: bool = True) -> dict:
    """A domain version under `parent`: the parent's full-context lower layers further
    pre-trained (MLM) on the domain corpus, optionally window-distilled toward themselves
    (distill_steps), then a branch of the corpus's top-alpha% n-grams valued by them. On a
    decoder store: runtime.construct.decoder_domain (mlm_steps are causal LM steps)."""
    if _decoder_store(store_path):
        from runtime.construct.decoder_domain import decoder_domain_create

        return decoder_domain_create(store_path, name, corpus_paths, parent=parent, alpha=alpha, lm_steps=mlm_steps,
                                     lr=lr, distill_steps=distill_steps, distill_lr=distill_lr,
                                     batch_size=batch_size, max_len=max_len, corpus_format=corpus_format, seed=seed,
                                     progress=progress)
    t0 = time.perf_counter()
    if not 0 <= alpha <= 100:
        raise ValueError(f"alpha must be a percentage between 0 and 100, got {alpha}")
    # Train without the writer lock (minutes), then take it to publish; the checks run again under it.
    with hkstore.open(store_path) as store:
        new_version_checks(store, name, parent)
        docs = read_corpora(corpus_paths, corpus_format)
        seqs = tokenize_corpus(base_encoder(store), docs, max_len)
        teacher, student, trained = _domain_encoders(store, parent, seqs, mlm_steps, lr, distill_steps, distill_lr,
                                                     batch_size, seed, progress)
    info = {"corpus": [os.path.abspath(p) for p in _as_list(corpus_paths)], "documents": len(docs),
            "max_len": max_len, **trained, "trained_from": parent}
    with _open_writable(store_path) as store:
        new_version_checks(store, name, parent)
        out = branch_from(store, name, parent, teacher, student, seqs, alpha, info)
        return {"store": os.fspath(store_path), "version": name, "parent": parent, **out,
                "seconds": round(time.perf_counter() - t0, 3)}


def domain_update(store_path, name, new_name, corpus_paths, *, alpha: float | None = None, mlm_steps: int = 100,
                  lr: float = 5e-5, distill_steps: int | None = None, distill_lr: float = 1e-4, batch_size: int = 16,
                  max_len: int | None = None, include_old: bool = True, corpus_format=None, seed: int = 0,
                  progress: bool = True) -> dict:
    """A new version `new_name` (a sibling: child of `name`'s parent) from `name`'s saved
    full-context lower weights further pre-trained on the new corpus and, like `name` unless
    distill_steps says otherwise, window-distilled; its n-grams are the top-alpha% (default:
    `name`'s alpha) of the old corpus (include_old) plus the new one. On a decoder store:
    runtime.construct.decoder_domain (mlm_steps are causal LM steps)."""
    if _decoder_store(store_path):
        from runtime.construct.decoder_domain import decoder_domain_update

        return decoder_domain_update(store_path, name, new_name, corpus_paths, alpha=alpha, lm_steps=mlm_steps,
                                     lr=lr, distill_steps=distill_steps, distill_lr=distill_lr,
                                     batch_size=batch_size, max_len=max_len, include_old=include_old,
                                     corpus_format=corpus_format, seed=seed, progress=progress)
    t0 = time.perf_counter()
    with hkstore.open(store_path) as store:
        parent, alpha, max_len, old_paths, distill_steps = update_plan(store, name, new_name, alpha, max_len,
                                                                       include_old, distill_steps)
        docs = read_corpora(corpus_paths, corpus_format)
        base = base_encoder(store)
        seqs = tokenize_corpus(base, docs, max_len)
        old_seqs = tokenize_corpus(base, read_corpora(old_paths, corpus_format), max_len) if old_paths else []
        teacher, student, trained = _domain_encoders(store, name, seqs, mlm_steps, lr, distill_steps, distill_lr,
                                                     batch_size, seed, progress)
    new_paths = [os.path.abspath(p) for p in _as_list(corpus_paths)]
    info = {"corpus": old_paths + [p for p in new_paths if p not in old_paths], "documents": len(docs),
            "max_len": max_len, **trained, "trained_from": name, "updates": name}
    with _open_writable(store_path) as store:
        new_version_checks(store, new_name, parent)
        out = branch_from(store, new_name, parent, teacher, student, old_seqs + seqs, alpha, info)
        return {"store": os.fspath(store_path), "version": new_name, "parent": parent, "from": name, **out,
                "seconds": round(time.perf_counter() - t0, 3)}


def domain_grow(store_path, name, corpus_paths, *, max_len: int | None = None, corpus_format=None) -> dict:
    """Add to version `name` the windows of a corpus (e.g. a log of the text tenants were asked
    about) that it serves only by backing off, valued by the version's own lower layers
    (runtime.construct.grow). The corpus is tokenized as construction does (max_len: the version's);
    a decoder store's windows are causal and valued as its construction values them."""
    from runtime.construct.grow import grow

    t0 = time.perf_counter()
    docs = read_corpora(corpus_paths, corpus_format)
    with _open_writable(store_path) as store:
        snap = store.snapshot()
        info = snap.versions[snap.version_index(name)]["info"]
        max_len = max_len or info.get("max_len", 128)
        if is_decoder_store(store.meta):  # causal windows, valued by the version's decoder layers
            from runtime.construct.decoder_store import tokenize_decoder_corpus
            from runtime.model.stored import base_decoder
            from runtime.plot.causal import KeyValuer

            base = base_decoder(store)
            seqs = tokenize_decoder_corpus(base, docs, max_len)
            out = grow(store, name, seqs, encoder=KeyValuer(version_encoder(store, name, base)))
        else:
            out = grow(store, name, seqs=tokenize_corpus(base_encoder(store), docs, max_len))
        return {"store": os.fspath(store_path), "documents": len(docs), **out,
                "seconds": round(time.perf_counter() - t0, 3)}


UNSEEN_VIEWS = 5  # draws of backed-off inputs per training run: enough variety, bounded memory


def _train_cfg(pet_type, lr, epochs, batch_size, seed, progress):
    """The PLOT-level PET's TrainConfig: its recipe (runtime.construct.recipe) with overrides."""
    return recipes.settings(pet_type, "plot", lr=lr, epochs=epochs, batch_size=batch_size, seed=seed,
                            progress=progress)[1]


def _fit_pet(store, encoder, pet, version, ids, targets, cfg, unseen: float = 0.0):
    """Train pet on version's inputs of ids. unseen > 0: as served to text outside the version's
    corpus (runtime.plot.unseen), a fresh draw of backoffs for each of up to UNSEEN_VIEWS epochs
    (the same number of steps: views x examples for epochs / views epochs)."""
    import dataclasses

    from runtime.construct.train import train_pet
    from runtime.plot.retrieve import retrieve_list

    snap = store.snapshot()
    if not unseen:
        return train_pet(encoder, pet, retrieve_list(snap, version, ids), targets, cfg)
    views = min(cfg.epochs, UNSEEN_VIEWS)
    rng = np.random.default_rng(cfg.seed)
    inputs = [x for _ in range(views) for x in retrieve_list(snap, version, ids, unseen=unseen, rng=rng)]
    cfg = dataclasses.replace(cfg, epochs=max(1, round(cfg.epochs / views)))
    return train_pet(encoder, pet, inputs, list(targets) * views, cfg)


def _record(tenant, store, version, exported, extra) -> PetRecord:
    meta = dict(exported.meta)
    meta.update({k: v for k, v in extra.items() if k not in ("tenant", "base_model", "version", "created")})
    meta.update(tenant=tenant, base_model=store.meta["base_model"], version=version, created=time.time())
    tensors = {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in exported.tensors.items()}
    return PetRecord(tenant=tenant, meta=meta, tensors=tensors)


class Trained(NamedTuple):
    """A tenant's newly trained records (its PET first, then its full-depth PET when trained)
    and what the summary reports about them."""
    records: list
    logs: dict  # level -> losses
    examples: int
    seconds: dict  # level -> training seconds


def _summary(trained: Trained, t0, sizes: dict) -> dict:
    """sizes: level -> the record's bytes in the PET pack, as `hkstore pack ls` reports them;
    seconds per level on the threads torch used (the machine's cores unless OMP_NUM_THREADS
    says otherwise)."""
    import torch

    from runtime.construct.train import loss_ends

    record, log = trained.records[0], trained.logs["plot"]
    out = {"tenant": record.tenant, "version": record.meta["version"], "pet_type": record.meta["pet_type"],
           "task": record.meta["task"], "labels": record.meta["labels"], "levels": list(trained.seconds),
           "examples": trained.examples, "steps": len(log), **loss_ends(log), "pet_bytes": int(sizes["plot"]),
           "level_seconds": trained.seconds, "threads": torch.get_num_threads(),
           "precision": _precisions(trained.records),
           "seconds": round(time.perf_counter() - t0, 3)}
    if stall := record.meta.get("train", {}).get("stalled"):
        out["stalled"] = stall  # the first run never left its starting loss: retrained at half its rate
    if corpus := record.meta.get("train", {}).get("corpus"):
        out["corpus_examples"] = corpus["examples"]  # texts the full-depth level labeled for it
    if "full" in trained.logs:
        full = trained.records[1]
        out["full"] = {"pet_type": full.meta["pet_type"], "layers": full.meta["layers"],
                       "steps": len(trained.logs["full"]), **loss_ends(trained.logs["full"]),
                       "pet_bytes": int(sizes["full"])}
        if stall := full.meta["train"].get("stalled"):
            out["full"]["stalled"] = stall
    return out


def _precisions(records) -> dict:
    """Each level's recorded precision (plot: the PET record's, which the exact level shares),
    and the CPU seconds measuring them took."""
    out = {("full" if r.meta.get("level") == "full" else "plot"): r.meta.get("precision") for r in records}
    out["seconds"] = round(sum((r.meta.get("precision_check") or {}).get("seconds", 0.0) for r in records), 3)
    return out


def _sizes(store, tenant) -> dict:
    snap = store.snapshot()
    return {"plot": snap.pets[tenant]["length"], "full": snap.full.get(tenant, {}).get("length")}


def _put_levels(store, groups) -> None:
    """Store tenants' PETs, each followed by its full-depth PET (trained with it) when it has
    one, in one commit; a tenant stored without one loses any it had (trained with the PET
    replaced: a full-depth tombstone, FORMAT.md section 5)."""
    fulls = store.fulls()
    records = []
    for pet, *full in groups:
        records += [pet, *full]
        if not full and pet.tenant in fulls:
            records.append(PetRecord(tenant=pet.tenant, meta={"deleted": time.time(), "level": "full"}, tensors={},
                                     tombstone=True))
    store.put_pets(records)


def check_levels(levels) -> tuple[str, ...]:
    """The levels asked for (a list, or a comma-separated string), in order; "plot" is always
    trained (every other level names it)."""
    if isinstance(levels, str):
        levels = [x.strip() for x in levels.split(",") if x.strip()]
    levels = tuple(dict.fromkeys(levels))
    if unknown := [x for x in levels if x not in recipes.LEVELS]:
        raise ValueError(f"unknown level {unknown[0]!r}; expected plot or plot,full")
    if "plot" not in levels:
        raise ValueError("levels must include plot: the full-depth PET is trained beside the tenant's PET")
    return levels


def tenant_create(store_path, tenant, *, version, train_path, task: str = "classification",
                  pet_type: str = recipes.PLOT_PET_TYPE,
                  epochs: int | None = None, max_examples: int | None = None, lr: float | None = None,
                  batch_size: int | None = None, max_len: int = 128, bottleneck: int | None = None,
                  rank: int | None = None, density: float | None = None, norms: tuple[str, ...] | None = None,
                  seed: int = 0, replace: bool = False, unseen: float | None = None, calibration_share: float = 0.0,
                  levels=recipes.LEVELS, corpus_paths=(), max_corpus: int = recipes.MAX_CORPUS,
                  precision: str = "auto", progress: bool = True) -> dict:
    """Fine-tune a PET + head on the upper layers with inputs served by PLOT `version`
    (runtime.plot.retrieve, the serving path) and store it as `tenant`'s PET; with level "full"
    also a full-depth PET on the same examples (runtime.construct.full), stored beside it.
    Training settings left None are the PET type's recipe (runtime.construct.recipe); epochs and
    batch_size apply to every level, lr and the PET's shape (bottleneck, rank, density, norms:
    create_pet's) to the PLOT-level PET only. unseen: train on inputs as the version serves
    text outside its corpus (each backoff step taken with this probability,
    runtime.plot.unseen; None: the PET type's recipe); 0 trains on the windows as served. calibration_share > 0: that share
    of the examples is held out of training, fits the tenant's level temperatures
    (runtime.construct.calibration; the meta's ``calibration``) and scores each level. A run of
    either level that never leaves its starting loss (runtime.construct.train.stalled) is trained
    once more at half the rate under the next seed; ``stalled`` in the summary (``full.stalled``
    for the full-depth level) and in the record's ``train`` keeps the first run's rate, seed and
    losses. corpus_paths: unlabeled text of the tenant's domain (needs level "full", which is then
    trained first): at most max_corpus of its texts, labeled by the full-depth level, train the
    PLOT-level PET beside the labeled examples (runtime.construct.pseudo; the record's
    ``train.corpus``). precision: what each level serves at (runtime.construct.precision): auto
    measures it, fp32 or bf16 is recorded as asked (bf16 only on a CPU with native bf16)."""
    t0 = time.perf_counter()
    # Train on a read-only snapshot (no writer lock: tenants can be trained in parallel), then
    # take the lock only to append the records; the checks run again under it.
    with hkstore.open(store_path) as store:
        trained = _train_new(store, base_encoder(store), tenant, version=version, train_path=train_path, task=task,
                             pet_type=pet_type, epochs=epochs, max_examples=max_examples, lr=lr,
                             batch_size=batch_size, max_len=max_len, bottleneck=bottleneck, rank=rank,
                             density=density, norms=norms, seed=seed, replace=replace, unseen=unseen,
                             calibration_share=calibration_share, levels=levels, corpus_paths=corpus_paths,
                             max_corpus=max_corpus, precision=precision, progress=progress)
    with _open_writable(store_path) as store:
        _tenant_checks(store, tenant, version, replace)
        _put_levels(store, [trained.records])
        sizes = _sizes(store, tenant)
    return _summary(trained, t0, sizes)


def tenants_create(store_path, specs, *, levels=("plot",), progress: bool = True) -> list[dict]:
    """Several tenant_create calls in one pass: one snapshot and one loaded base model train
    them all, one commit stores their PETs (none if any fails), full-depth PETs follow. specs:
    tenant_create's keyword arguments per tenant (``tenant`` among them; not ``progress``);
    `levels` is each spec's default (PLOT-only: a pass of many tenants stays short)."""
    t0 = time.perf_counter()
    specs = [dict(s) for s in specs]
    if len({s["tenant"] for s in specs}) != len(specs):
        raise ValueError("tenants_create: a tenant is named twice")
    trained = []
    with hkstore.open(store_path) as store:
        encoder = base_encoder(store)
        for spec in specs:
            t1 = time.perf_counter()
            trained.append((spec, _train_new(store, encoder, progress=progress, **{"levels": levels, **spec}),
                            time.perf_counter() - t1))
    with _open_writable(store_path) as store:
        for spec, *_ in trained:
            _tenant_checks(store, spec["tenant"], spec["version"], spec.get("replace", False))
        _put_levels(store, [t.records for _, t, _ in trained])
        sizes = {spec["tenant"]: _sizes(store, spec["tenant"]) for spec, *_ in trained}
    out = [dict(_summary(t, 0, sizes[spec["tenant"]]), seconds=round(dt, 3)) for spec, t, dt in trained]
    return [dict(o, pass_seconds=round(time.perf_counter() - t0, 3)) for o in out]


def _train_new(store, encoder, tenant, *, version, train_path, task="classification", pet_type=recipes.PLOT_PET_TYPE,
               epochs=None,
               max_examples=None, lr=None, batch_size=None, max_len=128, bottleneck=None, rank=None, density=None,
               norms=None, seed=0, replace=False, unseen=None, calibration_share=0.0, levels=recipes.LEVELS,
               corpus_paths=(), max_corpus=recipes.MAX_CORPUS, held_out_path=None, precision="auto",
               progress=True) -> Trained:
    """A new tenant's records trained on store's snapshot (not stored). held_out_path: labeled
    examples kept out of training (the train file's format) that calibrate and score the levels
    as a calibration share would, for a caller that made its own split (hkstore demo)."""
    from runtime.construct import full as fulllib
    from runtime.construct.train import unstalled
    from runtime.model import pet as petlib

    t0 = time.perf_counter()
    levels = check_levels(levels)
    check_precision(precision)  # before minutes of training
    hkstore.store.check_name("tenant", tenant)
    if pet_type not in petlib.PET_TYPES:
        raise ValueError(f"unknown PET type {pet_type!r}; expected one of {', '.join(petlib.PET_TYPES)}")
    if corpus_paths and "full" not in levels:
        raise ManagerError("--corpus teaches the PLOT level with the full-depth level's answers: add level full")
    _tenant_checks(store, tenant, version, replace)
    unseen = recipes.recipe(pet_type, "plot").unseen if unseen is None else unseen
    data, labels = read_task(train_path, task)
    pick = _subsample(len(data[0]), max_examples, seed)
    ids, targets = encode_task(encoder, data, task, labels, max_len, pick)
    ids, targets, held = _hold_out(ids, targets, calibration_share, seed)
    if held_out_path is not None:
        if held:
            raise ValueError("give a calibration share or a held-out file, not both")
        held = encode_task(encoder, read_task(held_out_path, task)[0], task, labels, max_len)
    options, cfg = recipes.settings(pet_type, "plot", lr=lr, epochs=epochs, batch_size=batch_size,
                                    bottleneck=bottleneck, rank=rank, density=density, norms=norms, seed=seed,
                                    progress=progress)
    seconds, full, taught = {}, None, ([], [])

    def fit_full():
        t1 = time.perf_counter()
        out = fulllib.fit_full_level(store, task, labels, ids, targets, epochs=epochs, batch_size=batch_size,
                                     seed=seed, progress=progress)
        seconds["full"] = round(time.perf_counter() - t1, 3)
        return out

    if corpus_paths:  # the top first: it labels the corpus the PLOT level also learns from
        from runtime.construct.pseudo import pseudo_examples

        full = fit_full()
        texts = data[0] if task == "classification" else [" ".join(words) for words in data[0]]
        docs = _unlabeled(read_corpora(list(corpus_paths)), texts, max_corpus, seed)
        taught = pseudo_examples(encoder, full.whole, full.pet, docs, task, labels, max_len)

    def fit(c):
        pet = petlib.create_pet(encoder, pet_type, task, labels, seed=c.seed, **options)
        return _fit_pet(store, encoder, pet, version, ids + taught[0], targets + taught[1], c, unseen)

    t1 = time.perf_counter()
    exported, log, cfg, stall = unstalled(fit, cfg)
    extra = {"train": {"path": os.path.abspath(train_path), "examples": len(ids), "epochs": cfg.epochs, "lr": cfg.lr,
                       "max_len": max_len, "unseen": unseen, "loss_last": log[-1], "updates": 0}}
    if corpus_paths:
        extra["train"]["corpus"] = {"paths": [os.path.abspath(p) for p in corpus_paths], "examples": len(taught[0])}
    if stall:
        extra["train"]["stalled"] = stall
    if held:
        # the PET as stored and served: a diff or mask PET trains dense and is cut at export
        extra["calibration"] = _calibration(store, encoder, version, exported, held, calibration_share, 0)
    record = _record(tenant, store, version, exported, extra)
    plot_seconds = round(time.perf_counter() - t1, 3)
    if full is None and "full" in levels:
        full = fit_full()
    trained = Trained([record], {"plot": log}, len(ids), {"plot": plot_seconds, **seconds})
    if full is not None:
        trained.records.append(fulllib.full_level_record(record, full, ids, held))
        trained.logs["full"] = full.log
    _mark_precision(store, encoder, trained.records, held, (ids, targets), precision, seed)
    return trained


def _mark_precision(store, encoder, records, held, training, asked, seed) -> None:
    """Each record's precision (runtime.construct.precision), measured on the held-out
    examples, else on a sample of the training ones (an agreement check between fp32 and bf16
    more than a score: a tenant created without a held-out share is measured too)."""
    from runtime.construct import precision

    ids, targets = held if held else precision.training_sample(*training, seed=seed)
    precision.mark(store.snapshot(), encoder, records, ids, targets, asked, "held-out" if held else "training")


def _unlabeled(docs, labeled, limit, seed) -> list[str]:
    """At most limit of docs (a seeded sample), none empty and none equal to a labeled text
    (whitespace aside): those have their labels."""
    skip = {" ".join(text.split()) for text in labeled}
    docs = [d for d in docs if (plain := " ".join(d.split())) and plain not in skip]
    return [docs[i] for i in _subsample(len(docs), limit, seed)]


def _hold_out(ids, targets, share, seed):
    """(training ids, targets, held-out (ids, targets) or None) for a calibration share."""
    if not share:
        return ids, targets, None
    from runtime.construct.calibration import holdout

    train, held = holdout(len(ids), share, seed)
    return ([ids[i] for i in train], [targets[i] for i in train],
            ([ids[i] for i in held], [targets[i] for i in held]))


def _calibration(store, encoder, version, pet, held, share, updates):
    """The PET's calibration record (runtime.construct.calibration), tied to its training round."""
    from runtime.construct.calibration import calibrate_pet

    return dict(calibrate_pet(store, encoder, version, pet, *held, share=share), updates=updates)


def _tenant_checks(store, tenant, version, replace):
    snap = store.snapshot()
    snap.version_index(version)  # UnknownVersion
    if tenant in snap.pets and not replace:
        raise ManagerError(f"tenant {tenant!r} already exists; use tenant update, or remove it first")


def load_tenant(store, tenant, encoder):
    """(stored meta, runtime.model.pet.Pet) of a tenant's live PET, checked against the encoder."""
    from runtime.model.pet import load_pet, pet_meta

    record = store.get_pet(tenant)
    try:
        return record.meta, load_pet(encoder, record.tensors, pet_meta(record.meta))
    except ValueError as e:
        raise ManagerError(f"tenant {tenant!r}: stored PET does not fit the model ({e})") from None


def tenant_update(store_path, tenant, *, train_path=None, version=None, epochs: int = 1,
                  max_examples: int | None = None, lr: float | None = None, batch_size: int | None = None,
                  max_len: int | None = None, seed: int = 0, precision: str | None = None,
                  progress: bool = True) -> dict:
    """Continue fine-tuning a tenant's stored PET (on new data, else its original training
    file), optionally on another PLOT version; the labels of the data must be the head's. A
    tenant with a full-depth PET has it trained further on the same examples and stored with
    the new PET, so no level is served from an older round (lr applies to the PET only). Each
    level's precision is chosen again as tenant_create chooses it (precision None: as the
    tenant's was asked at its last round)."""
    t0 = time.perf_counter()
    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.pets:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        if precision is None:
            precision = (snap.read_pet(tenant).meta.get("precision_check") or {}).get("asked", "auto")
        check_precision(precision)
        started_from = (dict(snap.pets[tenant]), dict(snap.full.get(tenant) or {}))
        trained, examples = _update_plot(store, tenant, train_path=train_path, version=version, epochs=epochs,
                                         max_examples=max_examples, lr=lr, batch_size=batch_size, max_len=max_len,
                                         seed=seed, progress=progress)
        if started_from[1]:
            _update_full(store, trained, examples, epochs=epochs, batch_size=batch_size, seed=seed, progress=progress)
        _mark_precision(store, base_encoder(store), trained.records, examples[2], examples[:2], precision, seed)
    record = trained.records[0]
    with _open_writable(store_path) as store:
        snap = store.snapshot()
        if (dict(snap.pets.get(tenant) or {}), dict(snap.full.get(tenant) or {})) != started_from:
            raise ManagerError(f"tenant {tenant!r} was changed or removed while this update trained; run it again")
        snap.version_index(record.meta["version"])
        _put_levels(store, [trained.records])
        sizes = _sizes(store, tenant)
        stale = tenant in store.snapshot().students  # distilled from the PET just replaced (FORMAT.md section 5)
    out = _summary(trained, t0, sizes)
    if stale:
        out["students"] = f"stale: the teacher serves until hkstore students create {store_path} {tenant}"
    return out


def _update_plot(store, tenant, *, train_path, version, epochs, max_examples, lr, batch_size, max_len, seed,
                 progress):
    """(Trained: the tenant's PET trained further, (ids, targets, held-out (ids, targets) or
    None) it trained on)."""
    t0 = time.perf_counter()
    encoder = base_encoder(store)
    meta, pet = load_tenant(store, tenant, encoder)
    version = version or meta["version"]
    store.snapshot().version_index(version)
    train = dict(meta.get("train") or {})
    train_path = train_path or train.get("path")
    if not train_path:
        raise ManagerError(f"tenant {tenant!r} records no training file; pass one")
    task, labels = meta["task"], list(meta["labels"])
    data, found = read_task(train_path, task)
    if unknown := sorted(set(found) - set(labels)):
        raise ManagerError(f"{train_path}: labels {unknown} do not match tenant {tenant!r}'s head "
                           f"(its labels: {labels}); create a new tenant for a new label set")
    max_len = max_len or train.get("max_len", 128)
    pick = _subsample(len(data[0]), max_examples, seed)
    ids, targets = encode_task(encoder, data, task, labels, max_len, pick)
    share = (meta.get("calibration") or {}).get("share") or 0.0  # a calibrated tenant is refitted alike
    ids, targets, held = _hold_out(ids, targets, share, seed)
    cfg = _train_cfg(meta["pet_type"], lr or train.get("lr"), epochs, batch_size, seed, progress)
    from runtime.construct.train import trainable

    model = trainable(encoder, pet)
    exported, log = _fit_pet(store, encoder, model, version, ids, targets, cfg, train.get("unseen", 0.0))
    train.update(path=os.path.abspath(train_path), examples=len(ids), epochs=epochs, lr=cfg.lr, max_len=max_len,
                 loss_last=log[-1], updates=int(train.get("updates", 0)) + 1)
    extra = {k: v for k, v in meta.items() if k not in exported.meta and k not in ("tenant", "version", "created")}
    extra["train"] = train
    extra.pop("calibration", None)
    if held:
        extra["calibration"] = _calibration(store, encoder, version, exported, held, share, train["updates"])
    record = _record(tenant, store, version, exported, extra)
    trained = Trained([record], {"plot": log}, len(ids), {"plot": round(time.perf_counter() - t0, 3)})
    return trained, (ids, targets, held)


def _update_full(store, trained: Trained, examples, *, epochs, batch_size, seed, progress) -> None:
    """Train the tenant's stored full-depth PET further on the examples its PET was updated
    on; appended to trained."""
    from runtime.construct.full import update_full_level

    t0 = time.perf_counter()
    record = trained.records[0]
    ids, targets, held_out = examples
    full, log = update_full_level(store, record, store.get_full(record.tenant), ids, targets, held_out,
                                  epochs=epochs, batch_size=batch_size, seed=seed, progress=progress)
    trained.records.append(full)
    trained.logs["full"] = log
    trained.seconds["full"] = round(time.perf_counter() - t0, 3)


def tenant_rm(store_path, tenant) -> dict:
    """Remove a tenant: its PET, students and full-depth PET (one tombstone, FORMAT.md)."""
    with _open_writable(store_path) as store:
        store.delete_pet(tenant)
    return {"tenant": tenant, "removed": True}


def encode_eval(encoder, data, task: str, label_names: list[str], max_len: int):
    """encode_task for scoring: a classification label the head lacks becomes target -1
    (never predicted, so counted wrong); a tag the head lacks is scored as O."""
    x, y = data
    if task == "classification":
        index = {name: j for j, name in enumerate(label_names)}
        return encoder.tokenize(x, max_len), [index.get(label, -1) for label in y]
    return encode_task(encoder, (x, [[t if t in label_names else "O" for t in ts] for ts in y]), task, label_names,
                       max_len)


def tenant_eval(store_path, tenant, test_path, *, max_examples: int | None = None, max_len: int | None = None,
                batch_size: int = 64, seed: int = 0, version: str | None = None) -> dict:
    """Score a tenant on a labeled file through the serving path (retrieve + upper + PET):
    accuracy for classification, entity-level F1 for tagging. `version` serves the PLOT inputs
    from another version than the tenant's (e.g. a grown child of it)."""
    import torch

    from runtime.construct.data import accuracy, entity_f1, word_tags
    from runtime.model.pet import head
    from runtime.plot.retrieve import retrieve

    store = hkstore.open(store_path)
    try:
        encoder = base_encoder(store)
        meta, pet = load_tenant(store, tenant, encoder)
        version = version or meta["version"]
        store.snapshot().version_index(version)  # UnknownVersion before any work
        task, labels = meta["task"], list(meta["labels"])
        data, _ = read_task(test_path, task)
        max_len = max_len or (meta.get("train") or {}).get("max_len", 128)
        pick = _subsample(len(data[0]), max_examples, seed)
        x = [data[0][i] for i in pick]
        y = [data[1][i] for i in pick]
        ids, targets = encode_eval(encoder, (x, y), task, labels, max_len)
        predicted = []
        with torch.no_grad():
            for start in range(0, len(ids), batch_size):
                inputs, mask, _ = retrieve(store.snapshot(), version, ids[start:start + batch_size])
                logits = head(pet, encoder.upper(inputs, mask, pet))
                predicted += logits.argmax(-1).tolist()
        if task == "classification":
            score = accuracy(targets, predicted)
            metric = "accuracy"
        else:
            pred_tags = [word_tags(p, t, labels, len(words)) for p, t, words in zip(predicted, targets, x)]
            score = entity_f1([[t if t in labels else "O" for t in ts] for ts in y], pred_tags)
            metric = "entity_f1"
        return {"tenant": tenant, "version": version, "metric": metric, "score": score, "examples": len(ids)}
    finally:
        store.close()


def tenant_precision(store_path, tenant, dev_path, target: float | None = None) -> dict:
    """Each current level of a tenant whose precision was asked auto measured again on a
    labelled dev file (a better sample than the held-out share; runtime.construct.precision,
    target None: its default), its records rewritten in one commit (content and created
    unchanged, so nothing that names them goes stale). Returns level -> {"precision",
    "precision_check"} of every level measured."""
    from runtime.construct import precision
    from runtime.construct.full import is_stale

    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        if tenant not in snap.pets:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        pet = snap.read_pet(tenant)
        records = [pet]
        if tenant in snap.full and not is_stale(snap.read_full(tenant).meta, pet.meta):
            records.append(snap.read_full(tenant))
        records = [r for r in records if (r.meta.get("precision_check") or {}).get("asked", "auto") == "auto"]
        if records:
            encoder = base_encoder(store)
            task, labels = pet.meta["task"], list(pet.meta["labels"])
            max_len = (pet.meta.get("train") or {}).get("max_len", 128)
            ids, targets = encode_eval(encoder, read_task(dev_path, task)[0], task, labels, max_len)
            precision.mark(snap, encoder, records, ids, targets, "auto", "dev",
                           precision.TARGET if target is None else target)
    if not records:
        return {}
    with _open_writable(store_path) as store:
        snap = store.snapshot()
        now = [snap.read_pet(tenant).meta.get("created") if tenant in snap.pets else None,
               snap.read_full(tenant).meta.get("created") if tenant in snap.full else None]
        if any(r.meta.get("created") not in now for r in records):
            raise ManagerError(f"tenant {tenant!r} was changed while its precision was measured; run it again")
        store.put_pets(records)
    return {("full" if r.meta.get("level") == "full" else "plot"):
            {"precision": r.meta["precision"], "precision_check": r.meta["precision_check"]} for r in records}


def status(store_path) -> dict:
    """Versions (with their info) and tenants of a store, for --json listings."""
    store = hkstore.open(store_path)
    try:
        snap = store.snapshot()
        return {"versions": [{"name": v["name"], "parent": v["parent"], "segments": len(v["segments"]),
                              "info": v["info"]} for v in snap.versions],
                "tenants": {t: dict(loc) for t, loc in snap.pets.items()}}
    finally:
        store.close()


__all__ = ["ManagerError", "build", "domain_create", "domain_grow", "domain_update", "tenant_create", "tenants_create", "tenant_update",
           "tenant_rm", "tenant_ls", "tenant_info",
           "tenant_eval", "tenant_precision", "check_precision", "version_encoder", "base_encoder", "status"]
