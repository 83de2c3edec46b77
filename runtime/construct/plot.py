"""PLOT construction (HMI §3.4, FORMAT.md §4): the root, domain branches and position tables.

    keys, counts = ngram_counts(seqs, n, kind, pad_id)        # distinct windows of a corpus
    stats = build_root(store, encoder, seqs)                  # the root PLOT, resumable
    meta = build_branch(store, "biology", "root", domain_encoder, seqs, alpha=50)

Values are served by runtime.plot.retrieve.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from formats.backoff import backoff, key_order, left
from formats.xxh64 import checksum
from hkstore.branch import create_branch
from hkstore.errors import StoreError
from runtime.model.stored import check_encoder, lower_fingerprint
from runtime.plot.retrieve import retrieve
from runtime.plot.window import corpus_windows, window_values

BUILD_INFO = "build"  # the root's version-info field recording a (possibly unfinished) build




def _void(keys: np.ndarray) -> np.ndarray:
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    return keys.view(np.dtype((np.void, 4 * keys.shape[1]))).ravel()


def unique_keys(keys: np.ndarray, return_counts: bool = False):
    """Distinct rows of keys (m, n) in lexicographic (numeric) order; with their counts."""
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    n = keys.shape[1]
    if not len(keys):
        out = keys.reshape(0, n)
        return (out, np.zeros(0, dtype=np.int64)) if return_counts else out
    # Unique on a byte view (fast), then a numeric lexicographic sort of the (fewer) distinct rows.
    _, first, counts = np.unique(_void(keys), return_index=True, return_counts=True)
    distinct = keys[first]
    order = np.lexsort(distinct.T[::-1])
    distinct = np.ascontiguousarray(distinct[order])
    return (distinct, counts[order].astype(np.int64)) if return_counts else distinct


def ngram_counts(seqs, n: int, kind: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct windows of every window of every sequence (edge windows included) and how
    often each occurs: (keys (k, n) uint32 in lexicographic order, counts (k,) int64)."""
    wins, _ = corpus_windows(seqs, n, kind, pad_id)
    return unique_keys(wins, return_counts=True)


def backoff_closure(keys: np.ndarray, kind: str, pad_id: int) -> np.ndarray:
    """keys plus every key on their backoff chains (distinct, lexicographic order)."""
    keys = unique_keys(keys)
    found = [keys]
    current = keys
    while len(current):
        current = current[key_order(current, kind, pad_id) > 1]
        if not len(current):
            break
        current = unique_keys(backoff(current, kind, pad_id))
        found.append(current)
    return unique_keys(np.concatenate(found)) if len(found) > 1 else keys


def unigrams(vocab_size: int, n: int, kind: str, pad_id: int) -> np.ndarray:
    """The uni-gram [pad .. t .. pad] of every vocabulary id t."""
    keys = np.full((vocab_size, n), pad_id, dtype=np.uint32)
    keys[:, left(n, kind)] = np.arange(vocab_size, dtype=np.uint32)
    return keys


def compute_values(encoder, keys: np.ndarray, batch_size: int = 2048) -> np.ndarray:
    """PLOT values (m, n, d) float16 of keys under torch.no_grad."""
    with torch.no_grad():
        return window_values(encoder, keys, batch_size).numpy().astype(np.float16)


def root_keys(seqs, n: int, kind: str, pad_id: int, vocab_size: int) -> tuple[np.ndarray, dict]:
    """Every key the root holds: the corpus windows, their backoff chains and every uni-gram."""
    wins, _ = corpus_windows(seqs, n, kind, pad_id)
    distinct = unique_keys(wins)
    closed = backoff_closure(distinct, kind, pad_id)
    keys = unique_keys(np.concatenate([closed, unigrams(vocab_size, n, kind, pad_id)]))
    stats = {"corpus_windows": int(len(wins)), "distinct_windows": int(len(distinct)),
             "backoff_keys": int(len(closed) - len(distinct)), "keys": int(len(keys))}
    return keys, stats


def build_root(store, encoder, seqs, *, chunk: int = 50_000, batch_size: int = 2048, progress: bool = True,
               on_chunk=None, version: str | None = None, info: dict | None = None) -> dict:
    """Fill the root PLOT from a corpus of token id lists (see module doc); returns stats.

    Keys are sorted, cut into chunks of `chunk` keys, and each chunk becomes one segment of the
    root. After each segment the root's version info records it (field "build"), so a rerun
    with the same corpus, model and chunk size skips finished chunks; a rerun with anything
    else on a partly or fully built root is refused. on_chunk(index, chunks) is called after
    each chunk is durable (tests use it to interrupt a build).
    """
    meta = store.meta
    version = version or store.snapshot().version_names[0]
    n, kind, pad_id = meta["n"], meta["window"], meta["pad_id"]
    check_encoder(meta, encoder)
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if not len(seqs) or not sum(len(s) for s in seqs):
        raise ValueError("empty corpus: no token sequences to build the root from")
    t0 = time.perf_counter()
    keys, stats = root_keys(seqs, n, kind, pad_id, meta.get("vocab_size") or encoder.config.vocab_size)
    fingerprint = f"{checksum(keys.tobytes()):016x}-{lower_fingerprint(encoder)}-{chunk}"
    chunks = -(-len(keys) // chunk)
    snap = store.snapshot()
    vinfo = snap.versions[snap.version_index(version)]
    record = dict(vinfo["info"].get(BUILD_INFO) or {})
    if record.get("fingerprint") != fingerprint:
        if vinfo["segments"]:
            raise StoreError(f"version {version!r} already holds segments from another corpus or model; "
                             "build into a new store")
        record = {"fingerprint": fingerprint, "chunk": chunk, "chunks": chunks, "keys": int(len(keys)),
                  "done": {}, "complete": False, **stats}
        store.set_version_info(version, **{BUILD_INFO: record}, **(info or {}))
    done = {int(k): v for k, v in record["done"].items()}
    # A segment added just before a crash, whose "done" record never committed: adopt it if
    # it holds exactly the next chunk's keys.
    recorded = set(done.values())
    for name, segment in zip(vinfo["segments"], snap.version_segments(version)):
        if name in recorded:
            continue
        seg_keys = np.asarray(segment.keys)
        for i in range(chunks):
            if i not in done and np.array_equal(seg_keys, keys[i * chunk:(i + 1) * chunk]):
                done[i] = name
                break
    skipped = len(done)
    todo_keys = sum(min(chunk, len(keys) - i * chunk) for i in range(chunks) if i not in done)
    computed = 0
    t1 = time.perf_counter()
    from tqdm import tqdm

    with tqdm(total=todo_keys, desc=f"PLOT {version}", unit="win", unit_scale=True, disable=not progress) as bar:
        for i in range(chunks):
            if i in done:
                continue
            part = keys[i * chunk:(i + 1) * chunk]
            name = store.add_segment(version, part, compute_values(encoder, part, batch_size))
            done[i] = name
            record["done"] = {str(k): v for k, v in sorted(done.items())}
            record["complete"] = len(done) == chunks
            store.set_version_info(version, **{BUILD_INFO: record})
            computed += len(part)
            bar.update(len(part))
            if on_chunk is not None:
                on_chunk(i, chunks)
    if not record.get("complete"):
        record["complete"] = True
        store.set_version_info(version, **{BUILD_INFO: record})
    seconds = time.perf_counter() - t0
    compute_s = time.perf_counter() - t1
    return dict(stats, chunks=chunks, chunks_skipped=skipped, keys_computed=computed, seconds=round(seconds, 3),
                windows_per_s=round(computed / compute_s, 1) if computed and compute_s > 0 else None)


def build_branch(store, name, parent, encoder, seqs, alpha, info=None, *, batch_size: int = 2048) -> dict:
    """Version `name` under `parent`: the most frequent n-grams of the domain corpus `seqs`
    covering `alpha`% of its windows (HMI §5.1), valued by the domain encoder's lower layers."""
    meta = store.meta
    check_encoder(meta, encoder)
    if not len(seqs) or not sum(len(s) for s in seqs):
        raise ValueError(f"empty corpus: no token sequences to build branch {name!r} from")
    keys, counts = ngram_counts(seqs, meta["n"], meta["window"], meta["pad_id"])
    t0 = time.perf_counter()
    out = create_branch(store, name, parent, keys, counts, alpha,
                        lambda kept: compute_values(encoder, kept, batch_size), info)
    return dict(out, seconds=round(time.perf_counter() - t0, 3))


def fit_position(store, version, reference, seqs, *, max_seqs: int = 4096, batch_size: int = 128,
                 min_count: int = 8, seed: int = 0) -> dict:
    """Fit and store `version`'s position table (FORMAT.md section 4). Why: a window's value is
    computed at local positions 0..n-1, so the aggregate carries no absolute position, which
    the upper layers of a BERT expect (its embeddings add one).

    Row i becomes the table in force now (own or inherited) plus the mean, over the corpus
    sequences that reach position i, of reference.lower's full-context output at i minus what
    retrieve() serves there now: the least-squares per-position correction. Rows seen fewer
    than min(min_count, sequences) times repeat the last row seen enough. At most max_seqs
    sequences (a seeded sample) are used. Returns {rows, sequences, cosine_before, cosine_after}: the mean
    per-token cosine of served inputs to full-context outputs, on up to 512 of them.
    """
    seqs = [s for s in seqs if 0 < len(s) <= reference.config.max_len]
    if not seqs:
        raise ValueError(f"empty corpus: no token sequences to fit the position table of {version!r}")
    if len(seqs) > max_seqs:
        pick = np.random.default_rng(seed).choice(len(seqs), size=max_seqs, replace=False)
        seqs = [seqs[i] for i in sorted(pick.tolist())]
    rows, d = reference.config.max_len, store.meta["d"]
    total, count = torch.zeros(rows, d, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64)
    before = store.snapshot()
    # Batches of similar lengths (little padding); the targets of the first 512 sequences are
    # kept for the cosines below.
    by_length = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))
    targets = {}
    with torch.no_grad():
        for picked in _chunks(by_length, batch_size):
            batch = [seqs[j] for j in picked]
            served, mask, _ = retrieve(before, version, batch)
            full = reference.lower(*reference.pad(batch))
            residual = (full - served) * mask[..., None]
            total[:served.shape[1]] += residual.sum(0).double()
            count[:served.shape[1]] += mask.sum(0).double()
            for b, j in enumerate(picked):
                if j < 512:
                    targets[j] = full[b, :len(seqs[j])]
    seen = count >= min(min_count, len(seqs))
    mean = (total / count.clamp(min=1)[:, None]).float()
    last_seen = torch.cummax(torch.where(seen, torch.arange(rows), 0), 0).values
    table = mean[last_seen].numpy()
    current = before.position(version)
    if current is not None:
        table[:min(rows, len(current))] += current[:rows]
    store.set_position(version, table)
    after = store.snapshot()
    cosines = {"before": [], "after": []}
    with torch.no_grad():
        for start in range(0, min(len(seqs), 512), batch_size):
            batch = seqs[start:start + batch_size]
            for key, snap in (("before", before), ("after", after)):
                served, mask, _ = retrieve(snap, version, batch)
                target = torch.zeros_like(served)
                for b in range(len(batch)):
                    target[b, :len(batch[b])] = targets[start + b]
                cosines[key].append(F.cosine_similarity(served, target, dim=-1)[mask])
    return {"rows": rows, "sequences": len(seqs),
            **{f"cosine_{k}": round(torch.cat(v).mean().item(), 4) for k, v in cosines.items()}}


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
