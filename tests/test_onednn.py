"""The CPU executor's oneDNN GEMMs against torch's own linear."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.exec import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 200), n=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_packed_linear_is_linear(m, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g)
    got = onednn.PackedLinears().linear(x, lin.weight, lin.bias)
    assert not got.is_mkldnn and got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4 * (k ** 0.5))


def test_a_changed_weight_is_packed_again():
    """Weights written in place (a dedicated model's swap) or replaced are never served stale."""
    lin, packed = torch.nn.Linear(8, 4), onednn.PackedLinears()
    x = torch.randn(5, 8)
    before = packed.linear(x, lin.weight, lin.bias)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    torch.testing.assert_close(packed.linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias))
    lin.weight = torch.nn.Parameter(torch.randn(4, 8))
    torch.testing.assert_close(packed.linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias))
    assert not torch.allclose(before, packed.linear(x, lin.weight, lin.bias))


def test_packed_weights_go_with_their_model():
    import gc

    packed = onednn.PackedLinears()
    lin = torch.nn.Linear(8, 4)
    packed.linear(torch.randn(2, 8), lin.weight, lin.bias)
    assert len(packed._packed) == 1
    del lin
    gc.collect()
    assert not packed._packed


def test_the_executor_takes_the_gemm_it_is_asked_for():
    from runtime.exec.cpu import CpuExecutor
    from runtime.model.encoder import load_encoder

    enc = load_encoder()
    assert CpuExecutor(enc, gemm="addmm").packed is None
    assert CpuExecutor(enc).packed is not None
    with pytest.raises(ValueError, match="gemm must be"):
        CpuExecutor(enc, gemm="mkl")
