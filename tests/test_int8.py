"""runtime.exec.int8: the row scheme equals a NumPy model of its quantized arithmetic (to fp32
rounding, its integer GEMM exactly, saturation-prone values included); the fbgemm-based schemes
stay within the quantization error bound of the fp32 GEMM on what they quantize; the shared
projections follow in-place weight swaps; and the CPU executor with int8 serves mixed batches,
full rows' lower layers included, within a small distance of its fp32 results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import int8
from runtime.exec.cpu import CpuExecutor
from tests.test_executor_cpu import pet_zoo, tiny_encoder


class _Layer(torch.nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        for t in int8.TARGETS:
            setattr(self, t, torch.nn.Linear(d_in, d_out))


class _Enc:
    def __init__(self, d_in, d_out):
        self.layers = [_Layer(d_in, d_out)]


def _bound(x, w):
    """|x W^T - int8 result| per element: weights rounded to half a per-channel step, 7-bit
    activations (reduce_range) to half a per-tensor step, and their product."""
    s_w = w.abs().amax(1) / 127.0
    s_x = (x.max().clamp_min(0) - x.min().clamp_max(0)) / 127.0
    return (x.abs() @ (s_w / 2).expand(w.shape[1], -1) + (s_x / 2) * w.abs().sum(1)
            + w.shape[1] * s_x * s_w / 4) * 1.01 + 1e-5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), d_in=st.integers(1, 48), d_out=st.integers(1, 48),
       shift=st.floats(-2, 2))
def test_linear_within_quantization_bound(seed, rows, d_in, d_out, shift):
    g = torch.Generator().manual_seed(seed)
    enc = _Enc(d_in, d_out)
    x = torch.randn(rows, d_in, generator=g) + shift
    q = int8.Int8Shared(enc, [0], "tensor")
    lin = enc.layers[0].ffn_in
    with torch.no_grad():
        want = lin(x)
    got = q.linear(0, "ffn_in", x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= _bound(x, lin.weight.detach())).all()


def row_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The row scheme in NumPy: symmetric int8 per row, 7-bit per output channel, exact int64
    products, fp32 rescaling."""
    f = np.float32
    sw = np.maximum(np.abs(w).max(1) / f(63), f(1e-12)).astype(f)
    qw = np.clip(np.round(w / sw[:, None]), -63, 63).astype(np.int64)
    sx = (np.maximum(np.abs(x).max(1), f(1e-12)) / f(127)).astype(f)
    qx = np.round(x / sx[:, None]).astype(np.int64)
    assert np.abs(qx).max(initial=0) <= 127
    acc = qx @ qw.T
    return (acc.astype(f) * sw[None, :]) * sx[:, None] + b[None, :]


@st.composite
def operands(draw):
    rows, d_in, d_out = draw(st.integers(1, 40)), draw(st.integers(1, 48)), draw(st.integers(1, 48))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["gauss", "extreme", "outlier rows"]))
    if kind == "extreme":  # every product at full scale: where int16 pair sums would saturate
        x = g.choice([-1.0, 1.0], (rows, d_in)) * draw(st.floats(1e-3, 1e3))
        w = g.choice([-1.0, 1.0], (d_out, d_in))
    else:
        x = g.normal(draw(st.floats(-2, 2)), 1, (rows, d_in))
        w = g.normal(0, 0.1, (d_out, d_in))
        if kind == "outlier rows":
            x[g.random(rows) < 0.3] *= 100
    x[g.random(rows) < 0.1] = 0  # zero rows (padding) keep a finite scale
    return x.astype(np.float32), w.astype(np.float32), g.normal(0, 1, d_out).astype(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operands(), into_out=st.booleans())
def test_row_scheme_equals_numpy_reference(ops, into_out):
    x, w, b = ops
    enc = _Enc(w.shape[1], w.shape[0])
    lin = enc.layers[0].v
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    q = int8.Int8Shared(enc, [0], "row")
    out = torch.full((len(x), len(b)), np.nan) if into_out else None
    got = q.linear(0, "v", torch.from_numpy(x), out).numpy()
    want = row_reference(x, w, b)
    # one fp32 rounding per step apart (torch may fuse the last multiply-add)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * (np.abs(want).max() + 1))
    if into_out:
        assert np.shares_memory(got, out.numpy())


def test_row_weights_are_7_bit():
    qwt, scale = int8.row_weights(torch.randn(33, 17) * 5)
    assert qwt.dtype == torch.int8 and qwt.shape == (17, 33)
    assert int(qwt.abs().max()) == int8.ROW_WEIGHT_MAX and scale.shape == (33,)


def _calibrated(d_in, d_out, x, seed):
    torch.manual_seed(seed)
    enc = _Enc(d_in, d_out)
    rec = int8.Recorder(enc)
    with torch.no_grad():
        want = enc.layers[0].ffn_out(x)
    for t in int8.TARGETS:
        rec.linear(0, t, x[: len(x) // 2])  # two batches: the running maximum
        got = rec.linear(0, t, x[len(x) // 2:])
    torch.testing.assert_close(got, want[len(x) // 2:])
    torch.testing.assert_close(rec.absmax[(0, "ffn_out")], x.abs().amax(0))
    return enc, rec.absmax


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), d_in=st.integers(2, 48), d_out=st.integers(1, 48),
       wide=st.floats(1, 50))
def test_smooth_within_bound_of_its_smoothed_operands(seed, rows, d_in, d_out, wide):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g)
    x[:, 0] *= wide  # an outlier channel
    enc, absmax = _calibrated(d_in, d_out, x, seed)
    lin = enc.layers[0].ffn_out
    w = lin.weight.detach()
    s = int8.smooth_factors(absmax[(0, "ffn_out")], w)
    got = int8.Int8Shared(enc, [0], "smooth", absmax).linear(0, "ffn_out", x)
    with torch.no_grad():
        want = lin(x)
    assert ((got - want).abs() <= _bound(x / s, w * s) + 1e-4 * want.abs()).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), d_in=st.integers(2, 48), d_out=st.integers(1, 48))
def test_outlier_channels_run_in_fp32(seed, rows, d_in, d_out):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g)
    x[:, 1] = 40 * torch.sign(x[:, 1])  # above the threshold: fp32
    enc, absmax = _calibrated(d_in, d_out, x, seed)
    lin = enc.layers[0].ffn_out
    q = int8.Int8Shared(enc, [0], "outlier", absmax)
    rest = x.clone()
    rest[:, 1] = 0
    w_rest = lin.weight.detach().clone()
    w_rest[:, 1] = 0
    with torch.no_grad():
        want = lin(x)
        only = torch.zeros_like(x)
        only[:, 1] = x[:, 1]
        # nothing but the outlier channel: only fp32 arithmetic left
        torch.testing.assert_close(q.linear(0, "ffn_out", only), lin(only), rtol=1e-5, atol=1e-4)
    assert ((q.linear(0, "ffn_out", x) - want).abs() <= _bound(rest, w_rest) + 1e-4).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operands(), wide=st.floats(7, 100))
def test_row_outlier_is_row_on_the_rest_plus_fp32_outliers(ops, wide):
    x, w, b = ops
    x = x.copy()
    x[:, 0] *= wide / max(float(np.abs(x[:, 0]).max()), 1e-3)
    x[0, 0] = wide  # channel 0 reaches `wide`: an outlier
    tx = torch.from_numpy(x)
    enc, absmax = _calibrated(w.shape[1], w.shape[0], tx, 0)
    lin = enc.layers[0].ffn_out
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    out = int8.Int8Shared(enc, [0], "row-outlier", absmax).linear(0, "ffn_out", tx).numpy()
    idx = np.flatnonzero(absmax[(0, "ffn_out")].numpy() > int8.OUTLIER_THRESHOLD)
    assert 0 in idx
    rest, w_rest = x.copy(), w.copy()
    rest[:, idx], w_rest[:, idx] = 0, 0
    want = row_reference(rest, w_rest, b) + x[:, idx] @ w[:, idx].T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * (np.abs(want).max() + 1))


def test_bad_scheme_or_missing_calibration_is_refused(tmp_path_factory):
    enc = _Enc(4, 4)
    with pytest.raises(ValueError, match="scheme must be one of"):
        int8.Int8Shared(enc, [0], "int4")
    with pytest.raises(ValueError, match="calibrated"):
        int8.Int8Shared(enc, [0], "smooth")


def test_full_rows_lower_layers_go_through_int8(tmp_path_factory):
    """The executor hands every layer a full row runs, the lower ones included, to its int8 GEMMs."""
    from runtime.exec.rows import Gathered, Row
    from tests.test_executor_cpu import random_pet

    enc = tiny_encoder(tmp_path_factory.mktemp("tiny8"))
    pet = random_pet(enc, "lora", "classification", 3, level="full", rank=2, targets=("q", "ffn_in"))
    rec = int8.Recorder(enc)
    ex = CpuExecutor(enc, int8=rec)
    rows = [Row([5, 6, 7], ex.load_pet(pet, key="t"), "v", source="full")]
    ex.compute(ex.prepare(Gathered([], None, [None], {"retrieval": 0.0}), rows))
    assert {i for i, _ in rec.absmax} == set(range(enc.config.num_layers))
    assert 0 < enc.lower_layers


def test_follows_in_place_weight_swaps():
    enc = _Enc(16, 8)
    q = int8.Int8Shared(enc, [0])
    x = torch.randn(5, 16)
    before = q.linear(0, "o", x)
    with torch.no_grad():
        enc.layers[0].o.weight.mul_(-1)
        enc.layers[0].o.bias.mul_(-1)
    after = q.linear(0, "o", x)
    torch.testing.assert_close(after, -before, rtol=0, atol=1e-3)


def test_executor_int8_close_to_fp32(tmp_path_factory):
    enc = tiny_encoder(tmp_path_factory.mktemp("tiny"))
    zoo = pet_zoo(enc, 3)
    g = torch.Generator().manual_seed(0)
    B, L = len(zoo), 9
    inputs = torch.randn(B, L, enc.config.d, generator=g)
    mask = torch.arange(L)[None, :] < torch.randint(1, L + 1, (B,), generator=g)[:, None]
    fp32, q8 = CpuExecutor(enc), CpuExecutor(enc, int8=True)
    pets = [fp32.load_pet(p, key=k) for k, p in enumerate(zoo)]
    want, got = fp32.run(inputs, mask, pets), q8.run(inputs, mask, pets)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        # quantization moves logits a little, never wholesale
        assert (a - b).abs().max() <= 0.05 * b.abs().max() + 0.05
    assert any(not torch.equal(a, b) for a, b in zip(got, want))  # it really ran the int8 GEMMs
    with pytest.raises(ValueError, match="int8"):
        CpuExecutor(enc, kernels="reference", int8=True)


def test_runtime_dtype_int8_serves_close_to_fp32():
    """runtime.open(..., dtype="int8") on the CPU: the same requests, logits near fp32's."""
    import runtime
    from tests.test_runtime import requests_for, shared_tiny_store

    tiny = shared_tiny_store()
    reqs = requests_for(tiny, 6)
    with runtime.open(tiny[0], device="cpu", max_len=48) as fp32, \
            runtime.open(tiny[0], device="cpu", max_len=48, dtype="int8") as q8:
        assert q8.executor.int8 is not None and fp32.executor.int8 is None
        want, got = fp32.infer(reqs), q8.infer(reqs)
    for a, b in zip(got, want):
        a, b = np.asarray(a.logits), np.asarray(b.logits)
        assert a.shape == b.shape and np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 0.05
    with pytest.raises(ValueError, match="int8"):
        runtime.open(tiny[0], device="cpu", dtype="fp16")
