"""What serving a decoder tenant in bf16 costs, on text it never trained on, and what the
per-tenant choice (lm_tenant_create at precision auto) keeps.

    python -m experiments.decoder_precision --model DECODER --out OUT

DECODER is tools.pretrain_decoder's. A decoder store (n = 3, 2 lower layers) is built from
WikiText-2 valid.txt, then one lm tenant (LoRA r8, 3 epochs, lm_tenant_create's defaults)
per domain of the SciBERT suite, trained on the first --train texts of its train split; its
held-out text is the first --test texts of its test split. Per tenant: the precision
lm_tenant_create recorded (measured on its training text), its held-out perplexity through
generation's GEMMs in fp32 and in bf16 (decoder_tenant.served_perplexities), and how many
greedy continuations (--max-tokens of --prompts 8-token prompts from the held-out text, through
DecoderRuntime) come out identical in bf16 and in fp32.

Results in OUT/decoder-precision.json (resumable: finished tenants are skipped); --write also
merges the summary into benchmarks/results/decoders_124m.json ("decoder_precision").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
DOMAINS = {  # tenant: its texts in the suite (text_classification: JSON lines; ner: CoNLL)
    "acl": "scibert/text_classification/citation_intent",
    "chemprot": "scibert/text_classification/chemprot",
    "scicite": "scibert/text_classification/sci-cite",
    "ncbi": "scibert/ner/NCBI-disease",
    "sciie": "scibert/ner/sciie",
}
RESULTS = ROOT / "benchmarks" / "results" / "decoders_124m.json"  # its section holds the decoders' bf16 figures


def texts(path: Path, limit: int) -> list[str]:
    """The first `limit` texts of a split: a JSON line's text, or a CoNLL sentence's tokens."""
    from runtime.construct.data import read_classification, read_conll

    if "text_classification" in str(path):
        return read_classification(path)[0][:limit]
    return [" ".join(words) for words in read_conll(path)[0][:limit]]


def held_out(store_path, tenant, lines) -> tuple[dict, int]:
    """({"fp32": ppl, "bf16": ppl}, tokens) of lines under tenant, through generation's GEMMs."""
    import hkstore
    from runtime.construct.decoder_store import tokenize_decoder_corpus
    from runtime.construct.decoder_tenant import load_lm_pet, served_perplexities
    from runtime.model.stored import base_decoder
    from runtime.plot.retrieve import retrieve_list

    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        dec = base_decoder(store)
        pet = load_lm_pet(store, tenant, dec)
        seqs = [s for s in tokenize_decoder_corpus(dec, lines, dec.config.max_len) if len(s) > 1]
        inputs = retrieve_list(snap, snap.read_pet(tenant).meta["version"], seqs)
    scores, _ = served_perplexities(dec, pet, inputs, seqs)
    return scores, sum(len(s) - 1 for s in seqs)


def greedy_agreement(store_path, tenant, lines, prompts: int, max_tokens: int) -> dict:
    """How many of the greedy continuations of 8-token prompts are identical at bf16 and fp32."""
    from runtime.gen.api import DecoderRuntime

    out = {}
    for dtype in ("fp32", "bf16"):
        with DecoderRuntime(store_path, dtype=dtype) as rt:
            ids = [s[:8] for s in rt.decoder.tokenize(lines) if len(s) >= 8][:prompts]
            reqs = [{"tenant": tenant, "prompt": p, "max_tokens": max_tokens} for p in ids]
            out[dtype] = [r["ids"] for r in rt.generate(reqs)]
    same = sum(a == b for a, b in zip(out["fp32"], out["bf16"]))
    return {"prompts": len(out["fp32"]), "identical": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a decoder from tools.pretrain_decoder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=str(DATA), help="the shared data directory (WikiText-2 and the suite)")
    ap.add_argument("--tenants", default=",".join(DOMAINS))
    ap.add_argument("--train", type=int, default=400, help="training texts a tenant")
    ap.add_argument("--test", type=int, default=200, help="held-out texts a tenant")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--write", action="store_true", help=f"merge the summary into {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args(argv)

    import torch

    from runtime.construct.decoder_store import build_decoder
    from runtime.construct.decoder_tenant import lm_tenant_create

    torch.set_num_threads(1)
    out, data = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "decoder-precision.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    store = out / "store"
    if not (out / "store.built").exists():  # (build_decoder resumes an unfinished build)
        t0 = time.time()
        build_decoder(store, model_path=args.model, corpus_paths=[data / "wikitext-2" / "valid.txt"], n=3,
                      lower_layers=2, progress=True)
        (out / "store.built").write_text(f"{time.time() - t0:.0f} s\n")
    names = args.tenants.split(",")
    for k, tenant in enumerate(names):
        if tenant in results:
            continue
        t0 = time.time()
        split = data / DOMAINS[tenant]
        (out / f"{tenant}.train.txt").write_text("\n".join(texts(split / "train.txt", args.train)) + "\n")
        made = lm_tenant_create(store, tenant, train_path=out / f"{tenant}.train.txt", replace=True, progress=False)
        test = texts(split / "test.txt", args.test)
        scores, tokens = held_out(store, tenant, test)
        results[tenant] = {"chosen": made["precision"], "training": made["precision_check"].get("scores"),
                           "held_out": scores, "held_out_tokens": tokens,
                           "held_out_rise": round(scores["bf16"] / scores["fp32"] - 1, 6),
                           "greedy": greedy_agreement(store, tenant, test, args.prompts, args.max_tokens),
                           "train_ppl": [made["train_ppl_before"], made["train_ppl_after"]]}
        results_path.write_text(json.dumps(results, indent=1))
        print(f"[{k + 1}/{len(names)}] {tenant}: {json.dumps(results[tenant])} ({time.time() - t0:.0f} s)", flush=True)
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    if args.write:
        from benchmarks.claims import merge

        merge(RESULTS, {"decoder_precision": summary})


def summarize(results: dict) -> dict:
    """The claims of BENCHMARKS' decoder section (per tenant, lists: the document's table need not show them)."""
    from benchmarks.bench_cores import cpu_model

    rows = list(results.values())
    pct = lambda x: round(100 * x, 2)  # noqa: E731
    return {
        "tenants": len(rows),
        "chosen_bf16": sum(r["chosen"] == "bf16" for r in rows),
        "max_training_rise_pct": pct(max(r["training"]["bf16"] / r["training"]["fp32"] - 1 for r in rows)),
        "max_held_out_rise_pct": pct(max(r["held_out_rise"] for r in rows)),
        "greedy_identical_pct": pct(sum(r["greedy"]["identical"] for r in rows)
                                    / sum(r["greedy"]["prompts"] for r in rows)),
        "per_tenant": [[name, r["chosen"], r["training"]["fp32"], r["training"]["bf16"], r["held_out"]["fp32"],
                        r["held_out"]["bf16"], r["greedy"]["identical"], r["greedy"]["prompts"]]
                       for name, r in results.items()],
        "machine": f"{cpu_model()}, {os.cpu_count()} cores", "load": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d"),
    }


if __name__ == "__main__":
    main()
