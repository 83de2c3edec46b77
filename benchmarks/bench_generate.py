"""Output tokens/s of generation on the CPU: hGPT (runtime.gen.batcher over a decoder store,
lookups instead of the lower layers) at several numbers of concurrent sequences, next to the
full decoder's own greedy loop (runtime.model.decoder.Decoder.greedy: all layers, KV caches).

    python -m benchmarks.bench_generate --store /tmp/hgpt-stores/n3-l2 --concurrency 1 8 --max-tokens 32

Prompts are the first lines of WikiText-2 test.txt (8 tokens each); greedy; every sequence
runs to max_tokens (EOS is not special here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tools.pretrain_decoder import WIKITEXT, read_lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    import hkstore
    from runtime.model.stored import base_decoder
    from runtime.gen.batcher import Batcher
    from runtime.gen.plot_decode import PlotDecoder
    from runtime.gen.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    store = hkstore.open(args.store)
    dec = base_decoder(store)
    dec.config = dec.config.__class__(**{**dec.config.__dict__, "eos_id": None})  # run every sequence to the end
    gen = PlotDecoder(store.snapshot(), "root", dec)
    lines = [line for line in read_lines(os.path.join(WIKITEXT, "test.txt")) if not line.startswith("=")]
    prompts = [ids[:args.prompt_tokens] for ids in dec.tokenize(lines[:max(args.concurrency)])]
    params = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    t0 = time.perf_counter()
    for p in prompts[:2]:
        dec.greedy(p, args.max_tokens)
    seconds = time.perf_counter() - t0
    rows.append({"row": "full decoder greedy (1 sequence)", "tokens_per_s": round(2 * args.max_tokens / seconds, 1)})
    print(json.dumps(rows[-1]), flush=True)
    for c in args.concurrency:
        b = Batcher(gen, kv_budget_bytes=1 << 34, max_running=c)
        for p in prompts[:c]:
            b.submit(p, params)
        t0 = time.perf_counter()
        steps = 0
        while b.busy:
            b.step()
            steps += 1
        seconds = time.perf_counter() - t0
        rows.append({"row": f"hGPT batcher, {c} concurrent", "tokens_per_s": round(c * args.max_tokens / seconds, 1),
                     "steps": steps, "ms_per_step": round(1000 * seconds / steps, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"store": os.path.abspath(args.store), "n": store.meta["n"],
                      "lower_layers": store.meta["lower_layers"], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
