"""runtime.exec.cpu_batched against the reference ops (runtime.exec.ops_cpu), and the CPU
executor's batched path against its reference path, on random mixed batches.

Properties: on random segment tables (empty segments, segments without the part, tenants of
every request count) each batched op equals its ops_cpu counterpart within fp32 rounding;
segment_runs covers exactly the rows of the active segments; and on random mixed batches
of every PET type (LoRA of mixed ranks and targets, BitFit, diff, mask, adapters with
LayerNorm deltas, head-only; tenants without a part) the executor's logits are the same
with kernels="batched" and kernels="reference".
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import cpu_batched, ops_cpu
from runtime.exec.cpu import CpuExecutor
from runtime.exec.plan import prepare_pet
from tests.test_executor_cpu import pet_zoo, random_pet, tiny_encoder

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {"rtol": 1e-5, "atol": 1e-5}


@st.composite
def segment_tables(draw):
    """(seg_starts in requests, seg_ids, T, L): a plan-like table; member t of a group is
    stacked in segment order (what plan_batch + stack_group produce)."""
    counts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
    has = draw(st.lists(st.booleans(), min_size=len(counts), max_size=len(counts)))
    ids, t = [], 0
    for h in has:
        ids.append(t if h else -1)
        t += h
    L = draw(st.integers(1, 4))
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return starts, np.array(ids, dtype=np.int64), max(t, 1), L


def _rows(starts, L):
    return int(starts[-1]) * L


@SETTINGS
@given(table=segment_tables())
def test_runs_cover_active_segments(table):
    starts, ids, _, L = table
    runs, gaps = cpu_batched.segment_runs(starts, ids, L)
    covered = np.zeros(_rows(starts, L), dtype=int)
    for r0, r1, n, t0 in runs:
        assert (r1 - r0) % n == 0
        covered[r0:r1] += 1
    for r0, r1 in gaps:
        covered[r0:r1] += 10
    for s, t in enumerate(ids):
        a, b = starts[s] * L, starts[s + 1] * L
        assert (covered[a:b] == (1 if t >= 0 else 10)).all()
    # a run's stacked index of segment j is t0 + j
    for r0, r1, n, t0 in runs:
        size = (r1 - r0) // n
        for j in range(n):
            s = int(np.searchsorted(starts * L, r0 + j * size, side="right")) - 1
            while starts[s] == starts[s + 1]:  # skip empty segments at that row
                s += 1
            assert ids[s] == t0 + j


@SETTINGS
@given(table=segment_tables(), seed=st.integers(0, 2**16), r=st.integers(1, 5), d_in=st.integers(1, 9),
       d_out=st.integers(1, 9))
def test_lora_bias_diff_equal_reference(table, seed, r, d_in, d_out):
    starts, ids, T, L = table
    g = torch.Generator().manual_seed(seed)
    rows = _rows(starts, L)
    runs, _ = cpu_batched.segment_runs(starts, ids, L)
    seg_rows = starts * L
    x = torch.randn(rows, d_in, generator=g)
    y0 = torch.randn(rows, d_out, generator=g)
    A, B = torch.randn(T, r, d_in, generator=g), torch.randn(T, d_out, r, generator=g)
    scales = torch.rand(T, generator=g) + 0.5
    torch.testing.assert_close(cpu_batched.lora(y0.clone(), x, runs, A, B, scales),
                               ops_cpu.sgmv(y0.clone(), x, A, B, seg_rows, ids, scales), **TOL)
    delta = torch.randn(T, d_out, generator=g)
    torch.testing.assert_close(cpu_batched.bias(y0.clone(), runs, delta),
                               ops_cpu.bias_gather(y0.clone(), delta, seg_rows, ids), **TOL)
    sizes = torch.randint(0, d_in * d_out + 1, (T,), generator=g).tolist()
    index = torch.cat([torch.randint(0, d_in * d_out, (k,), generator=g).sort().values for k in sizes]).to(torch.int32)
    value = torch.randn(len(index), generator=g)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)
    torch.testing.assert_close(cpu_batched.diff(y0.clone(), x, runs, index, value, offsets),
                               ops_cpu.sparse_add(y0.clone(), x, index, value, offsets, seg_rows, ids), **TOL)


@SETTINGS
@given(table=segment_tables(), seed=st.integers(0, 2**16), r=st.integers(1, 5), d_out=st.sampled_from([3, 512, 513, 700]))
def test_lora_on_expand_weights_equals_reference(table, seed, r, d_out):
    """The expand weights' layout (transposed in memory for wide outputs) changes nothing: the
    same values, and lora on them equals the reference, in fp32 and in bf16 products."""
    starts, ids, T, L = table
    g = torch.Generator().manual_seed(seed)
    rows, d_in = _rows(starts, L), 4
    runs, _ = cpu_batched.segment_runs(starts, ids, L)
    x, y0 = torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)
    A, B = torch.randn(T, r, d_in, generator=g), torch.randn(T, d_out, r, generator=g).half()
    scales = torch.rand(T, generator=g) + 0.5
    for dtype in (torch.float32, torch.bfloat16):
        Bx = cpu_batched.expand_weight(B, dtype)
        assert Bx.dtype == dtype and torch.equal(Bx, B.to(dtype))
        assert Bx.transpose(1, 2).is_contiguous() if d_out > 512 else Bx.is_contiguous()
    torch.testing.assert_close(cpu_batched.lora(y0.clone(), x, runs, A, cpu_batched.expand_weight(B, torch.float32), scales),
                               ops_cpu.sgmv(y0.clone(), x, A, B.float(), starts * L, ids, scales), **TOL)


@SETTINGS
@given(table=segment_tables(), seed=st.integers(0, 2**16), b=st.integers(1, 6), d=st.integers(2, 9))
def test_adapter_and_layernorm_equal_reference(table, seed, b, d):
    starts, ids, T, L = table
    g = torch.Generator().manual_seed(seed)
    rows = _rows(starts, L)
    runs, gaps = cpu_batched.segment_runs(starts, ids, L)
    seg_rows = starts * L
    y0 = torch.randn(rows, d, generator=g)
    w = [torch.randn(T, b, d, generator=g), torch.randn(T, b, generator=g), torch.randn(T, d, b, generator=g),
         torch.randn(T, d, generator=g)]
    torch.testing.assert_close(cpu_batched.adapter(y0.clone(), runs, *w),
                               ops_cpu.segmented_adapter(y0.clone(), *w, seg_rows, ids), **TOL)
    ln = torch.nn.LayerNorm(d, eps=1e-12)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5, generator=g)
        ln.bias.normal_(0, 0.1, generator=g)
    res = torch.randn(rows, d, generator=g)
    gain, shift = torch.randn(T, d, generator=g) * 0.2, torch.randn(T, d, generator=g) * 0.2
    with torch.no_grad():
        want = ops_cpu.segmented_layernorm(y0, res, ln.weight, ln.bias, gain, shift, seg_rows, ids, ln.eps)
        got = cpu_batched.layernorm(y0.clone(), res, ln, runs, gaps, gain, shift)
        # normalizing amplifies rounding when a row's values are close (d as small as 2 here)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        plain = cpu_batched.layernorm(y0.clone(), res, ln)
        torch.testing.assert_close(plain, ops_cpu.residual_layernorm(y0, res, ln.weight, ln.bias, ln.eps),
                                   rtol=1e-4, atol=1e-4)


def test_order_by_count_groups_equal_counts():
    keys = ["a", "b", "a", "c", "b", "d", "a"]
    order = cpu_batched.order_by_count(keys)
    assert [keys[j] for j in order] == ["a", "a", "a", "b", "b", "c", "d"]
    assert sorted(order.tolist()) == list(range(len(keys)))
    kinds = ["x", "y", "x", "y", "x", "z", "x"]  # b and d have 2 requests; c (y) and d (z): 1
    keys = ["a", "b", "a", "c", "b", "d", "a"]
    order = cpu_batched.order_by_count(["a", "c", "d", "e"], ["x", "y", "x", "y"])
    assert order.tolist() == [0, 2, 1, 3]
    assert [keys[j] for j in cpu_batched.order_by_count(keys, kinds)] == ["a", "a", "a", "b", "b", "c", "d"]


def test_stack_into_pads_and_reuses():
    buffers = {}
    a, b = torch.ones(2, 3), torch.full((1, 3), 2.0)
    out = cpu_batched.stack_into(buffers, "k", [a, b], pad_dim=0)
    assert out.shape == (2, 2, 3) and out[1, 1].abs().sum() == 0 and out[1, 0, 0] == 2
    again = cpu_batched.stack_into(buffers, "k", [b, b], pad_dim=0)
    assert again.data_ptr() == out.data_ptr() and again.shape == (2, 1, 3)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_executor_batched_equals_reference(tmp_path_factory, data):
    enc, zoo = _setup(tmp_path_factory)
    B = data.draw(st.integers(1, 12))
    assignment = data.draw(st.lists(st.integers(0, len(zoo) - 1), min_size=B, max_size=B))
    lengths = data.draw(st.lists(st.integers(1, 10), min_size=B, max_size=B))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    L = max(lengths)
    inputs = torch.randn(B, L, enc.config.d, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    inputs[~mask] = 7.0
    fast, ref = CpuExecutor(enc), CpuExecutor(enc, kernels="reference", prefetch=False)
    serving = [fast.load_pet(p, key=k) for k, p in enumerate(zoo)]
    pets = [serving[a] for a in assignment]
    want = ref.run(inputs, mask, pets, keys=list(assignment))
    got = fast.run(inputs, mask, pets, keys=list(assignment))
    fast.close()
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


_CACHE: dict = {}


def _setup(tmp_path_factory):
    if "zoo" not in _CACHE:
        enc = tiny_encoder(tmp_path_factory.mktemp("tiny"))
        _CACHE["zoo"] = (enc, pet_zoo(enc, 2))
    return _CACHE["zoo"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_layer_blocks_stack_like_groups(tmp_path_factory, data):
    """pack_layers + stack_layer give every group the weights stack_group_into gives it, with
    one copy per layer when the batch's tenants share the layer's layout; and the executor's
    logits with packed PETs of one layout equal the reference ops'."""
    enc, zoo = _setup(tmp_path_factory)
    kind = data.draw(st.sampled_from(["adapter", "lora", "bitfit", "mixed"]))
    T = data.draw(st.integers(1, 5))
    seed = data.draw(st.integers(0, 2**16))
    if kind == "mixed":
        exported = [zoo[j % len(zoo)] for j in range(seed, seed + T)]
    else:
        opts = {"adapter": {"bottleneck": 4}, "lora": {"rank": 3, "targets": ("q", "ffn_out")}, "bitfit": {}}[kind]
        exported = [random_pet(enc, kind, "classification", seed + j, **opts) for j in range(T)]
    ex = CpuExecutor(enc, prefetch=False)
    packed = [ex.load_pet(p, key=j) for j, p in enumerate(exported)]
    plain = [prepare_pet(enc, p, key=j) for j, p in enumerate(exported)]
    counts = data.draw(st.lists(st.integers(1, 3), min_size=T, max_size=T))
    keys = [j for j, c in enumerate(counts) for _ in range(c)]
    L = 3
    plan_p, plan_u = ex.plan([packed[k] for k in keys], keys), ex.plan([plain[k] for k in keys], keys)
    for layer in ex.layers:
        buffers = {}
        got = cpu_batched.stack_layer(buffers, plan_p, layer, L)
        want = cpu_batched.stack_layer({}, plan_u, layer, L)
        assert [g.kind for g, _ in got] == [g.kind for g, _ in want]
        for (g, (runs, gaps, w)), (_, (runs_u, gaps_u, w_u)) in zip(got, want):
            assert runs == runs_u and gaps == gaps_u and w.keys() == w_u.keys()
            for name in w:
                torch.testing.assert_close(w[name], w_u[name], rtol=0, atol=0)
        layouts = {p.blocks[layer][1] if layer in p.blocks else None for p in plan_p.tenants}
        assert (("layer", layer) in buffers) == (None not in layouts and len(layouts) == 1)
        if kind != "mixed" and any(g.layer == layer for g in plan_p.groups.values()):
            assert ("layer", layer) in buffers  # tenants of one PET config: one copy a layer
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(len(keys), L, enc.config.d, generator=g)
    mask = torch.ones(len(keys), L, dtype=torch.bool)
    ref = CpuExecutor(enc, kernels="reference", prefetch=False)
    for a, b in zip(ex.run(inputs, mask, [packed[k] for k in keys], keys),
                    ref.run(inputs, mask, [plain[k] for k in keys], keys)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
