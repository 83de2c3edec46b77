"""PLOT construction and the one retrieval path (HMI §3.4, FORMAT.md §4).

    keys, counts = ngram_counts(seqs, n, kind, pad_id)        # distinct windows of a corpus
    stats = build_root(store, encoder, seqs)                  # the root PLOT, resumable
    meta = build_branch(store, "biology", "root", domain_encoder, seqs, alpha=50)
    inputs, mask, served = retrieve(snapshot, "biology", seqs)  # upper-layer inputs

`retrieve` is what training (runtime/manager.py) and serving call alike, so a PET is trained
on exactly the inputs it will be served with: the windows of every sequence, one batched
lookup for the whole batch, then the normalized aggregation of runtime.window plus the
version's position table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from formats.backoff import backoff, key_order, left
from formats.xxh64 import checksum
from hkstore.branch import create_branch
from hkstore.errors import StoreError
from runtime.window import aggregate_batch, offsets, window_values
from runtime.window import windows as seq_windows

BUILD_INFO = "build"  # the root's version-info field recording a (possibly unfinished) build


# -- windows and n-gram counts -----------------------------------------------------------


def corpus_windows(seqs, n: int, kind: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows (sum of lengths, n) uint32, lengths (B,) int64) of every sequence, in order.

    Vectorized: runtime.window.windows over the concatenation of the sequences with runs of
    pad_id between them long enough that no window reaches across, keeping the rows of real
    positions. Identical to concatenating windows(seq) per sequence.
    """
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    if not len(seqs) or not lengths.sum():
        return np.zeros((0, n), dtype=np.uint32), lengths
    off = offsets(n, kind)
    gap = int(max(-off.min(), off.max(), 0))
    parts, keep = [], []
    pad_run = np.full(gap, pad_id, dtype=np.int64)
    for s in seqs:
        parts.append(np.asarray(s, dtype=np.int64).reshape(-1))
        keep.append(np.ones(len(parts[-1]), dtype=bool))
        parts.append(pad_run)
        keep.append(np.zeros(gap, dtype=bool))
    flat = np.concatenate(parts)
    if len(flat) and (flat.min() < 0 or flat.max() >= 2**32):
        raise ValueError("token ids must fit in uint32")
    return seq_windows(flat, n, kind, pad_id)[np.concatenate(keep)], lengths


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


# -- retrieval: the single path of training and serving -------------------------------------


@dataclass
class Served:
    """Per-window provenance of a retrieve() batch, right-padded like the inputs."""

    windows: np.ndarray  # (B, L, n) uint32: the window around each position (pad rows past length)
    version: np.ndarray  # (B, L) int16: served version index, -1 past a sequence's end (and on a miss)
    order: np.ndarray  # (B, L) int8: order of the served key, 0 past the end (and on a miss)
    lengths: np.ndarray  # (B,) int64
    version_names: list = field(default_factory=list)

    def summary(self) -> dict:
        """Counts of served windows per version name and per order (for analysts)."""
        real = np.arange(self.version.shape[1])[None, :] < self.lengths[:, None]
        v, o = self.version[real], self.order[real]
        return {
            "windows": int(real.sum()),
            "by_version": {self.version_names[i] if i >= 0 else "miss": int((v == i).sum()) for i in np.unique(v)},
            "by_order": {int(k): int((o == k).sum()) for k in np.unique(o)},
        }


def retrieve(snapshot, version, seqs) -> tuple[torch.Tensor, torch.Tensor, Served]:
    """Upper-layer inputs of token id sequences served by PLOT `version` of `snapshot` (a
    hkstore Snapshot or Store): (inputs float32 (B, L, d), mask bool (B, L), served).

    Windows of every sequence, ONE lookup for the whole batch, then runtime.window's
    normalized aggregation plus the version's position table (snapshot.position); positions
    past a sequence's length are zero and masked out.
    """
    meta = snapshot.meta
    n, kind, pad_id, d = meta["n"], meta["window"], meta["pad_id"], meta["d"]
    if not len(seqs):
        raise ValueError("retrieve needs at least one sequence")
    wins, lengths = corpus_windows(seqs, n, kind, pad_id)
    vocab = meta.get("vocab_size")
    if vocab and len(wins) and int(wins.max()) >= vocab:
        raise ValueError(f"token id {int(wins.max())} is outside the store's vocabulary of {vocab}")
    result = snapshot.lookup(version, wins)
    B, L = len(seqs), int(lengths.max())
    real = np.arange(L)[None, :] < lengths[:, None]
    values = np.zeros((B, L, n, d), dtype=np.float32)
    values[real] = result.values
    inputs = aggregate_batch(torch.from_numpy(values), torch.from_numpy(lengths), n, kind)
    add_position(inputs, real, snapshot.position(version))
    served_windows = np.full((B, L, n), pad_id, dtype=np.uint32)
    served_windows[real] = wins
    served_version = np.full((B, L), -1, dtype=np.int16)
    served_version[real] = result.version
    served_order = np.zeros((B, L), dtype=np.int8)
    served_order[real] = result.order
    served = Served(served_windows, served_version, served_order, lengths, list(result.version_names))
    return inputs, torch.from_numpy(real), served


def add_position(inputs: torch.Tensor, real: np.ndarray, table) -> None:
    """Add a version's position table (FORMAT.md section 4) to aggregated inputs (B, L, d) in
    place, at real positions only; rows past the table's end add nothing."""
    if table is None:
        return
    rows = min(inputs.shape[1], len(table))
    inputs[:, :rows] += torch.from_numpy(np.array(table[:rows])) * torch.from_numpy(real[:, :rows, None])


def retrieve_list(snapshot, version, seqs, batch_size: int = 256) -> list[torch.Tensor]:
    """retrieve() in batches, returned as one (length, d) tensor per sequence: the
    precomputed-inputs form runtime.train's loops take. Rows are exactly retrieve()'s."""
    out = []
    for start in range(0, len(seqs), batch_size):
        batch = seqs[start:start + batch_size]
        inputs, _, served = retrieve(snapshot, version, batch)
        out += [inputs[b, :length].clone() for b, length in enumerate(served.lengths.tolist())]
    return out


# -- building PLOT tables -------------------------------------------------------------------


def check_encoder(meta: dict, encoder) -> None:
    """Refuse an encoder whose shape or vocabulary differs from the store's."""
    c = encoder.config
    problems = []
    if c.d != meta["d"]:
        problems.append(f"width {c.d} != store d {meta['d']}")
    if meta.get("vocab_size") and c.vocab_size != meta["vocab_size"]:
        problems.append(f"vocabulary {c.vocab_size} != store vocab_size {meta['vocab_size']}")
    if c.pad_id != meta["pad_id"]:
        problems.append(f"pad id {c.pad_id} != store pad_id {meta['pad_id']}")
    if encoder.lower_layers != meta["lower_layers"]:
        problems.append(f"lower_layers {encoder.lower_layers} != store lower_layers {meta['lower_layers']}")
    fp = meta.get("tokenizer_fingerprint")
    if fp and fp != encoder.tokenizer_fingerprint():
        problems.append("its tokenizer differs from the store's (tokenizer fingerprint mismatch)")
    if problems:
        raise StoreError("the model does not match the store: " + "; ".join(problems))


def lower_fingerprint(encoder) -> str:
    """XXH64 (hex) over the lower layers' weights: which function a table's values come from."""
    h = 0
    for p in encoder.lower_parameters():
        h = checksum(p.detach().contiguous().float().numpy().tobytes()) ^ ((h * 0x9E3779B97F4A7C15) & (2**64 - 1))
    return f"{h:016x}"


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
    with torch.no_grad():
        for batch in _chunks(seqs, batch_size):
            served, mask, _ = retrieve(before, version, batch)
            residual = (reference.lower(*reference.pad(batch)) - served) * mask[..., None]
            total[:served.shape[1]] += residual.sum(0).double()
            count[:served.shape[1]] += mask.sum(0).double()
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
        for batch in _chunks(seqs[:512], batch_size):
            target = reference.lower(*reference.pad(batch))
            for key, snap in (("before", before), ("after", after)):
                served, mask, _ = retrieve(snap, version, batch)
                cosines[key].append(F.cosine_similarity(served, target, dim=-1)[mask])
    return {"rows": rows, "sequences": len(seqs),
            **{f"cosine_{k}": round(torch.cat(v).mean().item(), 4) for k, v in cosines.items()}}


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
