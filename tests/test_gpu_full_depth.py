"""The full-depth level on the GPU executor, through the kernel emulation, against the CPU executor.

The product's full-depth recipe (runtime.construct.recipe: LoRA on all six targets of every
layer) for several tenants, their records held as `tenant create` stores them (fp16 layers) or
in fp32, in mixed batches beside PLOT rows of other tenants (LoRA and adapter PETs on the upper
layers): every row's logits from the GPU executor equal the CPU executor's on the same batch, in
fp32 and fp16, whichever LoRA kernel the plan asks for. Every layer's LoRA runs as one batched
kernel launch per target for the whole batch (the lower layers for the full rows, the upper
layers for all rows), SGMV or BGMV as asked - never a per-tenant loop. The same checks run on
a real GPU with CuPy (marker gpu) when there is one.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.construct.full import stored_tensors
from runtime.construct.recipe import FULL_PET_TYPE, recipe
from runtime.exec.cpu import CpuExecutor
from runtime.exec.rows import Gathered, Row
from runtime.model import pet as petlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling test modules, any import mode
from test_executor_cpu import random_pet, tiny_encoder  # noqa: E402


def _emu_missing():
    from runtime.exec.emu.module import compiler_missing_reason

    return compiler_missing_reason()


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


BACKENDS = [pytest.param("emu", marks=pytest.mark.skipif(_emu_missing() is not None,
                                                         reason=f"CUDA emulation unavailable: {_emu_missing()}")),
            pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(),
                                                                            reason="needs CuPy and a CUDA GPU")])]


@contextlib.contextmanager
def gpu_executor(enc, backend, ops, **kwargs):
    """A GpuExecutor on the emulation (the CuPy stand-in) or on the real device."""
    from runtime.exec import ops_gpu
    from runtime.exec.gpu import GpuExecutor

    if backend == "cuda":
        ex = GpuExecutor(enc, _ops=ops, **kwargs)
        try:
            yield ex
        finally:
            ex.close()
        return
    from runtime.exec.emu import cupy_standin

    with ops_gpu.use_cupy(cupy_standin):
        yield GpuExecutor(enc, _cupy=cupy_standin, _ops=ops, **kwargs)

FULL_TENANTS = 4
UPPER = [("lora", {"rank": 3, "targets": ("q", "v")}), ("adapter", {"bottleneck": 4})]
LORA_OPS = ("sgmv", "bgmv")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """(encoder, upper-only PETs, [(full-depth PET as the executors load it, fp16 record?)])."""
    enc = tiny_encoder(tmp_path_factory.mktemp("fd"))
    options = dict(recipe(FULL_PET_TYPE, "full").options)
    full = []
    for j in range(FULL_TENANTS):
        pet = random_pet(enc, FULL_PET_TYPE, ("classification", "tagging")[j % 2], 40 + j, level="full", **options)
        half = j % 2 == 0  # the stored form (fp16 layers) beside an fp32 one
        if half:
            pet = petlib.load_pet(enc, stored_tensors(pet.tensors), pet.meta, half=True)
        full.append(pet)
    upper = [random_pet(enc, kind, ("tagging", "classification")[j % 2], 60 + j, **opts)
             for j, (kind, opts) in enumerate(UPPER)]
    return enc, upper, full


def test_the_zoo_is_the_full_depth_recipe_on_every_layer(zoo):
    enc, _, full = zoo
    for p in full:
        assert petlib.is_full(p) and p.meta["layers"] == list(range(enc.config.num_layers))
        assert sorted(p.meta["targets"]) == sorted(petlib.TARGETS)


class CountingOps:
    """runtime.exec.ops_gpu with its LoRA launches recorded as (kernel, rows of y), in order."""

    def __init__(self, ops):
        self._ops = ops
        self.lora = []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name not in LORA_OPS:
            return fn

        def launch(y, *args, **kwargs):
            self.lora.append((name, int(y.shape[0])))
            return fn(y, *args, **kwargs)

        return launch


@st.composite
def mixed_batches(draw, vocab):
    """[(source, pet index, ids)]: at least two full rows of different tenants and one plot row."""
    rows = [("full", 0, None), ("full", 1, None), ("plot", 0, None)]
    rows += [draw(st.sampled_from([("full", j, None) for j in range(FULL_TENANTS)]
                                  + [("plot", j, None) for j in range(len(UPPER))]))
             for _ in range(draw(st.integers(0, 4)))]
    rows = draw(st.permutations(rows))
    out = []
    for source, j, _ in rows:
        n = draw(st.integers(1, 8))
        out.append((source, j, draw(st.lists(st.integers(5, vocab - 1), min_size=n, max_size=n))))
    return out


def run(ex, zoo, batch, seed):
    """The executor's logits per row for a mixed batch (plot inputs drawn from seed)."""
    enc, upper, full = zoo
    # tenant j's PLOT-level PET and full-depth PET share a key: the executor must keep them apart
    serving = {("plot", j): ex.load_pet(p, key=f"t{j}", token=0) for j, p in enumerate(upper)}
    serving |= {("full", j): ex.load_pet(p, key=f"t{j}", token=0) for j, p in enumerate(full)}
    rows = [Row(ids, serving[(s, j)], "v", source=s) for s, j, ids in batch]
    plot = [b for b, r in enumerate(rows) if r.source == "plot"]
    g = torch.Generator().manual_seed(seed)
    L = max(len(rows[b].ids) for b in plot)
    inputs = torch.randn(len(plot), L, enc.config.d, generator=g)
    for k, b in enumerate(plot):
        inputs[k, len(rows[b].ids):] = 7.0  # padding content must not leak into any result
    gathered = Gathered(plot, inputs, [None] * len(rows), {"retrieval": 0.0})
    return ex.compute(ex.prepare(gathered, rows))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_full_depth_rows_in_mixed_batches_equal_the_cpu_executor(zoo, backend, data):
    from runtime.exec import ops_gpu

    enc, upper, full = zoo
    batch = data.draw(mixed_batches(enc.config.vocab_size))
    dtype = data.draw(st.sampled_from(["fp32", "fp16"]))
    kernel = data.draw(st.sampled_from(["sgmv", "bgmv"]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    cpu = CpuExecutor(enc)
    want = run(cpu, zoo, batch, seed)
    cpu.close()
    ops = CountingOps(ops_gpu)
    with gpu_executor(enc, backend, ops, dtype=dtype, lora_kernel=kernel, max_batch=4, max_len=8, hot_tier_rows=0,
                      prefetch=data.draw(st.booleans())) as ex:
        got = run(ex, zoo, batch, seed)
    for g, w in zip(got, want):
        g, w = np.asarray(g, dtype=np.float64), np.asarray(w, dtype=np.float64)
        assert g.shape == w.shape and np.isfinite(g).all()
        if dtype == "fp32":
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5)
        else:  # fp16 activations and weights: tests/test_executor_gpu.py's 1e-2 relative (norms) for the
            # upper layers, twice that here: a full row runs every layer in fp16
            assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w)
    # the full rows' lower layers, then every row's upper layers: one launch per layer and target
    full_rows = [len(ids) for s, _, ids in batch if s == "full"]
    lower_rows = len(full_rows) * max(full_rows)
    lower = enc.lower_layers * len(petlib.TARGETS)
    assert ops.lora[:lower] == [(kernel, lower_rows)] * lower
    upper = ops.lora[lower:]
    assert len(upper) == (enc.config.num_layers - enc.lower_layers) * len(petlib.TARGETS)
    assert {name for name, _ in upper} == {kernel} and len({rows for _, rows in upper}) == 1
    assert upper[0][1] % len(batch) == 0  # B x L: every row of the batch in the one launch


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_lower_layer_lora_would_show(zoo, backend):
    """The comparison can fail: a full-depth PET whose lower-layer LoRA is dropped answers
    differently from the one the CPU executor runs (so the lower layers' launches matter)."""
    from runtime.exec import ops_gpu

    enc, upper, full = zoo
    batch = [("full", 1, [5, 6, 7, 8]), ("plot", 0, [9, 10, 11]), ("full", 3, [12, 13])]
    cpu = CpuExecutor(enc)
    want = run(cpu, zoo, batch, 0)
    cpu.close()
    tensors = {k: v for k, v in full[1].tensors.items()
               if not (k.startswith("layers.0.") or k.startswith("layers.1."))}
    meta = dict(full[1].meta, layers=list(range(enc.lower_layers, enc.config.num_layers)))
    cut = (enc, upper, [full[0], petlib.Pet(tensors, meta), *full[2:]])
    with gpu_executor(enc, backend, ops_gpu, max_batch=4, max_len=8, hot_tier_rows=0) as ex:
        got = run(ex, cut, batch, 0)
    assert not np.allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4, atol=5e-5)
