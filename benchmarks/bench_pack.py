"""How well do PET payloads compress, and what does decompressing them cost against a memcpy?

Builds realistic PET tensor sets for a d=384 encoder with 3 upper layers (MiniLM-L6-like:
ffn width 1536, upper layers 3..5), lays each out exactly as a pack record's raw payload, and
prints a markdown table. Usage: python -m benchmarks.bench_pack [--seed N] [--min-seconds S]

Values are synthetic Gaussians at trained-weight scales: their mantissas are as incompressible
as real weights', so the ratios are representative. Throughputs are cache-hot (payloads of
20-600 KB), so memcpy and xxh64 are upper bounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import xxhash
import zstandard

from formats import pack
# The payload layout is the pack's own, so the sizes measured are the sizes stored.
from formats.pack import _pack_tensors

D, FFN, UPPER = 384, 1536, (3, 4, 5)
# (d_out, d_in) of each target's weight.
SHAPES = {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "ffn_in": (FFN, D), "ffn_out": (D, FFN)}
LEVELS = (1, 3, 9)


def adapter(rng, dtype):
    tensors = {}
    for i in UPPER:
        for target in ("o", "ffn_out"):
            p = f"layers.{i}.adapter.{target}."
            tensors |= {
                p + "down.weight": rng.normal(0, 0.02, (64, D)),
                p + "down.bias": rng.normal(0, 0.01, 64),
                p + "up.weight": rng.normal(0, 0.02, (D, 64)),
                p + "up.bias": rng.normal(0, 0.01, D),
            }
        for ln in ("ln_attn", "ln_ffn"):  # the LayerNorm gain/shift deltas adapters carry
            tensors |= {f"layers.{i}.norm.{ln}.weight": rng.normal(0, 0.01, D),
                        f"layers.{i}.norm.{ln}.bias": rng.normal(0, 0.01, D)}
    return {name: t.astype(dtype) for name, t in tensors.items()}


def lora(rng):
    tensors = {}
    for i in UPPER:
        for target in ("q", "v"):
            d_out, d_in = SHAPES[target]
            tensors[f"layers.{i}.lora.{target}.A"] = rng.normal(0, 1 / np.sqrt(d_in), (16, d_in))
            tensors[f"layers.{i}.lora.{target}.B"] = rng.normal(0, 0.01, (d_out, 16))
    return {name: t.astype(np.float32) for name, t in tensors.items()}


def bitfit(rng):
    return {f"layers.{i}.bias.{t}": rng.normal(0, 0.01, shape[0]).astype(np.float32)
            for i in UPPER for t, shape in SHAPES.items()}


def diff(rng, density=0.005):
    tensors = {}
    for i in UPPER:
        for target, (d_out, d_in) in SHAPES.items():
            size = d_out * d_in
            index = np.sort(rng.choice(size, int(size * density), replace=False)).astype(np.int32)
            tensors[f"layers.{i}.diff.{target}.index"] = index
            value = rng.normal(0, 0.01, len(index)).astype(np.float32)
            tensors[f"layers.{i}.diff.{target}.value"] = value
    return tensors


def head(rng, labels=13):
    return {"head.weight": rng.normal(0, 0.02, (labels, D)).astype(np.float32),
            "head.bias": np.zeros(labels, np.float32)}


def mb_per_s(nbytes, fn, min_seconds):
    """Best-of throughput in MB/s: repeat fn in batches until min_seconds have passed."""
    best, spent, batch = float("inf"), 0.0, 1
    while spent < min_seconds:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed / batch), spent + elapsed
        batch = batch * 2 if elapsed < 0.01 else batch
    return nbytes / best / 1e6


def row(name, tensors, min_seconds):
    raw, _ = _pack_tensors(tensors)
    packed = {level: zstandard.ZstdCompressor(level=level).compress(raw) for level in LEVELS}
    ratios = {level: len(packed[level]) / len(raw) for level in LEVELS}
    level = pack.ZSTD_LEVEL
    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    src, dst = np.frombuffer(raw, np.uint8), np.empty(len(raw), np.uint8)
    compress = mb_per_s(len(raw), lambda: compressor.compress(raw), min_seconds)
    unzstd = mb_per_s(len(raw), lambda: decompressor.decompress(packed[level]), min_seconds)
    memcpy = mb_per_s(len(raw), lambda: np.copyto(dst, src), min_seconds)
    # Every read verifies the payload checksum, so this bounds the zero-copy path too.
    checksum = mb_per_s(len(raw), lambda: xxhash.xxh64_intdigest(raw), min_seconds)
    stored = "zstd" if ratios[level] <= pack.ZSTD_MAX_RATIO else "raw"
    sizes = " | ".join(f"{len(packed[lv]):,} ({ratios[lv]:.3f})" for lv in LEVELS)
    return (f"| {name} | {len(raw):,} | {sizes} | {compress:,.0f} | {unzstd:,.0f} | "
            f"{memcpy:,.0f} | {checksum:,.0f} | {stored} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-seconds", type=float, default=0.5,
                        help="time spent per throughput measurement")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    payloads = {
        "adapter b=64 fp32": adapter(rng, np.float32),
        "adapter b=64 fp16": adapter(rng, np.float16),
        "LoRA r=16 q,v fp32": lora(rng),
        "BitFit bias deltas fp32": bitfit(rng),
        "diff-pruning 0.5% (int32 idx + fp32)": diff(rng),
        "head 13 labels fp32": head(rng),
    }
    level = pack.ZSTD_LEVEL
    print(f"PET payloads, d={D}, upper layers {UPPER}; {platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, zstandard {zstandard.__version__}")
    print()
    print(f"| payload | raw bytes | zstd-1 bytes (ratio) | zstd-3 bytes (ratio) | zstd-9 bytes (ratio) "
          f"| zstd-{level} compress MB/s | zstd-{level} decompress MB/s | memcpy MB/s | xxh64 MB/s "
          f"| stored as (rule: zstd-{level} if ratio <= {pack.ZSTD_MAX_RATIO}) |")
    print("| --- |" + " ---: |" * 8 + " --- |")
    for name, tensors in payloads.items():
        print(row(name, tensors, args.min_seconds))


if __name__ == "__main__":
    main()
