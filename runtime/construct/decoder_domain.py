"""Domain versions of a decoder store (hGPT): `hkstore domain create/update` on a decoder store.

    decoder_domain_create(store_path, "bio", ["bio.txt"], parent="root", alpha=50, lm_steps=100)
    decoder_domain_update(store_path, "bio", "bio2", ["more.txt"])

As for encoder stores (runtime.construct.manager.domain_create / domain_update), with the decoder's
rules: the parent's full-context lower layers are further pre-trained on the domain corpus with
the causal LM loss (the encoder's MLM), optionally window-distilled toward themselves
(runtime.construct.decoder_distill), and the branch keeps the corpus's most frequent causal windows
covering alpha% of it (HMI §5.1), valued by those layers at each window's real tokens
(runtime.plot.causal); a window it lacks falls back to the parent's. Last its position table is
fitted toward the further pre-trained layers' full-context outputs.

The loss runs through the base decoder's frozen upper layers and LM head: those serve every
version and every tenant, so the lower layers learn to feed them (a GPT-2's tied word
embeddings train as part of the lower layers; the head keeps the base's).
"""

from __future__ import annotations

import copy
import os
import time

import hkstore
from runtime.construct.branch import branch_from, new_version_checks, update_plan
from runtime.construct.data import read_corpora
from runtime.model.stored import (
    base_decoder,
    context_encoder,
    is_distilled,
    version_encoder,
)
from runtime.plot.causal import KeyValuer


def train_lower_lm(start, base, seqs: list[list[int]], cfg):
    """(a copy of start with its lower layers trained by next-token cross-entropy through base's
    frozen upper layers and LM head, losses)."""
    import torch.nn.functional as F

    from runtime.construct.train import _fit

    seqs = [s for s in seqs if 1 < len(s) <= base.config.max_len]
    base.requires_grad_(False)
    student = copy.deepcopy(start).requires_grad_(False)

    def loss_of(batch):
        ids, mask = student.pad([seqs[j] for j in batch])
        logits = base.logits(base.upper(student.lower(ids, mask), mask))[:, :-1]
        targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    lower = [p.requires_grad_(True) for p in student.lower_parameters()]
    log = _fit(lower, len(seqs), loss_of, cfg, "causal lm (lower layers)")
    return student.requires_grad_(False).eval(), log


def _train_cfg(steps, n_seqs, lr, batch_size, seed, progress):
    from runtime.construct.train import TrainConfig

    return TrainConfig(lr=lr, epochs=max(1, -(-steps * batch_size // max(1, n_seqs))), max_steps=steps,
                       batch_size=batch_size, seed=seed, progress=progress)


def _domain_decoders(store, source, base, seqs, lm_steps, lr, distill_steps, distill_lr, batch_size, seed,
                     progress):
    """(teacher, student, info): source's full-context lower layers further pre-trained (causal
    LM) on the domain, then - with distill_steps - window-distilled toward that teacher,
    starting from source's own distilled layers if it has them. student is None without
    distillation: the teacher values the branch itself."""
    from runtime.construct.decoder_distill import distill_causal_windows
    from runtime.construct.train import loss_ends

    if lm_steps < 0 or distill_steps < 0:
        raise ValueError("the training steps must be >= 0")
    teacher, lm = context_encoder(store, source, base), None
    if lm_steps:
        teacher, log = train_lower_lm(teacher, base, seqs, _train_cfg(lm_steps, len(seqs), lr, batch_size, seed,
                                                                      progress))
        lm = {"steps": len(log), "lr": lr, **loss_ends(log), "loss": "causal lm"}
    student, distill = None, None
    if distill_steps:
        start = version_encoder(store, source, base) if is_distilled(store, source) else None
        student, log = distill_causal_windows(teacher, seqs, store.meta["n"],
                                              _train_cfg(distill_steps, len(seqs), distill_lr, batch_size, seed,
                                                         progress), student=start)
        distill = {"steps": len(log), "lr": distill_lr, **loss_ends(log)}
    # (the info key stays "mlm", as encoder versions name their further pre-training)
    return teacher, student, {"mlm": lm, "distill": distill}


def _paths(paths):
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def _corpus(decoder, paths, corpus_format, max_len):
    from runtime.construct.decoder_store import tokenize_decoder_corpus

    docs = read_corpora(paths, corpus_format)
    return docs, tokenize_decoder_corpus(decoder, docs, max_len)


def _publish(store_path, new, parent, teacher, student, seqs, alpha, info):
    with hkstore.open(store_path, writable=True) as store:
        new_version_checks(store, new, parent)
        return branch_from(store, new, parent, KeyValuer(teacher),
                            KeyValuer(student) if student is not None else None, seqs, alpha, info)


def decoder_domain_create(store_path, name, corpus_paths, *, parent: str = "root", alpha: float = 50,
                          lm_steps: int = 100, lr: float = 5e-5, distill_steps: int = 0, distill_lr: float = 1e-4,
                          batch_size: int = 16, max_len: int = 128, corpus_format=None, seed: int = 0,
                          progress: bool = True) -> dict:
    """A domain version `name` under `parent` of a decoder store (see the module doc)."""
    t0 = time.perf_counter()
    if not 0 <= alpha <= 100:
        raise ValueError(f"alpha must be a percentage between 0 and 100, got {alpha}")
    with hkstore.open(store_path) as store:  # train without the writer lock; checks again under it
        new_version_checks(store, name, parent)
        base = base_decoder(store)
        docs, seqs = _corpus(base, corpus_paths, corpus_format, max_len)
        teacher, student, trained = _domain_decoders(store, parent, base, seqs, lm_steps, lr, distill_steps,
                                                     distill_lr, batch_size, seed, progress)
    info = {"corpus": [os.path.abspath(p) for p in _paths(corpus_paths)], "documents": len(docs),
            "max_len": max_len, **trained, "trained_from": parent}
    out = _publish(store_path, name, parent, teacher, student, seqs, alpha, info)
    return {"store": os.fspath(store_path), "version": name, "parent": parent, "architecture": "decoder", **out,
            "seconds": round(time.perf_counter() - t0, 3)}


def decoder_domain_update(store_path, name, new_name, corpus_paths, *, alpha: float | None = None,
                          lm_steps: int = 100, lr: float = 5e-5, distill_steps: int | None = None,
                          distill_lr: float = 1e-4, batch_size: int = 16, max_len: int | None = None,
                          include_old: bool = True, corpus_format=None, seed: int = 0, progress: bool = True) -> dict:
    """A sibling `new_name` of domain version `name`: name's layers trained on further on the new
    corpus, its windows the top-alpha% of the old corpus (include_old) and the new one."""
    t0 = time.perf_counter()
    with hkstore.open(store_path) as store:
        parent, alpha, max_len, old_paths, distill_steps = update_plan(store, name, new_name, alpha, max_len,
                                                                       include_old, distill_steps)
        base = base_decoder(store)
        docs, seqs = _corpus(base, corpus_paths, corpus_format, max_len)
        old_seqs = _corpus(base, old_paths, corpus_format, max_len)[1] if old_paths else []
        teacher, student, trained = _domain_decoders(store, name, base, seqs, lm_steps, lr, distill_steps,
                                                     distill_lr, batch_size, seed, progress)
    new_paths = [os.path.abspath(p) for p in _paths(corpus_paths)]
    info = {"corpus": old_paths + [p for p in new_paths if p not in old_paths], "documents": len(docs),
            "max_len": max_len, **trained, "trained_from": name, "updates": name}
    out = _publish(store_path, new_name, parent, teacher, student, old_seqs + seqs, alpha, info)
    return {"store": os.fspath(store_path), "version": new_name, "parent": parent, "from": name,
            "architecture": "decoder", **out, "seconds": round(time.perf_counter() - t0, 3)}
