"""Store lookups against np.take, LMDB and SQLite on two workloads, systems interleaved.

  zipf      : batches of 4,096 windows drawn Zipf (s = 1.1) over ALL stored keys (uni-, bi- and
              tri-grams), every window a hit; a fresh batch every round (a stream, as a server sees
              it: rows the process has not returned yet keep arriving from the Zipf tail).
  published : bench_store's mix (90% Zipf tri-gram hits, 10% stored-nowhere tri-grams that back
              off), also a fresh batch every round.

Systems: hkstore (store.lookup, C path unless HKSTORE_NO_ACCEL=1), the ceiling `np.take` of
exactly the rows the lookup serves from an in-memory (anonymous) copy of the values, LMDB
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
import statistics
import subprocess
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
        vals = [None] * len(keys)
        with self.env.begin(buffers=False) as txn:
            cur = txn.cursor()
            todo = list(range(len(keys)))
            while todo:
                found = dict(cur.getmulti([keys[i] for i in todo]))
                still = []
                for i in todo:
                    v = found.get(keys[i])
                    if v is None:
                        still.append(i)
                    else:
                        vals[i] = v
                for i in still:
                    keys[i] = bs.next_key(keys[i])
                todo = still
        rows = np.frombuffer(b"".join(vals), dtype=np.float16).reshape(len(vals), bs.N, D)
        return np.take(rows, inv.ravel(), axis=0)


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
    a = ap.parse_args()
    ks, values = build(a.dir, a.seed)
    log("reading the files into the page cache; the in-memory ceiling copy")
    bs.preread([os.path.join(a.dir, p) for p in ("hk", "lmdb", "sqlite.db")])
    ceiling = np.array(values)  # (E, 3, d) fp16 in anonymous memory
    # Two opens of the same store, each its own mmap and row checks: one as a fresh process
    # meets it (each row checked, and its pages mapped, on first return), one warmed first.
    st = hkstore.open(os.path.join(a.dir, "hk"))
    st_warm = hkstore.open(os.path.join(a.dir, "hk"))
    t = time.perf_counter()
    c = time.thread_time()
    failed = st_warm.warm()
    warm_s, warm_cpu_s = time.perf_counter() - t, time.thread_time() - c
    log(f"warm(): {warm_s:.2f} s ({warm_cpu_s:.2f} s CPU), {failed} rows failed")
    seg_cold = st.snapshot().version_segments("root")[0]
    lm = LmdbMulti(os.path.join(a.dir, "lmdb"))
    sq = bs.Sqlite(os.path.join(a.dir, "sqlite.db"), D, False, "in")
    rng = np.random.default_rng([a.seed, 1])
    draw_all = zipf_sampler(rng, E, bs.ZIPF_S)
    uptime = [open("/proc/loadavg").read().split()[:3]]
    res = {"command": "python -m benchmarks.bench_lookup " + " ".join(sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''}".strip(", "),
           "accel": accel.describe(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "warm_s": warm_s, "warm_cpu_s": warm_cpu_s, "entries": E, "d": D, "n": bs.N, "batch": bs.BATCH, "rounds": a.rounds, "workloads": {}, "rows": []}
    for wl in a.workloads.split(","):
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
                c = time.thread_time()
                t = time.perf_counter()
                out = systems[name](w, r)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
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
                f"CPU {row['over_np_take_cpu']:.2f}{extra}")
    res["load"] = {"loadavg_1_5_15_before_and_after_each_workload": uptime,
                   "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    log(res["load"]["uptime"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
