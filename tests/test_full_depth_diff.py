"""experiments.full_depth's fd-diff row: retraining a pruned diff moves only the kept entries."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.full_depth import kept_only
from runtime.construct.full import embeddings
from runtime.construct.train import TrainConfig, train_pet
from runtime.model.encoder import load_encoder
from runtime.model.pet import Pet, create_pet, export
from runtime.model.tiny import make_tiny_model

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "birds sing at dawn"]


@settings(max_examples=8, deadline=None)
@given(density=st.sampled_from([0.01, 0.05, 0.2]), seed=st.integers(0, 3))
def test_retraining_keeps_the_pruned_support_and_moves_its_values(tmp_path_factory, density, seed):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), TEXTS, d=16, layers=2)
    whole = load_encoder(path, 0)
    pet = create_pet(whole, "diff", "classification", ["a", "b"], level="full", targets=("q", "ffn_in"),
                     density=density, seed=seed)
    x = embeddings(whole, whole.tokenize(TEXTS))
    cfg = TrainConfig(lr=1e-2, epochs=2, batch_size=2, seed=seed, progress=False)
    train_pet(whole, pet, x, [0, 1, 0], cfg)
    pruned = export(Pet(pet.tensors, dict(pet.meta)))
    again, _ = train_pet(whole, kept_only(whole, pruned), x, [0, 1, 0], cfg)
    indexes = [k for k in pruned.tensors if k.endswith(".index")]
    assert indexes
    for k in indexes:
        assert torch.equal(again.tensors[k], pruned.tensors[k])  # same entries, same order
    moved = [(again.tensors[k[:-5] + "value"] - pruned.tensors[k[:-5] + "value"]).abs().max() for k in indexes]
    assert max(moved) > 0  # the kept entries did learn
