"""Import a Hugging Face PEFT LoRA adapter of a causal LM (GPT-2, OPT, Llama layouts) as an
`lm` PET (FORMAT.md section 5): what `hkstore pack import` does on a decoder store.

NumPy only, like hkstore.peft (whose config checks it shares). Module names map to the PET
targets: q_proj / k_proj / v_proj -> q / k / v, o_proj or out_proj -> o, fc1 or up_proj ->
ffn_in, fc2 or down_proj -> ffn_out; GPT-2's fused attn.c_attn becomes three LoRAs sharing its
A (its B cut into the q, k and v rows), attn.c_proj -> o, mlp.c_fc -> ffn_in, mlp.c_proj ->
ffn_out. A Llama gate_proj LoRA has no PET target yet and is refused.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from hkstore.peft import (
    WEIGHTS,
    PeftImportError,
    _read_config,
    _read_tensors,
    _storable,
)

MODULES = {
    "self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",), "self_attn.v_proj": ("v",),
    "self_attn.o_proj": ("o",), "self_attn.out_proj": ("o",), "fc1": ("ffn_in",), "fc2": ("ffn_out",),
    "mlp.up_proj": ("ffn_in",), "mlp.down_proj": ("ffn_out",),
    "attn.c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "mlp.c_fc": ("ffn_in",), "mlp.c_proj": ("ffn_out",),
}
ORDER = ("q", "k", "v", "o", "ffn_in", "ffn_out")
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.decoder\.|model\.|transformer\.)(?:layers|h)\.(\d+)\.(.+)"
                  r"\.lora_([AB])\.weight")


def _check_config(config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise PeftImportError(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r <= 0 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise PeftImportError(f"adapter config needs a positive int r and a numeric lora_alpha (r={r!r}, "
                              f"lora_alpha={alpha!r})")
    for field, why in (("use_dora", "DoRA adapters"), ("rank_pattern", "per-module rank_pattern"),
                       ("alpha_pattern", "per-module alpha_pattern"), ("modules_to_save", "modules_to_save")):
        if config.get(field):
            raise PeftImportError(f"{why} ({field}) not supported for a decoder tenant")
    if config.get("bias", "none") != "none":
        raise PeftImportError(f"bias={config['bias']!r} trains base biases, which a LoRA PET cannot carry")


def load_peft_causal_lm(directory, *, lower_layers: int, num_layers: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, tensors) of a PEFT LoRA adapter of a causal LM, as an lm PET; PeftImportError
    (one line) for anything it cannot express."""
    directory = Path(directory)
    config = _read_config(directory)
    _check_config(config)
    r = config["r"]
    tensors, targets, layers = {}, set(), set()
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, array in _read_tensors(directory).items():
        match = _KEY.fullmatch(key)
        if not match:
            raise PeftImportError(f"{key}: not a LoRA weight of a decoder layer")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in MODULES:
            raise PeftImportError(f"{key}: module {module!r} has no PET target (known: {', '.join(sorted(MODULES))})")
        if not lower_layers <= layer < num_layers:
            raise PeftImportError(f"{key}: layer {layer} is not an upper layer ({lower_layers}..{num_layers - 1}): "
                                  "lower layers are baked into the PLOT")
        pairs.setdefault((layer, module), {})[side] = _storable(key, array)
    if not pairs:
        raise PeftImportError(f"{directory / WEIGHTS} holds no LoRA weights")
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise PeftImportError(f"layer {layer} {module}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        parts = MODULES[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r or b.shape[0] % len(parts):
            raise PeftImportError(f"layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} do not fit rank {r}")
        rows = b.shape[0] // len(parts)
        for j, target in enumerate(parts):
            tensors[f"layers.{layer}.lora.{target}.A"] = a
            tensors[f"layers.{layer}.lora.{target}.B"] = np.ascontiguousarray(b[j * rows:(j + 1) * rows])
            targets.add(target)
        layers.add(layer)
    meta = {"pet_type": "lora", "task": "lm", "labels": [], "rank": r,
            "scale": config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r),
            "targets": sorted(targets, key=ORDER.index), "layers": sorted(layers),
            "base_model": config.get("base_model_name_or_path"), "source": "peft"}
    # Every listed layer must carry every target (one PET meta for all of them).
    missing = [f"layers.{i}.lora.{t}.A" for i in layers for t in targets if f"layers.{i}.lora.{t}.A" not in tensors]
    if missing:
        raise PeftImportError(f"the adapter's layers do not all carry the same targets ({missing[0]} is missing)")
    return meta, tensors
