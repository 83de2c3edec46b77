"""runtime.gen.lora_batch: the base projection plus BGMV / SGMV deltas equals applying each
row's own LoRA alone (runtime.model.pet.linear), whatever the mix of tenants, ranks, targets
and rows without a PET."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.gen.lora_batch import LoraBatch, lora_only
from runtime.model import pet as petlib
from runtime.model.pet import Pet

D_IN, D_OUT, LAYERS = 12, 10, (2, 3)


def make_pet(seed, rank, targets, layers):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for t in targets:
            tensors[f"layers.{i}.lora.{t}.A"] = torch.randn(rank, D_IN, generator=g)
            tensors[f"layers.{i}.lora.{t}.B"] = torch.randn(D_OUT, rank, generator=g)
    return Pet(tensors, {"pet_type": "lora", "task": "lm", "scale": 0.5 + seed % 3, "rank": rank})


pet_spec = st.tuples(st.integers(1, 6), st.sampled_from([("q",), ("v",), ("q", "v")]),
                     st.sampled_from([(2,), (3,), (2, 3)]))


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(pet_spec, min_size=1, max_size=4),
       rows=st.lists(st.integers(-1, 3), min_size=1, max_size=12),
       mode=st.sampled_from([None, "bgmv", "sgmv"]), seed=st.integers(0, 1000), positions=st.integers(0, 3))
def test_base_plus_delta_equals_each_row_alone(specs, rows, mode, seed, positions):
    """x (B, d_in): a decode step; x (B, T, d_in): a prefill, row b's positions with row b's LoRA."""
    pets = [make_pet(seed + k, *spec) for k, spec in enumerate(specs)]
    row_pets = [None if r < 0 else pets[r % len(pets)] for r in rows]
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(D_IN, D_OUT)
    x = torch.randn(len(rows), *([positions] if positions else []), D_IN, generator=g)
    lb = LoraBatch(row_pets, mode)
    for i in LAYERS:
        for target in ("q", "v", "o"):
            d = lb.delta(i, target, x)
            got = F.linear(x, lin.weight, lin.bias) + (0 if d is None else d)
            want = torch.cat([petlib.linear(p, i, target, x[r:r + 1], lin) for r, p in enumerate(row_pets)])
            assert torch.allclose(got, want, atol=1e-4), (mode, i, target)
            if target == "o":
                assert d is None  # no LoRA edits it


def test_mode_by_rows_per_adapter_and_what_takes_this_path():
    a, b = make_pet(1, 4, ("q",), (2,)), make_pet(2, 4, ("q",), (2,))
    assert LoraBatch([a] * 8).mode == "sgmv" and LoraBatch([a, b, None]).mode == "bgmv"
    assert LoraBatch([None, None]).empty
    adapter = Pet({"layers.2.adapter.o.down.weight": torch.zeros(2, D_OUT)}, {"pet_type": "adapter"})
    normed = Pet(dict(a.tensors, **{"layers.2.norm.ln_attn.weight": torch.zeros(D_IN)}), dict(a.meta))
    assert lora_only(None) and lora_only(a) and not lora_only(adapter) and not lora_only(normed)
