"""A few steps of each training loop lower the loss on a tiny synthetic task."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.implementations import BertWordPieceTokenizer

from runtime.construct.data import IGNORE
from runtime.model.encoder import Config, Encoder, load_encoder
from runtime.model.pet import PET_TYPES, create_pet, head
from runtime.construct.train import (TrainConfig, _dropout, _pad_inputs, distill_windows, train_full, train_mlm,
                                     train_pet, train_upper)

POSITIVE = ["the results were good", "a good and clear method", "good cells grew well", "this is good work"]
NEGATIVE = ["the results were bad", "a bad and unclear method", "bad cells died early", "this is bad work"]


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A randomly initialized 2-layer encoder over a 20-word vocabulary: the loops that update
    shared weights (embeddings included) run in milliseconds on it."""
    words = "the results were good a and clear method cells grew well this is work bad unclear died early in dish"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(words.split())]
    path = tmp_path_factory.mktemp("tiny") / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    config = Config(vocab_size=len(vocab), d=32, heads=4, ffn=64, num_layers=2, max_len=32, pad_id=0, eps=1e-12)
    torch.manual_seed(0)
    return Encoder(config, BertWordPieceTokenizer(str(path)), path.read_bytes(), lower_layers=1).requires_grad_(False)


def tiny_task(tiny):
    docs = tiny.tokenize(POSITIVE + NEGATIVE)
    with torch.no_grad():
        inputs = [tiny.lower(*tiny.pad([d]))[0] for d in docs]
    return docs, inputs, [1] * len(POSITIVE) + [0] * len(NEGATIVE)


@pytest.fixture(scope="module")
def task(encoder):
    """Classification: does the sentence say good (1) or bad (0)? Tagging: is the token good/bad?"""
    docs = encoder.tokenize(POSITIVE + NEGATIVE)
    labels = [1] * len(POSITIVE) + [0] * len(NEGATIVE)
    marked = {encoder.tokenizer.token_to_id("good"), encoder.tokenizer.token_to_id("bad")}
    tags = [[IGNORE if j in (0, len(d) - 1) else int(t in marked) for j, t in enumerate(d)] for d in docs]
    with torch.no_grad():
        inputs = [encoder.lower(*encoder.pad([d]))[0] for d in docs]
    return docs, inputs, labels, tags


def config(lr, steps=6):
    # One full batch per step: the logged losses are on the same examples, so they must fall.
    return TrainConfig(lr=lr, epochs=steps, batch_size=8, warmup=0.0, progress=False)


@pytest.mark.parametrize("pet_type", PET_TYPES)
def test_pet_classification(encoder, task, pet_type):
    _, inputs, labels, _ = task
    pet = create_pet(encoder, pet_type, "classification", ["bad", "good"])
    # A dense diff/mask step moves every weight of the layer: it needs a smaller rate.
    exported, log = train_pet(encoder, pet, inputs, labels, config(1e-3 if pet_type in ("diff", "mask") else 1e-2))
    assert len(log) == 6 and log[-1] < log[0]
    assert not any(v.requires_grad for v in exported.tensors.values())


def test_pet_tagging(encoder, task):
    _, inputs, _, tags = task
    pet = create_pet(encoder, "lora", "tagging", ["other", "judgement"])
    exported, log = train_pet(encoder, pet, inputs, tags, config(1e-2))
    assert log[-1] < log[0]
    x = inputs[0][None]
    with torch.no_grad():
        logits = head(exported, encoder.upper(x, torch.ones(x.shape[:2], dtype=torch.bool), exported))
    assert logits.shape == (1, len(x[0]), 2)


def test_full_and_upper_fine_tuning_leave_the_encoder_alone(tiny):
    docs, inputs, labels = tiny_task(tiny)
    before = [p.clone() for p in tiny.parameters()]
    trained, _, log = train_full(tiny, create_pet(tiny, "head", "classification", ["bad", "good"]),
                                 docs, labels, config(1e-2))
    assert log[-1] < log[0] and not torch.equal(trained.layers[0].q.weight, tiny.layers[0].q.weight)
    trained, _, log = train_upper(tiny, create_pet(tiny, "head", "classification", ["bad", "good"]),
                                  inputs, labels, config(1e-2))
    assert log[-1] < log[0] and not torch.equal(trained.layers[1].q.weight, tiny.layers[1].q.weight)
    assert torch.equal(trained.layers[0].q.weight, tiny.layers[0].q.weight)
    assert all(torch.equal(p, q) for p, q in zip(before, tiny.parameters()))


def test_mlm_trains_only_the_lower_layers(tiny):
    docs = tiny.tokenize(["the cells grew in the dish and the cells died early"] * 16)
    trained, log = train_mlm(tiny, docs, TrainConfig(lr=1e-2, epochs=20, batch_size=16, progress=False))
    assert sum(log[-3:]) < sum(log[:3])
    assert not torch.equal(trained.word.weight, tiny.word.weight)
    assert not torch.equal(trained.layers[0].ffn_in.weight, tiny.layers[0].ffn_in.weight)
    assert torch.equal(trained.layers[1].ffn_in.weight, tiny.layers[1].ffn_in.weight)


def test_window_distillation(tiny):
    docs = tiny_task(tiny)[0][:4]
    trained, log = distill_windows(tiny, docs, 3, "centered", config(1e-2))
    assert log[-1] < log[0]
    assert torch.equal(trained.layers[1].q.weight, tiny.layers[1].q.weight)


@given(rate=st.floats(0.05, 0.9), seed=st.integers(0, 2**31))
@settings(max_examples=25, deadline=None)
def test_dropout_zeroes_a_share_and_rescales_the_rest(rate, seed):
    """BERT's (inverted) dropout: each element is 0 or x / (1 - rate), about `rate` of them 0."""
    drop = _dropout(TrainConfig(lr=1.0, dropout=rate, lora_dropout=rate, seed=seed))
    x = torch.rand(4000) + 0.5
    for place in ("hidden", "attention", "lora"):
        y = drop(place, x)
        kept = y != 0
        assert torch.allclose(y[kept], x[kept] / (1 - rate))
        assert abs((~kept).float().mean().item() - rate) < 0.05


def test_dropout_is_off_by_default_and_checks_its_rates():
    assert _dropout(TrainConfig(lr=1.0)) is None
    only_lora = _dropout(TrainConfig(lr=1.0, lora_dropout=0.5))
    x = torch.ones(100)
    assert torch.equal(only_lora("hidden", x), x) and torch.equal(only_lora("attention", x), x)
    with pytest.raises(ValueError, match="dropout rates"):
        _dropout(TrainConfig(lr=1.0, dropout=1.0))


def test_pet_dropout_changes_training_only(tiny):
    """Dropout is seeded (a rerun gives the same losses), changes the training losses, keeps the
    batch order, and leaves the trained PET's serving forward deterministic (no dropout)."""
    whole = copy.deepcopy(tiny)
    whole.lower_layers = 0  # every layer "upper": inputs are embeddings, as a full-depth PET's
    docs, _, labels = tiny_task(tiny)
    with torch.no_grad():
        inputs = [whole.embed(whole.pad([d])[0])[0] for d in docs]

    def fit(**rates):
        pet = create_pet(whole, "lora", "classification", ["bad", "good"], layers=[0, 1])
        return train_pet(whole, pet, inputs, labels, TrainConfig(lr=1e-2, epochs=3, batch_size=4, progress=False,
                                                                 **rates))

    plain, (pet, dropped), (_, again) = fit(), fit(dropout=0.3, lora_dropout=0.3), fit(dropout=0.3, lora_dropout=0.3)
    assert dropped == again and dropped != plain[1] and len(dropped) == len(plain[1])
    x, real = _pad_inputs(inputs)
    with torch.no_grad():
        assert torch.equal(head(pet, whole.upper(x, real, pet)), head(pet, whole.upper(x, real, pet)))
