import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from formats.pack import PetRecord, decode_record, encode_record
from hkstore.peft import PeftImportError, load_peft_lora

D, R = 32, 4
PREFIX = "base_model.model.encoder.layer"


def lora_pair(rng, layer, module, prefix=PREFIX, rank=R, d_out=D):
    return {
        f"{prefix}.{layer}.{module}.lora_A.weight": rng.normal(size=(rank, D)).astype(np.float32),
        f"{prefix}.{layer}.{module}.lora_B.weight": rng.normal(size=(d_out, rank)).astype(np.float32),
    }


def write_adapter(path, tensors, **config):
    """A directory laid out as PEFT's save_pretrained writes it."""
    path.mkdir(exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "SEQ_CLS", "r": R, "lora_alpha": 8,
              "target_modules": ["query", "value"], "use_rslora": False, "bias": "none",
              "base_model_name_or_path": "sentence-transformers/all-MiniLM-L6-v2",
              "modules_to_save": None} | config
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def upper_qv(rng, prefix=PREFIX):
    tensors = {}
    for layer in (3, 4, 5):
        for module in ("attention.self.query", "attention.self.value"):
            tensors |= lora_pair(rng, layer, module, prefix)
    return tensors


def test_converts_names_shapes_and_meta(tmp_path):
    source = upper_qv(np.random.default_rng(0))
    meta, tensors = load_peft_lora(write_adapter(tmp_path / "a", source), lower_layers=3, num_layers=6)
    assert meta == {"pet_type": "lora", "rank": R, "scale": 2.0, "targets": ["q", "v"],
                    "layers": [3, 4, 5], "base_model": "sentence-transformers/all-MiniLM-L6-v2",
                    "source": "peft"}
    assert len(tensors) == 12
    np.testing.assert_array_equal(tensors["layers.4.lora.v.A"],
                                  source[f"{PREFIX}.4.attention.self.value.lora_A.weight"])
    np.testing.assert_array_equal(tensors["layers.5.lora.q.B"],
                                  source[f"{PREFIX}.5.attention.self.query.lora_B.weight"])
    # The result is storable as is.
    record = PetRecord("acme", meta, tensors)
    assert decode_record(encode_record(record)).tensors.keys() == tensors.keys()


def test_every_target_module_maps(tmp_path):
    rng = np.random.default_rng(1)
    modules = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v",
               "attention.output.dense": "o", "intermediate.dense": "ffn_in", "output.dense": "ffn_out"}
    source = {}
    for module in modules:
        source |= lora_pair(rng, 5, module, d_out=4 * D if module == "intermediate.dense" else D)
    path = write_adapter(tmp_path / "a", source, target_modules=["query", "key", "value", "dense"])
    meta, tensors = load_peft_lora(path, lower_layers=3, num_layers=6)
    assert meta["targets"] == list(modules.values())
    assert tensors["layers.5.lora.ffn_in.B"].shape == (4 * D, R)


@pytest.mark.parametrize("prefix", ["encoder.layer", "bert.encoder.layer",
                                    "base_model.model.bert.encoder.layer"])
def test_key_prefix_variants(tmp_path, prefix):
    source = upper_qv(np.random.default_rng(0), prefix)
    _, tensors = load_peft_lora(write_adapter(tmp_path / "a", source), lower_layers=3, num_layers=6)
    _, expected = load_peft_lora(write_adapter(tmp_path / "b", upper_qv(np.random.default_rng(0))),
                                 lower_layers=3, num_layers=6)
    assert tensors.keys() == expected.keys()


def test_rslora_scale(tmp_path):
    source = upper_qv(np.random.default_rng(0))
    path = write_adapter(tmp_path / "a", source, use_rslora=True, lora_alpha=16)
    meta, _ = load_peft_lora(path, lower_layers=3, num_layers=6)
    assert meta["scale"] == pytest.approx(16 / math.sqrt(R))


@pytest.mark.parametrize("head_key", ["base_model.model.classifier",
                                      "base_model.model.classifier.modules_to_save.default",
                                      "classifier.modules_to_save"])
def test_classifier_becomes_the_head(tmp_path, head_key):
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(13, D)).astype(np.float32), np.zeros(13, np.float32)
    source = upper_qv(rng) | {f"{head_key}.weight": weight, f"{head_key}.bias": bias}
    path = write_adapter(tmp_path / "a", source, modules_to_save=["classifier", "score"])
    meta, tensors = load_peft_lora(path, lower_layers=3, num_layers=6)
    assert meta["task"] == "classification"
    np.testing.assert_array_equal(tensors["head.weight"], weight)
    np.testing.assert_array_equal(tensors["head.bias"], bias)


def test_float64_is_stored_as_float32(tmp_path):
    source = {k: v.astype(np.float64) for k, v in upper_qv(np.random.default_rng(0)).items()}
    _, tensors = load_peft_lora(write_adapter(tmp_path / "a", source), lower_layers=3, num_layers=6)
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}


def rng_pairs(*pairs):
    rng, tensors = np.random.default_rng(0), {}
    for layer, module in pairs:
        tensors |= lora_pair(rng, layer, module)
    return tensors


QUERY = "attention.self.query"
A_KEY, B_KEY = f"{PREFIX}.3.{QUERY}.lora_A.weight", f"{PREFIX}.3.{QUERY}.lora_B.weight"

GOOD = rng_pairs((3, QUERY))
# case: (config changes, tensors, expected message)
BAD_ADAPTERS = {
    "not LoRA": ({"peft_type": "IA3"}, GOOD, "not a LoRA adapter: peft_type is 'IA3'"),
    "unknown config target": ({"target_modules": ["q_proj", "v_proj"]}, GOOD,
                              "unknown target module 'q_proj'"),
    "unknown key target": ({}, rng_pairs((3, "attention.self.gate")),
                           "unknown target module 'attention.self.gate'"),
    "lower layer": ({}, rng_pairs((1, QUERY)),
                    "lower layers are baked into the PLOT and cannot take a LoRA"),
    "layer past the model": ({}, rng_pairs((6, QUERY)), "layer 6 does not exist in a 6-layer model"),
    "A/B mismatch": ({}, GOOD | {B_KEY: np.zeros((D, R + 1), np.float32)}, "do not fit rank"),
    "rank differs from r": ({"r": 8}, GOOD, "do not fit rank r=8"),
    "A without B": ({}, {A_KEY: np.zeros((R, D), np.float32)}, "lora_B is missing"),
    "no LoRA weights": ({}, {"classifier.weight": np.zeros((2, D), np.float32)},
                        "holds no LoRA weights"),
    "DoRA": ({"use_dora": True}, GOOD, "DoRA"),
    "trained biases": ({"bias": "all"}, GOOD, "bias='all'"),
    "other modules_to_save": ({"modules_to_save": ["pooler"]}, GOOD, r"modules_to_save \['pooler'\]"),
    "embedding LoRA": ({}, GOOD | {"embeddings.word_embeddings.lora_embedding_A": np.zeros((R, 5))},
                       "not a LoRA weight of an encoder layer"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapters_are_refused_with_a_reason(tmp_path, case):
    config, tensors, message = BAD_ADAPTERS[case]
    path = write_adapter(tmp_path / "a", tensors, **config)
    with pytest.raises(PeftImportError, match=message):
        load_peft_lora(path, lower_layers=3, num_layers=6)


def test_missing_and_unreadable_files(tmp_path):
    path = write_adapter(tmp_path / "a", rng_pairs((3, QUERY)))
    (path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(PeftImportError, match="not readable safetensors"):
        load_peft_lora(path, lower_layers=3, num_layers=6)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(PeftImportError, match="adapter_model.safetensors is missing"):
        load_peft_lora(path, lower_layers=3, num_layers=6)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(PeftImportError, match="not readable JSON"):
        load_peft_lora(path, lower_layers=3, num_layers=6)
    (path / "adapter_config.json").unlink()
    with pytest.raises(PeftImportError, match="adapter_config.json is missing"):
        load_peft_lora(path, lower_layers=3, num_layers=6)


def test_errors_are_value_errors():
    assert issubclass(PeftImportError, ValueError)
