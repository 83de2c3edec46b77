"""benchmarks.peft_compare compares like with like: its PEFT model, given hkstore's LoRA weights,
computes hkstore's function, and its every-sub-token labels agree with hkstore's first sub-tokens."""

import argparse

import pytest
import torch

pytest.importorskip("peft")

from benchmarks.peft_compare import every_subtoken, peft_model  # noqa: E402
from runtime.construct.data import IGNORE, encode_tagging  # noqa: E402
from runtime.model.encoder import load_encoder  # noqa: E402
from runtime.model.pet import TARGETS, create_pet, head  # noqa: E402

HF = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
      "o": "attention.output.dense", "ffn_in": "intermediate.dense", "ffn_out": "output.dense"}
LABELS = ["B-X", "I-X", "O"]
WORDS = [["hepatoblastoma", "in", "a", "child"], ["adenomatous", "polyposis", "coli", "tumours", "."]]
TAGS = [["B-X", "O", "O", "O"], ["B-X", "I-X", "I-X", "I-X", "O"]]


@pytest.fixture(scope="module")
def whole():
    return load_encoder(None, 0)


def test_peft_model_with_hkstore_weights_computes_hkstore_function(whole):
    pet = create_pet(whole, "lora", "tagging", LABELS, layers=list(range(6)), targets=TARGETS, rank=4, seed=1)
    g = torch.Generator().manual_seed(2)
    for name, v in pet.tensors.items():
        if name.endswith(".B"):  # created as 0: make the LoRA branch count
            v.data = torch.randn(v.shape, generator=g) * 0.05
    model = peft_model(argparse.Namespace(seed=0, rank=4, scale=2.0), argparse.Namespace(kind="tagging", labels=LABELS),
                       0.0, 0.0).eval()
    params = dict(model.named_parameters())
    assert sum(".lora_A." in n for n in params) == 36 and not any("pooler" in n and "lora" in n for n in params)
    with torch.no_grad():
        for name, v in pet.tensors.items():
            if name.startswith("head."):
                params[f"base_model.model.classifier.modules_to_save.default.{name[5:]}"].copy_(v)
                continue
            _, i, _, target, ab = name.split(".")
            params[f"base_model.model.bert.encoder.layer.{i}.{HF[target]}.lora_{ab}.default.weight"].copy_(v)
        ids, real = whole.pad(whole.tokenize([" ".join(w) for w in WORDS], 64))
        ours = head(pet, whole.upper(whole.embed(ids), real, pet))
        theirs = model(input_ids=ids, attention_mask=real.long()).logits
    assert torch.allclose(ours[real], theirs[real], atol=1e-4)


def test_every_subtoken_labels_extend_the_first_subtoken_labels(whole, tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("".join("".join(f"{w}\t{t}\n" for w, t in zip(ws, ts)) + "\n" for ws, ts in zip(WORDS, TAGS)))
    task = argparse.Namespace(kind="tagging", labels=LABELS, train_path=str(path), max_len=64)
    first = encode_tagging(whole, WORDS, TAGS, LABELS, 64)[1]
    every = every_subtoken(whole, task)
    for f, e, (_, word_ids), tags in zip(first, every, whole.tokenize_words(WORDS, 64), TAGS):
        assert [y for y in f if y != IGNORE] == [e[j] for j, y in enumerate(f) if y != IGNORE]
        for j, w in enumerate(word_ids):
            if w is None:
                assert e[j] == IGNORE
            elif f[j] == IGNORE:  # a continuation sub-token: its word's tag, B- read as I-
                assert LABELS[e[j]] == tags[w].replace("B-", "I-")
    assert any(y == IGNORE for y in first[0][1:-1])  # the sentences do split words
