"""The CPU executor's precisions (runtime.exec.precision): bf16 rows against fp32, and ``auto``
running each row at its PET's recorded precision in mixed batches.

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

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import cpu_batched, precision
from runtime.exec.cpu import CpuExecutor
from runtime.exec.rows import Gathered, Row
from runtime.model import pet as petlib
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
        "precision auto: this CPU has no AVX512_BF16 / AMX-BF16, every row runs fp32"]


@needs_bf16
def test_auto_runs_per_row_where_the_cpu_has_bf16(tmp_path):
    ex = CpuExecutor(tiny_encoder(tmp_path), precision="auto")
    assert ex.precision == "auto" and ex.bf16 is precision.shared_bf16()


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


# -- auto: each row at its PET's recorded precision ---------------------------------------------

SETTINGS = settings(max_examples=10, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
RECORDS = (None, "fp32", "bf16")  # None: a PET from before precisions were recorded


def recorded(pet, record):
    """pet with its meta's precision record set to record (None: no record)."""
    meta = {k: v for k, v in pet.meta.items() if k != "precision"}
    return petlib.Pet(pet.tensors, meta if record is None else dict(meta, precision=record))


def compute(ex, rows, plot_inputs):
    """The executor's (logits, attention received) per row; plot_inputs[b] (length, d) for plot rows."""
    plot = [b for b, r in enumerate(rows) if r.source == "plot"]
    L = max((len(rows[b].ids) for b in plot), default=1)
    inputs = torch.full((len(plot), L, plot_inputs[plot[0]].shape[1] if plot else 1), 7.0)
    for j, b in enumerate(plot):
        inputs[j, :len(rows[b].ids)] = plot_inputs[b]
    prepared = ex.prepare(Gathered(plot, inputs if plot else None, [None] * len(rows), {"retrieval": 0.0}), rows)
    got = ex.compute(prepared)
    return got, prepared.received or [None] * len(rows)


@st.composite
def tenants_and_rows(draw, n_upper, n_full, vocab):
    """(records of the upper and the full PETs, [(source, pet index, ids, attention)])."""
    records = draw(st.lists(st.sampled_from(RECORDS), min_size=n_upper + n_full, max_size=n_upper + n_full))
    rows = []
    for _ in range(draw(st.integers(1, 7))):
        source = draw(st.sampled_from(["plot", "context", "full"]))
        pet = draw(st.integers(0, (n_full if source == "full" else n_upper) - 1))
        n = draw(st.integers(1, 9))
        ids = draw(st.lists(st.integers(5, vocab - 1), min_size=n, max_size=n))
        rows.append((source, pet, ids, source == "plot" and draw(st.booleans())))
    return records[:n_upper], records[n_upper:], rows


@needs_bf16
@SETTINGS
@given(data=st.data())
def test_auto_answers_each_row_as_its_recorded_precision_alone(zoo, data):  # noqa: F811
    """A mixed batch of plot, context and full rows whose PETs record fp32, bf16 or nothing: under
    auto each row's logits (and attention received) are what that row alone gets from an
    executor forced to its recorded precision (fp32 for no record)."""
    enc, upper, full = zoo
    up_rec, full_rec, batch = data.draw(tenants_and_rows(len(upper), len(full), enc.config.vocab_size))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    prefetch = data.draw(st.booleans())
    executors = {p: CpuExecutor(enc, precision=p, context=BaseContext(enc), prefetch=prefetch)
                 for p in ("auto", "fp32", "bf16")}
    loaded = {p: ({j: ex.load_pet(recorded(pet, up_rec[j]), key=f"t{j}", token=0) for j, pet in enumerate(upper)},
                  {j: ex.load_pet(recorded(pet, full_rec[j]), key=f"t{j}", token=0) for j, pet in enumerate(full)})
              for p, ex in executors.items()}

    def rows_for(p, items):
        ups, fulls = loaded[p]
        return [Row(ids, (fulls if s == "full" else ups)[j], "v", source=s, attention=a) for s, j, ids, a in items]

    plot_inputs = {b: torch.randn(len(ids), enc.config.d, generator=g)
                   for b, (s, _, ids, _) in enumerate(batch) if s == "plot"}
    got, received = compute(executors["auto"], rows_for("auto", batch), plot_inputs)
    for b, (s, j, ids, a) in enumerate(batch):
        record = (full_rec if s == "full" else up_rec)[j]
        p = "bf16" if record == "bf16" else "fp32"
        alone, alone_received = compute(executors[p], rows_for(p, [batch[b]]),
                                        {0: plot_inputs[b]} if s == "plot" else {})
        want = torch.as_tensor(np.asarray(alone[0]))
        # The same kernels on another batch shape: a row run at the other precision moved 3e-4
        # to 1.3e-2 of its scale, a bf16 row in a batch was within 1e-6 of itself alone; bf16
        # keeps a margin for a CPU whose oneDNN picks kernels by the row count (a sum landing on
        # a rounding boundary rounds to the other bf16 neighbour, 2^-8 relative)
        tol = 1e-4 if p == "fp32" else 1e-3
        torch.testing.assert_close(torch.as_tensor(np.asarray(got[b])), want, rtol=tol,
                                   atol=tol * float(want.abs().max()))
        if a:
            torch.testing.assert_close(torch.as_tensor(received[b]), torch.as_tensor(alone_received[0]),
                                       rtol=1e-4, atol=1e-5)
    for ex in executors.values():
        ex.close()


@needs_bf16
def test_auto_plans_the_bf16_rows_last_and_runs_them_bf16(zoo):  # noqa: F811
    """The plan puts each precision's rows in one range (bf16 last, a tenant's rows at its
    first item's record); a bf16 row's answer is bf16's, not fp32's."""
    enc, upper, _ = zoo
    ex = CpuExecutor(enc, precision="auto", prefetch=False)
    records = ["bf16", None, "fp32"]
    pets = [ex.load_pet(recorded(p, r), key=f"t{j}") for j, (p, r) in enumerate(zip(upper, records))]
    items = [0, 1, 2, 0, 1, 0]
    plan = ex.plan([pets[j] for j in items])
    assert plan.bf16_from == 3 and sorted(plan.perm[3:].tolist()) == [0, 3, 5]
    assert ex.plan([pets[1], pets[2]]).bf16_from is None and ex.plan([pets[0]]).bf16_from == 0
    x = torch.linspace(-2, 2, 4 * 3 * enc.config.d).view(4, 3, enc.config.d)
    mask = torch.ones(4, 3, dtype=torch.bool)
    got = ex.forward(x, mask, ex.plan([pets[j] for j in (0, 1, 0, 2)]))
    fp32 = CpuExecutor(enc, precision="fp32", prefetch=False)
    want = fp32.forward(x, mask, fp32.plan([pets[j] for j in (0, 1, 0, 2)]))
    for b in (1, 3):  # fp32 rows: fp32's answers
        torch.testing.assert_close(got[b], want[b], rtol=1e-4, atol=1e-5)
    for b in (0, 2):  # bf16 rows: not fp32's
        assert float((got[b] - want[b]).abs().max()) > 1e-4 * float(want[b].abs().max())


def test_auto_without_the_instructions_serves_a_bf16_record_at_fp32(zoo, no_native_bf16):  # noqa: F811
    """On a CPU without native bf16, a PET that records bf16 answers under auto exactly what a
    forced-fp32 executor answers (bit for bit: the same fp32 kernels on the same batch)."""
    enc, upper, full = zoo
    batch = [("full", 0, [5, 6, 7, 8], False), ("plot", 1, [9, 10], True), ("context", 2, [7, 8, 9], False)]
    got = {}
    for p in ("auto", "fp32"):
        ex = CpuExecutor(enc, precision=p, context=BaseContext(enc), prefetch=False)
        ups = [ex.load_pet(recorded(pet, "bf16"), key=f"t{j}", token=0) for j, pet in enumerate(upper)]
        fulls = [ex.load_pet(recorded(pet, "bf16"), key=f"t{j}", token=0) for j, pet in enumerate(full)]
        rows = [Row(ids, (fulls if s == "full" else ups)[j], "v", source=s, attention=a) for s, j, ids, a in batch]
        got[p] = compute(ex, rows, {1: torch.linspace(-1, 1, 2 * enc.config.d).view(2, -1)})
        assert ex.bf16 is None
    for a, b in zip(got["auto"][0], got["fp32"][0]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cut_runs_keeps_whole_segments_renumbered():
    """cut_runs equals cutting the per-segment expansion of (runs, gaps) at the range."""
    starts, ids, L = [0, 2, 4, 6, 7, 9, 11], [0, 1, 2, -1, 3, 4], 3
    runs, gaps = cpu_batched.segment_runs(starts, ids, L)

    def segments(runs, gaps):
        out = [(a + j * (b - a) // n, a + (j + 1) * (b - a) // n, t0 + j) for a, b, n, t0 in runs for j in range(n)]
        return sorted(out + [(a, b, -1) for a, b in gaps])

    whole = segments(runs, gaps)
    for r0 in sorted({0, *(s * L for s in starts)}):
        for r1 in sorted({s * L for s in starts if s * L > r0}):
            want = [(a - r0, b - r0, t) for a, b, t in whole if a >= r0 and b <= r1]
            got = segments(*cpu_batched.cut_runs(runs, gaps, r0, r1))
            assert [s for s in got if s[2] >= 0] == [s for s in want if s[2] >= 0]
            assert sum(b - a for a, b, t in got if t < 0) == sum(b - a for a, b, t in want if t < 0)
    with pytest.raises(ValueError, match="cut a segment"):
        cpu_batched.cut_runs(runs, gaps, 3, 12)
