"""The PLOT hot tier's hit rate and the host lookup work it saves (issue: runtime, "a
GPU-resident hot tier for PLOT").

    python -m benchmarks.bench_hot_tier --store /tmp/hmi3/store --texts TEXTFILE [--version root]

Requests' texts (one per line; default: first paragraphs of stdlib docstrings) are served in
batches, in order, each text once, through the GPU executor's own retrieval code
(runtime.exec.gpu: probe the tier, host lookup of the misses only, periodic rebuild from
the keys seen so far) run on the host (benchmarks.host_device). Per tier size: the hit rate
after the first --warmup batches and the host time per batch spent in store lookups: of the
misses, and of the rebuilds (keys new to the tier) spread over the batches, beside the host
lookup of every window (no tier). Those are CPU costs and are measured here; the device-side probe and
gather are not (they need a GPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def read_texts(path):
    if path:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    from runtime.demo.run import ROOT_MODULES
    from runtime.demo.stdlib_text import docstrings

    return [text for text, _, _ in docstrings(ROOT_MODULES)]


def batches_of(encoder, texts, batch, max_len):
    seqs = encoder.tokenize(texts, max_len)
    return [seqs[i:i + batch] for i in range(0, len(seqs), batch)]


def run_tier(encoder, snapshot, version, batches, rows, rebuild_every, warmup):
    """(hit rate after warm-up, host seconds per measured batch looking up misses, the same
    for the rebuilds' lookups, rows in the tier)."""
    from runtime.exec.hot_tier import HotTier
    from benchmarks.host_device import HostGpuExecutor

    ex = HostGpuExecutor(encoder, hot_tier_rows=rows, hot_rebuild_every=rebuild_every,
                         max_batch=max(len(b) for b in batches), max_len=max(len(s) for b in batches for s in b))
    rebuild_lookup = [0.0]
    lookup = HotTier.lookup

    def timed(snapshot, windows, version_index):  # the rebuilds' host lookups
        t0 = time.perf_counter()
        out = lookup(snapshot, windows, version_index)
        rebuild_lookup[0] += time.perf_counter() - t0
        return out

    ex.hot.lookup = timed
    hits = misses = 0
    miss_s = rebuild_s = 0.0
    for i, seqs in enumerate(batches):
        h0, m0, s0, r0 = ex.hot.hits, ex.hot.misses, ex.hot.lookup_seconds, rebuild_lookup[0]
        ex._retrieve_hot(snapshot, seqs, [version] * len(seqs))
        if i >= warmup:
            hits += ex.hot.hits - h0
            misses += ex.hot.misses - m0
            miss_s += ex.hot.lookup_seconds - s0
            rebuild_s += rebuild_lookup[0] - r0
    measured = max(1, len(batches) - warmup)
    return hits / max(1, hits + misses), miss_s / measured, rebuild_s / measured, ex.hot.rows


def run_plain(snapshot, version, batches, warmup):
    """Host lookup seconds per measured batch with no tier: every window looked up."""
    from runtime.construct.plot import corpus_windows

    meta = snapshot.meta
    seconds = 0.0
    for i, seqs in enumerate(batches):
        wins, _ = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
        t0 = time.perf_counter()
        snapshot.lookup(version, wins)
        if i >= warmup:
            seconds += time.perf_counter() - t0
    return seconds / max(1, len(batches) - warmup)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--version", default="root")
    p.add_argument("--texts", default=None, help="one request text per line (default: stdlib docstrings)")
    p.add_argument("--rows", default="4096,16384,65536,262144", help="tier sizes (rows) to try")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--rebuild-every", type=int, default=32)
    p.add_argument("--warmup", type=int, default=32, help="batches before measuring")
    args = p.parse_args(argv)

    import torch

    import hkstore
    from runtime.model import stored

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    texts = read_texts(args.texts)
    with hkstore.open(args.store) as st:
        snapshot = st.snapshot()
        snapshot.version_index(args.version)
        encoder = stored.base_encoder(st)
        batches = batches_of(encoder, texts, args.batch, args.max_len)
        if len(batches) <= args.warmup:
            raise SystemExit(f"{len(batches)} batches of texts: need more than --warmup {args.warmup}")
        windows = sum(len(s) for b in batches[args.warmup:] for s in b) / (len(batches) - args.warmup)
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; store {args.store} "
              f"(version {args.version}, d={snapshot.meta['d']}, n={snapshot.meta['n']}, {snapshot.meta['dtype']}); "
              f"{len(texts)} texts in {len(batches)} batches of {args.batch}, {windows:.0f} windows per batch; "
              f"first {args.warmup} batches are warm-up\n")
        # One untimed pass first: the first lookup of a row checks its checksum and faults its
        # page in; every variant below should find the store equally warm.
        run_plain(snapshot, args.version, batches, 0)
        plain = run_plain(snapshot, args.version, batches, args.warmup)
        lines = ["| tier rows | tier bytes | hit rate | host ms / batch: misses | rebuilds | total | vs no tier |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                 f"| 0 | 0 | – | {1000 * plain:.2f} | – | {1000 * plain:.2f} | 1.00x |"]
        row_bytes = snapshot.meta["n"] * snapshot.meta["d"] * 2
        for rows in [int(r) for r in args.rows.split(",") if r]:
            rate, miss_s, rebuild_s, used = run_tier(encoder, snapshot, args.version, batches, rows,
                                                     args.rebuild_every, args.warmup)
            total = miss_s + rebuild_s
            lines.append(f"| {rows:,} | {used * row_bytes / 2**20:.0f} MiB | {100 * rate:.1f}% | {1000 * miss_s:.2f} | "
                         f"{1000 * rebuild_s:.2f} | {1000 * total:.2f} | {total / plain:.2f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
