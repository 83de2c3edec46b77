"""The bf16 layers' fused residual + LayerNorm (runtime/exec/_fused.c through
cpu_batched.residual_layernorm) against the reference: ATen's sum and LayerNorm with each
tenant run's affine (cpu_batched.layernorm), row by row."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import cpu_batched

needs_fused = pytest.mark.skipif(cpu_batched._fused is None, reason="runtime.exec._fused not built")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def norm_batches(draw):
    """(segment request counts, each segment's tenant or -1 for none, tenants, d)."""
    T = draw(st.integers(1, 5))
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    ids = draw(st.lists(st.integers(-1, T - 1), min_size=len(counts), max_size=len(counts)))
    return counts, ids, T, draw(st.sampled_from([8, 24, 37, 64]))  # whole, partial and no 16-lane blocks


def _case(counts, ids, T, d, seed, L=3):
    g = torch.Generator().manual_seed(seed)
    ln = torch.nn.LayerNorm(d).requires_grad_(False)  # as the executor holds the encoder
    ln.weight.copy_(torch.randn(d, generator=g))
    ln.bias.copy_(torch.randn(d, generator=g))
    gain, shift = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    starts = np.concatenate([[0], np.cumsum(counts)])
    runs, gaps = cpu_batched.segment_runs(starts, ids, L)
    R = int(starts[-1]) * L
    residual = torch.randn(R, d, generator=g) * 3 + 1
    y = torch.randn(R, d, generator=g).to(torch.bfloat16)
    return ln, gain, shift, starts, runs, gaps, residual, y


@needs_fused
@SETTINGS
@given(batch=norm_batches(), seed=st.integers(0, 2**31 - 1), copy=st.booleans(), deltas=st.booleans())
def test_fused_is_the_reference_row_by_row(batch, seed, copy, deltas):
    """The fused pass equals the reference (fp32 sum, LayerNorm, each run's deltas) to fp32
    rounding, writes the residual in place, its bf16 copy is exactly the residual rounded, and
    a segment alone gets the bits it gets inside the batch."""
    counts, ids, T, d = batch
    L = 3
    ln, gain, shift, starts, runs, gaps, residual, y = _case(counts, ids, T, d, seed, L)
    if not deltas:
        runs = gaps = gain = shift = None
    before = residual.clone()
    want = cpu_batched.layernorm(y.float(), residual.clone(), ln, runs, gaps, gain, shift)
    out16 = torch.empty(residual.shape, dtype=torch.bfloat16) if copy else None
    got = cpu_batched.residual_layernorm(y, residual, ln, runs, gaps, gain, shift, out16)
    assert got.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    if copy:
        assert torch.equal(out16, got.to(torch.bfloat16))
    for s in range(len(counts)):
        r0, r1 = int(starts[s]) * L, int(starts[s + 1]) * L
        if deltas:
            alone_runs, alone_gaps = cpu_batched.segment_runs([0, counts[s]], [ids[s]], L)
        else:
            alone_runs = alone_gaps = None
        alone = cpu_batched.residual_layernorm(y[r0:r1].clone(), before[r0:r1].clone(), ln, alone_runs, alone_gaps,
                                               gain, shift)
        assert torch.equal(alone, got[r0:r1])


@needs_fused
def test_fused_bits_do_not_hang_on_threads():
    """Threads take whole rows: 1, 3 or 8 threads give the same bits (rows enough for each)."""
    ln, gain, shift, starts, runs, gaps, residual, y = _case([40, 30, 50], [0, -1, 1], 2, 384, 7, L=8)
    got = []
    for n in (1, 3, 8):
        with _threads(n):
            got.append(cpu_batched.residual_layernorm(y, residual.clone(), ln, runs, gaps, gain, shift))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


@needs_fused
def test_without_the_extension_the_reference_runs(monkeypatch):
    """No build (or HKSTORE_NO_ACCEL): the same function on ATen's ops, the same answer to fp32
    rounding; an operand the kernel does not take (a strided y) goes that way too."""
    ln, gain, shift, starts, runs, gaps, residual, y = _case([2, 1, 3], [1, -1, 0], 2, 48, 3)
    fused = cpu_batched.residual_layernorm(y, residual.clone(), ln, runs, gaps, gain, shift)
    strided = torch.cat([y, y], 1)[:, ::2]
    torch.testing.assert_close(cpu_batched.residual_layernorm(strided, residual.clone(), ln, runs, gaps, gain, shift),
                               cpu_batched.layernorm(strided.float(), residual.clone(), ln, runs, gaps, gain, shift))
    monkeypatch.setattr(cpu_batched, "_fused", None)
    out16 = torch.empty(y.shape, dtype=torch.bfloat16)
    ref = cpu_batched.residual_layernorm(y, residual.clone(), ln, runs, gaps, gain, shift, out16)
    torch.testing.assert_close(ref, fused, rtol=1e-5, atol=2e-5)
    assert torch.equal(out16, ref.to(torch.bfloat16))


@needs_fused
def test_a_row_outside_the_tables_is_refused():
    """The kernel checks every row's table index before it writes: an IndexError, x untouched."""
    x, y = torch.randn(4, 16), torch.zeros(4, 16, dtype=torch.bfloat16)
    table, keep = torch.ones(2, 16), x.clone()
    rows = np.array([0, 1, 2, 0], np.int64)
    with pytest.raises(IndexError, match="table row 2 of 2"):
        cpu_batched._fused.add_layernorm(x.data_ptr(), y.data_ptr(), rows.ctypes.data, table.data_ptr(),
                                         table.data_ptr(), 0, 4, 16, 2, 1e-5, 1)
    assert torch.equal(x, keep)


class _threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)
