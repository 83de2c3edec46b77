"""The decode step's cheaper non-GEMM ops: the greedy choice with its logprob, the FFN's
activation fused into its GEMM, a step's logits taken without a copy."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.exec import onednn
from runtime.exec import precision as precisionlib
from runtime.gen.batcher import _stacked
from runtime.gen.row_precision import RowPrecision
from runtime.gen.sampling import greedy
from runtime.model.decoder import _act

native = pytest.mark.skipif(precisionlib.bf16_native() is None, reason="this CPU has no native bf16")
packed = pytest.mark.skipif(onednn.SHARED is None, reason="this torch has no oneDNN packed linear")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.integers(0, 2 ** 31 - 1), st.booleans())
def test_greedy_is_argmax_and_its_log_softmax(n, vocab, seed, ties):
    g = np.random.default_rng(seed)
    # few distinct values: many rows with tied maxima, where the first index must win
    logits = torch.from_numpy((g.integers(-3, 4, (n, vocab)) if ties else g.normal(0, 5, (n, vocab))).astype(np.float32))
    tokens, logprobs = greedy(logits)
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1)[torch.arange(n), logits.argmax(-1)]
    assert torch.allclose(torch.tensor(logprobs), want, atol=1e-5)


def test_greedy_takes_bf16_logits():
    logits = torch.randn(3, 1000).to(torch.bfloat16)
    tokens, logprobs = greedy(logits)
    assert tokens == logits.float().argmax(-1).tolist()
    assert all(lp <= 0 for lp in logprobs)


@packed
@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "relu", "silu"])
def test_linear_act_equals_the_activation_of_the_linear_in_fp32(act):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    got = RowPrecision.FP32.linear_act(x, w, b, act)
    assert torch.allclose(got, _act(act, RowPrecision.FP32.linear(x, w, b)), atol=1e-5)
    # (..., d) inputs, as a prefill's (B, T, d)
    got3 = RowPrecision.FP32.linear_act(x.view(7, 1, 64), w, b, act)
    assert got3.shape == (7, 1, 96) and torch.allclose(got3[:, 0], got, atol=1e-6)


@packed
@native
def test_linear_act_runs_each_row_at_its_precision():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(6, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    bf16_rows = torch.tensor([1, 4])
    mixed = RowPrecision(bf16_rows, False).linear_act(x, w, b, "gelu_tanh")
    every_bf16 = RowPrecision(torch.arange(6), True).linear_act(x, w, b, "gelu_tanh")
    every_fp32 = RowPrecision.FP32.linear_act(x, w, b, "gelu_tanh")
    assert torch.allclose(mixed[bf16_rows], every_bf16[bf16_rows], atol=1e-5)
    fp = torch.tensor([0, 2, 3, 5])
    assert torch.allclose(mixed[fp], every_fp32[fp], atol=1e-6)
    assert not torch.allclose(every_bf16, every_fp32, atol=1e-5)  # the bf16 rows did run in bf16
    ref = F.gelu(x @ w.T + b, approximate="tanh")
    assert (every_bf16 - ref).abs().max() <= 0.03 * ref.abs().max()


def test_stacked_takes_a_steps_rows_without_a_copy():
    step = torch.randn(4, 50)
    rows = list(step)  # what a decode step leaves in its sequences' logits
    assert _stacked(rows) is step
    for picked in (rows[:3], rows[::-1], [rows[0], rows[2]], [rows[1]] * 4, [torch.randn(50), rows[1]]):
        assert torch.equal(_stacked(picked), torch.stack(picked))


@packed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_rows_fused_activation_hangs_on_its_own_lora_not_its_batch_mates(precision):
    """ffn_in's activation is fused into the GEMM for rows whose LoRA leaves ffn_in alone; a row
    beside one whose LoRA edits ffn_in gets exactly what it gets beside one whose LoRA does not,
    and the editing row gets its delta before the activation."""
    from types import SimpleNamespace

    from runtime.gen.batched_step import ffn_in_act
    from runtime.gen.lora_batch import LoraBatch

    if precision == "bf16" and precisionlib.bf16_native() is None:
        pytest.skip("this CPU has no native bf16")
    g = torch.Generator().manual_seed(2)
    d, f, r = 32, 64, 4

    def lora(*targets):
        return SimpleNamespace(meta={"pet_type": "lora", "scale": 2.0, "precision": precision}, tensors={
            k: torch.randn(*shape, generator=g) * 0.1 for t in targets
            for k, shape in ((f"layers.0.lora.{t}.A", (r, d)), (f"layers.0.lora.{t}.B", (f if t == "ffn_in" else d, r)))})

    blk = SimpleNamespace(ffn_in=torch.nn.Linear(d, f))
    x = torch.randn(3, d, generator=g)
    own, edits, leaves = lora("q"), lora("ffn_in"), lora("v")

    def run(pets):
        lb, rp = LoraBatch(pets), RowPrecision.of(precision, pets)

        def unfused():
            y = rp.linear(x, blk.ffn_in.weight, blk.ffn_in.bias)
            delta = lb.delta(0, "ffn_in", x)
            return _act("gelu_tanh", y if delta is None else y + delta)
        return ffn_in_act(rp, lb, 0, blk, x, "gelu_tanh", unfused), unfused()

    beside_edit, unfused_edit = run([own, edits, own])
    beside_other, unfused_other = run([own, leaves, own])
    assert torch.equal(beside_edit[[0, 2]], beside_other[[0, 2]])
    assert torch.equal(beside_edit[1], unfused_edit[1])  # the edit comes before the activation
    assert not torch.allclose(beside_edit[1], unfused_other[1], atol=1e-3)  # and it is there
