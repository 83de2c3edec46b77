"""The GPU executor's decode path (runtime.exec.gpu_decoder through runtime.gen.device_decode)
against the CPU reference path (runtime.gen.plot_decode), run on the CUDA-on-CPU emulation: the
executor code unchanged on runtime.exec.emu.cupy_standin, every custom op a real .cu kernel
launch (aggregate for the causal last slot, BGMV / SGMV, the segmented adapter, bias gather,
sparse add, fused LayerNorm). GPT-2, OPT and Llama layouts (transformers-built tiny models),
every decoder PET kind, mixed tenants in one step, sequences joining and leaving."""

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
from runtime.construct.plot import build_root
from runtime.exec import ops_gpu
from runtime.gen.batcher import Batcher
from runtime.gen.device_decode import DevicePlotDecoder
from runtime.gen.plot_decode import PlotDecoder
from runtime.gen.sampling import SamplingParams
from runtime.model import pet as petlib
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tokenizer
from runtime.plot.causal import KeyValuer

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling test modules, any import mode
from test_decoder_reference import (
    _hf_model,  # transformers-built tiny GPT-2 / OPT / Llama
)

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]


def _emu_missing():
    from runtime.exec.emu.module import compiler_missing_reason

    return compiler_missing_reason()


emulated = pytest.mark.skipif(_emu_missing() is not None, reason=f"CUDA emulation unavailable: {_emu_missing()}")


@pytest.fixture(scope="module", params=["gpt2", "opt", "llama"])
def setup(request, tmp_path_factory):
    torch.manual_seed(0)
    tok = make_tokenizer(TEXTS)
    model = _hf_model(request.param, tok.get_vocab_size()).eval()
    with torch.no_grad():  # far from uniform attention, as test_decoder_reference
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    dec = load_decoder(path, lower_layers=2)
    store = hkstore.create(path / "store", d=32, vocab_size=dec.config.vocab_size, n=3, window="causal",
                           lower_layers=2, architecture="decoder", pad_id=dec.config.pad_id,
                           tokenizer_fingerprint=dec.tokenizer_fingerprint())
    build_root(store, KeyValuer(dec), dec.tokenize(TEXTS[:2]), progress=False)  # the third text backs off
    return dec, store.snapshot()


@pytest.fixture
def standin():
    from runtime.exec.emu import cupy_standin

    with ops_gpu.use_cupy(cupy_standin):
        yield cupy_standin


def _device_gen(dec, snap, standin, **options):
    from runtime.exec.gpu_decoder import GpuDecoderExecutor

    return DevicePlotDecoder(snap, "root", dec, executor=GpuDecoderExecutor(dec, _cupy=standin, _ops=ops_gpu,
                                                                             **options))


def _pet(dec, kind, seed, **kwargs):
    pet = petlib.create_pet(dec, kind, "lm", [], seed=seed, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in pet.tensors.values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.3)
    return petlib.export(pet)  # the served form (a diff PET's index list), as a stored tenant's


def _zoo(dec):
    return {"lora": _pet(dec, "lora", 1), "lora-r4": _pet(dec, "lora", 2, rank=4),
            "adapter": _pet(dec, "adapter", 3), "bitfit": _pet(dec, "bitfit", 4), "diff": _pet(dec, "diff", 5)}


def _close(got, want, tol):
    err = (got - want).abs().max().item()
    return err <= tol * max(1.0, want.abs().max().item())


def _teacher_forced(gen, dec, snap, tol):
    """The same prompts and tokens through gen and the CPU path; every sequence's logits after
    its prefill and after each decode step agree (each with its own PET, several kinds and a
    base-model row in one step, one LoRA shared by two rows)."""
    zoo = _zoo(dec)
    prompts = dec.tokenize(["the cat sat", "a dog ran in the park", "storage engines keep", "the", "vectors ,"])
    pets = [zoo["lora"], None, zoo["adapter"], zoo["lora"], zoo["bitfit"]]
    prompts.append(dec.tokenize(["tables of"])[0])
    pets.append(zoo["diff"])
    cpu = PlotDecoder(snap, "root", dec)
    ref = [cpu.prefill(p, pet) for p, pet in zip(prompts, pets)]
    pool = gen.new_pool(256)
    seqs = gen.prefill_many(prompts, pets, [pool.alloc(len(p) + 6) for p in prompts], pool)
    rng = np.random.default_rng(0)
    for step in range(6):
        for s, r in zip(seqs, ref):
            assert _close(s.logits, r.logits, tol), step
            assert s.orders == r.orders  # the same windows served at the same orders
        tokens = rng.integers(4, dec.config.vocab_size, size=len(seqs)).tolist()
        gen.append(seqs, tokens, pool)
        for r, t in zip(ref, tokens):
            cpu.append([r], [t])
    assert any(o < 3 for s in seqs for o in s.orders)  # backoff was exercised


@emulated
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("fp16", 3e-2)])
def test_mixed_tenant_steps_match_the_cpu_path(setup, standin, dtype, tol):
    dec, snap = setup
    _teacher_forced(_device_gen(dec, snap, standin, dtype=dtype), dec, snap, tol)


def _gpu_available():
    from runtime.exec.gpu import cuda_available

    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("fp16", 3e-2)])
def test_real_gpu_matches_the_cpu_path(setup, dtype, tol):
    """The same check on a real device (CuPy, cuBLAS, the kernels compiled by NVRTC)."""
    dec, snap = setup
    _teacher_forced(DevicePlotDecoder(snap, "root", dec, dtype=dtype), dec, snap, tol)


@emulated
@pytest.mark.parametrize("lora_kernel", ["bgmv", "sgmv"])
def test_lora_kernels_agree(setup, standin, lora_kernel):
    """Every row its own LoRA (BGMV) or rows sharing one (SGMV): the same logits either way."""
    dec, snap = setup
    zoo = _zoo(dec)
    prompts = dec.tokenize(["the cat sat", "a dog ran", "storage engines"])
    pets = [zoo["lora"], zoo["lora-r4"], zoo["lora"]]
    cpu = PlotDecoder(snap, "root", dec)
    ref = [cpu.prefill(p, pet) for p, pet in zip(prompts, pets)]
    gen = _device_gen(dec, snap, standin, lora_kernel=lora_kernel)
    plan = gen.executor.plan([gen.executor.serving_pet(p) for p in pets])
    assert {g.bgmv for g in plan.groups.values()} == {lora_kernel == "bgmv"}
    pool = gen.new_pool(64)
    seqs = gen.prefill_many(prompts, pets, [pool.alloc(len(p) + 2) for p in prompts], pool)
    gen.append(seqs, [5, 6, 7], pool)
    for r, t in zip(ref, [5, 6, 7]):
        cpu.append([r], [t])
    for s, r in zip(seqs, ref):
        assert _close(s.logits, r.logits, 1e-4)


@emulated
def test_batcher_on_the_device_generates_what_the_cpu_path_does(setup, standin):
    """Continuous batching unchanged over the device path: sequences join as others leave
    (max_running 2), sampling with seeds, stop at max_tokens; the same tokens and text."""
    dec, snap = setup
    zoo = _zoo(dec)
    prompts = dec.tokenize(["the cat", "a dog ran", "storage", "the park and"])
    pets = [None, zoo["lora"], zoo["adapter"], zoo["lora-r4"]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True)]
    out = {}
    for name, gen in (("cpu", PlotDecoder(snap, "root", dec)), ("device", _device_gen(dec, snap, standin))):
        b = Batcher(gen, kv_budget_bytes=1 << 30, max_running=2)
        ids = [b.submit(p, s, pet) for p, s, pet in zip(prompts, params, pets)]
        b.run()
        out[name] = [b.result(i) for i in ids]
        if name == "device":
            assert b.pool.available == b.pool.positions  # every page given back
    for got, want in zip(out["device"], out["cpu"]):
        assert got["ids"] == want["ids"] and got["text"] == want["text"]
        assert got["finish_reason"] == want["finish_reason"]
        assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-4)


@emulated
def test_device_decoder_runtime_serves_generate(setup, standin, tmp_path):
    """DecoderRuntime(device="cuda") with an executor handed in: generate through the device
    path equals the CPU runtime's greedy output."""
    from runtime.exec.gpu_decoder import GpuDecoderExecutor
    from runtime.gen.api import DecoderRuntime

    dec, snap = setup
    store_path = snap.path if hasattr(snap, "path") else None
    if store_path is None:
        pytest.skip("snapshot does not expose its store path")
    reqs = [{"prompt": "the cat", "max_tokens": 5, "ignore_eos": True},
            {"prompt": "storage engines", "max_tokens": 3, "ignore_eos": True}]
    with DecoderRuntime(store_path, "cpu", decoder=dec) as rt:
        want = rt.generate(reqs)
    ex = GpuDecoderExecutor(dec, _cupy=standin, _ops=ops_gpu)
    with DecoderRuntime(store_path, "cuda", decoder=dec, executor=ex) as rt:
        got = rt.generate(reqs)
        assert rt.stats()["device"] == "cuda"
    assert [g["ids"] for g in got] == [w["ids"] for w in want]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_device_greedy_is_the_host_argmax_and_logprob(standin, data):
    """What a greedy row takes from the device (DeviceLogits) is what the batcher's host path
    computes: torch's argmax (the first of equal maxima: few distinct values, many ties) and
    its log_softmax there; host() gives the logits unchanged."""
    from runtime.exec.gpu_decoder import GpuDecoderExecutor

    B, V = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 40))
    levels = data.draw(st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=3))
    picks = data.draw(st.lists(st.integers(0, len(levels) - 1), min_size=B * V, max_size=B * V))
    logits = np.array([levels[k] for k in picks], dtype=np.float32).reshape(B, V)
    ex = GpuDecoderExecutor.__new__(GpuDecoderExecutor)  # _greedy needs only the array module
    ex.cp, ex.compute_stream = standin, standin.cuda.Stream()
    out = ex._greedy(standin.asarray(logits))
    want = torch.from_numpy(logits)
    assert out.argmax.tolist() == want.argmax(-1).tolist()
    lp = torch.log_softmax(want, -1).gather(1, want.argmax(-1)[:, None])[:, 0]
    assert np.allclose(out.logprob, lp.numpy(), rtol=1e-5, atol=1e-5)
    assert np.array_equal(out.host(), logits)


@emulated
def test_a_steady_batch_reuses_its_plan_and_stacks_and_greedy_rows_copy_no_logits(setup, standin):
    """Decode steps of the same sequences: the executor's plan is the same object and no
    layer's PET weights are stacked again; a batcher of greedy rows never copies logits back
    (only argmax and log-prob) and generates what the CPU path does."""
    dec, snap = setup
    zoo = _zoo(dec)
    gen = _device_gen(dec, snap, standin)
    ex = gen.executor
    stacked, copied = [], []
    stack, to_host = ex._stack, ex.to_host
    ex._stack = lambda *a: stacked.append(a[1]) or stack(*a)
    ex.to_host = lambda *a: copied.append(1) or to_host(*a)
    prompts = dec.tokenize(["the cat sat", "a dog ran", "storage engines"])
    pets = [zoo["lora"], zoo["lora-r4"], None]
    pool = gen.new_pool(64)
    seqs = gen.prefill_many(prompts, pets, [pool.alloc(len(p) + 4) for p in prompts], pool)
    gen.append(seqs, [5, 6, 7], pool)
    plan, before = ex._plan[1], len(stacked)
    assert before > 0
    gen.append(seqs, [8, 9, 10], pool)
    assert ex._plan[1] is plan and len(stacked) == before
    assert not copied
    out = {}
    for name, g in (("cpu", PlotDecoder(snap, "root", dec)), ("device", gen)):
        b = Batcher(g, kv_budget_bytes=1 << 30, max_running=2)
        ids = [b.submit(p, SamplingParams(max_tokens=4, ignore_eos=True), pet) for p, pet in zip(prompts, pets)]
        b.run()
        out[name] = [b.result(i) for i in ids]
    assert not copied
    for got, want in zip(out["device"], out["cpu"]):
        assert got["ids"] == want["ids"] and got["text"] == want["text"]
        assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-4)


def test_the_host_stand_in_runs_the_decode_path(setup):
    """The executor's code on benchmarks.host_device's NumPy stand-in (what profiles the decode
    step's host time without a GPU) serves the same logits as the CPU path."""
    from benchmarks.host_device import HostGpuExecutor, HostOps, host_cupy
    from runtime.exec.gpu_decoder import GpuDecoderExecutor

    class HostDecoderExecutor(GpuDecoderExecutor):
        copy_h2d = HostGpuExecutor.copy_h2d

    dec, snap = setup
    ex = HostDecoderExecutor(dec, _cupy=host_cupy(), _ops=HostOps())
    _teacher_forced(DevicePlotDecoder(snap, "root", dec, executor=ex), dec, snap, 1e-4)
