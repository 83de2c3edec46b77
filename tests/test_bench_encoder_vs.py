"""The encoder benchmark's baselines compute the model they stand for, and its claims hold only
what the run measured."""

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks import bench_encoder_vs as bev  # noqa: E402


def tiny_bert(seed):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=30000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def test_the_onnx_export_is_bert_and_the_check_tells_models_apart(tmp_path):
    """The exported graph gives BertModel's hidden states on a padded batch of another shape than
    the one it was traced with; the same check against a different copy's weights fails, so a
    wrong export could not pass it."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    first, second = bev.bert_copy(0), bev.bert_copy(1)
    session = bev.export_onnx(first, str(tmp_path / "m.onnx"))
    assert bev.onnx_matches(first, session, seed=3) < 1e-3
    assert bev.onnx_matches(second, session, seed=3) > 1e-3


@pytest.mark.slow
def test_the_compiled_baselines_are_frozen_bert_in_fp32_and_bf16():
    """torch.compile with inductor's freezing gives BertModel's hidden states (fp32: to the order
    of the sums; bf16: within its rounding) on padded batches of several sizes, and the check
    tells another model apart; the bf16 copy really holds bf16 weights and the fp32 model is untouched."""
    first, second = tiny_bert(0), tiny_bert(1)
    with torch.no_grad():
        fp32 = bev.compile_dedicated(first)
        bf16 = bev.compile_dedicated(first, torch.bfloat16)
        assert torch._inductor.config.freezing
        assert bev.compiled_matches(first, fp32, seed=3) < 1e-4
        assert bev.compiled_matches(second, fp32, seed=3) > 1e-2
        assert 1e-5 < bev.compiled_matches(first, bf16, seed=3) < 0.1
        ids = torch.randint(1000, 20000, (5, 17))
        mask = torch.ones_like(ids)
        mask[2, 9:] = 0
        want = first(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(fp32(ids, mask)[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)
    assert next(bf16._orig_mod.parameters()).dtype == torch.bfloat16
    assert next(first.parameters()).dtype == torch.float32


def raw_rounds():
    """Two rounds at two tenant counts with fixed rates: the ratios are known."""
    rates = {"hPLM": 100.0, "full-depth": 50.0, "full-depth bf16": 90.0, "transformers": 30.0, "compiled": 40.0,
             "compiled bf16": 80.0}
    raw = []
    for T, scale in ((1, 1.0), (16, 0.8)):
        for r in range(2):
            row = {"tenants": T, "round": r, "load": 1.0 + r}
            for k, v in rates.items():  # the dedicated models slow at 16 tenants, ours do not
                row[k] = v * (scale if k in ("transformers", "compiled", "compiled bf16") else 1.0)
            raw.append(row)
    return raw


def test_the_claims_hold_the_measured_ratios_and_nothing_unmeasured():
    args = argparse.Namespace(tenants=[1, 16], gemm="auto")
    result = bev.summarize(args, raw_rounds())
    rates, ratio = result["tables"]
    systems = ("hPLM", "full-depth", "full-depth bf16", "transformers", "compiled", "compiled bf16")
    assert rates["columns"][1:] == [f"{s} requests/CPU-s" for s in systems]
    assert "full-depth bf16 / compiled bf16" in ratio["columns"] and "hPLM bf16 / compiled" not in ratio["columns"]
    assert ratio["rows"][0][ratio["columns"].index("full-depth / compiled")] == "1.25 (1.25-1.25)"
    claims = bev.precision_claims(args, result)
    # full-depth / compiled: 1.25 at 1 tenant, 1.5625 at 16: claimed at its worst
    assert claims["top_vs_compile"] == 1.25
    assert claims["plot_vs_compile"] == 2.5
    assert claims["bf16_speedup_top"] == 1.8
    assert claims["section"] == bev.PRECISION_SECTION and claims["load"] == "1.0-2.0"
    named = {"top_vs_compile", "plot_vs_compile", "bf16_speedup_top", "int8_speedup_top", "max_points_lost",
             "top_vs_peft_mixed", "first_use_vs_prewarmed", "headline_auto_vs_compiled"}
    assert set(claims) - {"section", "command", "machine", "load", "date", "tables"} <= named
    assert "int8_speedup_top" not in claims
    without = [{k: v for k, v in r.items() if k != "full-depth bf16"} for r in raw_rounds()]
    assert "bf16_speedup_top" not in bev.precision_claims(args, bev.summarize(args, without))
