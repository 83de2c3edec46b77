"""The GPU executor against the CPU reference executor.

Two halves:

* ``@pytest.mark.gpu`` (skipped without CuPy and a CUDA GPU): the real GpuExecutor on fresh
  random inputs (random tiny models and every PET type) and on a real store built with
  runtime.construct.manager, served through runtime.open(device="cuda") with and without the hot tier,
  pipelining and prefetch: fp32 within 1e-5 relative, fp16 within 1e-2.
* Always: the same executor code run on the CPU with NumPy standing in for CuPy and
  runtime.exec.ops_cpu for runtime.exec.ops_gpu (streams and events become no-ops). That checks the
  executor's own logic - permutation, stacking and padding, the device PET cache and its
  eviction, the hot tier's keys, probe, gather/scatter and rebuilds, double buffering -
  everywhere, GPU or not.
* Always (skipped only without g++ >= 12): the same executor, unchanged, on the CuPy stand-in
  with runtime.exec.ops_gpu launching the real .cu kernels through the CPU emulation
  (runtime.exec.emu): random models and every PET type, a real store through the pipelined
  engine with and without the hot tier, and the property that a mixed batch equals each
  request run alone.  Only CuPy itself, timing and the real device are left to the GPU half.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec.cpu import CpuExecutor
from runtime.exec.gpu import GpuExecutor
from benchmarks.host_device import HostGpuExecutor as NumpyGpuExecutor
from runtime.engine import Engine
from runtime.exec.rows import Row

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling test modules, any import mode
from test_executor_cpu import pet_zoo, tiny_encoder  # noqa: E402

TOL = {"fp32": 1e-5, "fp16": 1e-2}


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def random_batch(enc, n_items, seed, max_len=12):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n_items)
    L = int(lengths.max())
    inputs = torch.randn(n_items, L, enc.config.d, generator=g)
    mask = torch.arange(L)[None, :] < torch.as_tensor(lengths)[:, None]
    inputs[~mask] = 0.0
    return inputs, mask


# -- always: the executor's logic on the CPU ----------------------------------------------------


@pytest.fixture(scope="module")
def zoo_setup(tmp_path_factory):
    enc = tiny_encoder(tmp_path_factory.mktemp("g"))
    return enc, pet_zoo(enc, 3)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_numpy_stand_in_matches_cpu_executor(zoo_setup, dtype, prefetch):
    enc, zoo = zoo_setup
    cpu = CpuExecutor(enc)
    gpu = NumpyGpuExecutor(enc, dtype=dtype, prefetch=prefetch, max_batch=4, max_len=8, pet_cache_bytes=4_000)
    serving = [cpu.load_pet(p, key=k) for k, p in enumerate(zoo)]
    rng = np.random.default_rng(0)
    for seed in range(4):  # several batches: cache hits, evictions, buffer reuse, a buffer regrowth
        assignment = rng.integers(0, len(zoo), size=9).tolist()
        inputs, mask = random_batch(enc, 9, seed)
        pets = [serving[a] for a in assignment]
        ref = cpu.run(inputs, mask, pets, keys=assignment)
        got = gpu.run(inputs.numpy(), mask.numpy(), pets, keys=assignment)
        for r, o in zip(ref, got):
            assert rel_err(o, r.numpy()) <= TOL[dtype]
    stats = gpu.pet_cache.stats()
    assert stats["hits"] > 0 and stats["evictions"] > 0


def _engine_outputs(executor, snapshot, rows, max_batch):
    engine = Engine(executor, lambda: snapshot, max_batch=max_batch, pipeline=True, batching="fifo")
    try:
        return engine.run(rows)
    finally:
        engine.close()


def _store_items(tiny, rt, count):
    from test_runtime import requests_for

    reqs = requests_for(tiny, count)
    return [Row(rt.encoder.tokenize([q["text"]])[0], rt.pet(q["tenant"]), rt.pet(q["tenant"]).version) for q in reqs]


@pytest.fixture(scope="module")
def store_setup():
    import runtime
    from test_runtime import shared_tiny_store

    tiny = shared_tiny_store()
    rt = runtime.open(tiny[0], device="cpu", max_len=48)
    yield tiny, rt
    rt.close()


def test_numpy_stand_in_hot_tier_on_a_real_store(store_setup):
    tiny, rt = store_setup
    items = _store_items(tiny, rt, 16)
    snap = rt.store.snapshot()
    ref = _engine_outputs(rt.executor, snap, items, 5)
    gpu = NumpyGpuExecutor(rt.encoder, hot_tier_rows=64, hot_rebuild_every=1, max_batch=5, max_len=48)
    for rounds in range(3):  # the tier warms up after the first batch, then serves hits
        got = _engine_outputs(gpu, snap, items, 5)
        for r, o in zip(ref, got):
            assert rel_err(o.logits, r.logits) <= 1e-5
            np.testing.assert_array_equal(o.served[0], r.served[0])  # served versions
            np.testing.assert_array_equal(o.served[1], r.served[1])  # and orders
    hot = gpu.hot.stats()
    assert hot["hits"] > 0 and hot["misses"] > 0 and hot["rebuilds"] >= 1 and 0 < hot["rows"] <= 64


def test_hot_tier_bench_counts_hits_of_a_repeating_stream(store_setup):
    """benchmarks/bench_hot_tier's measurement: a stream that repeats one set of texts hits every
    window once the tier holds them all, and a one-row tier hits at most the commonest key."""
    from benchmarks.bench_hot_tier import run_tier

    tiny, rt = store_setup
    items = _store_items(tiny, rt, 8)
    snap = rt.store.snapshot()
    batches = [[it.ids for it in items[:4]], [it.ids for it in items[4:]]] * 6
    rate, miss_s, rebuild_s, rows = run_tier(rt.encoder, snap, "root", batches, 4096, rebuild_every=2, warmup=2)
    assert rate == 1.0 and rows > 0 and miss_s >= 0 and rebuild_s >= 0
    rate, _, _, rows = run_tier(rt.encoder, snap, "root", batches, 1, rebuild_every=2, warmup=2)
    assert rows == 1 and 0 < rate < 0.5


def test_hot_tier_rebuilds_look_up_only_keys_new_to_it(store_setup):
    """A rebuild copies the rows of keys that stay resident on the device: after the first
    build, a stream that repeats itself costs no host lookups, and values stay exact."""
    tiny, rt = store_setup
    items = _store_items(tiny, rt, 6)
    snap = rt.store.snapshot()
    ref = _engine_outputs(rt.executor, snap, items, 3)
    gpu = NumpyGpuExecutor(rt.encoder, hot_tier_rows=4096, hot_rebuild_every=1, max_batch=3, max_len=48)
    for _ in range(2):  # every key seen, and in the tier after the next rebuild
        _engine_outputs(gpu, snap, items, 3)
    seen = gpu.hot.stats()
    for _ in range(2):
        got = _engine_outputs(gpu, snap, items, 3)
        for r, o in zip(ref, got):
            assert rel_err(o.logits, r.logits) <= 1e-5
    hot = gpu.hot.stats()
    assert hot["rebuilds"] >= seen["rebuilds"] + 4 and hot["rows"] == hot["rebuild_lookups"]
    assert hot["rebuild_lookups"] - seen["rebuild_lookups"] == 0 < hot["rows"]


def test_numpy_stand_in_without_hot_tier_through_the_engine(store_setup):
    tiny, rt = store_setup
    items = _store_items(tiny, rt, 11)
    snap = rt.store.snapshot()
    ref = _engine_outputs(rt.executor, snap, items, 4)
    gpu = NumpyGpuExecutor(rt.encoder, hot_tier_rows=0, max_batch=4, max_len=48)
    got = _engine_outputs(gpu, snap, items, 4)
    for r, o in zip(ref, got):
        assert rel_err(o.logits, r.logits) <= 1e-5


# -- emulated GPU: the real kernels, on the CPU -----------------------------------------------------
#
# The same GpuExecutor, unchanged, on runtime.exec.emu.cupy_standin (NumPy "device" arrays) with
# runtime.exec.ops_gpu launching the unchanged .cu kernels through the CPU emulation
# (runtime.exec.emu): every custom op of a forward pass is a real kernel launch here.


def _emu_missing():
    from runtime.exec.emu.module import compiler_missing_reason

    return compiler_missing_reason()


emulated = pytest.mark.skipif(_emu_missing() is not None, reason=f"CUDA emulation unavailable: {_emu_missing()}")


@pytest.fixture
def standin():
    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin

    with ops_gpu.use_cupy(cupy_standin):
        yield cupy_standin


def emulated_executor(enc, **kwargs):
    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin

    return GpuExecutor(enc, _cupy=cupy_standin, _ops=ops_gpu, **kwargs)


@emulated
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_emulated_gpu_matches_cpu_executor(zoo_setup, standin, dtype, prefetch):
    enc, zoo = zoo_setup
    cpu = CpuExecutor(enc)
    gpu = emulated_executor(enc, dtype=dtype, prefetch=prefetch, max_batch=4, max_len=8, pet_cache_bytes=4_000)
    serving = [cpu.load_pet(p, key=k) for k, p in enumerate(zoo)]
    rng = np.random.default_rng(1)
    for seed in range(3):  # cache hits, evictions, buffer reuse, a buffer regrowth
        assignment = rng.integers(0, len(zoo), size=9).tolist()
        inputs, mask = random_batch(enc, 9, seed)
        pets = [serving[a] for a in assignment]
        ref = cpu.run(inputs, mask, pets, keys=assignment)
        got = gpu.run(inputs.numpy(), mask.numpy(), pets, keys=assignment)
        for r, o in zip(ref, got):
            assert rel_err(o, r.numpy()) <= TOL[dtype]
    assert gpu.pet_cache.stats()["evictions"] > 0


@emulated
@pytest.mark.parametrize("options", [{"hot_tier_rows": 0}, {"hot_tier_rows": 64, "hot_rebuild_every": 1}])
def test_emulated_gpu_on_a_real_store(store_setup, standin, options):
    """Real store data through the engine (pipelined): retrieval, the hot tier's device
    probe / gather / aggregation and every layer's kernels, against the CPU executor."""
    tiny, rt = store_setup
    items = _store_items(tiny, rt, 10)
    snap = rt.store.snapshot()
    ref = _engine_outputs(rt.executor, snap, items, 4)
    gpu = emulated_executor(rt.encoder, max_batch=4, max_len=48, **options)
    for _ in range(2 if options["hot_tier_rows"] else 1):  # with the tier: misses, then hits
        got = _engine_outputs(gpu, snap, items, 4)
        for r, o in zip(ref, got):
            assert rel_err(o.logits, r.logits) <= 1e-5
            np.testing.assert_array_equal(o.served[0], r.served[0])
            np.testing.assert_array_equal(o.served[1], r.served[1])
    if options["hot_tier_rows"]:
        assert gpu.hot.stats()["hits"] > 0


@pytest.fixture(scope="module")
def emu_zoo(tmp_path_factory):
    from test_executor_cpu import pet_zoo as zoo_of

    enc = tiny_encoder(tmp_path_factory.mktemp("emu"))
    return enc, zoo_of(enc, 1)


@emulated
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_emulated_mixed_batch_equals_one_at_a_time(emu_zoo, standin, data):
    """test_executor_cpu's property on the emulated GPU path: a request's logits from a
    mixed-tenant batch equal the per-request reference, whatever else is in the batch and
    whichever LoRA kernel (SGMV or BGMV) runs."""
    from test_executor_cpu import reference

    enc, zoo = emu_zoo
    B = data.draw(st.integers(1, 7))
    assignment = data.draw(st.lists(st.integers(0, len(zoo) - 1), min_size=B, max_size=B))
    lengths = data.draw(st.lists(st.integers(1, 10), min_size=B, max_size=B))
    kernel = data.draw(st.sampled_from(["auto", "sgmv", "bgmv"]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    L = max(lengths)
    inputs = torch.randn(B, L, enc.config.d, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    inputs[~mask] = 7.0  # padding content must not leak into any result
    ex = emulated_executor(enc, lora_kernel=kernel, max_batch=8, max_len=10, hot_tier_rows=0)
    serving = [ex.load_pet(p, key=k) for k, p in enumerate(zoo)]
    out = ex.run(inputs.numpy(), mask.numpy(), [serving[a] for a in assignment], keys=list(assignment))
    for b, a in enumerate(assignment):
        ref = reference(enc, inputs[b, : lengths[b]], zoo[a])
        torch.testing.assert_close(torch.from_numpy(np.asarray(out[b])), ref, rtol=1e-4, atol=5e-5)


def test_auto_device_never_takes_the_standin_for_a_gpu(store_setup, standin):
    """With the stand-in handed to ops_gpu, runtime.open(device="auto") still finds no GPU
    (unless a real one is there): the stand-in is never importable as cupy."""
    import runtime
    from runtime import StoreError

    assert sys.modules.get("cupy") is not standin
    tiny, _ = store_setup
    real = _gpu_available()
    with runtime.open(tiny[0], device="auto", max_len=48) as r:
        assert r.device == ("cuda" if real else "cpu")
        assert isinstance(r.executor, GpuExecutor) == real
    if not real:
        with pytest.raises(StoreError):
            runtime.open(tiny[0], device="cuda", max_len=48)


# -- GPU: the real thing ----------------------------------------------------------------------


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


gpu = pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_matches_cpu_on_random_models(tmp_path_factory, dtype, seed):
    enc = tiny_encoder(tmp_path_factory.mktemp("m"), d=[32, 48, 64][seed], heads=[4, 3, 8][seed],
                       ffn=[64, 97, 128][seed], seed=seed)
    zoo = pet_zoo(enc, seed)
    cpu = CpuExecutor(enc)
    ex = GpuExecutor(enc, dtype=dtype, max_batch=16, max_len=16, pet_cache_bytes=1 << 20, hot_tier_rows=0)
    serving = [cpu.load_pet(p, key=k) for k, p in enumerate(zoo)]
    rng = np.random.default_rng(seed)
    for batch in range(3):
        n = int(rng.integers(1, 17))
        assignment = rng.integers(0, len(zoo), size=n).tolist()
        inputs, mask = random_batch(enc, n, seed * 10 + batch, max_len=16)
        pets = [serving[a] for a in assignment]
        ref = cpu.run(inputs, mask, pets, keys=assignment)
        got = ex.run(inputs.numpy(), mask.numpy(), pets, keys=assignment)
        for r, o in zip(ref, got):
            assert rel_err(o, r.numpy()) <= TOL[dtype]
    ex.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("options", [{"hot_tier_rows": 0}, {"hot_tier_rows": 256, "pipeline": False},
                                     {"hot_tier_rows": 64, "prefetch": False}])
def test_gpu_runtime_matches_cpu_runtime_on_a_real_store(store_setup, dtype, options):
    import runtime
    from test_runtime import requests_for

    tiny, rt = store_setup
    reqs = requests_for(tiny, 30)
    ref = rt.infer(reqs)
    with runtime.open(tiny[0], device="cuda", dtype=dtype, max_len=48, max_batch=8, **options) as g:
        for _ in range(3):  # the hot tier warms up and serves hits from the second batch on
            got = g.infer(reqs)
            for r, o in zip(ref, got):
                assert rel_err(o.logits, r.logits) <= TOL[dtype]
                if dtype == "fp32" and r.task == "classification":
                    assert o.label == r.label
        stats = g.stats()
        if options["hot_tier_rows"]:
            assert stats["hot_tier"]["hits"] > 0
