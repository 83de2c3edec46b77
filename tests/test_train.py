"""A few steps of each training loop lower the loss on a tiny synthetic task."""

import copy
import dataclasses

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.implementations import BertWordPieceTokenizer

from runtime.construct.data import IGNORE
from runtime.model.encoder import Config, Encoder, load_encoder
from runtime.model.pet import PET_TYPES, create_pet, head
from runtime.construct.train import (DISTILL_T, TrainConfig, _dropout, _pad_inputs, distillation_loss,
                                     distill_windows, train_full, train_mlm, train_pet, train_upper)

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


def reference_kd(student, teacher, t=DISTILL_T):
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)) of one row, in NumPy."""
    def log_softmax(z):
        z = np.asarray(z, dtype=np.float64) / t
        return z - z.max() - np.log(np.exp(z - z.max()).sum())
    p = log_softmax(teacher)
    return float((np.exp(p) * (p - log_softmax(student))).sum()) * t * t


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(2, 5))
def test_distillation_loss_matches_a_reference_on_the_scored_tokens(seed, batch, labels_n):
    """Classification: the mean over examples of the reference; tagging: the mean over the
    tokens the labels score, whatever the teacher says on the IGNORE ones."""
    rng = np.random.default_rng(seed)
    student = rng.normal(size=(batch, labels_n)) * 3
    teacher = [rng.normal(size=labels_n) * 3 for _ in range(batch)]
    got = distillation_loss("classification", torch.tensor(student, dtype=torch.float32), teacher, [0] * batch)
    want = np.mean([reference_kd(s, t) for s, t in zip(student, teacher)])
    assert abs(got.item() - want) < 1e-4 * max(1.0, want)

    lengths = rng.integers(1, 6, size=batch)
    student = rng.normal(size=(batch, int(lengths.max()), labels_n)) * 3
    teacher = [rng.normal(size=(n, labels_n)) * 3 for n in lengths]
    tags = [[int(x) if x >= 0 else IGNORE for x in rng.integers(-1, labels_n, size=n)] for n in lengths]
    got = distillation_loss("tagging", torch.tensor(student, dtype=torch.float32), teacher, tags)
    rows = [reference_kd(student[b, j], teacher[b][j]) for b in range(batch) for j in range(lengths[b])
            if tags[b][j] != IGNORE]
    assert abs(got.item() - (np.mean(rows) if rows else 0.0)) < 1e-4 * max(1.0, np.mean(rows) if rows else 1.0)
    for b in range(batch):  # the teacher on an unscored token changes nothing
        for j in range(lengths[b]):
            if tags[b][j] == IGNORE:
                teacher[b][j] = teacher[b][j] + 100.0
    again = distillation_loss("tagging", torch.tensor(student, dtype=torch.float32), teacher, tags)
    assert abs(again.item() - got.item()) < 1e-5 * max(1.0, got.item())


def test_a_distilled_pet_follows_its_teacher_over_the_labels(encoder, task):
    """At distill weight 1 the labels carry no weight: a teacher that says the opposite of every
    label is what the PET learns; at 0 (or with no teacher) the labels are."""
    _, inputs, labels, _ = task
    flipped = [np.array([4.0, -4.0]) if y else np.array([-4.0, 4.0]) for y in labels]
    cfg = TrainConfig(lr=1e-2, epochs=15, batch_size=8, warmup=0.0, progress=False, distill=1.0)

    def predictions(**kw):
        pet = create_pet(encoder, "lora", "classification", ["bad", "good"])
        train_pet(encoder, pet, inputs, labels, **kw)
        x, real = _pad_inputs(inputs)
        with torch.no_grad():
            return head(pet, encoder.upper(x, real, pet)).argmax(-1).tolist()

    assert predictions(cfg=cfg, teacher=flipped) == [1 - y for y in labels]
    assert predictions(cfg=cfg) == labels  # no teacher: distill has nothing to weigh
    assert predictions(cfg=dataclasses.replace(cfg, distill=0.0), teacher=flipped) == labels
    with pytest.raises(ValueError, match="teacher outputs"):
        train_pet(encoder, create_pet(encoder, "lora", "classification", ["bad", "good"]), inputs, labels, cfg,
                  flipped[:3])
