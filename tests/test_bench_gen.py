"""The generation benchmarks' own parts: the full-decoder baseline behind the batcher
(benchmarks.bench_tenants_gen.FullGen: GPT-shared / GPT-dedicated) generates what the reference
decoder's greedy loop does, and benchmarks.bench_gen_latency's Poisson client measures time to first
token and inter-token gaps against a real server with LoRA tenants it added."""

import asyncio

import pytest
import torch

from runtime.gen.batcher import Batcher
from runtime.gen.sampling import SamplingParams
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tiny_decoder

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]


def test_the_full_decoder_behind_the_batcher_is_the_reference_greedy_loop(tmp_path):
    from benchmarks.bench_tenants_gen import FullGen

    path = make_tiny_decoder(tmp_path / "m", TEXTS, d=32, layers=3, max_len=48)
    full = load_decoder(path, lower_layers=0)
    ref = load_decoder(path, lower_layers=2)
    full.config = ref.config = full.config.__class__(**{**full.config.__dict__, "eos_id": None})
    prompts = ref.tokenize(["the cat sat", "a dog ran in the park", "the"])
    b = Batcher(FullGen(full), kv_budget_bytes=1 << 30, max_running=2)  # the third joins later
    ids = [b.submit(p, SamplingParams(max_tokens=6)) for p in prompts]
    b.run()
    assert [b.result(i)["ids"] for i in ids] == [ref.greedy(p, 6) for p in prompts]


def test_the_poisson_client_against_a_real_server(tmp_path):
    pytest.importorskip("httpx")
    from runtime.construct.decoder_store import build_decoder
    from benchmarks.bench_gen_latency import Server, load_at, make_store

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_decoder(tmp_path / "m", TEXTS, d=32, layers=4, max_len=64)
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=model, corpus_paths=[tmp_path / "c.txt"], n=3, lower_layers=2,
                  progress=False)
    torch.set_num_threads(threads)
    store = make_store(tmp_path / "s", tmp_path / "work", tenants=3)
    assert make_store(tmp_path / "s", tmp_path / "work", tenants=3) == store  # made once
    server = Server(store, tmp_path / "work", threads=1)
    try:
        row = asyncio.run(load_at(server.url, rate=20, duration=1.0, prompts=["the cat", "a dog ran"],
                                  tenants=["t0000", "t0001", "t0002"], max_tokens=4, seed=0))
    finally:
        server.stop()
    assert row["requests"] > 5 and row["ok"] == row["requests"], row
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] and row["itl_ms"]["p99"] > 0  # (p50: events may come in one read)
    assert row["latency_ms"]["p50"] >= row["ttft_ms"]["p50"]
