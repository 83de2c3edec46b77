"""Import a Hugging Face PEFT LoRA adapter of a BERT-style encoder into PET pack tensors.

NumPy only: the adapter is read with safetensors.numpy, so no torch is needed (and bfloat16
files, which NumPy cannot hold, are refused). Names follow FORMAT.md section 5.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# BERT module path inside a layer -> our target name.
TARGETS = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
}
_PREFIX = r"(?:base_model\.model\.)?(?:bert\.)?"
_LORA_KEY = re.compile(_PREFIX + r"encoder\.layer\.(\d+)\.(.+)\.lora_([AB])\.weight")
# PEFT saves a modules_to_save copy as classifier.weight, or (older releases)
# classifier.modules_to_save[.<adapter>].weight.
_HEAD_KEY = re.compile(_PREFIX + r"classifier\.(?:modules_to_save\.(?:[^.]+\.)?)?(weight|bias)")
_TASKS = {"SEQ_CLS": "classification", "TOKEN_CLS": "tagging"}


class PeftImportError(ValueError):
    """The directory is not a LoRA adapter this store can serve; the message says why."""


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG
    if not path.is_file():
        raise PeftImportError(f"{path} is missing: not a PEFT adapter directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PeftImportError(f"{path} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise PeftImportError(f"{path} is not a JSON object")
    return config


def _check_config(config: dict) -> None:
    """Refuse the LoRA variants a (rank, scale, A, B) PET cannot express."""
    if config.get("peft_type") != "LORA":
        raise PeftImportError(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r <= 0 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise PeftImportError(f"adapter config needs a positive int r and a numeric lora_alpha "
                              f"(r={r!r}, lora_alpha={alpha!r})")
    if config.get("use_dora"):
        raise PeftImportError("DoRA adapters (use_dora) are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise PeftImportError("per-module rank_pattern/alpha_pattern is not supported: "
                              "a LoRA PET has one rank and one scale")
    if config.get("bias", "none") != "none":
        raise PeftImportError(f"bias={config['bias']!r} trains base biases, "
                              "which a LoRA PET cannot carry")
    # PEFT's sequence/token classification models list "classifier" and "score" themselves;
    # a BERT model has only the classifier.
    extra = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if extra:
        raise PeftImportError(f"modules_to_save {extra} not supported: "
                              "only the classifier head can be imported")
    targets = config.get("target_modules")
    # A string is a regex (or "all-linear"); the tensor keys are checked one by one anyway.
    if isinstance(targets, list):
        for name in targets:
            if not any(path == name or path.endswith("." + name) for path in TARGETS):
                raise PeftImportError(f"unknown target module {name!r}: "
                                      f"a BERT-style encoder layer has {sorted(TARGETS)}")


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    path = directory / WEIGHTS
    if not path.is_file():
        raise PeftImportError(f"{path} is missing (adapter_model.bin is not read: "
                              "save the adapter with safe_serialization)")
    try:
        return load_file(path)
    except Exception as err:  # safetensors raises its own error type, TypeError for bfloat16
        raise PeftImportError(f"{path} is not readable safetensors with NumPy dtypes ({err})") from None


def _storable(key: str, array: np.ndarray) -> np.ndarray:
    if array.dtype == np.float64:
        return array.astype(np.float32)  # the pack has no float64; LoRA weights lose nothing
    if array.dtype not in (np.float32, np.float16):
        raise PeftImportError(f"{key}: dtype {array.dtype} is not a float weight")
    return np.ascontiguousarray(array)


def _check_layer(key: str, layer: int, lower_layers: int, num_layers: int) -> None:
    if layer < lower_layers:
        raise PeftImportError(f"{key}: layer {layer} is below {lower_layers}: "
                              "lower layers are baked into the PLOT and cannot take a LoRA")
    if layer >= num_layers:
        raise PeftImportError(f"{key}: layer {layer} does not exist in a {num_layers}-layer model")


def _convert_lora(pairs: dict, r: int) -> dict[str, np.ndarray]:
    """Check each (layer, target)'s A (r, in) and B (out, r) and name them."""
    tensors = {}
    for (layer, target), pair in sorted(pairs.items()):
        where = f"layer {layer} target {target}"
        if set(pair) != {"A", "B"}:
            raise PeftImportError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != a.shape[0]:
            raise PeftImportError(f"{where}: lora_A {a.shape} and lora_B {b.shape} do not fit "
                                  f"rank r={r} (want A (r, in), B (out, r))")
        tensors[f"layers.{layer}.lora.{target}.A"] = a
        tensors[f"layers.{layer}.lora.{target}.B"] = b
    return tensors


def _convert_head(head: dict) -> dict[str, np.ndarray]:
    if not head:
        return {}
    weight, bias = head.get("weight"), head.get("bias")
    if weight is None or bias is None or weight.ndim != 2 or bias.shape != (weight.shape[0],):
        shapes = {k: v.shape for k, v in head.items()}
        raise PeftImportError(f"classifier needs weight (labels, d) and bias (labels), found {shapes}")
    return {"head.weight": weight, "head.bias": bias}


def load_peft_lora(directory, *, lower_layers: int,
                   num_layers: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, tensors) of the PEFT LoRA adapter in directory, in FORMAT.md section 5 names.

    meta: pet_type, rank, scale (alpha/r, alpha/sqrt(r) with rslora), targets, layers,
    base_model, source; plus task when the file carries a classifier and the config's
    task_type says which (SEQ_CLS -> classification, TOKEN_CLS -> tagging).
    Raises PeftImportError with one line saying what is wrong.
    """
    if not 0 <= lower_layers < num_layers:
        raise PeftImportError(f"lower_layers={lower_layers} must be in [0, num_layers={num_layers})")
    directory = Path(directory)
    config = _read_config(directory)
    _check_config(config)
    pairs, head = {}, {}
    for key, array in _read_tensors(directory).items():
        array = _storable(key, array)
        if match := _LORA_KEY.fullmatch(key):
            layer, module, side = int(match[1]), match[2], match[3]
            if module not in TARGETS:
                raise PeftImportError(f"{key}: unknown target module {module!r}, "
                                      f"expected one of {sorted(TARGETS)}")
            _check_layer(key, layer, lower_layers, num_layers)
            pairs.setdefault((layer, TARGETS[module]), {})[side] = array
        elif match := _HEAD_KEY.fullmatch(key):
            head[match[1]] = array
        else:
            raise PeftImportError(f"{key}: not a LoRA weight of an encoder layer nor the classifier")
    if not pairs:
        raise PeftImportError(f"{directory / WEIGHTS} holds no LoRA weights")
    r = config["r"]
    tensors = _convert_lora(pairs, r) | _convert_head(head)
    order = list(TARGETS.values())
    meta = {
        "pet_type": "lora",
        "rank": r,
        "scale": config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r),
        "targets": sorted({target for _, target in pairs}, key=order.index),
        "layers": sorted({layer for layer, _ in pairs}),
        "base_model": config.get("base_model_name_or_path"),
        "source": "peft",
    }
    if head and config.get("task_type") in _TASKS:
        meta["task"] = _TASKS[config["task_type"]]
    return meta, tensors


# -- export -------------------------------------------------------------------------------------

_MODULES = {target: module for module, target in TARGETS.items()}
_TASK_TYPES = {task: task_type for task_type, task in _TASKS.items()}


def save_peft_lora(directory, meta: dict, tensors: dict, *, base_model: str | None = None) -> dict:
    """Write a LoRA PET (meta, tensors in FORMAT.md section 5 names) as a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors, the names PEFT's save_pretrained writes
    for a BERT model), the inverse of load_peft_lora. The head, if any, becomes the classifier
    (modules_to_save); note that a PET's classification head reads the [CLS] hidden state
    directly, while BertForSequenceClassification puts BERT's pooler first. Returns the config."""
    from safetensors.numpy import save_file

    if meta.get("pet_type") != "lora":
        raise PeftImportError(f"only LoRA PETs export to PEFT; this one is {meta.get('pet_type')!r}")
    extra = sorted(k for k in tensors if not _is_lora_or_head(k))
    if extra:
        raise PeftImportError(f"the PET holds tensors PEFT's LoRA cannot carry: {', '.join(extra[:3])}")
    rank, scale = int(meta["rank"]), float(meta["scale"])
    out = {}
    for key, array in tensors.items():
        if key.startswith("layers."):
            _, layer, _, target, side = key.split(".")
            name = f"base_model.model.bert.encoder.layer.{layer}.{_MODULES[target]}.lora_{side}.weight"
        else:
            name = f"base_model.model.classifier.{key.split('.')[1]}"
        out[name] = np.ascontiguousarray(array, dtype=np.float32)
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({_MODULES[k.split(".")[3]].rsplit(".", 1)[-1] for k in tensors
                                  if k.startswith("layers.")}),
        "layers_to_transform": sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")}),
        "base_model_name_or_path": base_model or meta.get("base_model"), "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "inference_mode": True,
        "task_type": _TASK_TYPES.get(meta.get("task")) if "head.weight" in tensors else "FEATURE_EXTRACTION",
        "modules_to_save": ["classifier"] if "head.weight" in tensors else None,
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    save_file(out, str(directory / WEIGHTS))
    return config


def _is_lora_or_head(key: str) -> bool:
    parts = key.split(".")
    if key in ("head.weight", "head.bias"):
        return True
    return len(parts) == 5 and parts[0] == "layers" and parts[2] == "lora" and parts[3] in _MODULES \
        and parts[4] in ("A", "B")
