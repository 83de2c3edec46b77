"""The reference executor (PyTorch, CPU): the upper layers once for a mixed-tenant batch.

Per upper layer the shared projections run once for every row of the batch (one GEMM each);
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

Attention and GELU are shared, and so are the LayerNorms unless a PET of the batch edits them.
The result for a request equals ``runtime.model.encoder.Encoder.upper`` + ``runtime.model.pet.head`` run on
that request alone, whatever else is in its batch (tests/test_executor_cpu.py), up to float
rounding.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from runtime.exec import ops_cpu
from runtime.exec.plan import BatchPlan, Prepared, plan_batch, prepare_pet, stack_group
from runtime.exec.threads import helper_thread_setup
from runtime.plot.mixed import retrieve_mixed


class CpuExecutor:
    device = "cpu"

    def __init__(self, encoder, *, lora_kernel: str = "auto", prefetch: bool = True):
        if lora_kernel not in ("auto", "sgmv", "bgmv"):
            raise ValueError(f"lora_kernel must be auto, sgmv or bgmv, got {lora_kernel!r}")
        self.encoder = encoder
        self.config = encoder.config
        self.lora_kernel = lora_kernel
        self.prefetch = bool(prefetch)
        self.layers = list(range(encoder.lower_layers, encoder.config.num_layers))
        self._pool = None

    # -- PETs and plans --------------------------------------------------------------------

    def load_pet(self, pet, key=None, token=None):
        """ServingPet of an exported runtime.model.pet.Pet (mask PETs need the base weights)."""
        return prepare_pet(self.encoder, pet, key, token)

    def plan(self, pets, keys=None) -> BatchPlan:
        return plan_batch(pets, keys, self.lora_kernel)

    # -- the scheduler's interface ---------------------------------------------------------

    def prepare(self, snapshot, items) -> Prepared:
        t0 = time.perf_counter()
        inputs, mask, served = retrieve_mixed(snapshot, [it.ids for it in items], [it.version for it in items])
        retrieval = time.perf_counter() - t0
        plan = self.plan([it.pet for it in items])
        return Prepared(items, {"retrieval": retrieval, "transfer": 0.0}, (inputs, mask, plan), served)

    def compute(self, prepared: Prepared) -> list:
        inputs, mask, plan = prepared.payload
        return [y.numpy() for y in self.forward(inputs, mask, plan)]

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
        seg_rows = plan.seg_starts * L

        def stack(i):
            return [(g, stack_group(plan, g)) for g in plan.layer_groups(i)]

        if self.prefetch and len(self.layers) > 1:
            # Layer-wise prefetch: layer i+1's stacked PET weights are built on a helper
            # thread while layer i computes (torch releases the GIL in its kernels).
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkstore-prefetch",
                                                initializer=helper_thread_setup)
            pending = self._pool.submit(stack, self.layers[0])
            for idx, i in enumerate(self.layers):
                stacked = pending.result()
                if idx + 1 < len(self.layers):
                    pending = self._pool.submit(stack, self.layers[idx + 1])
                x = self.layer(i, x, m, B, L, plan, stacked, seg_rows)
        else:
            for i in self.layers:
                x = self.layer(i, x, m, B, L, plan, stack(i), seg_rows)
        return self.heads(x.view(B, L, d), m, plan)

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
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B * L, d)
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
