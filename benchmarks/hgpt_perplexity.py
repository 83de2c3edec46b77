"""Perplexity of the full decoder vs hGPT (causal PLOT inputs + the upper layers), HMI Tables 9/11.

    python -m benchmarks.hgpt_perplexity --model /tmp/hkstore-decoder --lower-layers 2 --n 2 3 5
    python -m benchmarks.hgpt_perplexity --model DIR --store-dir /tmp/hgpt-stores --n 3   # + real stores

The evaluation text is the first --eval-tokens tokens of WikiText-2 test.txt (no table or
model saw it), as the [CLS] doc [SEP] stream of tools.pretrain_decoder, cut into
non-overlapping blocks of the model's context. Rows, each a perplexity per token and per word
of that text:

    full             the decoder itself
    windowed n=N     full coverage: every token's upper-layer input is the decoder's lower layers
                     on exactly [x(i-N+1) .. x(i)] (runtime.plot.causal.windowed_lower): what a
                     causal store holding every window of the text would serve
    store n=N        with --store-dir: a real decoder store built from --corpus (default
                     WikiText-2 valid.txt) by runtime.construct.decoder_store (backoff on the
                     windows it lacks; position table fitted unless --no-position), plus the
                     share of evaluation windows served at each order
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from tools.pretrain_decoder import WIKITEXT, read_lines, stream


def blocks_of(ids, ctx: int, max_tokens: int) -> list[list[int]]:
    ids = ids[:max_tokens + 1].tolist()
    return [ids[s:s + ctx + 1] for s in range(0, len(ids) - 1, ctx) if len(ids[s:s + ctx + 1]) > 1]


def nll_of(dec, blocks, inputs_of, batch: int = 16) -> float:
    """Total negative log-likelihood of the blocks' next tokens; inputs_of(seqs) gives the
    upper layers' inputs (B, L, d) and mask of the blocks' first L tokens."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.no_grad():
        for start in range(0, len(blocks), batch):
            chunk = blocks[start:start + batch]
            h, mask = inputs_of([b[:-1] for b in chunk])
            logits = dec.logits(dec.upper(h, mask))
            y = torch.full(mask.shape, -100, dtype=torch.long)
            for j, b in enumerate(chunk):
                y[j, :len(b) - 1] = torch.tensor(b[1:])
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lower-layers", type=int, default=2)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 3, 5])
    ap.add_argument("--eval-tokens", type=int, default=20_000)
    ap.add_argument("--wikitext", default=WIKITEXT)
    ap.add_argument("--store-dir", default=None, help="also build and evaluate real stores here (one per n)")
    ap.add_argument("--corpus", default=None, help="store corpus (default: WikiText-2 valid.txt)")
    ap.add_argument("--no-position", action="store_true", help="stores without a position table")
    ap.add_argument("--distill-steps", type=int, default=0, help="window-distill the stores' lower layers first")
    ap.add_argument("--no-windowed", action="store_true", help="skip the full-coverage rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    import hkstore
    from runtime.construct.decoder_store import build_decoder
    from runtime.model.decoder import load_decoder
    from runtime.plot.causal import windowed_lower
    from runtime.plot.retrieve import retrieve

    if args.threads:
        torch.set_num_threads(args.threads)
    dec = load_decoder(args.model, lower_layers=args.lower_layers)
    docs = read_lines(os.path.join(args.wikitext, "test.txt"))
    ids = stream(dec.tokenizer, docs)
    blocks = blocks_of(ids, dec.config.max_len, args.eval_tokens)
    tokens = sum(len(b) - 1 for b in blocks)
    # words of the evaluated text: the same share of the test set's words as of its tokens
    words = sum(len(d.split()) + 1 for d in docs) * tokens / (len(ids) - 1)

    def row(name, nll, seconds, **extra):
        r = {"row": name, "token_ppl": round(math.exp(nll / tokens), 2), "word_ppl": round(math.exp(nll / words), 2),
             "seconds": round(seconds, 1), **extra}
        print(json.dumps(r), flush=True)
        return r

    rows = []
    t0 = time.perf_counter()
    rows.append(row("full", nll_of(dec, blocks, lambda s: (lambda x, m: (dec.lower(x, m), m))(*dec.pad(s))),
                    time.perf_counter() - t0))

    def windowed(n):
        def inputs_of(seqs):
            _, mask = dec.pad(seqs)
            h = torch.zeros(*mask.shape, dec.config.d)
            for b, v in enumerate(windowed_lower(dec, seqs, n)):
                h[b, :len(v)] = v
            return h, mask
        return inputs_of

    for n in [] if args.no_windowed else args.n:
        t0 = time.perf_counter()
        rows.append(row(f"windowed n={n}", nll_of(dec, blocks, windowed(n)), time.perf_counter() - t0))
    if args.store_dir:
        corpus = args.corpus or os.path.join(args.wikitext, "valid.txt")
        for n in args.n:
            t0 = time.perf_counter()
            path = os.path.join(args.store_dir, f"n{n}-l{args.lower_layers}")
            built = build_decoder(path, model_path=args.model, corpus_paths=[corpus], n=n,
                                  lower_layers=args.lower_layers, position=not args.no_position, progress=False,
                                  distill_steps=args.distill_steps)
            t1 = time.perf_counter()
            orders = {}
            with hkstore.open(path) as store:
                snap = store.snapshot()

                def inputs_of(seqs, snap=snap):
                    h, mask, served = retrieve(snap, "root", seqs)
                    real = mask.numpy()
                    for k, c in zip(*np.unique(served.order[real], return_counts=True)):
                        orders[int(k)] = orders.get(int(k), 0) + int(c)
                    return h, mask

                nll = nll_of(dec, blocks, inputs_of)
            total = sum(orders.values())
            size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)
            rows.append(row(f"store n={n}" + (f" distilled {args.distill_steps}" if args.distill_steps else ""), nll,
                            time.perf_counter() - t1, build_seconds=round(t1 - t0, 1), distill=built.get("distill"),
                            keys=built["keys"], store_bytes=size, position=built.get("position"),
                            served_by_order={k: round(v / total, 4) for k, v in sorted(orders.items())}))
    result = {"model": os.path.abspath(args.model), "lower_layers": args.lower_layers,
              "num_layers": dec.config.num_layers, "eval_tokens": tokens, "eval_words": round(words), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
