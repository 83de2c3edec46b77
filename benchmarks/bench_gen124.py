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
adapter_names=[...])) on the same weights and workload, every base GEMM of both sides on the
same oneDNN packed weights, and both hGPT and PEFT mixed again in bf16 (hGPT-bf16,
transformers+PEFT-mixed-bf16: where the CPU has native bf16), rounds interleaved and rotating;
the summary here is the median over rounds of the ratios within each round, and how many of
the greedy tokens bf16 leaves as fp32 chose them, on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from tools.pretrain_decoder import WIKITEXT, read_lines

SYSTEMS = ("hGPT", "hGPT-bf16", "transformers+PEFT-mixed", "transformers+PEFT-mixed-bf16", "transformers+PEFT")
# (name, numerator, denominator) of each ratio the summary gives
RATIOS = (("hGPT/PEFT-mixed", "hGPT", "transformers+PEFT-mixed"),
          ("hGPT-bf16/PEFT-mixed-bf16", "hGPT-bf16", "transformers+PEFT-mixed-bf16"),
          ("hGPT-bf16/PEFT-mixed", "hGPT-bf16", "transformers+PEFT-mixed"),
          ("hGPT/PEFT-switch", "hGPT", "transformers+PEFT"),
          ("hGPT-bf16/hGPT", "hGPT-bf16", "hGPT"),
          ("PEFT-mixed-bf16/PEFT-mixed", "transformers+PEFT-mixed-bf16", "transformers+PEFT-mixed"))
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
    CPU second): each of RATIOS at every count, and hGPT@T / hGPT@first count."""
    rate = {(r["round"], r["tenants"], r["system"]): r[key] for r in rows if key in r}
    rounds = sorted({r["round"] for r in rows})
    out = []
    for T in counts:
        row = {"tenants": T}
        for s in SYSTEMS:
            xs = [rate[(k, T, s)] for k in rounds if (k, T, s) in rate]
            row[s] = round(statistics.median(xs), 1) if xs else None
        for name, num, den in (*(((name, (T, a), (T, b)) for name, a, b in RATIOS)),
                               ("hGPT@T/@1", (T, "hGPT"), (counts[0], "hGPT"))):
            xs = [rate[(k, *num)] / rate[(k, *den)] for k in rounds if (k, *num) in rate and (k, *den) in rate]
            row[name] = round(statistics.median(xs), 2) if xs else None
            row[name + " rounds"] = [round(x, 2) for x in xs]
        out.append(row)
    return out


def agreement(runs: list[list[int]], refs: list[list[int]]) -> dict:
    """How far greedy runs keep to reference runs of the same requests: the share of requests
    identical throughout, and of tokens generated before a request's first differing one
    (after it the two continue different texts, so later tokens are not compared)."""
    same = kept = total = 0
    for got, want in zip(runs, refs):
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        same += got == want
        kept, total = kept + k, total + len(want)
    return {"requests_identical": round(same / len(refs), 3), "tokens_before_divergence": round(kept / total, 3)}


def greedy_tokens(store: str, tenants: int, requests: int, max_tokens: int, prompt_tokens: int, batch: int) -> dict:
    """bf16 against fp32 greedy tokens, the benchmark's requests at `tenants` tenants, on each side:
    {"hGPT": agreement, "transformers+PEFT-mixed": agreement}."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from benchmarks.bench_tenants_gen import Bench
    from runtime.gen.batcher import Batcher
    from runtime.gen.plot_decode import PlotDecoder
    from runtime.gen.sampling import SamplingParams

    bench = Bench(SimpleNamespace(store=store, model=None, threads=torch.get_num_threads(), requests=requests,
                                  prompt_tokens=prompt_tokens, rank=8, batch=batch, max_tokens=max_tokens,
                                  device="cpu", resident=1))
    who = np.random.default_rng(tenants).integers(tenants, size=len(bench.prompts)).tolist()
    pets = bench.lora_pets(tenants)

    def hgpt(precision):
        b = Batcher(PlotDecoder(bench.store.snapshot(), "root", bench.dec, precision=precision), 1 << 34, batch)
        rids = [b.submit(p, SamplingParams(max_tokens=max_tokens), pets[t]) for p, t in zip(bench.prompts, who)]
        b.run()
        return [b.result(r)["ids"] for r in rids]

    def peft(dtype):
        model = bench.peft_mixed_model(tenants, dtype)
        out = []
        for k in range(0, len(who), batch):
            ids = torch.tensor(bench.prompts[k:k + batch])
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
                                     adapter_names=[f"t{t}" for t in who[k:k + batch]])
            out += gen[:, ids.shape[1]:].tolist()
        return out

    return {"tenants": tenants, "hGPT": agreement(hgpt("bf16"), hgpt("fp32")),
            "transformers+PEFT-mixed": agreement(peft(torch.bfloat16), peft(None))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="directory for the checkpoint, the store and the raw rows")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-124m")
    ap.add_argument("--lower-layers", type=int, default=2)
    ap.add_argument("--corpus-lines", type=int, default=300)
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 10, 100, 1000])
    ap.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                    help="default: all (the bf16 ones where the CPU has native bf16)")
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
    from runtime.exec.precision import bf16_native

    bf16 = bf16_native() is not None
    if args.systems is None:
        args.systems = [s for s in SYSTEMS if bf16 or not s.endswith("bf16")]
    elif not bf16 and any(s.endswith("bf16") for s in args.systems):
        ap.error("the bf16 systems need a CPU with AVX512_BF16 or AMX-BF16; this one has neither")

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
    if "hGPT-bf16" in args.systems and "transformers+PEFT-mixed-bf16" in args.systems and args.device == "cpu":
        summary["bf16_greedy_agreement"] = greedy_tokens(store, args.tenants[0], args.requests, args.max_tokens,
                                                         args.prompt_tokens, args.batch)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
