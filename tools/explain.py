"""Where each token's knowledge comes from: the window, the version and order that served it,
and how far its PLOT input is from what the full encoder would compute.

    rows = explain("STORE", "biology", "the cell divides")
    rows[1] == {"position": 1, "token": "the", "id": 1996, "window": [101, 1996, 3526],
                "window_tokens": ["[CLS]", "the", "cell"], "version": "biology", "order": 3,
                "own_order": 3, "backoff": 0, "cosine_distance": 0.03, "reference": "base", ...}

The PLOT input is runtime.plot.retrieve's (the serving path: one batched lookup of the
sequence's windows, then the normalized aggregation). The reference is Encoder.lower on the
whole sequence (full context), with:
  * reference="base" (default): the base model named by the store's meta["model_path"] (the
    embedded model if none). This is what the upper layers were trained on, and the target
    window distillation trains a distilled root towards (runtime.construct.train.distill_windows), so the
    distance is the error the upper layers see.
  * reference="version": the lower weights that produced `version`'s own values, by
    runtime.construct.manager's convention: the nearest version on its ancestry whose info names
    "lower_weights" (STORE/models/<version>.safetensors: a domain's MLM-trained layers, or a
    distilled root), else the base model. The distance is then the windowing error alone for
    tokens served by those weights.
Encoders load lazily on first use and are cached per model / weights file.
"""

from __future__ import annotations

import os

import numpy as np

import hkstore
from formats.backoff import key_order
from runtime.model.stored import is_decoder_store
from runtime.serving import MAX_TEXT_CHARS, unicode_problem
from tools.report import cosine_distance

REFERENCES = ("base", "version")
_ENCODERS = {}


def _base_encoder(store):
    from runtime.model import stored

    meta = store.meta
    model_path = meta.get("model_path") or stored.default_model_path()
    key = (os.path.abspath(model_path), meta["lower_layers"], meta.get("tokenizer_fingerprint"))
    if key not in _ENCODERS:
        _ENCODERS[key] = stored.base_encoder(store)  # loads and checks it matches the store
    return _ENCODERS[key]


def _reference_encoder(store, version, reference, base):
    """(encoder, label) for the full-context reference."""
    if reference == "base":
        return base, "base"
    from runtime.model import stored

    snap = store.snapshot()
    for v in snap.ancestry(version):
        entry = snap.versions[v]["info"].get("lower_weights")
        if entry:
            path = os.path.join(store.path, entry["file"])
            key = (os.path.abspath(path), entry.get("xxh64"), id(base))
            if key not in _ENCODERS:
                _ENCODERS[key] = stored.load_lower(store.path, entry, base)
            return _ENCODERS[key], f"version:{snap.version_names[v]}"
    return base, "base"


def explain(store_path, version, text, *, reference="base", max_len=None) -> list[dict]:
    """One row per token of `text` (tokenized by the store's model, [CLS] ... [SEP], cut to
    max_len ids, default the model's max positions). See the module doc for the fields'
    meaning; raises StoreError / UnknownVersion / ValueError with a one-line message."""
    import torch

    from runtime.plot.retrieve import retrieve

    if reference not in REFERENCES:
        raise ValueError(f"unknown reference {reference!r}; expected one of {', '.join(REFERENCES)}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("nothing to explain: empty text")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"the text has {len(text):,} characters, more than {MAX_TEXT_CHARS:,} (the limit per text)")
    if bad := unicode_problem(text):
        raise ValueError(f"the text is not valid UTF-8 ({bad})")
    store = hkstore.open(store_path)
    try:
        snap = store.snapshot()
        meta = snap.meta
        if is_decoder_store(meta):
            raise ValueError(f"{store_path} is a decoder store: explain compares an encoder's lower layers in "
                             "full context with their PLOT inputs, so it is for encoder stores (hkstore generate "
                             "serves a decoder store)")
        vi = snap.version_index(version)
        base = _base_encoder(store)
        ids = base.tokenize([text], 1 << 30)[0]
        limit = max_len or base.config.max_len
        if len(ids) > limit:
            if max_len is None:  # never cut silently
                raise ValueError(f"the text has {len(ids)} tokens, more than the model's {limit} positions; "
                                 "shorten it, or pass max_len (--max-len) to cut it")
            ids = base.tokenize([text], max_len)[0]
        inputs, _, served = retrieve(snap, snap.version_names[vi], [ids])
        ref, label = _reference_encoder(store, vi, reference, base)
        with torch.no_grad():
            full = ref.lower(*ref.pad([ids]))[0]
        plot_in = inputs[0, :len(ids)].numpy()
        dist = cosine_distance(plot_in, full.numpy())
        tok = base.tokenizer
        wins = served.windows[0, :len(ids)]
        own = key_order(wins, meta["window"], meta["pad_id"])
        rows = []
        for i, t in enumerate(ids):
            v = int(served.version[0, i])
            order = int(served.order[0, i])
            rows.append({
                "position": i, "token": tok.id_to_token(t) or str(t), "id": int(t),
                "window": [int(x) for x in wins[i]],
                "window_tokens": ["_" if int(x) == meta["pad_id"] else (tok.id_to_token(int(x)) or str(int(x)))
                                  for x in wins[i]],
                "version": served.version_names[v] if order > 0 and v >= 0 else None,
                "version_index": v if order > 0 else None, "order": order, "own_order": int(own[i]),
                "backoff": int(own[i]) - order if order > 0 else None,
                "cosine_distance": float(dist[i]),
                "plot_norm": float(np.linalg.norm(plot_in[i])), "full_norm": float(full[i].norm()),
                "reference": label,
            })
        return rows
    finally:
        store.close()


__all__ = ["REFERENCES", "explain"]
