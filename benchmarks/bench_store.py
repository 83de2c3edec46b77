"""Benchmark the hkstore PLOT store against the layouts it replaces, on one machine in one run.

Measures, and prints as markdown tables (machine first):
  1. lookup throughput (batches of 4096 centered tri-gram windows, 90% Zipf hits, 10% misses that
     back off) for hkstore, the SkipBERT layout (dict + memmap), LMDB, SQLite and two np.take
     ceilings from an in-memory copy of the values: the same rows the lookups serve, and as many
     uniformly random rows (the issue's ceiling), for fp16 and int8 stores;
  2. the index at scale (10M entries, small d): hkstore against both ceilings;
  3. open time against store size, in fresh processes, against SkipBERT's dict rebuild;
  4. bytes per entry, and int8's cosine to fp16 on BERT-like vectors;
  5. compaction throughput and space reclaimed.

Usage: python benchmarks/bench_store.py [--quick] [--entries N] [--d D] [--out DIR]
Everything it builds lives in a temporary directory under /tmp (or --tmp) that is removed at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import hkstore  # noqa: E402
from formats import accel  # noqa: E402
from formats.segment import Segment, quantize_int8  # noqa: E402

VOCAB = 30522
CEIL_SAME = "ceiling np.take (fp16, in memory)"  # the rows the lookups serve
CEIL_UNIFORM = "ceiling np.take uniform rows (fp16, in memory)"  # as many uniformly random rows
PAD = 0
N = 3
BATCH = 4096
HIT_FRACTION = 0.9
ZIPF_S = 1.1
BIGRAM_FRACTION = 0.10  # share of a store's entries that are [a, b, pad] bi-grams
POOL = 65536  # distinct BERT-like vectors the values are drawn from
Z4 = b"\0\0\0\0"

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- machine ----------------------------------------------------------------------------------


def machine_info():
    cpu, cores = platform.processor() or platform.machine(), os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        if names:
            cpu, cores = names[0], len(names)
    except OSError:
        pass
    mem = {}
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                k, v = ln.split(":", 1)
                mem[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    import lmdb

    return {
        "cpu": cpu, "cores": cores, "ram_bytes": mem.get("MemTotal"), "mem_available_bytes": mem.get("MemAvailable"),
        "kernel": platform.release(), "python": platform.python_version(), "numpy": np.__version__,
        "lmdb": lmdb.__version__, "lmdb_lib": ".".join(map(str, lmdb.version())), "sqlite": sqlite3.sqlite_version,
    }


def mem_available():
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return None


def du(path):
    """Bytes a file or directory really occupies (sparse files count what is allocated)."""
    if os.path.isfile(path):
        st = os.stat(path)
        return min(st.st_size, st.st_blocks * 512) if st.st_blocks else st.st_size
    return sum(du(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def preread(paths):
    """Pull files into the OS page cache, so every system is timed from memory, not disk."""
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(dp, f) for dp, _, fs in os.walk(p) for f in fs]
        for fn in files:
            with open(fn, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


# -- data -------------------------------------------------------------------------------------


def pack(keys):
    """One int64 per (a, b, c) key, ids < 2**20."""
    k = np.asarray(keys, dtype=np.int64)
    return (k[:, 0] << 40) | (k[:, 1] << 20) | k[:, 2]


def sorted_unique(x):
    # np.unique on int64 takes a slow hash path in numpy >= 2.3; sorting is 50x faster here.
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if len(x) else x


def random_keys(rng, count, vocab, c_pad=False, exclude=None):
    """`count` distinct random keys with ids in 1..vocab-1 (slot 2 = pad if c_pad), none in `exclude`."""
    out = np.zeros((0,), dtype=np.int64)
    while len(out) < count:
        want = int((count - len(out)) * 1.2) + 64
        k = rng.integers(1, vocab, (want, N), dtype=np.int64)
        if c_pad:
            k[:, 2] = PAD
        p = sorted_unique(np.concatenate([out, pack(k)]))
        if exclude is not None and len(exclude):
            p = p[~contains(exclude, p)]
        out = p
    out = out[rng.permutation(len(out))[:count]]
    return np.stack([(out >> 40) & 0xFFFFF, (out >> 20) & 0xFFFFF, out & 0xFFFFF], axis=1).astype(np.uint32)


def contains(sorted_arr, q):
    if not len(sorted_arr):
        return np.zeros(len(q), dtype=bool)
    i = np.searchsorted(sorted_arr, q).clip(0, len(sorted_arr) - 1)
    return sorted_arr[i] == q


class KeySet:
    """The entries of a store: keys in entry order, and a numpy key -> entry number map."""

    def __init__(self, rng, count, vocab=VOCAB):
        self.vocab = vocab
        if count >= 2 * vocab:
            n_uni = vocab
            n_bi = int(count * BIGRAM_FRACTION)
        else:  # too small to hold the whole vocabulary: tri-grams only (open-time stores)
            n_uni = n_bi = 0
        n_tri = count - n_uni - n_bi
        uni = np.zeros((n_uni, N), dtype=np.uint32)
        uni[:, 1] = np.arange(n_uni)
        bi = random_keys(rng, n_bi, vocab, c_pad=True) if n_bi else np.zeros((0, N), np.uint32)
        tri = random_keys(rng, n_tri, vocab)
        self.keys = np.concatenate([uni, bi, tri])
        self.n_uni, self.n_bi, self.n_tri = n_uni, n_bi, n_tri
        self.tri_start = n_uni + n_bi
        packed = pack(self.keys)
        self.order = np.argsort(packed, kind="stable")
        self.sorted = packed[self.order]

    def rows_of(self, keys):
        """Entry number of each key, -1 where it is not stored."""
        q = pack(keys)
        i = np.searchsorted(self.sorted, q).clip(0, len(self.sorted) - 1)
        return np.where(self.sorted[i] == q, self.order[i], -1)

    def served_rows(self, windows):
        """The entry the backoff chain ([a,b,c] -> [a,b,pad] -> [pad,b,pad]) serves each window from."""
        w = np.array(windows, dtype=np.uint32)
        rows = self.rows_of(w)
        order = np.where(rows >= 0, 1 + (w[:, 0] != PAD) + (w[:, 2] != PAD), 0)
        for _ in range(2):
            todo = rows < 0
            if not todo.any():
                break
            w2 = w[todo]
            has_c = w2[:, 2] != PAD
            w2[has_c, 2] = PAD
            w2[~has_c, 0] = PAD
            w[todo] = w2
            r = self.rows_of(w2)
            rows[todo] = r
            order[todo] = np.where(r >= 0, 1 + (w2[:, 0] != PAD) + (w2[:, 2] != PAD), 0)
        return rows, order


def make_batches(rng, ks, n_batches, batch=BATCH):
    """Batches of windows: HIT_FRACTION Zipf(s=ZIPF_S) draws over the stored tri-grams, the rest
    stored-nowhere tri-grams whose backoff is a stored bi-gram (half) or only the uni-gram (half)."""
    total = n_batches * batch
    n_hit = int(round(batch * HIT_FRACTION)) * n_batches
    n_miss = total - n_hit
    ranks = np.arange(1, ks.n_tri + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -ZIPF_S)
    cdf /= cdf[-1]
    rank_to_key = rng.permutation(ks.n_tri)
    hits = ks.keys[ks.tri_start + rank_to_key[np.searchsorted(cdf, rng.random(n_hit)).clip(0, ks.n_tri - 1)]]
    tri_sorted = np.sort(pack(ks.keys[ks.tri_start:]))
    bi_sorted = np.sort(pack(ks.keys[ks.n_uni:ks.tri_start]))
    misses = []
    want_bi = n_miss // 2 if ks.n_bi else 0
    while sum(len(m) for m in misses) < want_bi:
        m = ks.keys[ks.n_uni + rng.integers(0, ks.n_bi, want_bi)].copy()
        m[:, 2] = rng.integers(1, ks.vocab, want_bi)
        misses.append(m[~contains(tri_sorted, pack(m))])
    misses = [np.concatenate(misses)[:want_bi]] if misses else []
    while sum(len(m) for m in misses) < n_miss:
        m = rng.integers(1, ks.vocab, (n_miss, N)).astype(np.uint32)
        mb = m.copy()
        mb[:, 2] = PAD
        misses.append(m[~contains(tri_sorted, pack(m)) & ~contains(bi_sorted, pack(mb))])
    misses = np.concatenate(misses)[:n_miss]
    per_hit, per_miss = n_hit // n_batches, n_miss // n_batches
    out = []
    miss_perm = rng.permutation(n_miss)
    for b in range(n_batches):
        w = np.concatenate([hits[b * per_hit:(b + 1) * per_hit], misses[miss_perm[b * per_miss:(b + 1) * per_miss]]])
        out.append(np.ascontiguousarray(w[rng.permutation(len(w))], dtype=np.uint32))
    return out


def model_params(d, seed=1234):
    """A fixed 'model': LayerNorm gain/bias with a few outlier dimensions, an anisotropy direction."""
    r = np.random.default_rng(seed)
    gamma = (1.0 + 0.1 * r.standard_normal(d)).astype(np.float32)
    beta = (0.05 * r.standard_normal(d)).astype(np.float32)
    n_out = max(1, d // 128)
    out = r.choice(d, n_out, replace=False)
    gamma[out] = r.uniform(6.0, 10.0, n_out) * r.choice([-1, 1], n_out)
    beta[out] = r.uniform(-4.0, 4.0, n_out)
    spread = np.exp(0.5 * r.standard_normal(d)).astype(np.float32)
    shared = (0.7 * r.standard_normal(d)).astype(np.float32)
    return gamma, beta, spread, shared, out


def bert_like(rng, m, d):
    """BERT-hidden-state-like vectors: anisotropic Gaussian pre-activations, LayerNorm'ed, with
    LayerNorm gain/bias that give d//128 (at least 1) outlier dimensions of magnitude ~5-15."""
    gamma, beta, spread, shared, _ = model_params(d)
    x = rng.standard_normal((m, d), dtype=np.float32) * spread + shared
    x = (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + 1e-12)
    return x * gamma + beta


def fill_values(out, keys, pool, salt=0, chunk=1 << 16):
    """out[i, j] = a pool vector picked by (i, j, salt), zeros in pad slots (FORMAT.md section 4)."""
    count = len(keys)
    P = len(pool)
    for s in range(0, count, chunk):
        e = min(count, s + chunk)
        idx = ((np.arange(s, e, dtype=np.int64)[:, None] * N + np.arange(N) + salt * 7919) * 2654435761) % P
        v = pool[idx]
        v[keys[s:e] == PAD] = 0
        out[s:e] = v
    return out


# -- the systems under test -------------------------------------------------------------------


class SkipBert:
    """SkipBERT's layout: a Python dict key tuple -> row, rebuilt at open, and a memmap of rows."""

    def __init__(self, directory):
        keys = np.load(os.path.join(directory, "keys.npy"))
        self.index = dict(zip(map(tuple, keys.tolist()), range(len(keys))))
        self.rows = np.load(os.path.join(directory, "rows.npy"), mmap_mode="r")
        sp = os.path.join(directory, "scales.npy")
        self.scales = np.load(sp, mmap_mode="r") if os.path.exists(sp) else None

    def resolve(self, windows):
        get = self.index.get
        rows = []
        append = rows.append
        for a, b, c in windows.tolist():
            r = get((a, b, c))
            if r is None and c:
                r = get((a, b, 0))
            if r is None and a:
                r = get((0, b, 0))
            append(r)
        return np.array(rows, dtype=np.int64)

    def lookup(self, windows):
        rows = self.resolve(windows)
        if self.scales is None:
            return np.take(self.rows, rows, axis=0)
        q = np.take(self.rows, rows, axis=0).astype(np.float32)
        q *= np.take(self.scales, rows, axis=0)[..., None]
        return q.astype(np.float16)


def write_skipbert(directory, keys, rows, scales=None, chunk=1 << 16):
    os.makedirs(directory, exist_ok=True)
    np.save(os.path.join(directory, "keys.npy"), np.ascontiguousarray(keys, dtype=np.uint32))
    out = np.lib.format.open_memmap(os.path.join(directory, "rows.npy"), mode="w+", dtype=rows.dtype, shape=rows.shape)
    for s in range(0, len(rows), chunk):
        out[s:s + chunk] = rows[s:s + chunk]
    out.flush()
    del out
    if scales is not None:
        np.save(os.path.join(directory, "scales.npy"), np.ascontiguousarray(scales))


def resolve_by_batches(keys, fetch) -> list:
    """The value of each key, backing off along next_key: fetch(keys) -> {key: value} for those
    it holds, asked once per backoff round for every key still unanswered."""
    out, cur, pending = [None] * len(keys), list(keys), list(range(len(keys)))
    while pending:
        found = fetch([cur[i] for i in pending])
        still = []
        for i in pending:
            v = found.get(cur[i])
            if v is None:
                still.append(i)
            else:
                out[i] = v
        for i in still:
            cur[i] = next_key(cur[i])
        pending = still
    return out


def next_key(k):
    """The next key of a centered n=3 backoff chain, on 12-byte little-endian keys; None at a uni-gram."""
    if k[8:12] != Z4:
        return k[:8] + Z4
    if k[0:4] != Z4:
        return Z4 + k[4:8] + Z4
    return None


def value_bytes(rows, scales, i):
    if scales is None:
        return rows[i].tobytes()
    return rows[i].tobytes() + scales[i].tobytes()


def decode_values(buf, m, d, int8):
    if not int8:
        return np.frombuffer(buf, dtype=np.float16).reshape(m, N, d)
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(m, N * d + 4 * N)
    q = raw[:, :N * d].view(np.int8).reshape(m, N, d).astype(np.float32)
    q *= np.ascontiguousarray(raw[:, N * d:]).view("<f4")[..., None]
    return q.astype(np.float16)


def key_bytes_sorted(keys):
    kb = np.ascontiguousarray(keys, dtype="<u4")
    order = np.argsort(kb.view(np.dtype((np.void, 4 * N))).ravel(), kind="stable")  # memcmp order
    raw = kb.tobytes()
    return raw, order


def build_lmdb(path, keys, rows, scales=None):
    import lmdb

    per = rows[0].nbytes + (scales[0].nbytes if scales is not None else 0)
    map_size = len(keys) * (-(-(per + 64) // 4096) * 4096 + 64) * 2 + (1 << 30)
    env = lmdb.open(path, map_size=map_size, subdir=True, sync=False, writemap=True, meminit=False, max_dbs=0)
    raw, order = key_bytes_sorted(keys)
    with env.begin(write=True) as txn:
        txn.cursor().putmulti(((raw[12 * i:12 * i + 12], value_bytes(rows, scales, i)) for i in order.tolist()),
                              append=True)
    env.sync(True)
    info, stat = env.info(), env.stat()
    env.close()
    return (info["last_pgno"] + 1) * stat["psize"]


class Lmdb:
    """LMDB: one read transaction per batch, `get` per key, backoff in Python (buffers, no copies)."""

    def __init__(self, path, d, int8):
        import lmdb

        self.env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=0)
        self.d, self.int8 = d, int8

    def lookup(self, windows):
        kb = np.ascontiguousarray(windows, dtype="<u4").tobytes()
        out = []
        append = out.append
        with self.env.begin(buffers=True) as txn:
            get = txn.get
            for i in range(0, len(kb), 12):
                k = kb[i:i + 12]
                v = get(k)
                while v is None:
                    k = next_key(k)
                    v = get(k)
                append(v)
            buf = b"".join(out)
        return decode_values(buf, len(windows), self.d, self.int8)


SQLITE_PAGE = 16384


def build_sqlite(path, keys, rows, scales=None):
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA page_size={SQLITE_PAGE}")
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("CREATE TABLE plot (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID")
    raw, order = key_bytes_sorted(keys)
    con.executemany("INSERT INTO plot VALUES (?, ?)",
                    ((raw[12 * i:12 * i + 12], value_bytes(rows, scales, i)) for i in order.tolist()))
    con.commit()
    con.close()
    return os.path.getsize(path)


class Sqlite:
    """SQLite, read-only, memory-mapped. method 'in': one `SELECT k, v ... WHERE k IN (...)` per backoff
    level per batch; method 'key': one prepared `SELECT v ... WHERE k = ?` per key."""

    MAX_VARS = 32000

    def __init__(self, path, d, int8, method):
        self.con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.con.execute(f"PRAGMA mmap_size={1 << 40}")
        self.d, self.int8, self.method = d, int8, method

    def _in(self, keys):
        found = {}
        for s in range(0, len(keys), self.MAX_VARS):
            chunk = keys[s:s + self.MAX_VARS]
            sql = "SELECT k, v FROM plot WHERE k IN (" + ",".join("?" * len(chunk)) + ")"
            found.update(self.con.execute(sql, chunk).fetchall())
        return found

    def lookup(self, windows):
        kb = np.ascontiguousarray(windows, dtype="<u4").tobytes()
        keys = [kb[i:i + 12] for i in range(0, len(kb), 12)]
        if self.method == "key":
            ex = self.con.execute
            sql = "SELECT v FROM plot WHERE k = ?"
            out = []
            for k in keys:
                row = ex(sql, (k,)).fetchone()
                while row is None:
                    k = next_key(k)
                    row = ex(sql, (k,)).fetchone()
                out.append(row[0])
        else:
            out = resolve_by_batches(keys, lambda batch: self._in(list(set(batch))))
        return decode_values(b"".join(out), len(windows), self.d, self.int8)


# -- timing -----------------------------------------------------------------------------------


def measure_all(openers, batches, warm_passes):
    """Time several systems on the same batches. Each system is opened right before its cold
    first batch (the first batch after open: hkstore checks its index, keys and flags then), then
    runs a first pass over all batches (hkstore checks each row's checksum the first time it returns
    it). The warm passes then go round-robin, batch by batch and system by system, so a load spike
    from other processes on the machine hits every system alike; each system reports the median.
    openers: name -> () -> (lookup function, open seconds)."""
    fns, out, res = {}, {}, {}
    for name, opener in openers.items():
        gc.collect()
        fn, open_s = opener()
        t = time.perf_counter()
        out[name] = fn(batches[0])
        cold = time.perf_counter() - t
        first = []
        for b in batches:
            t = time.perf_counter()
            fn(b)
            first.append(time.perf_counter() - t)
        fns[name] = fn
        res[name] = {"open_s": open_s, "cold_first_batch_s": cold, "first_pass_median_s": statistics.median(first)}
    warm = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    gc.collect()
    for _ in range(warm_passes):
        for b in batches:
            for name, fn in fns.items():
                c = time.thread_time()
                t = time.perf_counter()
                fn(b)
                warm[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
    for name, times in warm.items():
        med = statistics.median(times)
        cpu_med = statistics.median(cpu[name])
        res[name].update({"warm_median_s": med, "warm_min_s": min(times), "warm_p90_s": float(np.percentile(times, 90)),
                          "lookups_per_s": len(batches[0]) / med, "warm_times_s": times,
                          "cpu_median_s": cpu_med, "lookups_per_cpu_s": len(batches[0]) / max(cpu_med, 1e-9)})
    return res, out, fns


def compare(got, ref):
    """'yes', or the share of windows whose values differ."""
    if got.shape != ref.shape:
        return f"NO (shape {got.shape})"
    diff = (got != ref).reshape(len(got), -1).any(axis=1)
    return "yes" if not diff.any() else f"NO: {diff.mean():.1%} of windows differ"


def profile_lookup(fn, batches, top=14):
    """cProfile of warm hkstore lookups: (function, ms per batch self, ms per batch cumulative)."""
    prof = cProfile.Profile()
    prof.enable()
    for b in batches:
        fn(b)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        where = os.path.relpath(file, ROOT) if file.startswith(ROOT) else os.path.basename(file)
        rows.append({"function": f"{where}:{line}({name})" if line else name, "calls_per_batch": nc / len(batches),
                     "self_ms": 1e3 * tt / len(batches), "cum_ms": 1e3 * ct / len(batches)})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:top]


# -- section 1: lookups at entries x d ---------------------------------------------------------


def build_hkstore(path, keys, values, dtype, d, vocab=VOCAB):
    t = time.perf_counter()
    st = hkstore.create(path, d=d, vocab_size=vocab, dtype=dtype)
    st.add_segment("root", keys, values)
    st.close()
    seconds = time.perf_counter() - t
    seg = os.path.join(path, "segments", os.listdir(os.path.join(path, "segments"))[0])
    return seconds, seg


def section_lookup(cfg, tmp, rng, res):
    E, d = cfg.entries, cfg.d
    log(f"[1] keys and {cfg.batches} batches of {BATCH} windows over {E:,} entries")
    vocab = min(VOCAB, E // 3)  # the root holds a uni-gram for every id: small runs use a smaller vocabulary
    ks = KeySet(rng, E, vocab)
    batches = make_batches(rng, ks, cfg.batches)
    expected = [ks.served_rows(b) for b in batches]
    orders = np.concatenate([o for _, o in expected])
    mix = {f"order{o}": float((orders == o).mean()) for o in (3, 2, 1, 0)}
    res["lookup"] = {"entries": E, "d": d, "vocab": vocab, "uni": ks.n_uni, "bi": ks.n_bi, "tri": ks.n_tri,
                     "batch": BATCH, "batches": cfg.batches, "served_order_mix": mix, "systems": {}}
    log(f"    entries: {ks.n_uni:,} uni + {ks.n_bi:,} bi + {ks.n_tri:,} tri-grams; served orders {mix}")

    log(f"[1] values: {E:,} x {N} x {d} fp16 BERT-like vectors ({E * N * d * 2 / 2**30:.2f} GiB, file-backed)")
    pool = bert_like(rng, POOL, d).astype(np.float16)
    sb16 = os.path.join(tmp, "skipbert_fp16")
    os.makedirs(sb16)
    np.save(os.path.join(sb16, "keys.npy"), ks.keys)
    values = np.lib.format.open_memmap(os.path.join(sb16, "rows.npy"), mode="w+", dtype=np.float16, shape=(E, N, d))
    fill_values(values, ks.keys, pool)
    values.flush()

    builds, sizes = {}, {}
    # int8 first: quantize_int8 holds ~3 float32 copies of the values, so build it while little else is resident.
    need = 3 * E * N * d * 4
    avail = mem_available()
    log(f"[1] hkstore int8 build (engine quantization needs ~{need / 2**30:.1f} GiB; available "
        f"{(avail or 0) / 2**30:.1f} GiB)")
    if avail is not None and need > 0.85 * avail:
        raise SystemExit(f"not enough memory for the int8 build at {E:,} x {d}: lower --entries")
    hk8 = os.path.join(tmp, "hk_int8")
    builds["hkstore int8"], seg8 = build_hkstore(hk8, ks.keys, values, "int8", d, vocab)
    gc.collect()
    log(f"    {builds['hkstore int8']:.1f} s")
    log("[1] hkstore fp16 build")
    hk16 = os.path.join(tmp, "hk_fp16")
    builds["hkstore fp16"], seg16 = build_hkstore(hk16, ks.keys, values, "fp16", d, vocab)
    log(f"    {builds['hkstore fp16']:.1f} s")
    sizes["hkstore fp16"], sizes["hkstore int8"] = du(seg16), du(seg8)

    # int8 rows for the other layouts: exactly the bytes hkstore stored.
    s8 = Segment(seg8)
    sb8 = os.path.join(tmp, "skipbert_int8")
    t = time.perf_counter()
    write_skipbert(sb8, ks.keys, s8.values, np.asarray(s8.scales))
    builds["SkipBERT int8"] = time.perf_counter() - t
    builds["SkipBERT fp16"] = float("nan")  # its rows file is the values file written above
    sizes["SkipBERT fp16"], sizes["SkipBERT int8"] = du(sb16), du(sb8)

    for dtype, rows, scales in (("fp16", values, None), ("int8", s8.values, np.asarray(s8.scales))):
        log(f"[1] LMDB {dtype} build")
        t = time.perf_counter()
        sizes[f"LMDB {dtype}"] = build_lmdb(os.path.join(tmp, f"lmdb_{dtype}"), ks.keys, rows, scales)
        builds[f"LMDB {dtype}"] = time.perf_counter() - t
        log(f"    {builds[f'LMDB {dtype}']:.1f} s")
        log(f"[1] SQLite {dtype} build")
        t = time.perf_counter()
        sizes[f"SQLite {dtype}"] = build_sqlite(os.path.join(tmp, f"sqlite_{dtype}.db"), ks.keys, rows, scales)
        builds[f"SQLite {dtype}"] = time.perf_counter() - t
        log(f"    {builds[f'SQLite {dtype}']:.1f} s")
    res["lookup"]["build_seconds"] = builds
    res["bytes"] = {"entries": E, "d": d, "file_bytes": sizes,
                    "payload_per_entry": {"fp16": N * d * 2, "int8": N * d + 4 * N}}
    del s8

    log("[1] ceiling array: in-memory copy of the fp16 values")
    ceiling = np.array(values)  # (E, 3, d) fp16 in anonymous memory
    rows_for = {id(b): r for b, (r, _) in zip(batches, expected)}
    # The ceiling: as many uniformly random rows per batch (own generator: the data of
    # every other section stays what it was).
    uniform_rng = np.random.default_rng([cfg.seed, 1])
    uniform_for = {id(b): uniform_rng.integers(0, E, len(b)) for b in batches}
    ref16 = np.take(ceiling, expected[0][0], axis=0)  # what the spec says batch 0 returns (fp16)

    systems = res["lookup"]["systems"]
    for dtype in ("fp16", "int8"):
        int8 = dtype == "int8"
        hk_path = hk8 if int8 else hk16
        sb_path = sb8 if int8 else sb16
        lm_path = os.path.join(tmp, f"lmdb_{dtype}")
        sq_path = os.path.join(tmp, f"sqlite_{dtype}.db")
        log(f"[1] {dtype}: reading every system's files into the page cache")
        preread([hk_path, sb_path, lm_path, sq_path])
        handles = {}

        def timed_open(make):
            t = time.perf_counter()
            h = make()
            return h, time.perf_counter() - t

        def open_hk():
            st, s = timed_open(lambda: hkstore.open(hk_path))
            handles["hkstore"] = st
            return (lambda w: st.lookup("root", w).values), s

        def open_sb():
            sb, s = timed_open(lambda: SkipBert(sb_path))
            handles["sb"] = sb
            return sb.lookup, s

        def open_lm():
            lm, s = timed_open(lambda: Lmdb(lm_path, d, int8))
            handles["lm"] = lm
            return lm.lookup, s

        def open_sq(method):
            def opener():
                sq, s = timed_open(lambda: Sqlite(sq_path, d, int8, method))
                handles["sq_" + method] = sq
                return sq.lookup, s
            return opener

        def open_ceiling():
            return (lambda w: np.take(ceiling, rows_for[id(w)], axis=0)), 0.0

        def open_uniform_ceiling():
            return (lambda w: np.take(ceiling, uniform_for[id(w)], axis=0)), 0.0

        openers = {"hkstore": open_hk, "SkipBERT dict+memmap": open_sb, "LMDB get": open_lm,
                   "SQLite IN (...)": open_sq("in"), "SQLite per key": open_sq("key"),
                   CEIL_SAME: open_ceiling, CEIL_UNIFORM: open_uniform_ceiling}
        if int8:
            h8 = Segment(seg8)
            q8, sc8 = np.array(h8.values), np.array(h8.scales)
            del h8

            def take_dequant(w):
                r = rows_for[id(w)]
                q = np.take(q8, r, axis=0).astype(np.float32)
                q *= np.take(sc8, r, axis=0)[..., None]
                return q.astype(np.float16)

            openers["int8 np.take + dequant (in memory)"] = lambda: (take_dequant, 0.0)
        log(f"[1] {dtype}: timing {', '.join(openers)} ({cfg.warm_passes} warm passes, round-robin)")
        runs, outs, _ = measure_all(openers, batches, cfg.warm_passes)
        ref = outs["hkstore"]
        if ref.dtype != np.float16:  # int8 stores return float32 (dequantized); the others return fp16 of it
            ref = ref.astype(np.float16)
        got = handles["hkstore"].lookup("root", batches[0])
        runs["hkstore"]["served_orders_as_spec"] = compare(got.order, expected[0][1].astype(got.order.dtype))
        if not int8:
            runs["hkstore"]["values_as_spec"] = compare(ref, ref16)
        else:
            runs["hkstore"]["values_as_spec"] = compare(ref, outs["int8 np.take + dequant (in memory)"])
            # int8 fidelity on the stored vectors: the int8 rows hkstore wrote, dequantized, against their
            # fp16 source rows (the same entries, chosen by the spec's backoff, so a lookup bug cannot skew it).
            res.setdefault("cosine", {})["store_1st_batch"] = cosine_stats(
                ref16.astype(np.float32).reshape(-1, d),
                outs["int8 np.take + dequant (in memory)"].astype(np.float32).reshape(-1, d))
        for name in runs:
            if name != "hkstore" and not name.startswith("ceiling"):
                runs[name]["same_values_as_hkstore"] = compare(outs[name], ref)
        log(f"[1] {dtype}: profiling warm hkstore lookups")
        st = handles["hkstore"]
        res["lookup"][f"profile_{dtype}"] = profile_lookup(lambda w: st.lookup("root", w), batches)
        for h in handles.values():
            if isinstance(h, Lmdb):
                h.env.close()
            elif isinstance(h, Sqlite):
                h.con.close()
        del handles, st, openers
        if int8:
            del q8, sc8
        gc.collect()
        systems[dtype] = runs
        hk = runs["hkstore"]["lookups_per_s"]
        best_db = max(runs[k]["lookups_per_s"] for k in ("LMDB get", "SQLite IN (...)", "SQLite per key"))
        runs["_ratios"] = {"hkstore_over_ceiling": hk / runs[CEIL_SAME]["lookups_per_s"],
                           "hkstore_over_uniform_ceiling": hk / runs[CEIL_UNIFORM]["lookups_per_s"],
                           "hkstore_over_best_lmdb_sqlite": hk / best_db,
                           "hkstore_over_skipbert": hk / runs["SkipBERT dict+memmap"]["lookups_per_s"]}
        log(f"    {dtype}: " + ", ".join(f"{k} {v['lookups_per_s']:,.0f}/s" for k, v in runs.items() if not k.startswith("_")))
        if not int8:  # free disk and page cache for the int8 phase
            for p in (hk16, sb16, lm_path, sq_path):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
    del ceiling, values
    gc.collect()
    return ks


def cosine_stats(ref, got):
    """Per-vector cosine between rows of ref and got, skipping all-zero (pad) rows."""
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    nr, ng = np.linalg.norm(ref, axis=1), np.linalg.norm(got, axis=1)
    live = (nr > 0) & (ng > 0)
    c = (ref[live] * got[live]).sum(axis=1) / (nr[live] * ng[live])
    rel = np.linalg.norm(ref[live] - got[live], axis=1) / nr[live]
    return {"vectors": int(live.sum()), "mean": float(c.mean()), "min": float(c.min()),
            "p01": float(np.percentile(c, 1)), "mean_rel_l2_err": float(rel.mean())}


# -- section 4b: int8 fidelity ----------------------------------------------------------------


def section_cosine(cfg, rng, res):
    out = res.setdefault("cosine", {})
    d = cfg.d
    m = 20000
    x = bert_like(rng, m, d)
    q, s = quantize_int8(x)
    deq16 = (q.astype(np.float32) * s[..., None]).astype(np.float16).astype(np.float32)
    out["synthetic"] = cosine_stats(x.astype(np.float16).astype(np.float32), deq16)
    out["synthetic"]["absmax_mean"] = float(np.abs(x).max(axis=1).mean())
    out["synthetic"]["outlier_dims"] = int(len(model_params(d)[4]))
    try:
        if cfg.quick:
            raise RuntimeError("skipped in --quick (importing torch and the model takes seconds)")
        import torch

        from runtime.model.encoder import load_encoder

        enc = load_encoder(None, lower_layers=3)
        with torch.no_grad():
            V = enc.config.vocab_size
            ids = torch.as_tensor(rng.integers(1000, V, (4000, N)), dtype=torch.long)
            h = enc.lower(ids, torch.ones_like(ids, dtype=torch.bool)).numpy().reshape(-1, enc.config.d)
        q, s = quantize_int8(h)
        deq16 = (q.astype(np.float32) * s[..., None]).astype(np.float16).astype(np.float32)
        out["real"] = cosine_stats(h.astype(np.float16).astype(np.float32), deq16)
        out["real"]["model"] = "embedded all-MiniLM-L6-v2, lower 3 layers, random tri-gram windows"
    except Exception as e:  # torch, the runtime or the model missing: synthetic only
        out["real"] = {"available": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


# -- section 2: the index at scale -------------------------------------------------------------


def section_scale(cfg, tmp, rng, res):
    E, d = cfg.big_entries, cfg.big_d
    log(f"[2] {E:,} entries at d={d}: keys and batches")
    ks = KeySet(rng, E)
    batches = make_batches(rng, ks, cfg.batches)
    expected = [ks.served_rows(b)[0] for b in batches]
    pool = bert_like(rng, POOL, d).astype(np.float16)
    values = fill_values(np.empty((E, N, d), np.float16), ks.keys, pool)
    log(f"[2] hkstore fp16 build ({E * N * d * 2 / 2**30:.2f} GiB of values)")
    path = os.path.join(tmp, f"hk_big_{E}")
    build_s, seg = build_hkstore(path, ks.keys, values, "fp16", d)
    log(f"    {build_s:.1f} s")
    rows_for = {id(b): r for b, r in zip(batches, expected)}
    uniform_rng = np.random.default_rng([cfg.seed, 2])
    uniform_for = {id(b): uniform_rng.integers(0, E, len(b)) for b in batches}
    handles = {}

    def open_hk():
        t = time.perf_counter()
        st = hkstore.open(path)
        handles["hkstore"] = st
        return (lambda w: st.lookup("root", w).values), time.perf_counter() - t

    log("[2] timing hkstore and the ceilings (round-robin)")
    runs, outs, _ = measure_all({"hkstore": open_hk,
                                 CEIL_SAME: lambda: ((lambda w: np.take(values, rows_for[id(w)], axis=0)), 0.0),
                                 CEIL_UNIFORM: lambda: ((lambda w: np.take(values, uniform_for[id(w)], axis=0)), 0.0)},
                                batches, cfg.warm_passes)
    runs["hkstore"]["values_as_spec"] = compare(outs["hkstore"], outs[CEIL_SAME])
    st = handles.pop("hkstore")
    prof = profile_lookup(lambda w: st.lookup("root", w), batches)
    del st
    runs["_ratios"] = {"hkstore_over_ceiling": runs["hkstore"]["lookups_per_s"] / runs[CEIL_SAME]["lookups_per_s"],
                       "hkstore_over_uniform_ceiling": runs["hkstore"]["lookups_per_s"]
                       / runs[CEIL_UNIFORM]["lookups_per_s"]}
    res["scale"] = {"entries": E, "d": d, "build_seconds": build_s, "file_bytes": du(seg), "systems": runs,
                    "profile": prof}
    # SkipBERT files for the open-time test (rows are only memmapped there; keys drive the rebuild).
    write_skipbert(os.path.join(tmp, f"sb_open_{E}"), ks.keys, values)
    del values
    gc.collect()
    return path, ks


# -- section 3: open time ----------------------------------------------------------------------


def open_probe(kind, path, windows_path, reopens):
    """Runs in a fresh process: time the first open, the first lookup, then re-opens."""
    w = np.load(windows_path)
    out = {}
    if kind == "hkstore":
        t = time.perf_counter()
        st = hkstore.open(path)
        out["open_s"] = time.perf_counter() - t
        t = time.perf_counter()
        st.lookup("root", w)
        out["first_lookup_s"] = time.perf_counter() - t
        t = time.perf_counter()
        st.lookup("root", w)
        out["second_lookup_s"] = time.perf_counter() - t
        re = []
        for _ in range(reopens):
            t = time.perf_counter()
            s2 = hkstore.open(path)
            re.append(time.perf_counter() - t)
            s2.close()
        out["reopen_s"] = re
    else:
        t = time.perf_counter()
        sb = SkipBert(path)
        out["open_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sb.lookup(w)
        out["first_lookup_s"] = time.perf_counter() - t
    print(json.dumps(out))


def run_probe(kind, path, windows_path, reopens):
    cmd = [sys.executable, os.path.abspath(__file__), "--open-probe", kind, path, windows_path, str(reopens)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"open probe failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def section_open(cfg, tmp, rng, res, big):
    big_path, big_ks = big
    d = cfg.big_d
    rows_out = []
    for E in cfg.open_sizes:
        if E == cfg.big_entries:
            path, ks, sb = big_path, big_ks, os.path.join(tmp, f"sb_open_{E}")
        else:
            log(f"[3] store of {E:,} entries at d={d}")
            ks = KeySet(rng, E)
            values = fill_values(np.empty((E, N, d), np.float16), ks.keys, bert_like(rng, 4096, d).astype(np.float16))
            path = os.path.join(tmp, f"hk_open_{E}")
            build_hkstore(path, ks.keys, values, "fp16", d)
            sb = os.path.join(tmp, f"sb_open_{E}")
            write_skipbert(sb, ks.keys, values)
            del values
        wpath = os.path.join(tmp, f"windows_{E}.npy")
        np.save(wpath, ks.keys[rng.integers(0, E, BATCH)])
        preread([path, os.path.join(sb, "keys.npy")])
        log(f"[3] {E:,}: hkstore open x {cfg.open_procs} fresh processes")
        hk = [run_probe("hkstore", path, wpath, cfg.reopens) for _ in range(cfg.open_procs)]
        procs = cfg.open_procs_skipbert_big if E >= 5_000_000 else cfg.open_procs_skipbert
        log(f"[3] {E:,}: SkipBERT open (dict rebuild) x {procs} fresh processes")
        sbr = [run_probe("skipbert", sb, wpath, 0) for _ in range(procs)]
        med = statistics.median
        rows_out.append({
            "entries": E, "d": d, "store_bytes": du(path),
            "hkstore_open_s": med(r["open_s"] for r in hk),
            "hkstore_open_all_s": [r["open_s"] for r in hk],
            "hkstore_reopen_s": med(x for r in hk for x in r["reopen_s"]),
            "hkstore_first_lookup_s": med(r["first_lookup_s"] for r in hk),
            "hkstore_second_lookup_s": med(r["second_lookup_s"] for r in hk),
            "skipbert_open_s": med(r["open_s"] for r in sbr),
            "skipbert_open_all_s": [r["open_s"] for r in sbr],
            "skipbert_first_lookup_s": med(r["first_lookup_s"] for r in sbr),
        })
        log(f"    hkstore open {rows_out[-1]['hkstore_open_s'] * 1e3:.2f} ms, SkipBERT "
            f"{rows_out[-1]['skipbert_open_s'] * 1e3:.0f} ms")
        if path != big_path:
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(sb, ignore_errors=True)
    res["open"] = rows_out


def plot_open(rows, png):
    from tools import plots

    x = [r["entries"] for r in rows]
    series = {
        "hkstore.open (fresh process)": (x, [1e3 * r["hkstore_open_s"] for r in rows]),
        "hkstore.open (re-open)": (x, [1e3 * r["hkstore_reopen_s"] for r in rows]),
        "hkstore open + first 4096 lookups (lazy checks)":
            (x, [1e3 * (r["hkstore_open_s"] + r["hkstore_first_lookup_s"]) for r in rows]),
        "SkipBERT open (dict rebuild)": (x, [1e3 * r["skipbert_open_s"] for r in rows]),
    }
    plots.line_plot(series, f"entries (d = {rows[0]['d']}, fp16)", "ms", png, logx=True, logy=True,
                    title="Open time vs store size", hlines={"10 ms target": 10})


# -- section 5: compaction ---------------------------------------------------------------------


def section_compact(cfg, tmp, rng, res):
    out = []
    d, S = cfg.d, cfg.compact_entries
    pool = bert_like(rng, POOL, d).astype(np.float16)
    for dtype in ("fp16", "int8"):
        log(f"[5] {dtype}: version of 4 segments x {S:,} entries, 50% overlap, 5% tombstones in segments 2-4")
        path = os.path.join(tmp, f"compact_{dtype}")
        st = hkstore.create(path, d=d, vocab_size=VOCAB, dtype=dtype)
        uni = np.zeros((VOCAB, N), np.uint32)
        uni[:, 1] = np.arange(VOCAB)
        uni_values = fill_values(np.empty((VOCAB, N, d), np.float16), uni, pool, salt=99)
        st.add_segment("root", uni, uni_values)
        st.create_version("domain", parent="root")
        tri = random_keys(rng, S // 2 * 3 + S, VOCAB)
        n_eq = S // 100  # uni-grams whose value equals the root's: compaction drops them
        eq = rng.choice(VOCAB, n_eq, replace=False)
        tombs = 0
        for s in range(4):
            keys = tri[s * (S // 2): s * (S // 2) + S]
            values = fill_values(np.empty((len(keys), N, d), np.float16), keys, pool, salt=s + 1)
            tomb = None
            if s == 0:
                keys = np.concatenate([keys, uni[eq]])
                values = np.concatenate([values, uni_values[eq]])
            else:
                tomb = rng.random(len(keys)) < 0.05
                tombs += int(tomb.sum())
            st.add_segment("domain", keys, values, tombstone=tomb)
        sample = np.concatenate([tri[rng.integers(0, len(tri), BATCH - 512)], uni[eq[rng.integers(0, n_eq, 512)]]])
        sample[::7, 2] = rng.integers(1, VOCAB, len(sample[::7]))  # some windows that back off
        before = st.lookup("domain", sample)
        log(f"[5] {dtype}: hkstore.compact")
        t = time.perf_counter()
        r = hkstore.compact(st, "domain")
        wall = time.perf_counter() - t
        after = st.lookup("domain", sample)
        same = compare(np.concatenate([before.values.reshape(len(sample), -1).view(np.uint16),
                                       before.order[:, None].astype(np.uint16)], axis=1),
                       np.concatenate([after.values.reshape(len(sample), -1).view(np.uint16),
                                       after.order[:, None].astype(np.uint16)], axis=1))
        moved = int((before.version != after.version).sum())
        t = time.perf_counter()
        g = hkstore.gc(st)
        gc_s = time.perf_counter() - t
        st.close()
        r.update({"dtype": dtype, "d": d, "tombstones_written": tombs, "wall_s": wall, "gc_bytes_freed": g["bytes_freed"],
                  "gc_s": gc_s, "lookups_same_after": same,
                  "served_version_changed": moved, "sample_windows": len(sample)})
        out.append(r)
        log(f"    {r['bytes_before'] / 1e6:,.0f} MB in {r['seconds']:.1f} s = {r['mb_per_s']:.0f} MB/s")
        shutil.rmtree(path, ignore_errors=True)
    res["compact"] = out


# -- report ------------------------------------------------------------------------------------


def fmt_rate(x):
    return f"{x:,.0f}"


def report(res):
    m = res["machine"]
    L = []
    p = L.append
    p("# hkstore storage benchmark")
    p("")
    p(f"**Machine:** {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM "
      f"({m['mem_available_bytes'] / 2**30:.1f} GiB available at start); Linux {m['kernel']}; "
      f"Python {m['python']}, numpy {m['numpy']}, py-lmdb {m['lmdb']} (LMDB {m['lmdb_lib']}), SQLite {m['sqlite']}.")
    p(f"**Load from other processes:** 1-min load average {res['loadavg_start'][0]:.1f} at start, "
      f"{res['loadavg_end'][0]:.1f} at the end (on {m['cores']} cores): absolute numbers are noisy, ratios less so.")
    acc = res.get("accelerator")
    if acc:
        p(f"**hkstore lookup path:** {acc['description']} (accelerator used: {'yes' if acc['used'] else 'NO'}).")
    p(f"**Run:** `{res['command']}` ({res['mode']}), {res['total_seconds']:.0f} s in all ("
      + ", ".join(f"section {k}: {v:.0f} s" for k, v in res.get("section_seconds", {}).items())
      + f"). Stores built in a temp dir under {res['tmp_fs']} and read into the page cache before timing.")
    p("")
    if "lookup" in res:
        lk = res["lookup"]
        mix = lk["served_order_mix"]
        p(f"## 1. Lookup throughput: {lk['entries']:,} entries, d = {lk['d']}, n = 3 centered, batches of {lk['batch']}")
        p("")
        p(f"Root: {lk['uni']:,} uni-grams (every id of a {lk['vocab']}-id vocabulary), {lk['bi']:,} bi-grams "
          f"[a, b, pad], {lk['tri']:,} tri-grams. Windows: {HIT_FRACTION:.0%} hits drawn Zipf (s = {ZIPF_S}) over "
          f"the stored tri-grams, {1 - HIT_FRACTION:.0%} unstored tri-grams that back off; served orders: "
          f"3 = {mix['order3']:.1%}, 2 = {mix['order2']:.1%}, 1 = {mix['order1']:.1%}, miss = {mix['order0']:.1%}. "
          f"{lk['batches']} distinct batches; cold = first batch after open; first pass = each batch once "
          f"(hkstore checks each row's checksum the first time it returns it); warm = median over "
          f"{res['args']['warm_passes']} more passes, run round-robin across systems batch by batch so that load "
          f"from other processes hits all alike. Every system returns the (4096, 3, d) fp16 values; 'same values' "
          f"compares batch 0 bit for bit, and hkstore is checked against the FORMAT.md backoff rule. 'lookups per "
          f"CPU-s' divides by the median thread CPU time instead of wall time: less sensitive to other processes "
          f"taking the CPU (it still counts their cache pollution).")
        p("")
        p("| dtype | system | warm ms/batch | **lookups/s (warm median)** | warm min / p90 ms | lookups per CPU-s | first-pass ms/batch | cold first batch ms | open ms | same values as hkstore |")
        p("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for dtype, runs in lk["systems"].items():
            for name, r in runs.items():
                if name.startswith("_"):
                    continue
                same = r.get("same_values_as_hkstore", "-")
                if name == "hkstore":
                    same = f"(reference) values as the spec: {r['values_as_spec']}; orders: {r['served_orders_as_spec']}"
                p(f"| {dtype} | {name} | {r['warm_median_s'] * 1e3:.2f} | {fmt_rate(r['lookups_per_s'])} | "
                  f"{r['warm_min_s'] * 1e3:.2f} / {r['warm_p90_s'] * 1e3:.2f} | {fmt_rate(r['lookups_per_cpu_s'])} | "
                  f"{r['first_pass_median_s'] * 1e3:.2f} | "
                  f"{r['cold_first_batch_s'] * 1e3:.1f} | {r['open_s'] * 1e3:.1f} | {same} |")
        p("")
        p("| dtype | hkstore / ceiling (same rows) | hkstore / ceiling (uniform rows) | hkstore / best of (LMDB, SQLite) | best LMDB/SQLite method | hkstore / SkipBERT |")
        p("| --- | ---: | ---: | ---: | --- | ---: |")
        for dtype, runs in lk["systems"].items():
            cand = {k: runs[k]["lookups_per_s"] for k in ("LMDB get", "SQLite IN (...)", "SQLite per key")}
            best = max(cand, key=cand.get)
            sq_best = max(("SQLite IN (...)", "SQLite per key"), key=cand.get)
            ra = runs["_ratios"]
            p(f"| {dtype} | {ra['hkstore_over_ceiling']:.3f} | {ra.get('hkstore_over_uniform_ceiling', float('nan')):.3f} | "
              f"{ra['hkstore_over_best_lmdb_sqlite']:.2f} | "
              f"{best} (fastest SQLite method: {sq_best}) | {ra['hkstore_over_skipbert']:.2f} |")
        p("")
        p("Ceilings: `np.take` from an in-memory (anonymous memory) copy of the fp16 values, no lookup at all: "
          "'same rows' takes exactly the rows the lookups serve (Zipf-skewed, so cache-friendlier), 'uniform rows' "
          "takes as many uniformly random rows per batch (the issue's definition of the ceiling).")
        for dtype, runs in lk["systems"].items():
            ra = runs["_ratios"]
            u = ra.get("hkstore_over_uniform_ceiling", float("nan"))
            db = ra["hkstore_over_best_lmdb_sqlite"]
            p(f"Targets, {dtype}: lookups/s >= 0.8 x the uniform-rows ceiling: {'met' if u >= 0.8 else 'NOT met'} "
              f"({u:.2f} x); >= 3 x the best of LMDB and SQLite: {'met' if db >= 3 else 'NOT met'} ({db:.1f} x).")
        p("")
        p(f"SQLite: `CREATE TABLE plot (k BLOB PRIMARY KEY, v BLOB) WITHOUT ROWID`, page_size {SQLITE_PAGE} "
          f"(rows fit in a page; at 4096 they spill to overflow pages and lookups were ~3x slower), "
          f"mmap_size 1 TiB, read-only; both query methods are shown, the faster one counts. LMDB: read-only env, "
          f"lock=False, one read txn per batch, `get(buffers=True)` per key. SkipBERT: dict of 3-tuples -> row, "
          f"`np.load(mmap_mode='r')` rows, backoff in Python, no integrity checks. int8 values for every system are "
          f"the bytes hkstore stored (int8 + one fp32 scale per vector), dequantized to fp16 the same way.")
        b = lk["build_seconds"]
        p("")
        p("Build times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in b.items() if v == v) + ".")
        for key, title in (("profile_fp16", "fp16"), ("profile_int8", "int8")):
            if key in lk:
                p("")
                p(f"Where a warm hkstore.lookup batch goes ({title}, cProfile, which inflates per-call overhead; top by self time):")
                p("")
                p("| function | calls/batch | self ms/batch | cumulative ms/batch |")
                p("| --- | ---: | ---: | ---: |")
                for r in lk[key]:
                    p(f"| `{r['function']}` | {r['calls_per_batch']:.1f} | {r['self_ms']:.3f} | {r['cum_ms']:.3f} |")
        p("")
    if "scale" in res:
        sc = res["scale"]
        p(f"## 2. The index at scale: {sc['entries']:,} entries, d = {sc['d']} (fp16)")
        p("")
        p(f"Same window mix and batches of {BATCH}. Store file {sc['file_bytes'] / 2**30:.2f} GiB, built in "
          f"{sc['build_seconds']:.1f} s.")
        p("")
        p("| system | warm ms/batch | **lookups/s (warm median)** | warm min / p90 ms | lookups per CPU-s | first-pass ms/batch | cold first batch ms |")
        p("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, r in sc["systems"].items():
            if name.startswith("_"):
                continue
            p(f"| {name} | {r['warm_median_s'] * 1e3:.2f} | {fmt_rate(r['lookups_per_s'])} | "
              f"{r['warm_min_s'] * 1e3:.2f} / {r['warm_p90_s'] * 1e3:.2f} | {fmt_rate(r['lookups_per_cpu_s'])} | "
              f"{r['first_pass_median_s'] * 1e3:.2f} | {r['cold_first_batch_s'] * 1e3:.1f} |")
        p("")
        ra = sc["systems"]["_ratios"]
        p(f"hkstore / ceiling (same rows) = {ra['hkstore_over_ceiling']:.3f}; hkstore / ceiling (uniform rows) = "
          f"{ra.get('hkstore_over_uniform_ceiling', float('nan')):.3f}; hkstore values as the spec "
          f"(= the same-rows ceiling's rows): {sc['systems']['hkstore']['values_as_spec']}.")
        p("")
        p("| function (warm, cProfile) | calls/batch | self ms/batch | cumulative ms/batch |")
        p("| --- | ---: | ---: | ---: |")
        for r in sc["profile"][:8]:
            p(f"| `{r['function']}` | {r['calls_per_batch']:.1f} | {r['self_ms']:.3f} | {r['cum_ms']:.3f} |")
        p("")
    if "open" in res:
        rows = res["open"]
        p(f"## 3. Open time vs size (d = {rows[0]['d']} for every size, fp16; fresh processes)")
        p("")
        p("Each hkstore row: median over fresh processes of the first `hkstore.open(path)` (manifest + segment "
          "header), of re-opens in those processes, and of the first lookup of 4096 stored keys (which checks the "
          "index, keys and flags sections in full, once per process). SkipBERT open = `np.load` keys + dict "
          "rebuild + memmap rows. OS page cache warm. The first lookups are timed on a loaded machine: they are "
          "noisier than the opens.")
        p("")
        p("| entries | store size | hkstore open (fresh) ms | hkstore re-open ms | hkstore first lookup ms | hkstore 2nd lookup ms | SkipBERT open (dict rebuild) ms | SkipBERT / hkstore open |")
        p("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            p(f"| {r['entries']:,} | {r['store_bytes'] / 2**20:,.1f} MiB | {r['hkstore_open_s'] * 1e3:.2f} | "
              f"{r['hkstore_reopen_s'] * 1e3:.2f} | {r['hkstore_first_lookup_s'] * 1e3:.1f} | "
              f"{r['hkstore_second_lookup_s'] * 1e3:.1f} | {r['skipbert_open_s'] * 1e3:,.0f} | "
              f"{r['skipbert_open_s'] / r['hkstore_open_s']:,.0f}x |")
        big = rows[-1]
        p("")
        p(f"Target (flat, < 10 ms at {big['entries']:,}): {'met' if big['hkstore_open_s'] < 0.010 else 'NOT met'} "
          f"({big['hkstore_open_s'] * 1e3:.2f} ms; smallest store {rows[0]['hkstore_open_s'] * 1e3:.2f} ms).")
        if res.get("open_png"):
            p(f"Plot: `{res['open_png']}`.")
        p("")
    if "bytes" in res:
        by = res["bytes"]
        p(f"## 4. Bytes per entry ({by['entries']:,} entries, n = 3, d = {by['d']}) and int8 fidelity")
        p("")
        p("| layout | dtype | file bytes | bytes/entry | payload bytes/entry | overhead |")
        p("| --- | --- | ---: | ---: | ---: | ---: |")
        for name, size in by["file_bytes"].items():
            sysname, dtype = name.rsplit(" ", 1)
            per = size / by["entries"]
            pay = by["payload_per_entry"][dtype]
            p(f"| {sysname} | {dtype} | {size:,} | {per:,.1f} | {pay:,} | {per / pay - 1:+.1%} |")
        p("")
        p("LMDB size = pages in use (its map is sparse); payload = n*d values (+ n fp32 scales for int8).")
        p("")
    if "cosine" in res:
        co = res["cosine"]
        p("int8 (symmetric, one fp32 scale per vector) against fp16, per vector, pad vectors excluded:")
        p("")
        p("| vectors | count | mean cosine | p1 cosine | min cosine | mean relative L2 error |")
        p("| --- | ---: | ---: | ---: | ---: | ---: |")
        labels = {"synthetic": f"synthetic BERT-like, d = {res.get('lookup', {}).get('d', '?')}",
                  "store_1st_batch": "int8 rows stored by hkstore (dequantized) vs their fp16 source, rows of 1 batch",
                  "real": "real lower-layer outputs"}
        for k in ("synthetic", "store_1st_batch", "real"):
            c = co.get(k)
            if c and "mean" in c:
                p(f"| {labels[k]}{' (' + c['model'] + ')' if 'model' in c else ''} | {c['vectors']:,} | "
                  f"{c['mean']:.5f} | {c['p01']:.5f} | {c['min']:.5f} | {c['mean_rel_l2_err']:.4f} |")
        p("")
        syn = co.get("synthetic", {})
        p(f"Synthetic vectors: Gaussian pre-activations with per-dimension spread (log-normal, sigma 0.5) and a "
          f"shared offset (anisotropy), LayerNorm'ed, then LayerNorm gain ~1 +- 0.1 and bias ~0 +- 0.05 except "
          f"{syn.get('outlier_dims', '?')} outlier dimension(s) with |gain| 6-10 and bias +-4 (as BERT's few huge "
          f"hidden dimensions); mean per-vector |max| = {syn.get('absmax_mean', float('nan')):.1f}. "
          f"The store values are drawn from a pool of {POOL:,} such vectors.")
        real = co.get("real", {})
        if "available" in real and not real["available"]:
            p(f"Real lower-layer outputs: not measured ({real['reason']}).")
        p("")
    if "compact" in res:
        p("## 5. Compaction")
        p("")
        p("A branch `domain` under a root of uni-grams: 4 segments of S entries each, segment i covering keys "
          "[i*S/2, i*S/2 + S) of one key list (50% overlap with its neighbour, newer values win), segments 2-4 "
          "tombstone 5% of their keys, segment 1 also holds S/100 uni-grams equal to the root's (dropped as "
          "redundant). `hkstore.compact(store, 'domain')`, then `hkstore.gc` deletes the old segment files. "
          "4096 sample windows (stored keys, dropped uni-grams, some that back off) are looked up before and after: "
          "values and orders must not change; windows whose entry was dropped as equal to the parent's are then "
          "served by the root (same vector, other served version).")
        p("")
        p("| dtype | d | segments | entries before | tombstones | entries after | bytes before | bytes after | reclaimed | seconds | **MB/s** (bytes before / s) | gc freed | values+orders same after | served version moved to root |")
        p("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for r in res["compact"]:
            p(f"| {r['dtype']} | {r['d']} | {r['segments_before']} | {r['entries_before']:,} | {r['tombstones_written']:,} | "
              f"{r['entries_after']:,} | {r['bytes_before'] / 1e6:,.1f} MB | {r['bytes_after'] / 1e6:,.1f} MB | "
              f"{r['bytes_reclaimed'] / 1e6:,.1f} MB ({r['bytes_reclaimed'] / r['bytes_before']:.0%}) | "
              f"{r['seconds']:.2f} | {r['mb_per_s']:,.0f} | {r['gc_bytes_freed'] / 1e6:,.1f} MB | "
              f"{r['lookups_same_after']} | {r['served_version_changed']} of {r['sample_windows']} |")
        p("")
    return "\n".join(L)


# -- main --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, help="entries of the section-1 stores (default 1,000,000; quick 60,000)")
    ap.add_argument("--d", type=int, help="vector width of the section-1 stores (default 384; quick 128)")
    ap.add_argument("--big-entries", type=int, help="entries of the section-2 store (default 10,000,000)")
    ap.add_argument("--big-d", type=int, default=32, help="vector width of the section-2/3 stores (default 32)")
    ap.add_argument("--batches", type=int, help="distinct timed batches of 4096 windows (default 10)")
    ap.add_argument("--compact-entries", type=int, help="entries per segment in the compaction test (default 100,000)")
    ap.add_argument("--out", help="directory for bench_store.json (raw results) and open_time.png")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the temporary stores go (default /tmp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every section (< 60 s)")
    ap.add_argument("--only", default="1,2,3,4,5", help="sections to run, e.g. 1,3")
    ap.add_argument("--open-probe", nargs=4, metavar=("KIND", "PATH", "WINDOWS", "REOPENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.open_probe:
        kind, path, wpath, reopens = args.open_probe
        open_probe(kind, path, wpath, int(reopens))
        return

    q = args.quick
    args.entries = args.entries or (64_000 if q else 1_000_000)
    args.d = args.d or (64 if q else 384)
    args.big_entries = args.big_entries or (200_000 if q else 10_000_000)
    args.batches = args.batches or (3 if q else 10)
    args.warm_passes = 2 if q else 3
    args.compact_entries = args.compact_entries or (5_000 if q else 100_000)
    args.open_sizes = sorted({s for s in ((10_000, 50_000, args.big_entries) if q else
                                         (10_000, 100_000, 1_000_000, args.big_entries)) if s <= args.big_entries})
    args.open_procs = 2 if q else 5
    args.reopens = 3 if q else 5
    args.open_procs_skipbert = 2 if q else 3
    args.open_procs_skipbert_big = 2 if q else 3
    sections = {s.strip() for s in args.only.split(",")}

    res = {"machine": machine_info(), "mode": "quick" if q else "full",
           "command": "python " + " ".join([os.path.relpath(__file__, os.getcwd())] + sys.argv[1:]),
           "args": {k: v for k, v in vars(args).items() if k != "open_probe"}}
    res["loadavg_start"] = os.getloadavg()
    res["accelerator"] = {"used": accel.ext is not None, "built": accel.BUILT, "description": accel.describe()}
    rng = np.random.default_rng(args.seed)
    tmp = tempfile.mkdtemp(prefix="bench_store_", dir=args.tmp)
    res["tmp_fs"] = args.tmp
    log(f"temp dir {tmp}; mode {res['mode']}: entries {args.entries:,} x d {args.d}, big {args.big_entries:,} x d "
        f"{args.big_d}, open sizes {args.open_sizes}")
    res["section_seconds"] = {}

    def timed(name, fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        res["section_seconds"][name] = time.perf_counter() - t
        return out

    try:
        if "1" in sections:
            timed("1+4 lookups, sizes", section_lookup, args, tmp, rng, res)
            for name in os.listdir(tmp):  # free disk and page cache for what follows
                full = os.path.join(tmp, name)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        if "4" in sections:
            log("[4] int8 fidelity")
            timed("4 cosine", section_cosine, args, rng, res)
        if "2" in sections or "3" in sections:
            big = timed("2 scale", section_scale, args, tmp, rng, res) if "2" in sections else None
            if "3" in sections:
                if big is None:
                    args.open_sizes = [s for s in args.open_sizes if s != args.big_entries]
                timed("3 open", section_open, args, tmp, rng, res, big or (None, None))
            if big:
                shutil.rmtree(big[0], ignore_errors=True)
        if "5" in sections:
            timed("5 compaction", section_compact, args, tmp, rng, res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["total_seconds"] = time.perf_counter() - T0
    res["loadavg_end"] = os.getloadavg()
    if args.out and "open" in res:
        os.makedirs(args.out, exist_ok=True)
        png = os.path.join(args.out, "open_time.png")
        plot_open(res["open"], png)
        res["open_png"] = png
    text = report(res)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_store.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
        with open(os.path.join(args.out, "bench_store.md"), "w") as f:
            f.write(text + "\n")
    log("done")


if __name__ == "__main__":
    main()
