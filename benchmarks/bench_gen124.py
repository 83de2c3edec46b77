"""Generation at a realistic decoder size: hGPT against transformers + PEFT on a randomly
initialized GPT-2-small-shaped (124M) or OPT-125m-shaped decoder.

    python -m benchmarks.bench_gen124 --work OUT --shape gpt2-124m --tenants 1 10 100 1000 \
        --rounds 3 --requests 64 --max-tokens 32 --json benchmarks/results/decoders_124m.json

Speed does not depend on trained weights, so the checkpoint is made here (seeded, Hugging Face
layout: OUT/SHAPE/model) with the embedded MiniLM WordPiece tokenizer (its 30,522 ids are the
prompts' ids; the embedding and LM head keep the shape's full vocabulary) and a decoder store is
built on it (n = 3, --lower-layers lower layers as lookups, valued on the first --corpus-lines
lines of WikiText-2 valid.txt plus every uni-gram; no position table). Then
benchmarks.bench_tenants_gen measures hGPT, transformers+PEFT (one adapter slot, switched per
tenant) and transformers+PEFT-mixed (every tenant's adapter loaded, model.generate(...,
adapter_names=[...])) on the same weights and workload, rounds interleaved and rotating; the
summary here is the median over rounds of the ratios within each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from tools.pretrain_decoder import WIKITEXT, read_lines

SYSTEMS = ("hGPT", "transformers+PEFT-mixed", "transformers+PEFT")
SHAPES = {
    "gpt2-124m": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_positions": 1024},
    "opt-125m": {"model_type": "opt", "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "ffn_dim": 3072, "max_position_embeddings": 2048,
                 "word_embed_proj_dim": 768, "do_layer_norm_before": True},
}


def make_checkpoint(out: str, shape: str, seed: int = 0) -> str:
    """A seeded random checkpoint of the shape in out (kept: a rerun reuses it)."""
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.pretrain_decoder import decoder_tokenizer

    tok = decoder_tokenizer("minilm")
    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tok.token_to_id("[CLS]"),
                                  eos_token_id=tok.token_to_id("[SEP]"), pad_token_id=tok.token_to_id("[PAD]"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


def make_store(work: str, model: str, lower_layers: int, corpus_lines: int) -> str:
    store = os.path.join(work, f"n3-l{lower_layers}")
    if os.path.exists(os.path.join(store, "CURRENT")):
        return store
    from runtime.construct.decoder_store import build_decoder

    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(read_lines(os.path.join(WIKITEXT, "valid.txt"))[:corpus_lines]) + "\n")
    print(json.dumps(build_decoder(store, model_path=model, corpus_paths=[corpus], n=3, lower_layers=lower_layers,
                                   position=False, progress=False)), flush=True)
    return store


def per_round(rows, counts, key="tokens_per_s"):
    """Median over rounds of each within-round ratio of the rate `key` (tokens per wall or per
    CPU second): hGPT / each PEFT system at every count, and hGPT@T / hGPT@first count."""
    rate = {(r["round"], r["tenants"], r["system"]): r[key] for r in rows if key in r}
    rounds = sorted({r["round"] for r in rows})
    out = []
    for T in counts:
        row = {"tenants": T}
        for s in SYSTEMS:
            xs = [rate[(k, T, s)] for k in rounds if (k, T, s) in rate]
            row[s] = round(statistics.median(xs), 1) if xs else None
        for name, num, den in (("hGPT/PEFT-mixed", (T, "hGPT"), (T, "transformers+PEFT-mixed")),
                               ("hGPT/PEFT-switch", (T, "hGPT"), (T, "transformers+PEFT")),
                               ("hGPT@T/@1", (T, "hGPT"), (counts[0], "hGPT"))):
            xs = [rate[(k, *num)] / rate[(k, *den)] for k in rounds if (k, *num) in rate and (k, *den) in rate]
            row[name] = round(statistics.median(xs), 2) if xs else None
            row[name + " rounds"] = [round(x, 2) for x in xs]
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="directory for the checkpoint, the store and the raw rows")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-124m")
    ap.add_argument("--lower-layers", type=int, default=2)
    ap.add_argument("--corpus-lines", type=int, default=300)
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 10, 100, 1000])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: hGPT and both transformers+PEFT systems on the GPU")
    ap.add_argument("--json", default=None, help="write the summary here (JSON)")
    args = ap.parse_args(argv)
    if args.lower_layers < 0:
        ap.error("--lower-layers must be at least 0")

    from benchmarks import bench_tenants_gen

    work = os.path.join(args.work, args.shape)
    os.makedirs(work, exist_ok=True)
    model = make_checkpoint(os.path.join(work, "model"), args.shape)
    store = make_store(work, model, args.lower_layers, args.corpus_lines)
    raw = os.path.join(work, "rows.jsonl")
    bench_tenants_gen.main(["--store", store, "--tenants", *map(str, args.tenants), "--systems", *args.systems,
                            "--rounds", str(args.rounds), "--requests", str(args.requests), "--batch", str(args.batch),
                            "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
                            "--device", args.device, "--out", raw])
    rows = bench_tenants_gen.load(raw)
    summary = {"shape": args.shape, "device": args.device, "lower_layers": args.lower_layers, "requests": args.requests,
               "max_tokens": args.max_tokens, "batch": args.batch, "rounds": args.rounds,
               "load": [min(r["load"] for r in rows), max(r["load"] for r in rows)],
               "table": per_round(rows, args.tenants), "table_cpu": per_round(rows, args.tenants, "tokens_per_cpu_s"),
               "uptime": bench_tenants_gen.uptime()}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
