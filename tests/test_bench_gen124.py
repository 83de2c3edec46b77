"""benchmarks.bench_gen124's fairness: the checkpoint it makes is one set of weights that hGPT's
decoder and transformers read alike (GPT-2 and OPT shapes), PEFT's mixed-adapter batching applies
each row's own tenant exactly as switching the one slot to that tenant does (both on the packed
GEMMs hGPT runs), in bf16 too, and the summary is the median of within-round ratios."""

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bench_gen124

TINY = {"gpt2": {"model_type": "gpt2", "vocab_size": 30522, "n_embd": 16, "n_layer": 3, "n_head": 2,
                 "n_positions": 64},
        "opt": {"model_type": "opt", "vocab_size": 30522, "hidden_size": 16, "num_hidden_layers": 3,
                "num_attention_heads": 2, "ffn_dim": 32, "max_position_embeddings": 64,
                "word_embed_proj_dim": 16, "do_layer_norm_before": True}}


@pytest.fixture
def tiny_shapes(monkeypatch):
    monkeypatch.setattr(bench_gen124, "SHAPES", TINY)


@pytest.mark.parametrize("shape", sorted(TINY))
def test_the_checkpoint_is_the_same_model_to_hgpt_and_transformers(tmp_path, tiny_shapes, shape):
    from transformers import AutoModelForCausalLM

    from runtime.model.decoder import load_decoder

    path = bench_gen124.make_checkpoint(str(tmp_path / "m"), shape)
    ours = load_decoder(path, lower_layers=0).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([ours.tokenize(["the cat sat on the mat"])[0]])
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(input_ids=ids).logits, atol=1e-4)
    assert bench_gen124.make_checkpoint(path, shape) == path  # made once


@pytest.mark.skipif(not os.path.isdir(bench_gen124.WIKITEXT), reason="the prompts are WikiText-2 test lines")
def test_mixed_adapter_batching_applies_each_rows_tenant(tmp_path, tiny_shapes):
    from peft import set_peft_model_state_dict

    from benchmarks.bench_tenants_gen import Bench

    model = bench_gen124.make_checkpoint(str(tmp_path / "m"), "gpt2")
    store = bench_gen124.make_store(str(tmp_path), model, lower_layers=1, corpus_lines=5)
    bench = Bench(SimpleNamespace(store=store, model=None, threads=torch.get_num_threads(), requests=4,
                                  prompt_tokens=6, rank=8, batch=4, max_tokens=3, device="cpu", resident=1))
    tenants = [0, 2, 1, 2]
    ids = torch.tensor(bench.prompts[:len(tenants)])
    mixed, single = bench.peft_mixed_model(3), bench.peft_model()
    with torch.no_grad():
        got = mixed(input_ids=ids, adapter_names=[f"t{t}" for t in tenants]).logits
        want = []
        for row, t in zip(ids, tenants):
            set_peft_model_state_dict(single, bench.peft_tenants(3)[t])
            want.append(single(input_ids=row[None]).logits[0])
        other = mixed(input_ids=ids[:1], adapter_names=["t1"]).logits[0]
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    assert not torch.allclose(got[0], other, atol=1e-6)  # the tenants' adapters do differ
    from runtime.exec import onednn, precision

    if onednn.available():  # the base GEMMs ran on the packed weights hGPT's step uses
        assert id(mixed.base_model.model.lm_head.weight) in onednn.SHARED._packed
    if precision.bf16_native():
        with torch.no_grad():
            half = bench.peft_mixed_model(3, torch.bfloat16)(input_ids=ids, adapter_names=[f"t{t}" for t in tenants])
        assert half.logits.dtype == torch.bfloat16
        assert torch.allclose(half.logits.float(), got, atol=0.05 * float(got.abs().max()))


RATES = st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=5)


@settings(max_examples=50, deadline=None)
@given(RATES, st.floats(0.1, 10.0), st.floats(0.5, 4.0), st.floats(0.5, 4.0))
def test_the_summary_is_the_median_of_within_round_ratios(rates, r, bf_ours, bf_theirs):
    factor = {"hGPT": r, "hGPT-bf16": r * bf_ours, "transformers+PEFT-mixed-bf16": bf_theirs}
    rows = [{"round": k, "tenants": T, "system": s, "tokens_per_s": x * factor.get(s, 1.0) * (T / 10 + 1)}
            for k, x in enumerate(rates) for T in (1, 10) for s in bench_gen124.SYSTEMS]
    table = bench_gen124.per_round(rows, [1, 10])
    for row in table:  # every round has the same ratios, however the rounds' speeds differ
        assert row["hGPT/PEFT-mixed"] == row["hGPT/PEFT-switch"] == round(r, 2)
        assert row["hGPT/PEFT-mixed rounds"] == [round(r, 2)] * len(rates)
        assert row["hGPT-bf16/PEFT-mixed-bf16"] == round(r * bf_ours / bf_theirs, 2)
        assert row["hGPT-bf16/PEFT-mixed"] == round(r * bf_ours, 2)
        assert row["hGPT-bf16/hGPT"] == round(bf_ours, 2)
        assert row["PEFT-mixed-bf16/PEFT-mixed"] == round(bf_theirs, 2)
    assert table[1]["hGPT@T/@1"] == round(2.0 / 1.1, 2)


def test_greedy_agreement_counts_tokens_up_to_the_first_difference():
    refs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    runs = [[1, 2, 3, 4], [5, 0, 7, 8], [8, 9]]  # the second keeps 1 token, the third none
    assert bench_gen124.agreement(runs, refs) == {"requests_identical": round(1 / 3, 3),
                                                  "tokens_before_divergence": round(5 / 10, 3)}
