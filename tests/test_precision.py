"""The CPU executor's shared GEMMs in bf16 (runtime.exec.precision) against fp32.

bf16 keeps 8 significant bits: each GEMM input and output is rounded to about 2^-9 relative,
accumulation stays fp32, and the PET ops, attention, LayerNorm and the residual stream stay fp32.
Through the tiny encoder's four layers (LayerNorm after each) that moves logits by about 1% of
their scale (at most 1.3% on this batch); the test allows 5% of the largest logit, where a wrong
kernel (a missing bias, a transposed weight, another tenant's PET) moves them by their whole scale.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from runtime.exec import precision
from runtime.exec.cpu import CpuExecutor
from tests.test_exec_full import BaseContext, run_batch, zoo  # noqa: F401 - the fixture
from tests.test_executor_cpu import tiny_encoder

NATIVE = precision.bf16_native() is not None
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 / AMX-BF16")

# full rows (full-depth LoRA on every projection of every layer), plot and context rows together
BATCH = [("full", 0, [5, 6, 7, 8, 9, 10]), ("plot", 1, [9, 10]), ("full", 0, [11, 12, 13]), ("context", 0, [7, 8, 9]),
         ("full", 3, [11, 12, 13, 14]), ("plot", 0, [5, 6, 7, 8]), ("full", 2, [6, 9]), ("context", 2, [12, 5]),
         ("full", 4, [5, 9, 13, 6, 7])]


@pytest.fixture
def no_native_bf16(monkeypatch):
    """A CPU without bf16 instructions (the flag check is what decides)."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "avx512f"})
    precision.bf16_native.cache_clear()
    precision._say_fp32_once.cache_clear()
    yield
    precision.bf16_native.cache_clear()
    precision._say_fp32_once.cache_clear()


def test_a_bad_precision_name_is_refused(tmp_path):
    enc = tiny_encoder(tmp_path)
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, auto, got 'fp16'"):
        CpuExecutor(enc, precision="fp16")


def test_bf16_without_the_instructions_is_one_clear_error(tmp_path, no_native_bf16):
    enc = tiny_encoder(tmp_path)
    with pytest.raises(precision.PrecisionUnavailable, match="needs a CPU with AVX512_BF16 or AMX-BF16"):
        CpuExecutor(enc, precision="bf16")


def test_auto_without_the_instructions_keeps_fp32_and_says_so_once(tmp_path, no_native_bf16, caplog):
    enc = tiny_encoder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="runtime.exec.precision"):
        first, second = CpuExecutor(enc, precision="auto"), CpuExecutor(enc, precision="auto")
    assert first.precision == second.precision == "fp32" and first.bf16 is None
    assert [r.getMessage() for r in caplog.records] == [
        "precision auto: this CPU has no AVX512_BF16 / AMX-BF16, the shared GEMMs stay fp32"]


@needs_bf16
def test_auto_takes_bf16_where_the_cpu_has_it(tmp_path):
    assert CpuExecutor(tiny_encoder(tmp_path), precision="auto").precision == "bf16"


def test_bf16_with_int8_or_the_reference_kernels_is_refused(tmp_path):
    if not NATIVE:
        pytest.skip("bf16 is refused earlier on this CPU")
    enc = tiny_encoder(tmp_path)
    for options in ({"int8": True}, {"kernels": "reference"}, {"gemm": "addmm"}):
        with pytest.raises(ValueError, match="precision 'bf16' runs on the batched kernels"):
            CpuExecutor(enc, precision="bf16", **options)
        assert CpuExecutor(enc, precision="auto", **options).precision == "fp32"


@needs_bf16
def test_bf16_answers_are_fp32_answers_within_bf16_rounding(zoo):  # noqa: F811
    enc, upper, full = zoo
    runs = {}
    for p in ("fp32", "bf16"):
        ex = CpuExecutor(enc, precision=p, context=BaseContext(enc), prefetch=False)
        runs[p], want = run_batch(ex, enc, upper, full, BATCH, 0)
        ex.close()
    # bf16 really ran: the executor's packed weights are bf16, and its answers are not fp32's bits
    packed = ex.bf16._packed[id(enc.layers[0].q.weight)][2]
    assert packed.dtype == torch.bfloat16
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(runs["fp32"], runs["bf16"]))
    agree = margin_rows = 0
    for a, b, w in zip(runs["fp32"], runs["bf16"], want):
        a, b, w = (torch.as_tensor(np.asarray(t)) for t in (a, b, w))
        torch.testing.assert_close(a, w, rtol=1e-4, atol=2e-5)
        scale = float(w.abs().max())
        assert float((b - a).abs().max()) <= 0.05 * scale + 1e-3
        # labels: identical wherever fp32's top-two margin is above the allowed error (a nearer
        # tie may flip under any rounding)
        top = a.reshape(-1, a.shape[-1]).topk(2, dim=-1)
        clear = (top.values[:, 0] - top.values[:, 1]) > 2 * (0.05 * scale + 1e-3)
        got = b.reshape(-1, b.shape[-1]).argmax(-1)
        agree += int((got[clear] == top.indices[clear, 0]).sum())
        margin_rows += int(clear.sum())
    assert margin_rows >= 10 and agree == margin_rows


@needs_bf16
def test_the_runtime_serves_bf16_when_asked():
    """runtime.open(dtype='bf16') reaches the executor and answers as fp32 does; a bad dtype is a
    clear error."""
    import runtime
    from tests.test_runtime import requests_for, shared_tiny_store

    tiny = shared_tiny_store()
    reqs = requests_for(tiny)
    answers = {}
    for dtype in ("fp32", "bf16"):
        with runtime.open(tiny[0], device="cpu", dtype=dtype, max_len=48) as rt:
            assert rt.executor.precision == dtype
            answers[dtype] = rt.infer(reqs)
    for a, b in zip(answers["fp32"], answers["bf16"]):
        la, lb = np.asarray(a.logits), np.asarray(b.logits)
        assert np.abs(la - lb).max() <= 0.05 * np.abs(la).max() + 1e-3
    with pytest.raises(ValueError, match="fp32, bf16 or auto"):
        runtime.open(tiny[0], device="cpu", dtype="fp8")
