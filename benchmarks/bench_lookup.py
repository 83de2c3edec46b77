"""Store lookups against np.take, LMDB and SQLite on two workloads, systems interleaved.

  zipf      : batches of 4,096 windows drawn Zipf (s = 1.1) over ALL stored keys (uni-, bi- and
              tri-grams), every window a hit; a fresh batch every round (a stream, as a server sees
              it: rows the process has not returned yet keep arriving from the Zipf tail).
  published : bench_store's mix (90% Zipf tri-gram hits, 10% stored-nowhere tri-grams that back
              off), also a fresh batch every round.

Systems: hkstore (store.lookup, C path unless HKSTORE_NO_ACCEL=1), the ceiling `np.take` of
exactly the rows the lookup serves from an in-memory (anonymous) copy of the values, the same
`np.take` from the warmed store's own file mapping of its values section (where hkstore's rows
live: it separates what the memory costs from what the key search costs), LMDB
(dedupe the batch, one `getmulti` per backoff level) and SQLite (`IN (...)`, bench_store's), all
built the way bench_store builds them. Each round draws one batch and times every system on it,
in a rotating order; reported: the median of the per-round ratios and their spread.

    python -m benchmarks.bench_lookup --rounds 15 --out benchmarks/results/store_lookups_zipf.json

The store, LMDB and SQLite files are built once under --dir and reused (about 9 GB).
"""

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import hkstore  # noqa: E402
from benchmarks import bench_store as bs  # noqa: E402
from formats import accel  # noqa: E402

E, D = 1_000_000, 384
TAKE_MAPPED = "np.take (same rows, the store's file mapping)"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def build(directory, seed):
    """Keys, values and the three stores, built once (a marker file says the build finished)."""
    done = os.path.join(directory, "BUILT")
    rng = np.random.default_rng(seed)
    ks = bs.KeySet(rng, E, bs.VOCAB)
    values_path = os.path.join(directory, "values.npy")
    if os.path.exists(done):
        return ks, np.load(values_path, mmap_mode="r")
    os.makedirs(directory, exist_ok=True)
    log(f"building under {directory}")
    pool = bs.bert_like(rng, bs.POOL, D).astype(np.float16)
    values = np.lib.format.open_memmap(values_path, mode="w+", dtype=np.float16, shape=(E, bs.N, D))
    bs.fill_values(values, ks.keys, pool)
    values.flush()
    t = time.perf_counter()
    bs.build_hkstore(os.path.join(directory, "hk"), ks.keys, values, "fp16", D, bs.VOCAB)
    log(f"  hkstore {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    bs.build_lmdb(os.path.join(directory, "lmdb"), ks.keys, values)
    log(f"  LMDB {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    bs.build_sqlite(os.path.join(directory, "sqlite.db"), ks.keys, values)
    log(f"  SQLite {time.perf_counter() - t:.0f} s")
    open(done, "w").close()
    return ks, values


class LmdbMulti:
    """LMDB, the strongest Python client we know: dedupe the batch's keys, one `getmulti` per
    backoff level in one read transaction, then scatter the unique rows (np.take)."""

    def __init__(self, path):
        import lmdb

        self.env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=0)

    def lookup(self, windows):
        w = np.ascontiguousarray(windows, dtype="<u4")
        uniq, inv = np.unique(w.view(np.dtype((np.void, 12))).ravel(), return_inverse=True)
        keys = [bytes(k) for k in uniq.tolist()]
        with self.env.begin(buffers=False) as txn:
            cur = txn.cursor()
            vals = bs.resolve_by_batches(keys, lambda batch: dict(cur.getmulti(batch)))
        rows = np.frombuffer(b"".join(vals), dtype=np.float16).reshape(len(vals), bs.N, D)
        return np.take(rows, inv.ravel(), axis=0)


def pin_malloc():
    """glibc picks mmap or the heap for a 9.4 MB batch output by a threshold that moves with what
    was freed last, so a system's output sometimes comes back as fresh pages (2,300 page faults,
    ~1 ms) and sometimes not, depending on what ran before it. A fixed threshold above a batch
    and no trimming give every system the same reused heap memory. Returns whether it applied."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 32 << 20)) and bool(libc.mallopt(-1, 1 << 30))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def mem_gib():
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


def zipf_sampler(rng, count, s):
    ranks = np.arange(1, count + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -s)
    cdf /= cdf[-1]
    perm = rng.permutation(count)
    return lambda m: perm[np.searchsorted(cdf, rng.random(m)).clip(0, count - 1)]


def spread(xs):
    return [float(min(xs)), float(max(xs))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/hk_bench_lookup")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warm-batches", type=int, default=3, help="untimed batches each system runs first")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workloads", default="zipf,published")
    ap.add_argument("--out")
    ap.add_argument("--no-pin-malloc", action="store_true", help="leave glibc's dynamic mmap threshold on")
    a = ap.parse_args()
    ks, values = build(a.dir, a.seed)
    pinned = pin_malloc() if not a.no_pin_malloc else False
    log("reading the files into the page cache; the in-memory ceiling copy")
    bs.preread([os.path.join(a.dir, p) for p in ("hk", "lmdb", "sqlite.db")])
    ceiling = np.array(values)  # (E, 3, d) fp16 in anonymous memory
    # Two opens of the same store, each its own mmap and row checks: one as a fresh process
    # meets it (each row checked, and its pages mapped, on first return), one warmed first.
    st_warm = hkstore.open(os.path.join(a.dir, "hk"))
    t = time.perf_counter()
    c = time.thread_time()
    failed = st_warm.warm()
    warm_s, warm_cpu_s = time.perf_counter() - t, time.thread_time() - c
    log(f"warm(): {warm_s:.2f} s ({warm_cpu_s:.2f} s CPU), {failed} rows failed")
    mapped = st_warm.snapshot().version_segments("root")[0].values  # the file mapping warm() populated
    lm = LmdbMulti(os.path.join(a.dir, "lmdb"))
    sq = bs.Sqlite(os.path.join(a.dir, "sqlite.db"), D, False, "in")
    rng = np.random.default_rng([a.seed, 1])
    draw_all = zipf_sampler(rng, E, bs.ZIPF_S)
    uptime = [open("/proc/loadavg").read().split()[:3]]
    res = {"command": "python -m benchmarks.bench_lookup " + " ".join(sys.argv[1:]),
           "machine": f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()}), {mem_gib()} GiB",
           "accel": accel.describe(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "malloc_pinned": pinned, "warm_s": warm_s, "warm_cpu_s": warm_cpu_s, "entries": E, "d": D, "n": bs.N, "batch": bs.BATCH, "zipf_s": bs.ZIPF_S, "rounds": a.rounds, "workloads": {}, "rows": []}
    for wl in a.workloads.split(","):
        st = hkstore.open(os.path.join(a.dir, "hk"))  # a fresh open for each workload
        seg_cold = st.snapshot().version_segments("root")[0]
        if wl == "zipf":
            def draw():
                rows = draw_all(bs.BATCH)
                return np.ascontiguousarray(ks.keys[rows]), rows
        else:
            # One call: make_batches draws one Zipf rank -> key map per call, so per-round calls
            # would give every batch a different hot set (all rows fresh).
            stream = iter(bs.make_batches(rng, ks, a.rounds + a.warm_batches))

            def draw():
                w = next(stream)
                return w, ks.served_rows(w)[0]
        systems = {
            "hkstore": lambda w, r: st.lookup("root", w).values,
            "hkstore after warm()": lambda w, r: st_warm.lookup("root", w).values,
            "np.take (same rows, in memory)": lambda w, r: np.take(ceiling, r, axis=0),
            TAKE_MAPPED: lambda w, r: np.take(mapped, r, axis=0),
            "LMDB (dedupe + getmulti)": lambda w, r: lm.lookup(w),
            "SQLite (IN (...))": lambda w, r: sq.lookup(w),
        }
        names = list(systems)
        for _ in range(a.warm_batches):  # first batch after open: hkstore checks index/keys/flags then
            w, r = draw()
            for fn in systems.values():
                fn(w, r)
        times = {k: [] for k in names}
        cpu = {k: [] for k in names}
        faults = {k: [] for k in names}
        uniq, fresh = [], []
        for rnd in range(a.rounds):
            w, r = draw()
            uniq.append(len(np.unique(r)) / len(r))
            ur = np.unique(r)
            fresh.append(float((~seg_cold._row_ok[ur]).mean()) if seg_cold._row_ok is not None else 1.0)
            ref, outs = None, {}
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                gc.collect()
                f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c = time.thread_time()
                t = time.perf_counter()
                out = systems[name](w, r)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
                if name == "np.take (same rows, in memory)":
                    ref = out
                else:
                    outs[name] = out
            for name, out in outs.items():
                if out.shape != ref.shape or not np.array_equal(out.view(np.uint16), ref.view(np.uint16)):
                    raise SystemExit(f"{wl}: {name} differs from np.take of the served rows in round {rnd}")
        uptime.append(open("/proc/loadavg").read().split()[:3])
        block = {"unique_rows_per_batch": [float(np.median(uniq)), *spread(uniq)],
                 "unchecked_share_of_unique_rows_fresh_open": [float(np.median(fresh)), *spread(fresh)], "systems": {}}
        take = np.array(times["np.take (same rows, in memory)"])
        take_cpu = np.array(cpu["np.take (same rows, in memory)"])
        for name in names:
            t, tc = np.array(times[name]), np.array(cpu[name])
            row = {"workload": wl, "system": name, "lookups_per_s": float(bs.BATCH / np.median(t)),
                   "lookups_per_s_spread": spread(bs.BATCH / t), "ms_per_batch": float(1e3 * np.median(t)),
                   "cpu_ms_per_batch": float(1e3 * np.median(tc)),
                   "minor_faults_per_batch": float(np.median(faults[name])),
                   # per-round ratios: this system's speed over np.take's (wall clock, then thread CPU time)
                   "over_np_take": float(np.median(take / t)), "over_np_take_spread": spread(take / t),
                   "over_np_take_cpu": float(np.median(take_cpu / tc))}
            for db in ("LMDB (dedupe + getmulti)", "SQLite (IN (...))"):
                if name.startswith("hkstore"):
                    rr = np.array(times[db]) / t
                    key = "over_lmdb" if db.startswith("LMDB") else "over_sqlite"
                    row[key], row[key + "_spread"] = float(np.median(rr)), spread(rr)
            res["rows"].append(row)
            block["systems"][name] = row
        res["workloads"][wl] = block
        log(f"{wl}: unique rows per batch {block['unique_rows_per_batch'][0]:.2f}, of them unchecked in the "
            f"fresh open {block['unchecked_share_of_unique_rows_fresh_open'][0]:.2f}")
        for row in block["systems"].values():
            sp = row["over_np_take_spread"]
            extra = (f"  /LMDB {row['over_lmdb']:.2f} /SQLite {row['over_sqlite']:.2f}" if "over_lmdb" in row else "")
            log(f"  {row['system']:34s} {row['lookups_per_s']:>12,.0f}/s  {row['ms_per_batch']:7.2f} ms "
                f"(CPU {row['cpu_ms_per_batch']:.2f})  /take {row['over_np_take']:.2f} [{sp[0]:.2f}, {sp[1]:.2f}] "
                f"CPU {row['over_np_take_cpu']:.2f} faults {row['minor_faults_per_batch']:.0f}{extra}")
    load = ("loadavg (1, 5, 15 min) before and after each workload: "
            + "; ".join(" ".join(u) for u in uptime))
    log(load)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(claims_file(res, load), f, indent=1)
    print(markdown(claims_file(res, load)))


NAMES = {"hkstore": "hkstore, fresh open (rows checked and mapped on first return)",
         "hkstore after warm()": "hkstore after Store.warm()"}


def claims_file(res, load):
    """The results in benchmarks/claims.py's shape: one table (what BENCHMARKS.md shows, cell for
    cell), the rest under `raw` (a list: the claims check does not look for its numbers)."""
    columns = ["workload", "system", "lookups/s", "ms/batch", "CPU ms/batch", "/ np.take (median)",
               "/ np.take (min-max)", "hkstore / LMDB", "hkstore / SQLite"]
    rows = []
    for row in res["rows"]:
        hk = "over_lmdb" in row
        lo, hi = row["over_np_take_spread"]
        rows.append([row["workload"], NAMES.get(row["system"], row["system"]), round(row["lookups_per_s"]),
                     round(row["ms_per_batch"], 2), round(row["cpu_ms_per_batch"], 2),
                     round(row["over_np_take"], 2), f"{lo:.2f}-{hi:.2f}",
                     round(row["over_lmdb"], 2) if hk else "", round(row["over_sqlite"], 2) if hk else ""])
    return {"section": "Store lookups: Zipf over all keys", "command": res["command"], "machine": res["machine"],
            "load": load, "date": res["date"][:10], "tables": [{"columns": columns, "rows": rows}],
            "raw": [{k: v for k, v in res.items() if k != "command"}]}


def markdown(data):
    t = data["tables"][0]
    out = ["| " + " | ".join(t["columns"]) + " |", "| " + " | ".join("---" for _ in t["columns"]) + " |"]
    for r in t["rows"]:
        out.append("| " + " | ".join(f"{c:,}" if isinstance(c, int) else str(c) for c in r) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
