"""Full rows (a tenant's full-depth PET, from the base embeddings) in mixed batches.

Property: in a random batch of plot, context and full rows (random lengths; LoRA, adapter,
BitFit and diff PETs on random layer subsets, the full-depth ones including lower layers;
several tenants, some with several rows, one tenant with both kinds of PET), each row's
logits equal the row computed alone by the reference: for a plot row the upper layers with
its PET on its PLOT inputs, for a context row the same on the base lower layers' output, for
a full row every layer with its full-depth PET from the embeddings (Encoder.full) + head.
Checked on the CPU executor (batched and reference kernels) and on the GPU executor through
the kernel emulation. An upper-only PET that edits a lower layer is refused.

A full-depth PET whose record stores its layer tensors in fp16 (runtime.construct.full) is held
in fp16 by the executors' host form (half the bytes) and answers what the same PET rounded to
fp16 and held in fp32 answers, beside old fp32 records and PLOT-level PETs in one batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.construct.full import stored_tensors
from runtime.exec.cpu import CpuExecutor
from runtime.exec.plan import prepare_pet
from runtime.exec.rows import Gathered, Row
from runtime.model import pet as petlib
from tests.test_executor_cpu import random_pet, tiny_encoder

SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# (pet type, options) of the tenants' ordinary (upper-only) and full-depth PETs; the tiny
# encoder has 4 layers, 2 of them lower
UPPER = [("lora", {"rank": 3, "targets": ("q", "v")}), ("adapter", {"bottleneck": 4}), ("bitfit", {"layers": [3]})]
FULL = [("lora", {"rank": 4, "targets": petlib.TARGETS}), ("lora", {"rank": 2, "targets": ("k", "ffn_in"), "layers": [0]}),
        ("adapter", {"bottleneck": 3, "layers": [1, 3]}), ("bitfit", {"layers": [0, 2]}),
        ("diff", {"density": 0.05, "layers": [1]})]


class BaseContext:
    """Level 2's inputs for the tests: the base encoder's lower layers over the whole text."""

    def __init__(self, enc):
        self.enc = enc

    @torch.no_grad()
    def inputs(self, version, seqs):
        ids, mask = self.enc.pad(seqs)
        return self.enc.lower(ids, mask)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    enc = tiny_encoder(tmp_path_factory.mktemp("full"))
    upper = [random_pet(enc, kind, ("classification", "tagging")[j % 2], 10 + j, **opts)
             for j, (kind, opts) in enumerate(UPPER)]
    full = [random_pet(enc, kind, ("tagging", "classification")[j % 2], 20 + j, level="full", **opts)
            for j, (kind, opts) in enumerate(FULL)]
    return enc, upper, full


@torch.no_grad()
def reference(enc, row, plot_input, pet):
    """Row computed alone, unpadded."""
    ids = torch.tensor([row.ids])
    mask = torch.ones_like(ids, dtype=torch.bool)
    if row.source == "full":
        h = enc.full(enc.embed(ids), mask, pet)
    else:
        x = plot_input[None] if row.source == "plot" else enc.lower(ids, mask)
        h = enc.upper(x, mask, pet)
    return petlib.head(pet, h)[0]


@st.composite
def batches(draw, n_upper, n_full, vocab):
    """[(source, pet index, ids)]: pet index into the upper PETs (plot, context) or the full ones."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        source = draw(st.sampled_from(["plot", "context", "full"]))
        pet = draw(st.integers(0, (n_full if source == "full" else n_upper) - 1))
        n = draw(st.integers(1, 9))
        out.append((source, pet, draw(st.lists(st.integers(5, vocab - 1), min_size=n, max_size=n))))
    return out


def run_batch(ex, enc, upper, full, batch, seed, served=None):
    """The executor's logits per row, and the reference's; served[j]: the PET the executor loads
    for full PET j (default full[j], the reference's)."""
    # tenant j's ordinary PET and full-depth PET share the key "t{j}": the executor must keep them apart
    serving = {("u", j): ex.load_pet(p, key=f"t{j}", token=0) for j, p in enumerate(upper)}
    served = full if served is None else served
    serving |= {("f", j): ex.load_pet(p, key=f"t{j}", token=0) for j, p in enumerate(served)}
    rows = [Row(ids, serving[("f" if s == "full" else "u", j)], "v", source=s) for s, j, ids in batch]
    plot = [b for b, r in enumerate(rows) if r.source == "plot"]
    g = torch.Generator().manual_seed(seed)
    L = max((len(rows[b].ids) for b in plot), default=1)
    inputs = torch.randn(len(plot), L, enc.config.d, generator=g)
    for j, b in enumerate(plot):
        inputs[j, len(rows[b].ids):] = 7.0  # padding content must not leak into any result
    gathered = Gathered(plot, inputs if plot else None, [None] * len(rows), {"retrieval": 0.0})
    got = ex.compute(ex.prepare(gathered, rows))
    want = []
    for b, (s, j, _) in enumerate(batch):
        pet = full[j] if s == "full" else upper[j]
        want.append(reference(enc, rows[b], inputs[plot.index(b), :len(rows[b].ids)] if s == "plot" else None, pet))
    return got, want


@SETTINGS
@given(data=st.data())
def test_cpu_mixed_batch_with_full_rows_equals_each_row_alone(zoo, data):
    enc, upper, full = zoo
    batch = data.draw(batches(len(upper), len(full), enc.config.vocab_size))
    kernels = data.draw(st.sampled_from(["batched", "reference"]))
    ex = CpuExecutor(enc, kernels=kernels, prefetch=data.draw(st.booleans()), context=BaseContext(enc))
    got, want = run_batch(ex, enc, upper, full, batch, data.draw(st.integers(0, 2**31 - 1)))
    ex.close()
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        torch.testing.assert_close(torch.from_numpy(np.asarray(g)), w, rtol=1e-4, atol=2e-5)


def test_full_rows_under_int8_stay_within_its_error(zoo):
    """int8 quantizes the full rows' lower-layer GEMMs too: they still match within int8's error."""
    enc, upper, full = zoo
    ex = CpuExecutor(enc, int8=True, context=BaseContext(enc))
    batch = [("full", 0, [5, 6, 7, 8]), ("plot", 1, [9, 10]), ("full", 3, [11, 12, 13])]
    got, want = run_batch(ex, enc, upper, full, batch, 0)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(g) - w.numpy()).max() <= 0.1 * np.abs(w.numpy()).max() + 1e-3


def test_upper_only_pet_with_lower_layers_is_refused(zoo):
    enc, upper, full = zoo
    with pytest.raises(ValueError, match="not all upper layers"):
        petlib.create_pet(enc, "lora", "classification", ["a", "b"], layers=[0, 3])
    meta = {k: v for k, v in full[0].meta.items() if k != "level"}
    with pytest.raises(ValueError, match="not all upper layers"):
        petlib.load_pet(enc, full[0].tensors, meta)
    with pytest.raises(ValueError, match="edits lower layer 0: only a full-depth PET"):
        prepare_pet(enc, petlib.Pet(full[0].tensors, meta))


def test_full_pet_loads_through_its_stored_meta(zoo):
    """pet_meta keeps the level, so a full record's tensors load with their lower layers."""
    enc, _, full = zoo
    meta = dict(full[2].meta, version="v1", created="2026-01-01", tenant="t")
    loaded = petlib.load_pet(enc, full[2].tensors, petlib.pet_meta(meta))
    assert petlib.is_full(loaded) and loaded.meta["layers"] == [1, 3]
    assert petlib.create_pet(enc, "lora", "classification", ["a", "b"], level="full").meta["layers"] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown PET level"):
        petlib.create_pet(enc, "lora", "classification", ["a", "b"], level="lower")


def test_source_and_pet_must_agree(zoo):
    enc, upper, full = zoo
    ex = CpuExecutor(enc, context=BaseContext(enc))
    for source, pet in (("full", upper[0]), ("context", full[0])):
        rows = [Row([5, 6], ex.load_pet(pet, key="t"), "v", source=source)]
        with pytest.raises(ValueError, match="full rows, and only they"):
            ex.prepare(Gathered([], None, [None], {"retrieval": 0.0}), rows)


# -- full-depth records in fp16 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def halves(zoo):
    """The zoo's full-depth PETs as their records store them (fp16 layers, fp32 head): (held in
    fp16 as the runtime loads them, rounded the same and held in fp32: the reference)."""
    enc, _, full = zoo
    stored = [stored_tensors(p.tensors) for p in full]
    held = [petlib.load_pet(enc, t, p.meta, half=True) for t, p in zip(stored, full)]
    return held, [petlib.load_pet(enc, t, p.meta) for t, p in zip(stored, full)]


def draw_mixed(data, zoo, halves):
    """A drawn batch and, per full PET, (what the executor loads, the reference): fp16 records
    for some PETs, old fp32 ones for the others."""
    enc, upper, full = zoo
    batch = data.draw(batches(len(upper), len(full), enc.config.vocab_size))
    fp16 = data.draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
    held, rounded = halves
    served = [held[j] if fp16[j] else p for j, p in enumerate(full)]
    return batch, served, [rounded[j] if fp16[j] else p for j, p in enumerate(full)]


@SETTINGS
@given(data=st.data())
def test_fp16_full_depth_records_answer_as_their_rounded_pets_beside_fp32_ones(zoo, halves, data):
    enc, upper, full = zoo
    batch, served, want_pets = draw_mixed(data, zoo, halves)
    ex = CpuExecutor(enc, kernels=data.draw(st.sampled_from(["batched", "reference"])),
                     prefetch=data.draw(st.booleans()), context=BaseContext(enc))
    got, want = run_batch(ex, enc, upper, want_pets, batch, data.draw(st.integers(0, 2**31 - 1)), served)
    ex.close()
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(np.asarray(g)), w, rtol=1e-4, atol=2e-5)


def test_fp16_rounding_moves_the_answer_beyond_the_checks_tolerance(zoo, halves):
    """The fp16 record's answer is not the fp32 PET's within that tolerance: the check above can fail."""
    enc, upper, full = zoo
    ex = CpuExecutor(enc, context=BaseContext(enc))
    batch = [("full", 0, [5, 6, 7, 8, 9])]
    (got,), _ = run_batch(ex, enc, upper, full, batch, 0, halves[0])
    (exact,), _ = run_batch(ex, enc, upper, full, batch, 0)
    assert not np.allclose(np.asarray(got), np.asarray(exact), rtol=1e-4, atol=2e-5)


def test_the_host_form_of_an_fp16_record_holds_half_its_layer_bytes(zoo, halves):
    """ServingPet.nbytes (what runtime.sched.pet_cache.PetCache counts) is the fp16 bytes held:
    half the fp32 PET's for every layer tensor, the same for the fp32 head and int32 indices."""
    from runtime.sched.pet_cache import PetCache

    enc, _, full = zoo
    ex = CpuExecutor(enc)
    for p, held in zip(full, halves[0]):
        wide, narrow = ex.load_pet(p), ex.load_pet(held)
        fixed = sum(4 * v.numel() for k, v in p.tensors.items() if k.startswith("head.") or k.endswith(".index"))
        assert narrow.nbytes - fixed == (wide.nbytes - fixed) // 2 > 0
        assert all(b.dtype == torch.float16 for b, _ in narrow.blocks.values())
        cache = PetCache()
        assert cache.get("t/full", 0, lambda: narrow) is narrow and cache.nbytes == narrow.nbytes


# -- the GPU executor through the kernel emulation (as tests/test_executor_gpu.py) --------------


def _emu_missing():
    from runtime.exec.emu.module import compiler_missing_reason

    return compiler_missing_reason()


emulated = pytest.mark.skipif(_emu_missing() is not None, reason=f"CUDA emulation unavailable: {_emu_missing()}")


@emulated
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_emulated_gpu_mixed_batch_with_full_rows_equals_each_row_alone(zoo, data):
    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin
    from runtime.exec.gpu import GpuExecutor

    enc, upper, full = zoo
    batch = data.draw(batches(len(upper), len(full), enc.config.vocab_size))
    dtype = data.draw(st.sampled_from(["fp32", "fp16"]))
    with ops_gpu.use_cupy(cupy_standin):
        ex = GpuExecutor(enc, _cupy=cupy_standin, _ops=ops_gpu, max_batch=4, max_len=8, hot_tier_rows=0, dtype=dtype,
                         prefetch=data.draw(st.booleans()), context=BaseContext(enc))
        got, want = run_batch(ex, enc, upper, full, batch, data.draw(st.integers(0, 2**31 - 1)))
    for g, w in zip(got, want):
        g, w = np.asarray(g), w.numpy()
        assert g.shape == w.shape
        if dtype == "fp32":
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5)
        else:  # fp16 activations and weights: within 1e-2 of the logits' scale, as tests/test_executor_gpu.py
            assert np.abs(g - w).max() <= 1e-2 * max(np.abs(w).max(), 1.0)


@emulated
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_emulated_gpu_serves_fp16_full_depth_records_as_their_rounded_pets(zoo, halves, data):
    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin
    from runtime.exec.gpu import GpuExecutor

    enc, upper, full = zoo
    batch, served, want_pets = draw_mixed(data, zoo, halves)
    with ops_gpu.use_cupy(cupy_standin):
        ex = GpuExecutor(enc, _cupy=cupy_standin, _ops=ops_gpu, max_batch=4, max_len=8, hot_tier_rows=0,
                         prefetch=data.draw(st.booleans()), context=BaseContext(enc))
        got, want = run_batch(ex, enc, upper, want_pets, batch, data.draw(st.integers(0, 2**31 - 1)), served)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-4, atol=5e-5)
    # the device cache keeps an fp16 record's layers in fp16 too
    fp16_keys = {("full", f"t{j}") for j, p in enumerate(served) if p is not full[j]}
    for (key, _, layer), (arrays, _, _) in ex.pet_cache.entries.items():
        if key in fp16_keys and layer >= 0:
            assert all(a.dtype == np.float16 for part in arrays.values() for a in part if a.dtype.kind == "f")
