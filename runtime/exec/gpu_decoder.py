"""The GPU executor's decode path (hGPT on the device): a decoder's upper layers, its KV cache and
every sequence's PET on one CUDA device, for runtime.gen's continuous batcher.

    ex = GpuDecoderExecutor(decoder)                      # upper-layer weights + LM head on the device
    k, v = ex.kv_arrays(positions)                        # the device KV pool (runtime.gen.device_decode.DeviceKVPool)
    plan = ex.plan([ex.serving_pet(p) for p in pets])    # rows go in plan.perm's order
    h, orders = ex.inputs(snapshot, version, wins, lengths, starts)   # PLOT lookups -> (B, L, d) on the device
    logits = ex.forward(h, lengths, kv_len, pages, plan, k, v)        # (B, vocab) host fp32
    out = ex.forward(h, lengths, kv_len, pages, plan, k, v, host=False)  # DeviceLogits: argmax + log-prob on the host

One forward serves a prefill (a prompt per row, L = its padded length, kv_len = 0) and a decode
step (L = 1, kv_len = what each sequence's pages hold) alike: each row's new keys and values are
written at its next pages, then every row attends over its pages (causal inside the new
positions). Nothing runs the lower layers.

What it reuses of runtime.exec.gpu.GpuExecutor, unchanged: the batch plan (rows of one tenant
contiguous, one segment each), the device PET cache and layer-wise prefetch on the pets
stream, the edit operators (BGMV when every LoRA tenant of the step has one row, SGMV when
rows share one; BitFit bias gather; sparse diff add; the segmented adapter) and the PET lanes.
What is the decoder's own: pre-norm layers (LayerNorm through the fused kernel with a zero
residual, or RMSNorm), optional biases, rotary positions, gated FFNs, the tanh / ReLU / SiLU
activations, causal aggregation (the aggregate kernel with only each window's last slot
counted: runtime.plot.causal's rule), the position table gathered per row from a device copy,
and the LM head (one GEMM, fp32 logits back to the host for sampling).

What a decode step costs the host, kept small (as vLLM's persistent batch): while the batch's
rows and tenants stay the same from one step to the next, the plan and every layer's stacked
PET weights are the previous step's (nothing stacked or uploaded again); with host=False the
logits stay on the device and only each row's argmax and its log-probability come back (what a
greedy row needs; the whole (B, vocab) array is copied only for rows that sample).

The caller passes rows in the plan's order (runtime.gen.device_decode sorts its sequences by
``plan(pets).perm``) so that no permutation runs on the device.
"""

from __future__ import annotations

import math
import time

import numpy as np

from runtime.exec.gpu import _F32_MIN, GpuExecutor
from runtime.exec.plan import BatchPlan, ServingPet, prepare_pet


# The tanh GELU as the chain 0.5 * y * (1.0 + tanh(c * (y + 0.044715 * y * y * y))) of CuPy's
# fp32 element-wise kernels computes it (the Python floats taken as float32, evaluated left to
# right): each product and sum rounded on its own (_rn: never contracted into an FMA), so the
# result is the chain's to the bit.
_GELU_TANH = """
float t = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, y), y), y);
t = tanhf(__fmul_rn(c, __fadd_rn(y, t)));
out = __fmul_rn(__fmul_rn(0.5f, y), __fadd_rn(1.0f, t));
"""


class DeviceLogits:
    """A forward's next-token logits left on the device: argmax (B,) int64 and logprob (B,)
    float32 (each row's argmax's log-probability) on the host; host() copies the whole
    (B, vocab) fp32 array back once, for the rows that need it (sampling, top log-probs)."""

    def __init__(self, executor, device, argmax: np.ndarray, logprob: np.ndarray):
        self.executor, self.device, self.argmax, self.logprob = executor, device, argmax, logprob
        self._host = None

    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = self.executor.to_host(self.device, self.executor.compute_stream)
        return self._host


BASE = ServingPet(key="<base model>", meta={"task": "lm"}, parts={}, head_weight=None, head_bias=None)


class GpuDecoderExecutor(GpuExecutor):
    def __init__(self, decoder, *, dtype: str = "fp32", pet_cache_bytes: int = 512 << 20, prefetch: bool = True,
                 lora_kernel: str = "auto", device_id: int | None = None, lanes: int = 1, _cupy=None, _ops=None):
        self.decoder = decoder
        super().__init__(decoder, dtype=dtype, pet_cache_bytes=pet_cache_bytes, prefetch=prefetch, hot_tier_rows=0,
                         max_batch=1, max_len=1, lora_kernel=lora_kernel, device_id=device_id, lanes=lanes,
                         _cupy=_cupy, _ops=_ops)
        self._pets: dict[int, tuple] = {}  # id(Pet) -> (Pet, ServingPet): the Pet held so its id stays its own
        self._tables: dict = {}  # (version, manifest generation) -> device position table or None
        self._plan = (None, None, None)  # (the rows' ServingPet ids, their plan, the ServingPets: held, so
        # that an id is not reused while the plan is kept); the plan is reused while the batch is the same
        self._stacked: dict = {}  # (layer, L) -> that plan's stacked PET weights of the layer
        self._last = (None, None)  # (shape, device mask) of _last_slot
        self._gelu = None  # the fused tanh GELU kernel (CuPy), made at its first use
        self._zeros: dict = {}  # (shape, dtype) -> a zeroed device array (LayerNorm's residual), never written
        self.forward_seconds = 0.0

    # -- weights -----------------------------------------------------------------------------

    def _upload_weights(self) -> dict:
        """Upper layers' W^T (d_in, d_out), biases (None where the model has none), norms; and
        under key "final" the final norm and the LM head's W^T (d, vocab)."""
        cp, dec, out = self.cp, self.encoder, {}

        def dev(t):
            return None if t is None else cp.asarray(t.detach().numpy().astype(self.dtype))

        def norm(m, w, name):
            w[name + ".g"], w[name + ".b"], w[name + ".eps"] = dev(m.weight), dev(getattr(m, "bias", None)), float(m.eps)

        for i in self.layers:
            blk, w = dec.layers[i], {}
            for t in ("q", "k", "v", "o", "ffn_in", "ffn_out", "ffn_gate"):
                lin = getattr(blk, t, None)
                if lin is not None:
                    w[t] = cp.ascontiguousarray(dev(lin.weight.T))
                    w[t + ".b"] = dev(lin.bias)
            norm(blk.ln_attn, w, "ln_attn")
            norm(blk.ln_ffn, w, "ln_ffn")
            out[i] = w
        head = dec.word.weight if dec.config.tied else dec.lm_head
        final = {"head": cp.ascontiguousarray(dev(head.T))}
        norm(dec.ln_final, final, "ln_final")
        out["final"] = final
        return out

    def _alloc_buffers(self, tokens: int):
        self.staged = []  # the decode path stages its own inputs (see inputs)

    def kv_arrays(self, positions: int):
        """Zeroed device keys and values (upper layers, positions, kv_heads, head_dim) of a KV pool."""
        c, cp = self.config, self.cp
        shape = (len(self.layers), int(positions), c.kv_heads, c.head_dim)
        with self._device():
            return cp.zeros(shape, dtype=self.dtype), cp.zeros(shape, dtype=self.dtype)

    def plan(self, pets, keys=None) -> BatchPlan:
        """GpuExecutor.plan, the same object again while the rows' ServingPets are the same ones
        in the same order (consecutive decode steps of one batch)."""
        if keys is not None:
            return super().plan(pets, keys)
        ids = tuple(map(id, pets))
        if ids != self._plan[0]:
            self._plan, self._stacked = (ids, super().plan(pets), list(pets)), {}
        return self._plan[1]

    def _issue(self, plan, layer, L, keep):
        """GpuExecutor._issue, kept for the next forward of the same plan (its stacked weights are
        copies: a device PET cache eviction does not touch them; nothing to wait for the next time)."""
        if plan is not self._plan[1]:
            return super()._issue(plan, layer, L, keep)
        groups = self._stacked.get((layer, L))
        if groups is not None:
            return groups, None
        groups, event = super()._issue(plan, layer, L, keep)
        self._stacked[(layer, L)] = groups
        return groups, event

    def serving_pet(self, pet) -> ServingPet:
        """The executor form of a runtime.model.pet.Pet (None: the base model), made once per Pet."""
        if pet is None:
            return BASE
        entry = self._pets.get(id(pet))
        if entry is None:
            entry = self._pets[id(pet)] = (pet, prepare_pet(self.encoder, pet, key=id(pet), token=id(pet)))
        return entry[1]

    # -- inputs: lookups and causal aggregation -------------------------------------------------

    def inputs(self, snapshot, version, wins: np.ndarray, lengths: np.ndarray, starts: np.ndarray):
        """Upper-layer inputs (B, L, d) fp32 on the device of B rows of lengths[b] new tokens
        whose windows wins (sum(lengths), n) are row-major, the first at position starts[b]:
        one host lookup, the values uploaded in the store's dtype, each token's own window's
        last slot (the aggregate kernel, causal, every other slot masked out), plus the
        version's position table. Returns (inputs, served order of every window)."""
        cp = self.cp
        lengths = np.asarray(lengths, dtype=np.int64)
        B, L = len(lengths), int(lengths.max())
        result = snapshot.lookup(version, wins)
        values = np.ascontiguousarray(result.values)
        n = values.shape[1]  # the store's value slots: the key's n, or 1 (only its last slot kept)
        stream, keep = self.input_stream, []
        with self._device(), stream:
            if (lengths == L).all():  # no padding (every decode step): the values are the rows
                padded = self.upload(values, stream, keep)
            else:
                rows = (np.repeat(np.arange(B, dtype=np.int64) * L, lengths)
                        + np.arange(len(wins), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths))
                padded = cp.zeros((B * L, n, values.shape[-1]), dtype=values.dtype)
                padded[self.upload(rows, stream, keep)] = self.upload(values, stream, keep)
            h = self.ops.aggregate(padded, self.upload(lengths.astype(np.int32), stream, keep), "causal",
                                   slot_mask=self._last_slot(B * L, n, stream, keep))
            table = self._position_table(snapshot, version, stream, keep)
            if table is not None:
                at = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(L)[None, :]
                real = (np.arange(L)[None, :] < lengths[:, None]) & (at < table.shape[0])
                h += table[self.upload(np.where(real, at, 0), stream, keep)] * \
                    self.upload(real.astype(np.float32)[..., None], stream, keep)
            done = cp.cuda.Event()
            done.record(stream)
        self.compute_stream.wait_event(done)
        self._keep_inputs = keep  # until the compute stream has used them (the next forward syncs)
        return h, np.asarray(result.order)

    def _last_slot(self, rows, n, stream, keep):
        """The (rows, n) device mask of each window's last slot, uploaded once per shape."""
        if self._last[0] != (rows, n):
            last = np.zeros((rows, n), dtype=bool)
            last[:, n - 1] = True
            self._last = ((rows, n), self.upload(last, stream, keep))
        return self._last[1]

    def _position_table(self, snapshot, version, stream, keep):
        key = (version, snapshot.manifest.get("generation"))
        if key not in self._tables:
            table = snapshot.position(version)
            self._tables = {key: None if table is None else self.upload(np.asarray(table, np.float32), stream, keep)}
        return self._tables[key]

    # -- the upper layers ------------------------------------------------------------------------

    def forward(self, h, lengths, kv_len, pages, plan, k_pool, v_pool, host: bool = True):
        """Next-token logits (B, vocab) fp32 after each row's last new token: on the host, or
        (host=False) a DeviceLogits (the array left on the device). h (B, L, d) device inputs;
        lengths (B,) new tokens per row; kv_len (B,) positions each row's pages already hold;
        pages (B, S) page indices (S >= max(kv_len + lengths); unused entries may repeat any
        page); plan: self.plan of the rows' ServingPets, the rows already in its order
        (plan.perm applied by the caller: one tenant's rows contiguous).
        Writes each row's new keys and values into k_pool / v_pool at its pages."""
        cp = self.cp
        t0 = time.perf_counter()
        B, L, d = h.shape
        if plan.size != B:
            raise ValueError(f"a plan for {plan.size} rows, inputs for {B}")
        lengths, kv_len = np.asarray(lengths, dtype=np.int64), np.asarray(kv_len, dtype=np.int64)
        keep = [self.__dict__.pop("_keep_inputs", None)]
        stream = self.compute_stream
        with self._device(), stream:
            self.pet_cache.new_batch()
            x = h.reshape(B * L, d).astype(self.dtype, copy=False)  # no copy: each layer makes new rows
            attend = self._attention(B, L, lengths, kv_len, np.asarray(pages, dtype=np.int64), k_pool, v_pool, keep)
            rotary = self._rotary(B, L, kv_len, keep) if self.config.rotary else None
            x = self._layers(plan, L, keep, x,
                             lambda i, x, groups: self._decoder_layer(i, x, B, L, groups, attend, rotary, keep))
            if L > 1:  # each row's last new token (one token per row: x is those already)
                x = x[self.upload(np.arange(B, dtype=np.int64) * L + lengths - 1, stream, keep)]
            final = self.weights["final"]
            y = self._plain_norm(final, "ln_final", x)
            logits = cp.matmul(y, final["head"]).astype(np.float32, copy=False)
            out = cp.asnumpy(logits) if host else self._greedy(logits)
            stream.synchronize()
        keep.clear()
        self.forward_seconds += time.perf_counter() - t0
        return out

    def _greedy(self, logits) -> DeviceLogits:
        """logits (B, vocab) left on the device, each row's argmax (the first of equal maxima, as
        torch's and NumPy's) and its log-probability -log(sum(exp(logits - max))) copied back."""
        cp = self.cp
        top = logits.max(axis=1, keepdims=True)
        total = cp.exp(logits - top).sum(axis=1)
        summary = cp.asnumpy(cp.stack([logits.argmax(axis=1).astype(np.float64), total.astype(np.float64)]))
        return DeviceLogits(self, logits, summary[0].astype(np.int64), -np.log(summary[1].astype(np.float32)))

    def _attention(self, B, L, lengths, kv_len, pages, k_pool, v_pool, keep):
        """attend(layer, q (B, L, H, hd), k, v (B, L, KV, hd)) -> ctx (B * L, H * hd): writes the
        real new positions' keys and values at their pages, gathers every row's pages and
        attends causally (query t of row b sees keys j <= kv_len[b] + t)."""
        cp, c = self.cp, self.config
        H, KV, hd = c.heads, c.kv_heads, c.head_dim
        S = pages.shape[1]
        real = np.arange(L)[None, :] < lengths[:, None]
        at = kv_len[:, None] + np.arange(L)[None, :]
        new_pages = self.upload(pages[np.arange(B)[:, None], np.minimum(at, S - 1)][real], self.compute_stream, keep)
        new_rows = None if real.all() else self.upload(np.flatnonzero(real.reshape(-1)), self.compute_stream, keep)
        flat = self.upload(pages.reshape(-1), self.compute_stream, keep)
        allowed = (np.arange(S)[None, None, :] <= at[:, :, None]) & \
            (np.arange(S)[None, None, :] < (kv_len + lengths)[:, None, None])
        allowed = self.upload(allowed[:, None, None], self.compute_stream, keep)  # (B, 1, 1, L, S)
        scale = np.float32(1.0 / math.sqrt(hd))

        def attend(i, q, k, v):
            li = i - self.layers[0]
            kp, vp = k_pool[li], v_pool[li]
            if new_rows is None:  # every position is new (a decode step): no gather
                kp[new_pages] = k.reshape(B * L, KV, hd)
                vp[new_pages] = v.reshape(B * L, KV, hd)
            else:
                kp[new_pages] = k.reshape(B * L, KV, hd)[new_rows]
                vp[new_pages] = v.reshape(B * L, KV, hd)[new_rows]
            keys = kp[flat].reshape(B, S, KV, hd).transpose(0, 2, 3, 1)[:, :, None]  # (B, KV, 1, hd, S)
            values = vp[flat].reshape(B, S, KV, hd).transpose(0, 2, 1, 3)[:, :, None]  # (B, KV, 1, S, hd)
            qg = q.reshape(B, L, KV, H // KV, hd).transpose(0, 2, 3, 1, 4)  # head h reads K/V head h // (H / KV)
            scores = cp.matmul(qg, keys).astype(np.float32, copy=False) * scale  # (B, KV, g, L, S)
            scores = cp.where(allowed, scores, np.float32(_F32_MIN))
            scores -= scores.max(axis=-1, keepdims=True)
            probs = cp.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            ctx = cp.matmul(probs.astype(self.dtype, copy=False), values)  # (B, KV, g, L, hd)
            return cp.ascontiguousarray(ctx.transpose(0, 3, 1, 2, 4)).reshape(B * L, H * hd)

        return attend

    def _rotary(self, B, L, kv_len, keep):
        """(cos, sin) (B, L, 1, hd) of each new position kv_len[b] + t (half-split pairs)."""
        c = self.config
        hd = c.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
        angles = (kv_len[:, None] + np.arange(L)[None, :]).astype(np.float32)[..., None] * inv_freq
        angles = np.concatenate([angles, angles], -1)[:, :, None, :]
        return (self.upload(np.cos(angles).astype(self.dtype), self.compute_stream, keep),
                self.upload(np.sin(angles).astype(self.dtype), self.compute_stream, keep))

    def _rotate(self, x, rotary):
        cos, sin = rotary
        half = x.shape[-1] // 2
        return x * cos + self.cp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin

    def _decoder_layer(self, i, h, B, L, groups, attend, rotary, keep):
        """One pre-norm decoder layer on rows h (B * L, d) (runtime.model.decoder.Decoder.layer)."""
        c, w = self.config, self.weights[i]
        H, KV, hd = c.heads, c.kv_heads, c.head_dim
        x = self._pre_norm(w, "ln_attn", h, groups, L, keep)
        q, k, v = self._proj(w, ("q", "k", "v"), x, groups)
        q, k, v = q.reshape(B, L, H, hd), k.reshape(B, L, KV, hd), v.reshape(B, L, KV, hd)
        if rotary is not None:
            q, k = self._rotate(q, rotary), self._rotate(k, rotary)
        a, = self._proj(w, ("o",), attend(i, q, k, v), groups)
        h = h + a
        x = self._pre_norm(w, "ln_ffn", h, groups, L, keep)
        if c.gated:  # the gate is the base model's (decoder PETs do not edit it)
            gate = self.cp.matmul(x, w["ffn_gate"])
            if w["ffn_gate.b"] is not None:
                gate += w["ffn_gate.b"]
            f = self._act(gate) * self._proj(w, ("ffn_in",), x, groups)[0]
        else:
            f = self._act(self._proj(w, ("ffn_in",), x, groups)[0])
        out, = self._proj(w, ("ffn_out",), f, groups)
        return h + out

    def _act(self, y):
        cp, act = self.cp, self.config.act
        if act == "gelu_tanh":
            return self._gelu_tanh(y)
        if act == "gelu":  # the erf GELU of the fused kernel, with a zero bias
            return self.ops.bias_gelu(y, self._zero(y[0]))
        if act == "relu":
            return y * (y > 0)
        return y / (1.0 + cp.exp(-y))  # silu

    def _gelu_tanh(self, y):
        """0.5 y (1 + tanh(sqrt(2 / pi) (y + 0.044715 y^3))): on CuPy in fp32 one kernel instead
        of nine, every step rounded as the separate element-wise kernels round it (_GELU_TANH)."""
        cp = self.cp
        if y.dtype != np.float32 or not hasattr(cp, "ElementwiseKernel"):
            return 0.5 * y * (1.0 + cp.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y * y * y)))  # Python floats keep the dtype
        if self._gelu is None:
            self._gelu = cp.ElementwiseKernel("float32 y, float32 c", "float32 out", _GELU_TANH, "hk_decoder_gelu_tanh")
        return self._gelu(y, np.float32(math.sqrt(2.0 / math.pi)))

    def _run_edits(self, ys, x, groups):
        """GpuExecutor._run_edits; on the compute stream alone (no lanes), each target's edits in
        the reference order (bias, diff, LoRA) without costing the operators first: the order
        differs from the lanes' chains only between edits of disjoint rows."""
        if len(self.lane_streams) >= 2:
            return super()._run_edits(ys, x, groups)
        for target, y in ys.items():
            for kind in ("bias", "diff", "lora"):
                if (kind, target) in groups:
                    self._edit(kind, y, x, groups[(kind, target)])

    def _plain_norm(self, w, name, x):
        g, b, eps = w[name + ".g"], w[name + ".b"], w[name + ".eps"]
        if b is None:
            return self._rms(x, g, eps)
        return self.ops.residual_layernorm(x, self._zero(x), g, b, eps)

    def _zero(self, like):
        """A zeroed device array of like's shape and dtype (a norm's residual: read, never written),
        made once per shape instead of once per norm."""
        key = (like.shape, like.dtype)
        if key not in self._zeros:
            if len(self._zeros) > 16:  # prefill shapes vary: keep the cache small
                self._zeros.clear()
            self._zeros[key] = self.cp.zeros(like.shape, dtype=like.dtype)
        return self._zeros[key]

    def _rms(self, x, gain, eps):
        x32 = x.astype(np.float32)
        scale = 1.0 / ((x32 * x32).mean(axis=-1, keepdims=True) + np.float32(eps)) ** 0.5
        return (gain.astype(np.float32) * (x32 * scale)).astype(self.dtype)

    def _pre_norm(self, w, name, h, groups, L, keep):
        """Norm `name` of rows h, with the gain (and shift) deltas of the tenants that have them."""
        if ("norm", name) not in groups:
            return self._plain_norm(w, name, h)
        group, nw = groups[("norm", name)]
        g, b, eps = w[name + ".g"], w[name + ".b"], w[name + ".eps"]
        if b is not None:
            return self.ops.segmented_layernorm(h, self._zero(h), g, b, nw["weight"], nw["bias"],
                                                nw["seg_starts"], nw["seg_ids"], eps)
        # RMSNorm: each row's gain plus its tenant's delta (rows of tenants without one: + 0)
        deltas = self.cp.concatenate([nw["weight"], self.cp.zeros((1, g.shape[0]), dtype=g.dtype)])
        which = np.repeat(group.request_ids, L)  # (rows,) stacked index, -1: none
        index = np.where(which < 0, deltas.shape[0] - 1, which)
        return self._rms(h, g + deltas[self.upload(index, self.compute_stream, keep)], eps)
