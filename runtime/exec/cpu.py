"""The reference executor (PyTorch, CPU): the upper layers once for a mixed-tenant batch.

Per upper layer the shared projections run once for every row of the batch (one GEMM each:
on the batched kernels oneDNN's on weights packed once, runtime.exec.onednn, where torch has
oneDNN, or ``gemm="addmm"``, MKL's through torch.addmm);
the tenants' edits follow through runtime.exec.ops_cpu on the batch plan's segments
(runtime.exec.plan.plan_batch: requests of a tenant are contiguous, one segment per tenant):

* LoRA: SGMV over the segments (``sgmv``), or BGMV per row when every LoRA request of the
  batch is its own tenant (``bgmv``), with the stacked (rank-padded) A and B;
* BitFit: ``bias_gather`` of the stacked bias deltas;
* diff pruning (and mask PETs, as diffs): ``sparse_add`` of the concatenated COO deltas;
* adapters: ``segmented_adapter`` on the output of the projection they wrap (o, ffn_out);
* LayerNorm deltas: ``segmented_layernorm`` (each segment's gain and shift);
* heads: one small GEMM per tenant (classification reads [CLS], tagging every token).

With ``prefetch=True`` the stacked weights of layer i+1 are built on a helper thread while
layer i computes (the CPU counterpart of the GPU executor's layer-wise prefetch).

``kernels="batched"`` (the default) runs the same edits through runtime.exec.cpu_batched
instead: the plan puts tenants with equal request counts next to each other, and every run
of such segments is one bmm/baddbmm on a view of the activations and a slice of the stacked
weights (stacked into reused buffers), attention is torch's fused scaled_dot_product_attention,
and residual + LayerNorm (+ the tenants' deltas) run as one pass. ``kernels="reference"``
keeps the per-segment ops_cpu calls (the specification; tests compare the two).

Full rows (runtime.exec.rows: a tenant's full-depth PET, from the base embeddings) first run the
lower layers with their PETs as a batch of their own (``lower_full``: the same layer function,
kernels and plan machinery, int8 included), then join the batch's other rows at the first upper layer.

``precision`` (runtime.exec.precision): every row fp32, every row bf16 (the shared GEMMs on
weights packed in bf16, ``layer_bf16``), or ``auto``: each row at the precision its PET records;
the plan puts the bf16 rows last, and each layer runs the fp32 range and the bf16 range of the
activations as batches of their own (``layer_mixed``: attention and LayerNorm are per request).

Attention and GELU are shared, and so are the LayerNorms unless a PET of the batch edits them.
The result for a request equals ``runtime.model.encoder.Encoder.upper`` + ``runtime.model.pet.head`` run on
that request alone, whatever else is in its batch (tests/test_executor_cpu.py), up to float
rounding.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from runtime.exec import cpu_batched, onednn, ops_cpu, students
from runtime.exec import precision as precision_
from runtime.exec.int8 import Int8Shared
from runtime.exec.plan import BatchPlan, plan_batch, prepare_pet, stack_group, tenant_key
from runtime.exec.rows import (FullInputs, Gathered, Prepared, assemble, attention_rows, full_inputs, gather_host,
                               received_rows, student_logits)
from runtime.exec.threads import helper_thread_setup
from runtime.model import student


def _groups(stacked) -> dict:
    """(kind, target) -> (runs, gaps, weights) of one layer's stacked groups."""
    return {(g.kind, g.target): w for g, w in stacked}


def edit_batched(y, x, groups, target, kinds=("bias", "diff", "lora", "adapter")):
    """The tenants' edits of one projection's output y (rows, d_out) from its input x, in place,
    on the batched kernels; groups: (kind, target) -> (runs, gaps, stacked weights)."""
    if "bias" in kinds and ("bias", target) in groups:
        runs, _, w = groups[("bias", target)]
        cpu_batched.bias(y, runs, w["delta"])
    if "diff" in kinds and ("diff", target) in groups:
        runs, _, w = groups[("diff", target)]
        cpu_batched.diff(y, x, runs, w["index"], w["value"], w["offsets"])
    if "lora" in kinds and ("lora", target) in groups:
        runs, _, w = groups[("lora", target)]
        cpu_batched.lora(y, x, runs, w["A"], w["B"], w["scales"])
    if "adapter" in kinds and ("adapter", target) in groups:  # last: it wraps the edited output
        runs, _, w = groups[("adapter", target)]
        cpu_batched.adapter(y, runs, w["down"], w["down_bias"], w["up"], w["up_bias"])
    return y


class CpuExecutor:
    device = "cpu"

    def __init__(self, encoder, *, lora_kernel: str = "auto", prefetch: bool = True, kernels: str = "batched",
                 int8=False, context=None, gemm: str = "auto", precision: str = "fp32"):
        if lora_kernel not in ("auto", "sgmv", "bgmv"):
            raise ValueError(f"lora_kernel must be auto, sgmv or bgmv, got {lora_kernel!r}")
        if kernels not in ("batched", "reference"):
            raise ValueError(f"kernels must be batched or reference, got {kernels!r}")
        if int8 and kernels != "batched":
            raise ValueError("int8 runs on the batched kernels (the reference stays fp32)")
        if gemm not in ("auto", "onednn", "addmm"):
            raise ValueError(f"gemm must be auto, onednn or addmm, got {gemm!r}")
        if gemm == "onednn" and not onednn.available():
            raise ValueError("gemm='onednn' needs a torch build with oneDNN (torch.backends.mkldnn)")
        # the batched kernels' fp32 shared GEMMs: oneDNN on packed weights where torch has it
        # (runtime/exec/onednn.py), else torch.addmm
        self.packed = onednn.SHARED if gemm != "addmm" else None
        # bf16 rows: the shared GEMMs on weights packed in bf16 (runtime.exec.precision). precision is
        # what was asked, resolved: "fp32" (every row; also auto where bf16 cannot run), "bf16" (every
        # row) or "auto" (each row at its PET's recorded precision, precision.row_bf16)
        bf16_able = kernels == "batched" and not int8 and gemm != "addmm"
        self.precision = "fp32" if precision == "auto" and not bf16_able else precision_.mode(precision)
        if self.precision == "bf16" and not bf16_able:
            raise ValueError("precision 'bf16' runs on the batched kernels' oneDNN GEMMs, "
                             "without int8 or gemm='addmm'")
        self.bf16 = precision_.shared_bf16() if self.precision != "fp32" else None
        self.kernels = kernels
        self._local = threading.local()  # per calling thread: cpu_batched.stack_into's reused buffers
        self.profile: dict | None = None  # set to {} to accumulate seconds per stage (batched)
        # the profile's clock: wall time; time.thread_time gives each thread's own CPU time (with
        # one torch thread, what a stage costs whatever else the machine runs)
        self.profile_clock = time.perf_counter
        self.encoder = encoder
        self.config = encoder.config
        self.context = context  # level 2's input source (runtime.exec.context.ContextInputs), for context rows
        self.lora_kernel = lora_kernel
        self.prefetch = bool(prefetch)
        self.layers = list(range(encoder.lower_layers, encoder.config.num_layers))
        # int8 (True: the default scheme, a scheme name, or a runtime.exec.int8.Int8Shared): the
        # shared projections of every layer the executor runs (full rows' lower layers too) as int8 GEMMs
        if int8 is True or isinstance(int8, str):
            int8 = Int8Shared(encoder, range(encoder.config.num_layers), *(() if int8 is True else (int8,)))
        self.int8 = int8 or None
        self._pool = None

    # -- PETs and plans --------------------------------------------------------------------

    def load_pet(self, pet, key=None, token=None):
        """ServingPet of an exported runtime.model.pet.Pet (mask PETs need the base weights),
        each layer's parts packed into one block (cpu_batched.pack_layers)."""
        return cpu_batched.pack_layers(prepare_pet(self.encoder, pet, key, token))

    def plan(self, pets, keys=None) -> BatchPlan:
        if self.kernels == "reference":
            return plan_batch(pets, keys, self.lora_kernel)
        if keys is None:
            keys = [tenant_key(p) for p in pets]
        # under auto the bf16 rows go last, so each precision's rows are one range of the
        # activations and each shared GEMM is one call per precision
        bf16 = [precision_.row_bf16(p.meta) for p in pets] if self.precision == "auto" else None
        order = cpu_batched.order_by_count(keys, [tuple(sorted(p.parts, key=str)) for p in pets], bf16)
        plan = plan_batch([pets[j] for j in order], [keys[j] for j in order], self.lora_kernel)
        plan.perm = order[plan.perm]
        if bf16 is not None:
            # a tenant's rows take its first item's precision, as plan_batch takes its first PET
            first = {}
            for k, b in zip(keys, bf16):
                first.setdefault(k, b)
            n16 = sum(first[k] for k in keys)
            plan.bf16_from = plan.size - n16 if n16 else None
        return plan

    def bf16_from(self, plan: BatchPlan) -> int:
        """The executed position from which plan's requests run bf16 (plan.size: none)."""
        if self.precision == "bf16":
            return 0
        if self.precision == "fp32" or plan.bf16_from is None:
            return plan.size
        return plan.bf16_from

    # -- a batch plan's rows (runtime.exec.rows) -----------------------------------------

    def gather(self, snapshot, rows) -> Gathered:
        return gather_host(snapshot, rows)

    def prepare(self, gathered: Gathered, rows) -> Prepared:
        t0 = time.perf_counter()
        teacher, inputs, lengths, parts, lower = assemble(gathered, rows, self.context, self.config.d)
        full = full_inputs(rows, teacher, self.encoder)
        full = None if full is None else (full, self.plan(full.pets))
        plan = self.plan([rows[b].pet for b in teacher]) if teacher else None
        if plan is not None and attention_rows(rows, teacher):
            plan.received = torch.zeros(inputs.shape[:2])
        mask = torch.from_numpy(np.arange(inputs.shape[1])[None, :] < lengths[:, None])
        timings = dict(gathered.timings, transfer=0.0, lower=lower)
        timings["retrieval"] += time.perf_counter() - t0 - lower
        return Prepared(rows, timings, (teacher, inputs, mask, plan, parts, full), gathered.served)

    @torch.no_grad()
    def compute(self, prepared: Prepared) -> list:
        teacher, inputs, mask, plan, parts, full = prepared.payload
        out = [None] * len(prepared.rows)
        if full is not None:  # the full rows' lower layers, then they are teacher rows like the others
            t0 = time.perf_counter()
            hidden = self.lower_full(*full)
            for j, t in enumerate(full[0].at):
                n = int(full[0].lengths[j])
                inputs[t, :n] = hidden[j, :n]
            prepared.timings["lower"] = prepared.timings.get("lower", 0.0) + time.perf_counter() - t0
        if teacher:
            for b, y in zip(teacher, self.forward(inputs, mask, plan)):
                out[b] = y.numpy()
            if plan.received is not None:
                prepared.received = received_rows(prepared.rows, teacher, plan, len(self.layers))
        for (group, _, idx, _, mask_s), h in zip(parts, students.ensembles([(g, k, x, m) for g, k, _, x, m in parts])):
            logits = student.head(group, h)
            for j, b in enumerate(idx):
                out[b] = student_logits(group, logits, mask_s, j).numpy()
        return out

    # -- the computation -------------------------------------------------------------------

    def run(self, inputs, mask, pets, keys=None) -> list:
        """Logits per request for inputs (B, L, d) and mask (B, L); pets[b] is a ServingPet
        or a runtime.model.pet.Pet (converted on the fly; pass ServingPets to reuse them)."""
        pets = [p if hasattr(p, "parts") else self.load_pet(p) for p in pets]
        return self.forward(inputs, mask, self.plan(pets, keys))

    @torch.no_grad()
    def forward(self, inputs, mask, plan: BatchPlan) -> list:
        """Logits per request in the caller's order: (labels,) or (length, labels)."""
        inputs = torch.as_tensor(inputs, dtype=torch.float32)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        B, L, d = inputs.shape
        if mask.shape != (B, L) or plan.size != B:
            raise ValueError(f"inputs {tuple(inputs.shape)}, mask {tuple(mask.shape)} and a plan for {plan.size} requests disagree")
        perm = torch.from_numpy(plan.perm)
        x = inputs[perm].reshape(B * L, d).contiguous()
        m = mask[perm]
        prof = self.profile
        t_start = self.profile_clock()
        x = self.run_layers(self.layers, x, m, B, L, plan)
        t0 = self.profile_clock()
        out = self.heads(x.view(B, L, d), m, plan)
        if prof is not None:
            end = self.profile_clock()
            prof["heads"] = prof.get("heads", 0.0) + end - t0
            prof["upper layers + heads (wall)"] = prof.get("upper layers + heads (wall)", 0.0) + end - t_start
        return out

    @torch.no_grad()
    def lower_full(self, full: FullInputs, plan: BatchPlan) -> torch.Tensor:
        """Layers [0, lower_layers) on the full rows' embeddings with their full-depth PETs
        (plan: a plan of full.pets), shared GEMMs once over those rows: (F, L_full, d), in
        full's order (padded positions hold what the layers made of padding)."""
        x = full.embeddings
        F_, L, d = x.shape
        mask = torch.from_numpy(np.arange(L)[None, :] < full.lengths[:, None])
        perm = torch.from_numpy(plan.perm)
        h = self.run_layers(range(self.encoder.lower_layers), x[perm].reshape(F_ * L, d).contiguous(), mask[perm],
                            F_, L, plan)
        out = torch.empty_like(x)
        out[perm] = h.view(F_, L, d)
        return out

    def run_layers(self, layers, x, m, B, L, plan: BatchPlan) -> torch.Tensor:
        """x (B*L, d), in plan's executed order, through `layers` with the plan's PETs; the
        kernels' layer function (updates x in place on the batched kernels)."""
        seg_rows = plan.seg_starts * L
        layers = list(layers)
        if not layers:
            return x
        batched = self.kernels == "batched"
        prof = self.profile
        if batched and not hasattr(self._local, "buffers"):
            self._local.buffers = {}
        buffers = self._local.buffers if batched else None

        def stack(i):
            if not batched:
                return [(g, stack_group(plan, g)) for g in plan.layer_groups(i)]
            t0 = self.profile_clock()
            out = cpu_batched.stack_layer(buffers, plan, i, L)
            if prof is not None:
                prof["PET stacking (prefetch thread)"] = prof.get("PET stacking (prefetch thread)", 0.0) + \
                    self.profile_clock() - t0
            return out

        if not batched:
            layer = self.layer
        else:
            split = self.bf16_from(plan)

            def layer(i, x, m, B, L, plan, stacked, seg_rows):
                return self.layer_mixed(i, x, m, B, L, plan.received, _groups(stacked), split)

        if self.prefetch and len(layers) > 1:
            # Layer-wise prefetch: layer i+1's stacked PET weights are built on a helper
            # thread while layer i computes (torch releases the GIL in its kernels).
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkstore-prefetch",
                                                initializer=helper_thread_setup)
            pending = self._pool.submit(stack, layers[0])
            for idx, i in enumerate(layers):
                stacked = pending.result()
                if idx + 1 < len(layers):
                    pending = self._pool.submit(stack, layers[idx + 1])
                x = layer(i, x, m, B, L, plan, stacked, seg_rows)
        else:
            for i in layers:
                x = layer(i, x, m, B, L, plan, stack(i), seg_rows)
        return x

    def _ticker(self):
        """tick(stage): the time since the last tick added to the profile's stage (when profiling)."""
        prof, clock = self.profile, [self.profile_clock()]

        def tick(stage):
            if prof is not None:
                now = self.profile_clock()
                prof[stage] = prof.get(stage, 0.0) + now - clock[0]
                clock[0] = now

        return tick

    def layer_mixed(self, i, x, m, B, L, received, groups, split):
        """One layer over a batch whose requests [0, split) are fp32 rows and [split, B) bf16
        rows: each precision's layer on its own range of the activations (in place). Attention
        and LayerNorm are per request and per row, so each range is a batch of its own (a
        batch of one precision is that precision's layer alone)."""
        if split == B:
            return self.layer_batched(i, x, m, B, L, received, groups)
        if split == 0:
            return self.layer_bf16(i, x, m, B, L, received, groups)
        r = split * L
        sub = (lambda r0, r1: {key: (*cpu_batched.cut_runs(runs, gaps, r0, r1), w)
                               for key, (runs, gaps, w) in groups.items()})
        rec = (None, None) if received is None else (received[:split], received[split:])
        for part, out in ((x[:r], self.layer_batched(i, x[:r], m[:split], split, L, rec[0], sub(0, r))),
                          (x[r:], self.layer_bf16(i, x[r:], m[split:], B - split, L, rec[1], sub(r, B * L)))):
            if out.data_ptr() != part.data_ptr():
                part.copy_(out)
        return x

    def layer_batched(self, i, x, m, B, L, received, groups):
        """One layer with runtime.exec.cpu_batched (kernels="batched"); groups: (kind, target) ->
        (runs, gaps, stacked weights)."""
        blk, c = self.encoder.layers[i], self.config
        d = c.d
        heads, dh = c.heads, d // c.heads
        tick = self._ticker()

        def proj(target, inp, lin, out):
            if self.int8 is not None:
                y = self.int8.linear(i, target, inp, out)
            elif self.packed is not None:
                y = self.packed.linear(inp, lin.weight, lin.bias)
            else:
                y = torch.addmm(lin.bias, inp, lin.weight.t(), out=out)
            tick("shared GEMMs")
            edit_batched(y, inp, groups, target)
            tick("PET ops")
            return y

        def norm(y, residual, name, ln):
            # into residual's memory: the residual is dead once added
            if ("norm", name) in groups:
                runs, gaps, w = groups[("norm", name)]
                y = cpu_batched.layernorm(y, residual, ln, runs, gaps, w["weight"], w["bias"], out=residual)
                tick("LayerNorm with PET deltas")
            else:
                y = cpu_batched.layernorm(y, residual, ln, out=residual)
                tick("LayerNorm, GELU")
            return y

        # Activations live in reused per-thread buffers and x is updated in place (the caller
        # hands a fresh copy): a new 50 MB tensor per projection costs as much as GELU.
        R, buffers = B * L, self._local.buffers
        qkv = cpu_batched.scratch(buffers, "qkv", (3, R, d))
        q, k, v = (proj(t, x, getattr(blk, t), qkv[j]).view(B, L, heads, dh).transpose(1, 2)
                   for j, t in enumerate(("q", "k", "v")))
        ctx = cpu_batched.attention(q, k, v, m, received)
        flat = cpu_batched.scratch(buffers, "ctx", (R, d))
        flat.view(B, L, heads, dh).copy_(ctx.transpose(1, 2))
        tick("attention")
        a = cpu_batched.scratch(buffers, "a", (R, d))
        h = norm(proj("o", flat, blk.o, a), x, "ln_attn", blk.ln_attn)
        f = torch.ops.aten.gelu_(proj("ffn_in", h, blk.ffn_in, cpu_batched.scratch(buffers, "f", (R, c.ffn))))
        tick("LayerNorm, GELU")
        return norm(proj("ffn_out", f, blk.ffn_out, a), h, "ln_ffn", blk.ln_ffn)

    def layer_bf16(self, i, x, m, B, L, received, groups):
        """One layer with the shared GEMMs in bf16 (bf16 rows): each projection's input is
        cast once, its output stays bf16 through the tenants' LoRA, BitFit and adapters (bf16
        products, fp32 accumulation), attention and GELU, so the activations never round-trip
        through fp32 (the casts cost as much as the bf16 GEMMs themselves: adapters on an fp32
        copy took 5x the PET time at the PLOT level); diff pruning's sparse products run on an
        fp32 copy; the residual stream and LayerNorm stay fp32, the sum, LayerNorm and the next
        projection's bf16 input one pass (cpu_batched.residual_layernorm)."""
        blk, c = self.encoder.layers[i], self.config
        d = c.d
        heads, dh = c.heads, d // c.heads
        tick = self._ticker()

        R, buffers, bf16 = B * L, self._local.buffers, torch.bfloat16

        def proj(target, inp16, lin, lora=True):
            y = self.bf16.linear(inp16, lin.weight, lin.bias)
            tick("shared GEMMs")
            if ("bias", target) in groups:
                cpu_batched.bias(y, groups[("bias", target)][0], groups[("bias", target)][2]["delta"])
            if ("diff", target) in groups:  # the sparse products in fp32
                y.copy_(edit_batched(y.float(), inp16.float(), groups, target, ("diff",)))
            if lora and ("lora", target) in groups:
                runs, _, w = groups[("lora", target)]
                cpu_batched.lora(y, inp16, runs, w["A"].to(bf16), cpu_batched.expand_weight(w["B"], bf16),
                                 w["scales"].to(bf16))
            if ("adapter", target) in groups:  # last: it wraps the edited output
                runs, _, w = groups[("adapter", target)]
                cpu_batched.adapter(y, runs, *(w[k].to(bf16) for k in ("down", "down_bias", "up", "up_bias")))
            tick("PET ops")
            return y

        def norm(y16, residual, name, ln, out16=None):
            # into the residual's memory (and, given out16, the next projection's bf16 input)
            runs, gaps, w = groups.get(("norm", name), (None, None, {}))
            out = cpu_batched.residual_layernorm(y16, residual, ln, runs, gaps, w.get("weight"), w.get("bias"), out16)
            tick("LayerNorm, GELU")
            return out

        x16 = cpu_batched.scratch(buffers, "x16", (R, d), bf16).copy_(x)
        loras = [groups.get(("lora", t)) for t in ("q", "k", "v")]
        # equal runs: the same tenant at each stacked index; an adapter would wrap the LoRA's output
        shared = loras[0] is not None and all(g is not None and g[0] == loras[0][0] for g in loras) and \
            not any(("adapter", t) in groups for t in ("q", "k", "v"))
        ys = [proj(t, x16, getattr(blk, t), lora=not shared) for t in ("q", "k", "v")]
        if shared:  # q, k and v read one input: one shrink GEMM against their A's side by side
            cpu_batched.lora_shared(ys, x16, loras[0][0], [w["A"] for _, _, w in loras],
                                    [cpu_batched.expand_weight(w["B"], bf16) for _, _, w in loras],
                                    loras[0][2]["scales"], bf16)
            tick("PET ops")
        q, k, v = (y.view(B, L, heads, dh).transpose(1, 2) for y in ys)
        ctx = cpu_batched.attention(q, k, v, m).transpose(1, 2)
        if received is not None:  # the attention each key receives, for word pruning: in fp32
            cpu_batched.add_received(q, k, m, received)
        if ctx.is_contiguous():  # torch's kernel writes (B, L, heads, dh): the o projection's input as it is
            flat = ctx.view(R, d)
        else:
            flat = cpu_batched.scratch(buffers, "ctx16", (R, d), bf16)
            flat.view(B, L, heads, dh).copy_(ctx)
        tick("attention")
        h = norm(proj("o", flat, blk.o), x, "ln_attn", blk.ln_attn, out16=x16)
        h16 = x16
        # GELU stays a pass of its own: in the GEMM's epilogue (oneDNN's post-op, on the fp32
        # accumulator) it would round once where this rounds twice, so a row's answer would hang
        # on whether another row's tenant edits ffn_in
        f = torch.ops.aten.gelu_(proj("ffn_in", h16, blk.ffn_in))
        tick("LayerNorm, GELU")
        return norm(proj("ffn_out", f, blk.ffn_out), h, "ln_ffn", blk.ln_ffn)

    def layer(self, i, x, m, B, L, plan, stacked, seg_rows):
        blk, c = self.encoder.layers[i], self.config
        d = c.d
        heads, dh = c.heads, d // c.heads
        groups = {(g.kind, g.target): (g, w) for g, w in stacked}

        def proj(target, inp, lin):
            y = F.linear(inp, lin.weight, lin.bias)
            return self.edit(y, inp, target, groups, seg_rows, L)

        q, k, v = (proj(t, x, getattr(blk, t)).view(B, L, heads, dh).transpose(1, 2) for t in ("q", "k", "v"))
        scores = (q @ k.transpose(-2, -1)) / (dh ** 0.5)
        scores = scores.masked_fill(~m[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1)
        if plan.received is not None:  # opt-in, as cpu_batched.attention
            plan.received += (probs * m[:, None, :, None]).sum(2).mean(1)
        ctx = (probs @ v).transpose(1, 2).reshape(B * L, d)
        h = self.norm(proj("o", ctx, blk.o), x, "ln_attn", blk.ln_attn, groups, seg_rows)
        f = F.gelu(proj("ffn_in", h, blk.ffn_in))
        return self.norm(proj("ffn_out", f, blk.ffn_out), h, "ln_ffn", blk.ln_ffn, groups, seg_rows)

    @staticmethod
    def norm(y, residual, name, ln, groups, seg_rows):
        """LayerNorm(y + residual) with ln's gain and shift, plus the tenants' deltas."""
        if ("norm", name) not in groups:
            return F.layer_norm(y + residual, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        g, w = groups[("norm", name)]
        return ops_cpu.segmented_layernorm(y, residual, ln.weight, ln.bias, w["weight"], w["bias"], seg_rows,
                                           g.seg_ids, ln.eps, out=y)

    @staticmethod
    def edit(y, x, target, groups, seg_rows, L):
        """The tenants' edits of one projection's output y (rows, d_out) from its input x."""
        if ("bias", target) in groups:
            g, w = groups[("bias", target)]
            ops_cpu.bias_gather(y, w["delta"], seg_rows, g.seg_ids)
        if ("diff", target) in groups:
            g, w = groups[("diff", target)]
            ops_cpu.sparse_add(y, x, w["index"], w["value"], w["offsets"], seg_rows, g.seg_ids)
        if ("lora", target) in groups:
            g, w = groups[("lora", target)]
            if g.bgmv:
                ops_cpu.bgmv(y, x, w["A"], w["B"], np.repeat(g.request_ids, L), w["scales"])
            else:
                ops_cpu.sgmv(y, x, w["A"], w["B"], seg_rows, g.seg_ids, w["scales"])
        if ("adapter", target) in groups:  # last: it wraps the edited output
            g, w = groups[("adapter", target)]
            ops_cpu.segmented_adapter(y, w["down"], w["down_bias"], w["up"], w["up_bias"], seg_rows, g.seg_ids, out=y)
        return y

    def heads(self, h, m, plan: BatchPlan) -> list:
        """Per-tenant head GEMMs; returns logits in the caller's item order."""
        out = [None] * plan.size
        lengths = m.sum(1).tolist()
        for s, p in enumerate(plan.tenants):
            a, b = int(plan.seg_starts[s]), int(plan.seg_starts[s + 1])
            if p.task == "classification":
                logits = F.linear(h[a:b, 0], p.head_weight, p.head_bias)
            else:
                logits = F.linear(h[a:b], p.head_weight, p.head_bias)
            for j in range(a, b):
                item = int(plan.perm[j])
                out[item] = logits[j - a] if p.task == "classification" else logits[j - a, : lengths[j]]
        return out

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def memory(self) -> dict:
        """Bytes of the shared upper-layer weights this executor computes with."""
        shared = sum(p.numel() * p.element_size() for p in self.encoder.upper_parameters())
        return {"shared_bytes": shared, "device_pet_bytes": 0}
