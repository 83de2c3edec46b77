"""The CPU executor's bf16 layer: its fused pieces against the unfused ones.

* ``cpu_batched.lora_shared`` (q, k and v's LoRA with one shrink GEMM against their A's side by
  side) equals ``cpu_batched.lora`` run once per output, on random segment tables and ranks;
* a PLOT-level batch in bf16 (adapters and BitFit run in bf16 on the projections' bf16 outputs,
  LoRA on q and v, a head-only tenant) answers as fp32 does within bf16's error, and each row as
  it does alone (bit for bit here: the same kernels).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import cpu_batched, precision
from runtime.exec.cpu import CpuExecutor
from tests.test_cpu_batched import segment_tables
from tests.test_executor_cpu import random_pet, tiny_encoder

needs_bf16 = pytest.mark.skipif(precision.bf16_native() is None, reason="this CPU has no AVX512_BF16 / AMX-BF16")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=segment_tables(), ranks=st.lists(st.integers(1, 5), min_size=3, max_size=3), seed=st.integers(0, 99))
def test_lora_shared_equals_one_lora_per_output(table, ranks, seed):
    starts, ids, T, L = table
    g = torch.Generator().manual_seed(seed)
    rows, d = int(starts[-1]) * L, 6
    runs, _ = cpu_batched.segment_runs(starts, ids, L)
    x = torch.randn(rows, d, generator=g)
    As = [torch.randn(T, r, d, generator=g) for r in ranks]
    Bs = [torch.randn(T, d + j, r, generator=g) for j, r in enumerate(ranks)]
    scales = torch.rand(T, generator=g)
    ys = [torch.randn(rows, d + j, generator=g) for j in range(3)]
    want = [cpu_batched.lora(y.clone(), x, runs, A, B, scales) for y, A, B in zip(ys, As, Bs)]
    got = cpu_batched.lora_shared([y.clone() for y in ys], x, runs, As, Bs, scales)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_bf16
def test_a_plot_level_batch_in_bf16_answers_as_fp32(tmp_path):
    enc = tiny_encoder(tmp_path)
    pets = [random_pet(enc, kind, ("classification", "tagging")[j % 2], 40 + j, **opts)
            for j, (kind, opts) in enumerate([("adapter", {"bottleneck": 6}), ("bitfit", {}),
                                              ("lora", {"rank": 3, "targets": ("q", "v")}), ("head", {})])]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 9, enc.config.d, generator=g)
    mask = torch.from_numpy(np.arange(9)[None, :] < np.array([9, 3, 5, 9, 1, 7, 2])[:, None])
    items = [0, 1, 2, 3, 0, 0, 2]
    out = {}
    for p in ("fp32", "bf16"):
        ex = CpuExecutor(enc, precision=p, prefetch=False)
        serving = [ex.load_pet(pet, key=j) for j, pet in enumerate(pets)]
        out[p] = ex.forward(x, mask, ex.plan([serving[j] for j in items]))
    for a, b in zip(out["fp32"], out["bf16"]):
        scale = float(a.abs().max())
        # bf16 rounding through the upper layers (see tests/test_precision.py): about 1% of the scale
        assert 0 < float((a - b).abs().max()) <= 0.05 * scale + 1e-3
