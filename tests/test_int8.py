"""runtime.exec.int8: the int8 shared projections stay within the quantization error bound of
the fp32 GEMM, follow in-place weight swaps, and the CPU executor with int8=True serves
mixed batches within a small distance of its fp32 results."""

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
    q = int8.Int8Upper(enc, [0])
    lin = enc.layers[0].ffn_in
    with torch.no_grad():
        want = lin(x)
    got = q.linear(0, "ffn_in", x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= _bound(x, lin.weight.detach())).all()


def test_follows_in_place_weight_swaps():
    enc = _Enc(16, 8)
    q = int8.Int8Upper(enc, [0])
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
