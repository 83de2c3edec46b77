"""Batched PET operations for the CPU executor: the segment loops of runtime.exec.ops_cpu as
a few batched GEMMs.

The reference ops (runtime.exec.ops_cpu) loop over a batch's segments: one small GEMM per
tenant per projection, each a parallel region of its own. Here the segments of a group are
cut into *runs*: maximal stretches of consecutive segments that all carry the part, have the
same number of requests and consecutive stacked indices. A run of n segments of c requests
(L rows each) is one ``(n, c*L, d)`` view of the activations, and its weights are the slice
``[t0, t0 + n)`` of the stacked tensors (``runtime.exec.plan.stack_group`` stacks the members
in segment order), so a run is one ``bmm`` / ``baddbmm`` with no gather and no padding.
``order_by_count`` puts tenants with equal request counts next to each other (the CPU
executor's plan does), so a batch of 64 tenants with one request each is one run, and so is
a batch of one tenant.

Every function here equals its ops_cpu counterpart up to fp32 rounding
(tests/test_cpu_batched.py); the reference functions stay the specification.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from formats import accel

__all__ = ["adapter", "add_received", "attention", "bias", "cut_runs", "diff", "expand_weight", "layernorm", "lora", "lora_shared", "order_by_count",
           "pack_layers", "residual_layernorm", "scratch", "segment_runs", "stack_into", "stack_layer"]

# (1: HK_FUSED_API_VERSION in runtime/exec/_fused.c; None: ATen's passes, layernorm, instead)
_fused = accel.extension("runtime.exec._fused", 1)


def order_by_count(keys: list, kinds: list | None = None, classes: list | None = None) -> np.ndarray:
    """A stable order of the items that puts tenants (keys) with the same number of requests
    together, most requests first; among those, tenants of the same kind (kinds[b], any
    hashable, e.g. the PET's set of parts) together, so that a group's runs are not cut by
    tenants without its part; tenants otherwise in first-appearance order. classes[b] (ints,
    a tenant's from its first item) comes before all that: each class is one contiguous range,
    lowest first (the executor's precision groups)."""
    first: dict = {}
    counts: dict = {}
    kind_ids: dict = {}
    kind_of: dict = {}
    class_of: dict = {}
    for b, k in enumerate(keys):
        if k not in first:
            first[k] = len(first)
            kind = kinds[b] if kinds is not None else None
            kind_of[k] = kind_ids.setdefault(kind, len(kind_ids))
            class_of[k] = int(classes[b]) if classes is not None else 0
        counts[k] = counts.get(k, 0) + 1
    rank = np.array([(class_of[k], -counts[k], kind_of[k], first[k]) for k in keys],
                    dtype=[("p", np.int64), ("c", np.int64), ("s", np.int64), ("f", np.int64)])
    return np.argsort(rank, order=("p", "c", "s", "f"), kind="stable")


def segment_runs(seg_starts, seg_ids, L: int) -> tuple[list, list]:
    """(runs, gaps) of one group on a plan's segment table (in requests; L rows a request).

    runs: [(row0, row1, n, t0)]: n consecutive segments of equal size, stacked indices
    t0 .. t0+n-1, rows row0 .. row1 (so rows (row1 - row0) // n per segment).
    gaps: [(row0, row1)]: rows of segments without the part (seg_ids < 0)."""
    starts = np.asarray(seg_starts, dtype=np.int64)
    ids = np.asarray(seg_ids, dtype=np.int64)
    counts = np.diff(starts)
    runs, gaps = [], []
    s, S = 0, len(ids)
    while s < S:
        if counts[s] == 0:
            s += 1
            continue
        if ids[s] < 0:
            e = s + 1
            while e < S and (ids[e] < 0 or counts[e] == 0):
                e += 1
            gaps.append((int(starts[s]) * L, int(starts[e]) * L))
            s = e
            continue
        e = s + 1
        while e < S and ids[e] == ids[e - 1] + 1 and counts[e] == counts[s]:
            e += 1
        runs.append((int(starts[s]) * L, int(starts[e]) * L, e - s, int(ids[s])))
        s = e
    return runs, gaps


def cut_runs(runs: list, gaps: list, r0: int, r1: int) -> tuple[list, list]:
    """(runs, gaps) of segment_runs restricted to rows [r0, r1) and renumbered from r0; r0 and
    r1 must fall on segment boundaries (a run cut there keeps whole segments)."""
    out_runs, out_gaps = [], []
    for a, b, n, t0 in runs:
        lo, hi = max(a, r0), min(b, r1)
        if lo >= hi:
            continue
        per = (b - a) // n
        if (lo - a) % per or (hi - a) % per:
            raise ValueError(f"rows [{r0}, {r1}) cut a segment of the run [{a}, {b})")
        out_runs.append((lo - r0, hi - r0, (hi - lo) // per, t0 + (lo - a) // per))
    for a, b in gaps:
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
            out_gaps.append((lo - r0, hi - r0))
    return out_runs, out_gaps


def _view(t: torch.Tensor, r0: int, r1: int, n: int) -> torch.Tensor:
    return t[r0:r1].view(n, (r1 - r0) // n, t.shape[1])


def scratch(buffers: dict, key, shape, dtype=torch.float32) -> torch.Tensor:
    """A (shape) view of the reused buffer buffers[key], grown as needed. A fresh multi-megabyte
    tensor per batch costs its page faults every time (glibc maps allocations above 32 MB
    anew), as much as a GELU pass; callers must not keep the result past the next call with
    the same key."""
    numel = int(np.prod(shape))
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = torch.empty(max(numel, int(1.25 * numel)), dtype=dtype)
        buffers[key] = buf
    return buf[:numel].view(shape)


def stack_into(buffers: dict, key, tensors: list, pad_dim: int | None = None) -> torch.Tensor:
    """torch.stack(tensors) into scratch(buffers, key), fp32 (fp16 tensors, as the host cache
    may hold a PET's, are upcast here), zero-padding dimension pad_dim (of each tensor) to the
    largest."""
    shape = list(tensors[0].shape)
    if pad_dim is not None:
        shape[pad_dim] = max(t.shape[pad_dim] for t in tensors)
    shape = [len(tensors), *shape]
    out = scratch(buffers, key, shape)  # the copies below cast fp16 as they go
    if pad_dim is None or all(t.shape[pad_dim] == shape[pad_dim + 1] for t in tensors):
        torch.stack(tensors, out=out)
    else:
        out.zero_()
        for j, t in enumerate(tensors):
            out[j].narrow(pad_dim, 0, t.shape[pad_dim]).copy_(t)
    return out


# -- the operations (in place on y, like ops_cpu) -------------------------------------------------


def lora(y, x, runs, A, B, scales) -> torch.Tensor:
    """ops_cpu.sgmv on runs: y[rows] += scale_t * (x[rows] @ A[t].T) @ B[t].T."""
    for r0, r1, n, t0 in runs:
        v = torch.bmm(_view(x, r0, r1, n), A[t0:t0 + n].transpose(1, 2))
        v.mul_(scales[t0:t0 + n].view(n, 1, 1))
        yv = _view(y, r0, r1, n)
        yv.baddbmm_(v, B[t0:t0 + n].transpose(1, 2))
    return y


def expand_weight(B, dtype) -> torch.Tensor:
    """LoRA's stacked B (n, d_out, r) cast to dtype for lora's expand. For a wide output
    (d_out > 512: the FFN's first projection) laid out (n, r, d_out) in memory, a transposed
    view returned so lora reads it as before: the expand's bmm gets a contiguous right operand,
    and torch's bf16 bmm ran it 1.15-1.45x faster at d_out 1,024 and 1,536 (1.4-1.9x at
    3,072), where at d_out 384 the plain cast measured 2-4% faster. One pass either way."""
    if B.shape[1] <= 512:
        return B.to(dtype)
    return torch.empty((B.shape[0], B.shape[2], B.shape[1]), dtype=dtype).copy_(B.transpose(1, 2)).transpose(1, 2)


def lora_shared(ys, x, runs, As, Bs, scales, dtype=None) -> list:
    """lora for several outputs of one input on the same runs (q, k and v): per run, one shrink
    GEMM against the outputs' A's side by side (fewer, larger small GEMMs), then each output's
    expand. dtype: the products' (the A's are cast to it once, together)."""
    rs = [A.shape[1] for A in As]
    for r0, r1, n, t0 in runs:
        A = torch.cat([a[t0:t0 + n] for a in As], 1)
        v = torch.bmm(_view(x, r0, r1, n), (A if dtype is None else A.to(dtype)).transpose(1, 2))
        v.mul_(scales[t0:t0 + n].view(n, 1, 1).to(v.dtype))
        off = 0
        for y, B, r in zip(ys, Bs, rs):
            _view(y, r0, r1, n).baddbmm_(v[:, :, off:off + r], B[t0:t0 + n].transpose(1, 2))
            off += r
    return ys


def bias(y, runs, delta) -> torch.Tensor:
    """ops_cpu.bias_gather on runs."""
    for r0, r1, n, t0 in runs:
        _view(y, r0, r1, n).add_(delta[t0:t0 + n].unsqueeze(1))
    return y


def diff(y, x, runs, index, value, offsets) -> torch.Tensor:
    """ops_cpu.sparse_add on runs: one block-diagonal sparse product per run (block j is the
    sparse delta of tenant t0 + j) instead of one sparse product per segment."""
    d_out, d_in = y.shape[1], x.shape[1]
    offs = offsets.tolist()
    for r0, r1, n, t0 in runs:
        lo, hi = offs[t0], offs[t0 + n]
        if lo == hi:
            continue
        f = index[lo:hi].long()
        block = torch.repeat_interleave(torch.arange(n), torch.tensor(np.diff(offs[t0:t0 + n + 1])))
        rows, cols = block * d_out + f // d_in, block * d_in + f % d_in
        delta = torch.sparse_coo_tensor(torch.stack([rows, cols]), value[lo:hi], (n * d_out, n * d_in),
                                        check_invariants=False)
        m = (r1 - r0) // n
        xt = _view(x, r0, r1, n).transpose(1, 2).reshape(n * d_in, m)
        _view(y, r0, r1, n).add_(torch.sparse.mm(delta, xt).view(n, d_out, m).transpose(1, 2))
    return y


def adapter(y, runs, down, down_bias, up, up_bias) -> torch.Tensor:
    """ops_cpu.segmented_adapter in place on y (out=y): y += up(relu(down(y))) on runs."""
    for r0, r1, n, t0 in runs:
        yv = _view(y, r0, r1, n)
        # bmm + add: baddbmm with a broadcast bias materializes the bias first (2x slower here)
        h = torch.bmm(yv, down[t0:t0 + n].transpose(1, 2)).add_(down_bias[t0:t0 + n].unsqueeze(1)).relu_()
        yv.baddbmm_(h, up[t0:t0 + n].transpose(1, 2))
        yv.add_(up_bias[t0:t0 + n].unsqueeze(1))
    return y


def attention(q, k, v, m, received=None) -> torch.Tensor:
    """Attention of (B, heads, L, dh) q, k, v under key mask m (B, L): torch's fused kernel;
    with received (a (B, L) tensor, BatchPlan.received) the probabilities are formed
    explicitly instead, and each key's, summed over real queries and averaged over heads,
    is added to received (the same pass, not a second one)."""
    if received is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, None, :])
    return _probs(q, k, m, received) @ v


def _probs(q, k, m, received) -> torch.Tensor:
    """The attention probabilities of q, k under key mask m; each key's, summed over real
    queries and averaged over heads, added to received."""
    scores = (q @ k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5)
    scores.masked_fill_(~m[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1)
    received += (probs * m[:, None, :, None]).sum(2).mean(1)
    return probs


def add_received(q, k, m, received) -> None:
    """Only the attention each key receives (attention's received), in fp32 whatever q and k
    hold: for rows whose attention output runs in bf16, which must not depend on whether
    another row of the batch asked for it."""
    _probs(q.float(), k.float(), m, received)


def layernorm(y, residual, ln, runs=None, gaps=None, gain=None, shift=None, out=None) -> torch.Tensor:
    """LayerNorm(y + residual) with ln's gain and shift, plus per-tenant deltas on runs
    (ops_cpu.segmented_layernorm; without runs, F.layer_norm), written into out (default y;
    residual is fine too) and returned. y is overwritten."""
    y.add_(residual)
    out = y if out is None else out
    affine = runs is None
    rows = y.shape[0]
    # the out= form of layer_norm: no fresh (rows, d) tensor per call
    torch.ops.aten.native_layer_norm.out(y, ln.normalized_shape, ln.weight if affine else None,
                                         ln.bias if affine else None, ln.eps, out0=out,
                                         out1=torch.empty(rows, 1), out2=torch.empty(rows, 1))
    if affine:
        return out
    for r0, r1 in gaps:
        torch.addcmul(ln.bias, out[r0:r1], ln.weight, out=out[r0:r1])
    for r0, r1, n, t0 in runs:
        g = (ln.weight + gain[t0:t0 + n]).unsqueeze(1)
        b = (ln.bias + shift[t0:t0 + n]).unsqueeze(1)
        o = _view(out, r0, r1, n)
        torch.addcmul(b, o, g, out=o)
    return out


def residual_layernorm(y16, residual, ln, runs=None, gaps=None, gain=None, shift=None, out16=None) -> torch.Tensor:
    """layernorm for the bf16 layers: LayerNorm(residual + y16) in fp32, with ln's gain and
    shift plus the tenants' deltas on runs, written into residual (and, given out16, its bf16
    copy there) and returned. One pass over the rows (runtime/exec/_fused.c, built with the
    package) where ATen takes three to five (cast, sum, LayerNorm, each run's affine, cast):
    1.1x the bf16 levels. Each row reads its gain and shift from a (tenants + 1, d) table, so
    a row's answer does not depend on the rows beside it. Without the extension, ATen's ops."""
    R, d = residual.shape
    T = 1 if runs is None else gain.shape[0] + 1
    fits = residual.is_contiguous() and residual.dtype == torch.float32 and y16.is_contiguous() and \
        y16.dtype == torch.bfloat16 and y16.shape == residual.shape and \
        (out16 is None or (out16.is_contiguous() and out16.dtype == torch.bfloat16 and out16.shape == residual.shape))
    if _fused is None or not fits:
        layernorm(y16.float(), residual, ln, runs, gaps, gain, shift, out=residual)
        if out16 is not None:
            out16.copy_(residual)
        return residual
    if runs is None:
        rows = np.zeros(R, np.int64)
        gain_t, shift_t = ln.weight.float().contiguous(), ln.bias.float().contiguous()
    else:  # row t < T - 1 of the tables is stacked tenant t's, the last the base model's (gaps)
        rows = np.full(R, T - 1, np.int64)
        for r0, r1, n, t0 in runs:
            rows[r0:r1] = np.repeat(np.arange(t0, t0 + n), (r1 - r0) // n)
        gain_t = torch.cat([ln.weight + gain.float(), ln.weight[None]])
        shift_t = torch.cat([ln.bias + shift.float(), ln.bias[None]])
    _fused.add_layernorm(residual.data_ptr(), y16.data_ptr(), rows.ctypes.data, gain_t.data_ptr(),
                         shift_t.data_ptr(), 0 if out16 is None else out16.data_ptr(), R, d, T, float(ln.eps),
                         torch.get_num_threads())
    return residual


_BLOCK_KINDS = ("lora", "bias", "adapter", "norm")  # float parts; diff indices are int32
_NAMES = {"lora": ("A", "B"), "bias": ("delta",), "adapter": ("down", "down_bias", "up", "up_bias"),
          "norm": ("weight", "bias")}


def pack_layers(pet):
    """Make each layer's float parts of a ServingPet views into one contiguous block per layer
    (pet.blocks[layer] = (block, layout)), once, when the PET enters the host cache; then a
    batch whose tenants share a layer's layout stacks the layer with one copy (stack_layer)
    instead of one per tensor. In place (same values and dtype: a block is fp16 when all its
    parts are, no extra memory); returns pet. Parts that already lie back to back in block
    order (a record read from a pack) are their block as they are: no copy."""
    if pet.blocks:
        return pet
    by_layer: dict = {}
    for part in pet.parts:
        if part[0] in _BLOCK_KINDS:
            by_layer.setdefault(part[1], []).append(part)
    for layer, parts in by_layer.items():
        parts.sort(key=_block_order)
        arrays = [a for p in parts for a in pet.parts[p]]
        layout = tuple((p, tuple(tuple(a.shape) for a in pet.parts[p])) for p in parts)
        layout = _LAYOUTS.setdefault(layout, layout)  # one object per layout: stack_layer compares by identity first
        if len(_LAYOUTS) > 4096:
            _LAYOUTS.clear()
        block = _span(arrays)
        if block is None:
            block = torch.cat([a.reshape(-1) for a in arrays])  # mixed dtypes: fp32
            flat = iter(block.split([a.numel() for a in arrays]))  # one split for all views
            for p, shapes in layout:
                pet.parts[p] = tuple(next(flat).view(shape) for shape in shapes)
        pet.blocks[layer] = (block, layout)
    return pet


# A layer's block: LayerNorm deltas first, then the targets' parts, in the order the encoder
# runs them, which is the order runtime.model.pet creates and exports a PET's tensors in: a
# record read from a pack lies in block order, and _span makes its memory the block.
_BLOCK_ORDER = {name: j for j, name in enumerate(("ln_attn", "ln_ffn", "q", "k", "v", "o", "ffn_in", "ffn_out"))}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16}
_LAYOUTS: dict = {}


def _block_order(part):
    return part[0] != "norm", _BLOCK_ORDER.get(part[2], len(_BLOCK_ORDER)), part[0], str(part[2])


def _span(arrays):
    """One 1-D tensor over the arrays' memory when they lie back to back in this order, in one
    dtype (views into one record's buffer do); else None. It holds the arrays, and through
    them their buffer."""
    dtype, start = arrays[0].dtype, arrays[0].data_ptr()
    end = start
    for a in arrays:
        if a.dtype != dtype or a.data_ptr() != end or not a.is_contiguous():
            return None
        end += a.numel() * a.element_size()
    if end == start or dtype not in _NUMPY:
        return None
    memory = (ctypes.c_char * (end - start)).from_address(start)
    memory.arrays = arrays  # each range is live while its array is: so is their union, while memory is
    return torch.from_numpy(np.frombuffer(memory, _NUMPY[dtype]))


def stack_layer(buffers: dict, plan, layer: int, L: int) -> list:
    """[(group, (runs, gaps, weights))] of one layer of a plan. When every tenant of the plan
    has the same layer layout (pack_layers), the layer's blocks are stacked with one copy and
    each group's weights are (T, ...) views of it (T = all tenants, so member t is tenant t);
    otherwise each group is stacked on its own (stack_group_into)."""
    blocks = [p.blocks.get(layer) for p in plan.tenants]
    shared = {}
    first = blocks[0]
    if first is not None and all(b is not None and (b[1] is first[1] or b[1] == first[1]) for b in blocks):
        stacked = stack_into(buffers, ("layer", layer), [b[0] for b in blocks])
        off = 0
        for part, shapes in first[1]:
            views = []
            for shape in shapes:
                n = int(np.prod(shape))
                views.append(stacked[:, off:off + n].view(len(blocks), *shape))
                off += n
            shared[part] = views
    out = []
    for g in plan.layer_groups(layer):
        runs, gaps = segment_runs(plan.seg_starts, g.seg_ids, L)
        part = (g.kind, g.layer, g.target)
        if part in shared:
            w = dict(zip(_NAMES[g.kind], shared[part]))
            if g.kind == "lora":
                w["scales"] = torch.tensor([plan.tenants[m].scale for m in g.members], dtype=torch.float32)
        else:
            w = stack_group_into(buffers, plan, g)
        out.append((g, (runs, gaps, w)))
    return out


def stack_group_into(buffers: dict, plan, group) -> dict:
    """runtime.exec.plan.stack_group into reused buffers (stack_into), fp32; same keys."""
    part = (group.kind, group.layer, group.target)
    arrays = [plan.tenants[m].parts[part] for m in group.members]

    def st(j, name, pad=None):
        return stack_into(buffers, (*part, name), [a[j] for a in arrays], pad)

    if group.kind == "lora":
        scales = torch.tensor([plan.tenants[m].scale for m in group.members], dtype=torch.float32)
        return {"A": st(0, "A", 0), "B": st(1, "B", 1), "scales": scales}
    if group.kind == "bias":
        return {"delta": st(0, "delta")}
    if group.kind == "diff":
        sizes = [len(a[0]) for a in arrays]
        return {"index": torch.cat([a[0] for a in arrays]), "value": torch.cat([a[1] for a in arrays]).float(),
                "offsets": torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)}
    if group.kind == "adapter":
        return {"down": st(0, "down", 0), "down_bias": st(1, "down_bias", 0), "up": st(2, "up", 1),
                "up_bias": st(3, "up_bias")}
    if group.kind == "norm":
        return {"weight": st(0, "weight"), "bias": st(1, "bias")}
    raise ValueError(f"unknown part kind {group.kind!r}")
