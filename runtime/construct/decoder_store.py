"""Construction of decoder stores (hGPT): the root causal PLOT of a decoder checkpoint.

    build_decoder(store_path, model_path=DIR, corpus_paths=[...], n=3, lower_layers=2)
    dec = base_decoder(store)                  # the store's decoder, checked against its meta

Same construction code as encoder stores (runtime.construct.plot.build_root: resumable chunks,
backoff closure, every uni-gram; fit_position), with a decoder's lower layers valuing causal
windows (runtime.plot.causal). The store's meta records architecture "decoder" (its window
kind is always causal); the root's info records the checkpoint's model_type with the corpus.
"""

from __future__ import annotations

import os
import time

import hkstore
from runtime.model.stored import ManagerError, base_decoder, load_decoder_model  # noqa: F401 - re-exported


def tokenize_decoder_corpus(decoder, docs: list[str], max_len: int) -> list[list[int]]:
    """Token ids of documents (with the tokenizer's BOS), each cut into pieces of at most max_len."""
    if max_len < 2:
        raise ValueError(f"max_len={max_len} is too small (at least 2)")
    out = []
    for ids in decoder.tokenize(docs, max_len=1 << 30):
        out += [ids[s:s + max_len] for s in range(0, len(ids), max_len)]
    return [s for s in out if s]


def build_decoder(store_path, *, model_path, corpus_paths, n: int = 3, lower_layers: int = 2, dtype: str = "fp16",
                  max_len: int | None = None, chunk: int = 50_000, batch_size: int = 2048, corpus_format=None,
                  position: bool = True, distill_steps: int = 0, distill_lr: float = 1e-4, distill_batch: int = 16,
                  seed: int = 0, progress: bool = True, on_chunk=None) -> dict:
    """Create the decoder store (or resume an unfinished build of it) and fill its root
    causal PLOT from the corpus; with position, fit the root's position table last (the
    decoder's learned absolute positions are what a window's local positions lose). With
    distill_steps > 0 the lower layers are first window-distilled (runtime.construct.decoder_distill)
    and saved in STORE/models/root.safetensors; the position table's target stays the original
    decoder's full-context output."""
    from runtime.construct import plot
    from runtime.construct.data import read_corpora
    from runtime.model.decoder_config import decoder_meta
    from runtime.plot.causal import KeyValuer

    t0 = time.perf_counter()
    model_path = os.path.abspath(os.fspath(model_path))
    try:
        meta = decoder_meta(model_path)
    except ValueError as e:
        raise ManagerError(str(e)) from None
    if not 0 <= lower_layers <= meta["num_layers"]:
        raise ManagerError(f"--lower-layers {lower_layers} is outside 0..{meta['num_layers']}: the model has "
                           f"{meta['num_layers']} layers")
    docs = read_corpora(corpus_paths, corpus_format)
    dec = load_decoder_model(model_path, lower_layers)
    max_len = max_len or dec.config.max_len
    seqs = tokenize_decoder_corpus(dec, docs, max_len)
    wanted = {"n": n, "window": "causal", "lower_layers": lower_layers, "dtype": dtype, "d": meta["d"],
              "vocab_size": meta["vocab_size"], "tokenizer_fingerprint": meta["tokenizer_fingerprint"],
              "architecture": "decoder"}
    if os.path.exists(os.path.join(store_path, "CURRENT")):
        store = hkstore.open(store_path, writable=True)
        differs = [k for k, v in wanted.items() if store.meta.get(k) != v]
        if differs:
            store.close()
            raise ManagerError(f"{store_path}: a store with other settings exists here ({', '.join(differs)} differ)")
        resumed = True
    else:
        store = hkstore.create(store_path, d=meta["d"], vocab_size=meta["vocab_size"], n=n, window="causal",
                               lower_layers=lower_layers, dtype=dtype, pad_id=meta["pad_id"],
                               base_model=meta["base_model"], tokenizer_fingerprint=meta["tokenizer_fingerprint"],
                               model_path=model_path, num_layers=meta["num_layers"], architecture="decoder")
        resumed = False
    try:
        root = store.snapshot().version_names[0]
        corpus = {"corpus": [os.path.abspath(p) for p in ([corpus_paths] if isinstance(corpus_paths, (str, os.PathLike))
                                                            else corpus_paths)],
                  "documents": len(docs), "sequences": len(seqs), "max_len": max_len, "model_type": meta["model_type"]}
        valuer, distill = dec, None
        if distill_steps:
            from runtime.model.stored import load_lower, save_lower

            info = store.snapshot().versions[0]["info"]
            previous = info.get("distill")
            if previous and previous.get("steps") == distill_steps and info.get("lower_weights"):
                valuer, distill = load_lower(store.path, info["lower_weights"], dec), previous
            else:
                from runtime.construct.decoder_distill import distill_causal_windows
                from runtime.construct.train import TrainConfig, loss_ends

                cfg = TrainConfig(lr=distill_lr, epochs=max(1, -(-distill_steps * distill_batch // len(seqs))),
                                  max_steps=distill_steps, batch_size=distill_batch, seed=seed, progress=progress)
                valuer, log = distill_causal_windows(dec, seqs, n, cfg)
                distill = {"steps": len(log), "lr": distill_lr, **loss_ends(log)}
                store.set_version_info(root, lower_weights=save_lower(store.path, root, valuer), distill=distill)
        stats = plot.build_root(store, KeyValuer(valuer), seqs, chunk=chunk, batch_size=batch_size, progress=progress,
                                on_chunk=on_chunk, info=corpus)
        fitted = store.snapshot().versions[0]["info"].get("position")
        if position and not store.snapshot().versions[0].get("position"):
            fitted = plot.fit_position(store, root, dec, seqs, seed=seed)
            store.set_version_info(root, position=fitted)
        return {"store": os.fspath(store_path), "version": root, "architecture": "decoder", "window": "causal",
                "resumed": resumed, "distill": distill, **corpus, **stats, "position": fitted,
                "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        store.close()
