"""HMI Fig. 15 on the CPU: output tokens/s of generation at 1, 10, 100, 1K and 10K tenants.

    python -m benchmarks.bench_tenants_gen --store /tmp/hgpt-stores/n3-l2 --tenants 1 10 100 1000 10000 \
        --rounds 3 --out /tmp/bench_tenants_gen.jsonl --figure figures/tenants_gen.png

Each measurement serves the same workload: --requests requests (prompts: the first lines of
WikiText-2 test.txt, --prompt-tokens each), greedy, every one running to --max-tokens (EOS is
not special here), request j belonging to a tenant drawn uniformly from T (seeded per round).
Systems (one torch thread each, the same base weights):

- hGPT: the decoder store through runtime.gen.batcher (lookups instead of the lower layers,
  continuous batching up to --batch sequences), every request with its tenant's LoRA
  (rank 8 on q and v of the upper layers; all T held in memory, as the server keeps loaded
  PETs), mixed tenants in one step by BGMV / SGMV (runtime.gen.lora_batch);
- hGPT-grouped: the same, but without BGMV / SGMV: decode steps and prefills run one GEMM per
  group of rows sharing a PET (what the batcher does for non-LoRA PETs; before session 10 it
  prefilled each such request alone, which the session-9 figures measured);
- GPT-shared: the full decoder (all layers, no PLOT) through the same batcher, no tenant weights;
- GPT-dedicated: a full fine-tuned copy per tenant: batches hold one tenant, one runs at a time,
  --resident copies stay loaded and any other tenant first copies its full weights from host
  memory into a resident slot (the swap; 8 distinct host copies stand in for T, since T full
  copies do not fit in memory: each swap still copies a full model from outside the caches);
- transformers+PEFT: the HF GPT-2 model of the store's checkpoint with one PEFT LoRA slot
  (r 8 on c_attn of the same upper layers); requests grouped by tenant, the tenant's adapter
  loaded into the slot (set_peft_model_state_dict from host memory), then model.generate on
  the group: what a user would write with transformers and PEFT;
- transformers+PEFT-mixed: the same model with every tenant's adapter loaded under its own name,
  batches of --batch requests in arrival order, each row naming its adapter
  (model.generate(..., adapter_names=[...]): PEFT's mixed-adapter batching);
- hGPT-bf16, transformers+PEFT-mixed-bf16: the same two with the base model's GEMMs in bf16
  (hGPT: runtime.gen.row_precision, weights packed once in bf16; PEFT: the model and its
  adapters loaded in bf16, what a user would deploy), on a CPU with native bf16.

On the CPU both PEFT systems run the base model's projections and LM head on the same oneDNN
packed GEMMs as hGPT (runtime.exec.onednn; each module's forward replaced, its LoRA untouched):
on an AMD CPU MKL's sgemm, transformers' default, keeps to AVX2 code, so without this a ratio
would measure the GEMM library, not the serving.

--device cuda runs hGPT on the GPU executor's decode path (needs CuPy and a GPU) and the two
transformers+PEFT systems on the same GPU through PyTorch; the hGPT-grouped, GPT-shared and
GPT-dedicated baselines stay on the CPU.

Rounds interleave the systems and tenant counts (the order rotates each round); each row is
one (round, T, system) measurement, appended to --out as a JSON line, so a stopped run resumes.
The summary gives the median over rounds, hGPT@T / hGPT@1 and hGPT / transformers+PEFT.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import statistics
import subprocess
import sys
import time

from tools.pretrain_decoder import WIKITEXT, read_lines

SYSTEMS = ("hGPT", "hGPT-bf16", "hGPT-grouped", "GPT-shared", "GPT-dedicated", "transformers+PEFT",
           "transformers+PEFT-mixed", "transformers+PEFT-mixed-bf16")
# PEFT's LoRA targets: GPT-2 fuses q, k, v in one Conv1D (its LoRA covers all three); OPT has q and v apart.
PEFT_TARGETS = {"gpt2": (["c_attn"], True), "opt": (["q_proj", "v_proj"], False)}


# -- the systems ------------------------------------------------------------------------------


class FullGen:
    """The full decoder (no PLOT: all layers run, their KV caches kept) behind the interface
    runtime.gen.batcher drives (prefill / append / decoder): GPT-shared and GPT-dedicated."""

    def __init__(self, decoder):
        self.decoder = decoder  # lower_layers = 0: upper() runs every layer

    def prefill(self, prompt, pet=None):
        import torch

        from runtime.gen.plot_decode import Sequence

        seq = Sequence(list(prompt), len(prompt), pet)
        with torch.no_grad():
            out = self.decoder.upper(self.decoder.lower(torch.tensor([prompt])), pet=pet, kv_cache=seq.cache)
            seq.logits = self.decoder.logits(out[0, -1])
        return seq

    def prefill_many(self, prompts, pets, slots, pool):
        import torch

        from runtime.gen.batched_prefill import prefill_batch
        from runtime.gen.plot_decode import Sequence

        seqs = [Sequence(list(p), len(p), pet, cache=None, slots=sl) for p, pet, sl in zip(prompts, pets, slots)]
        ids, mask = self.decoder.pad(prompts)
        with torch.no_grad():
            logits = prefill_batch(self.decoder, self.decoder.lower(ids, mask), mask, seqs, pool)
        for s, row in zip(seqs, logits):
            s.logits = row
        return seqs

    def append(self, seqs, tokens, pool=None):
        import torch

        from runtime.gen.batched_step import upper_step

        for s, t in zip(seqs, tokens):
            s.ids.append(int(t))
        positions = torch.tensor([len(s.ids) - 1 for s in seqs])
        with torch.no_grad():
            h = self.decoder.embed(torch.tensor(tokens), positions)
            for s, logits in zip(seqs, upper_step(self.decoder, seqs, h, pool)):
                s.logits = logits


def run_batcher(gen, prompts, pets, max_tokens, batch):
    from runtime.gen.batcher import Batcher
    from runtime.gen.sampling import SamplingParams

    b = Batcher(gen, kv_budget_bytes=1 << 34, max_running=batch)
    params = SamplingParams(max_tokens=max_tokens)
    for p, pet in zip(prompts, pets):
        b.submit(p, params, pet)
    b.run()
    return b.tokens


class Bench:
    def __init__(self, args):
        import torch

        import hkstore
        from runtime.model.decoder import load_decoder
        from runtime.model.stored import base_decoder

        torch.set_num_threads(args.threads)
        self.args = args
        self.store = hkstore.open(args.store)
        self.model_path = args.model or self.store.meta["model_path"]
        self.dec = self._no_eos(base_decoder(self.store))
        self._full = None
        lines = [x for x in read_lines(os.path.join(WIKITEXT, "test.txt")) if not x.startswith("=")]
        ids = [t for t in self.dec.tokenize(lines[:20 * args.requests]) if len(t) >= args.prompt_tokens]
        self.prompts = [t[:args.prompt_tokens] for t in ids[:args.requests]]
        self.upper = list(range(self.dec.lower_layers, self.dec.config.num_layers))
        self.pets, self.peft_states, self.host_copies, self.slots = [], [], [], []
        self.slot_of: dict[int, int] = {}  # GPT-dedicated: tenant -> its resident slot
        self.peft = self.peft_mixed = None

    @property
    def full(self):
        """The full decoder (GPT-shared), loaded on first use: a second copy of the weights."""
        if self._full is None:
            from runtime.model.decoder import load_decoder

            self._full = self._no_eos(load_decoder(self.model_path, lower_layers=0)).eval()
        return self._full

    @staticmethod
    def _no_eos(dec):
        dec.config = dec.config.__class__(**{**dec.config.__dict__, "eos_id": None})
        return dec

    # tenants' weights, made once up to the largest count

    def lora_pets(self, T):
        import torch

        from runtime.model.pet import Pet

        c, r = self.dec.config, self.args.rank
        g = torch.Generator().manual_seed(len(self.pets))
        while len(self.pets) < T:
            tensors = {}
            for i in self.upper:
                for t, d_out in (("q", c.heads * c.head_dim), ("v", c.kv_heads * c.head_dim)):
                    tensors[f"layers.{i}.lora.{t}.A"] = torch.randn(r, c.d, generator=g) / c.d ** 0.5
                    tensors[f"layers.{i}.lora.{t}.B"] = torch.randn(d_out, r, generator=g) * 0.01
            self.pets.append(Pet(tensors, {"pet_type": "lora", "task": "lm", "rank": r, "scale": 2.0}))
        return self.pets[:T]

    def _peft_base(self, dtype=None):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        dtype = dtype or torch.float32
        base = AutoModelForCausalLM.from_pretrained(self.model_path, torch_dtype=dtype).eval()
        base.to(self.args.device)
        targets, fan_in_fan_out = PEFT_TARGETS[self.dec.config.arch]
        self.peft_config = LoraConfig(r=self.args.rank, lora_alpha=2 * self.args.rank, target_modules=targets,
                                      layers_to_transform=self.upper, fan_in_fan_out=fan_in_fan_out,
                                      lora_dropout=0.0)
        model = get_peft_model(base, self.peft_config, autocast_adapter_dtype=False).eval()
        if self.args.device == "cpu":
            packed_gemms(model, dtype)
        return model

    def peft_model(self):
        if self.peft is None:
            self.peft = self._peft_base()
        return self.peft

    def peft_mixed_model(self, T, dtype=None):
        """A PEFT model holding tenants 0..T-1's adapters, named t0, t1, ... (loaded once; one
        model per dtype, default fp32)."""
        import torch

        from peft.tuners.lora import LoraLayer

        dtype = dtype or torch.float32
        if self.peft_mixed is None:
            self.peft_mixed = {}
        if dtype not in self.peft_mixed:
            model = self._peft_base(dtype)
            self.peft_mixed[dtype] = [model, 0, [m for m in model.modules() if isinstance(m, LoraLayer)]]
        model, named, layers = self.peft_mixed[dtype]
        states, cfg = self.peft_tenants(T), self.peft_config
        while named < T:
            name = f"t{named}"
            # What add_adapter and set_peft_model_state_dict do, without their walks over every
            # module, adapter and the whole state dict per call (quadratic: hours at 1,000): the
            # first adapter is made by PEFT, each later one copies its entries, then its weights.
            for m in layers:
                if name == "t0":
                    m.update_layer(name, cfg.r, cfg.lora_alpha, config=cfg)
                    continue
                for attr in m.adapter_layer_names + m.other_param_names:
                    entries = getattr(m, attr, None)
                    if hasattr(entries, "keys") and "t0" in entries:
                        entries[name] = copy.deepcopy(entries["t0"])
            model.peft_config[name] = cfg
            with torch.no_grad():
                for key, value in states[named].items():
                    at = key.replace(".lora_A.weight", f".lora_A.{name}.weight").replace(
                        ".lora_B.weight", f".lora_B.{name}.weight")
                    model.get_parameter(at).copy_(value)
            named += 1
        self.peft_mixed[dtype][1] = named
        return model.eval()

    def peft_tenants(self, T):
        import torch
        from peft import get_peft_model_state_dict

        shapes = {k: v.shape for k, v in get_peft_model_state_dict(self.peft_model()).items()}
        g = torch.Generator().manual_seed(len(self.peft_states))
        while len(self.peft_states) < T:
            self.peft_states.append({k: torch.randn(s, generator=g) * (0.01 if "lora_B" in k else 0.06)
                                     for k, s in shapes.items()})
        return self.peft_states[:T]

    def dedicated_copies(self):
        import torch

        from runtime.model.decoder import load_decoder

        if not self.host_copies:
            base = self.full.state_dict()
            g = torch.Generator().manual_seed(0)
            self.host_copies = [{k: v + torch.randn(v.shape, generator=g) * 1e-3 if v.is_floating_point() else v.clone()
                                 for k, v in base.items()} for _ in range(8)]
            self.slots = [self._no_eos(load_decoder(self.model_path, lower_layers=0)).eval()
                          for _ in range(self.args.resident)]
        return self.host_copies

    # one measurement: (output tokens, wall seconds, CPU seconds, swaps)

    def measure(self, system, tenants):
        a = self.args
        self._start()
        swaps = 0
        if system in ("hGPT", "hGPT-bf16", "hGPT-grouped"):
            from runtime.gen import batched_step, batcher, plot_decode
            from runtime.gen.lora_batch import lora_only
            from runtime.gen.plot_decode import PlotDecoder

            pets = self.lora_pets(max(tenants) + 1)
            gen = PlotDecoder(self.store.snapshot(), "root", self.dec,
                              precision="bf16" if system == "hGPT-bf16" else "fp32")
            if a.device == "cuda":  # the GPU executor's decode path (BGMV / SGMV kernels, KV pool on the device)
                from runtime.exec.gpu_decoder import GpuDecoderExecutor
                from runtime.gen.device_decode import DevicePlotDecoder

                self.executor = getattr(self, "executor", None) or GpuDecoderExecutor(self.dec)
                gen = DevicePlotDecoder(self.store.snapshot(), "root", self.dec, executor=self.executor)
            batched_step.lora_only = batcher.lora_only = plot_decode.lora_only = (
                lora_only if system != "hGPT-grouped" else (lambda pet: pet is None))
            self._start()
            try:
                tokens = run_batcher(gen, self.prompts, [pets[t] for t in tenants], a.max_tokens, a.batch)
            finally:
                batched_step.lora_only = batcher.lora_only = plot_decode.lora_only = lora_only
        elif system == "GPT-shared":
            full = self.full  # (loaded on first use, outside the clocks)
            self._start()
            tokens = run_batcher(FullGen(full), self.prompts, [None] * len(tenants), a.max_tokens, a.batch)
        elif system == "GPT-dedicated":
            import torch

            copies = self.dedicated_copies()
            resident: list = []  # tenants in the slots, least recently used first
            self._start()
            tokens = 0
            for tenant, rows in self._groups(tenants):
                if tenant in resident:
                    resident.remove(tenant)
                    slot = self.slot_of[tenant]
                else:
                    if len(resident) < len(self.slots):
                        slot = len(resident)
                    else:
                        slot = self.slot_of.pop(resident.pop(0))
                    with torch.no_grad():
                        for name, p in self.slots[slot].state_dict().items():
                            p.copy_(copies[tenant % len(copies)][name])
                    swaps += 1
                self.slot_of[tenant] = slot
                resident.append(tenant)
                tokens += run_batcher(FullGen(self.slots[slot]), [self.prompts[j] for j in rows], [None] * len(rows),
                                      a.max_tokens, a.batch)
        elif system in ("transformers+PEFT-mixed", "transformers+PEFT-mixed-bf16"):
            import torch

            model = self.peft_mixed_model(max(tenants) + 1, torch.bfloat16 if system.endswith("bf16") else None)
            self._start()
            tokens = 0
            for k in range(0, len(tenants), a.batch):
                tokens += self._peft_generate(model, list(range(k, min(k + a.batch, len(tenants)))),
                                              adapter_names=[f"t{t}" for t in tenants[k:k + a.batch]])
        else:
            from peft import set_peft_model_state_dict

            model = self.peft_model()
            states = self.peft_tenants(max(tenants) + 1)
            self._start()
            tokens, current = 0, None
            for tenant, rows in self._groups(tenants):
                if tenant != current:
                    set_peft_model_state_dict(model, states[tenant])
                    current = tenant
                    swaps += 1
                tokens += self._peft_generate(model, rows)
        wall, cpu = time.perf_counter() - self._t0[0], time.process_time() - self._t0[1]
        return tokens, wall, cpu, swaps

    def _start(self):
        """Start the clocks: wall time, and this process's CPU time (what a loaded machine's
        share of the cores does not change as much)."""
        self._t0 = (time.perf_counter(), time.process_time())

    def _peft_generate(self, model, rows, **kw):
        """Greedy model.generate on the prompts of rows (all of one length); output tokens."""
        import torch

        ids = torch.tensor([self.prompts[j] for j in rows], device=self.args.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=self.args.max_tokens, min_new_tokens=self.args.max_tokens,
                                 pad_token_id=0, **kw)
        out = out.cpu()  # the tokens are on the host before the clock stops, as a server's would be
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def _groups(self, tenants):
        """(tenant, request indices) in first-arrival order, at most --batch a group."""
        order: dict[int, list[int]] = {}
        for j, t in enumerate(tenants):
            order.setdefault(t, []).append(j)
        for t, rows in order.items():
            for k in range(0, len(rows), self.args.batch):
                yield t, rows[k:k + self.args.batch]


def packed_gemms(model, dtype) -> None:
    """Run every base projection and the LM head of a transformers (+ PEFT) model on oneDNN's
    packed GEMMs in dtype (runtime.exec.onednn, as hGPT's step); LoRA's own layers stay as they are."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from runtime.exec import onednn, precision

    if not onednn.available():
        return
    packer = onednn.SHARED if dtype == torch.float32 else precision.shared_bf16()
    for name, m in model.named_modules():
        if ".lora_" in name or not isinstance(m, (torch.nn.Linear, Conv1D)):
            continue
        # Conv1D keeps W^T (d_in, d_out): a transposed copy, kept on the module, is what gets packed
        w = m.weight if isinstance(m, torch.nn.Linear) else m.weight.detach().t().contiguous()
        m._packed_w = w

        def forward(x, m=m, w=w):
            y = packer.linear(x.reshape(-1, x.shape[-1]), w, m.bias)
            return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

        m.forward = forward


# -- the run ------------------------------------------------------------------------------------


def load(path):
    rows = []
    if path and os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows


def summarize(rows, counts, systems):
    med = {}
    for s in systems:
        for T in counts:
            xs = [r["tokens_per_s"] for r in rows if r["system"] == s and r["tenants"] == T]
            if xs:
                med[(s, T)] = statistics.median(xs)
    table = []
    for T in counts:
        row = {"tenants": T, **{s: round(med[(s, T)], 1) for s in systems if (s, T) in med}}
        if ("hGPT", T) in med and ("hGPT", counts[0]) in med:
            row["hGPT@T/@1"] = round(med[("hGPT", T)] / med[("hGPT", counts[0])], 3)
        if ("hGPT", T) in med and ("transformers+PEFT", T) in med:
            row["hGPT/PEFT"] = round(med[("hGPT", T)] / med[("transformers+PEFT", T)], 2)
        table.append(row)
    return med, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a decoder store (its model_path is the checkpoint)")
    ap.add_argument("--model", help="the HF checkpoint directory (default: the store's model_path)")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 10, 100, 1000, 10000])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="sequences running together at most")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--resident", type=int, default=4, help="GPT-dedicated: full copies kept loaded")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: hGPT on the GPU executor (runtime.gen.device_decode); the other systems stay on the CPU")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_tenants_gen.jsonl"), help="JSON lines, one per measurement (resume)")
    ap.add_argument("--figure", default=None, help="PNG of tokens/s against tenants")
    args = ap.parse_args(argv)

    import numpy as np

    rows = load(args.out)
    done = {(r["round"], r["tenants"], r["system"]) for r in rows}
    plan = []
    for rnd in range(args.rounds):
        pairs = [(T, s) for T in args.tenants for s in args.systems]
        shift = (rnd * len(args.systems) + rnd) % len(pairs)
        plan += [(rnd, T, s) for T, s in pairs[shift:] + pairs[:shift] if (rnd, T, s) not in done]
    bench = Bench(args)
    print(f"# {len(plan)} measurements to go ({len(done)} done in {args.out}); {uptime()}", flush=True)
    t_start = time.perf_counter()
    for k, (rnd, T, system) in enumerate(plan):
        tenants = np.random.default_rng(1000 * rnd + T).integers(T, size=len(bench.prompts)).tolist()
        tokens, seconds, cpu, swaps = bench.measure(system, tenants)
        row = {"round": rnd, "tenants": T, "system": system, "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 2), "cpu_seconds": round(cpu, 3),
               "tokens_per_cpu_s": round(tokens / cpu, 2), "swaps": swaps, "distinct": len(set(tenants)),
               "load": os.getloadavg()[0], "device": args.device if system == "hGPT" else "cpu"}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        elapsed = time.perf_counter() - t_start
        eta = elapsed / (k + 1) * (len(plan) - k - 1)
        print(json.dumps(row) + f"  [{k + 1}/{len(plan)}, ETA {eta:.0f} s]", flush=True)
    med, table = summarize(rows, args.tenants, args.systems)
    print(json.dumps({"store": os.path.abspath(args.store), "requests": len(bench.prompts), "batch": args.batch,
                      "max_tokens": args.max_tokens, "threads": args.threads, "device": args.device, "uptime": uptime(),
                      "median_tokens_per_s": table}, indent=1))
    if args.figure:
        from tools.plots import line_plot

        series = {s: ([T for T in args.tenants if (s, T) in med], [med[(s, T)] for T in args.tenants if (s, T) in med])
                  for s in args.systems}
        print(line_plot(series, "tenants", "output tokens/s (median of rounds)", args.figure, logx=True,
                        title=f"Generation, {len(bench.prompts)} requests x {args.max_tokens} tokens, CPU, 1 thread"))
    return 0


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], check=False, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average {os.getloadavg()}"


if __name__ == "__main__":
    sys.exit(main())
