"""PETs inside the reference layer: no-op at init, equal to merged dense weights, export/load."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load, save

from runtime.model.encoder import load_encoder
from runtime.model.pet import NORMS, PET_TYPES, TARGETS, create_pet, export, head, load_pet

LABELS = ["neg", "pos", "other"]


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


@pytest.fixture(scope="module")
def inputs(encoder):
    """Upper-layer inputs of a padded batch."""
    ids, mask = encoder.pad(encoder.tokenize(["Cells were lysed in buffer.", "The drug reduces secretion of catecholamine."]))
    with torch.no_grad():
        return encoder.lower(ids, mask), mask


def upper(encoder, inputs, pet=None):
    with torch.no_grad():
        return encoder.upper(*inputs, pet)


def perturbed(pet, seed=0):
    """The PET with every tensor randomized (scores get both signs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, v in pet.tensors.items():
            v.copy_(torch.randn(v.shape, generator=g) * (0.05 if not name.endswith(".score") else 1.0))
    return pet


def merged(encoder, pet):
    """A copy of the encoder with the PET folded into its dense weights (the naive reference)."""
    ref = copy.deepcopy(encoder)
    t = {k: v.detach() for k, v in pet.tensors.items()}
    with torch.no_grad():
        for i in pet.meta["layers"]:
            for target in TARGETS:
                lin, p = getattr(ref.layers[i], target), f"layers.{i}."
                if f"{p}lora.{target}.A" in t:
                    lin.weight += pet.meta["scale"] * t[f"{p}lora.{target}.B"] @ t[f"{p}lora.{target}.A"]
                if f"{p}bias.{target}" in t:
                    lin.bias += t[f"{p}bias.{target}"]
                if f"{p}diff.{target}.delta" in t:
                    lin.weight += t[f"{p}diff.{target}.delta"]
                if f"{p}mask.{target}.score" in t:
                    lin.weight *= t[f"{p}mask.{target}.score"] > 0
            for name in pet.meta.get("norms", ()):
                ln = getattr(ref.layers[i], name)
                ln.weight += t[f"layers.{i}.norm.{name}.weight"]
                ln.bias += t[f"layers.{i}.norm.{name}.bias"]
    return ref


@pytest.mark.parametrize("pet_type", PET_TYPES)
def test_fresh_pet_is_a_no_op(encoder, inputs, pet_type):
    pet = create_pet(encoder, pet_type, "classification", LABELS)
    base = upper(encoder, inputs)
    assert torch.allclose(upper(encoder, inputs, pet), base, atol=1e-5)
    assert torch.allclose(upper(encoder, inputs, export(pet)), base, atol=1e-5)


@pytest.mark.parametrize("pet_type", ["lora", "bitfit", "diff", "mask"])
@pytest.mark.parametrize("norms", [(), ("ln_ffn",), NORMS])
def test_pet_equals_merged_dense_weights(encoder, inputs, pet_type, norms):
    targets = TARGETS if pet_type == "lora" else None
    pet = perturbed(create_pet(encoder, pet_type, "classification", LABELS, targets=targets, norms=norms))
    assert sorted(k for k in pet.tensors if ".norm." in k) == sorted(
        f"layers.{i}.norm.{n}.{w}" for i in (3, 4, 5) for n in norms for w in ("weight", "bias"))
    assert torch.allclose(upper(encoder, inputs, pet), upper(merged(encoder, pet), inputs), atol=1e-4)


def test_adapter_equals_naive_layer(encoder, inputs):
    pet = perturbed(create_pet(encoder, "adapter", "classification", LABELS, layers=[3]))
    h, mask = inputs
    blk, t = encoder.layers[3], {k: v.detach() for k, v in pet.tensors.items()}
    with torch.no_grad():
        B, L, d = h.shape
        q, k, v = (getattr(blk, n)(h).view(B, L, 12, 32).transpose(1, 2) for n in "qkv")
        att = (q @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(~mask[:, None, None], -1e30).softmax(-1)

        def houlsby(y, target):
            p = f"layers.3.adapter.{target}."
            return y + torch.relu(y @ t[p + "down.weight"].T + t[p + "down.bias"]) @ t[p + "up.weight"].T + t[
                p + "up.bias"]

        def norm(x, name):  # the PET's LayerNorm deltas ride on the shared gain and shift
            ln, p = getattr(blk, name), f"layers.3.norm.{name}."
            return F.layer_norm(x, (d,), ln.weight + t[p + "weight"], ln.bias + t[p + "bias"], ln.eps)

        a = houlsby(blk.o((att @ v).transpose(1, 2).reshape(B, L, d)), "o")
        h1 = norm(h + a, "ln_attn")
        expected = norm(h1 + houlsby(blk.ffn_out(F.gelu(blk.ffn_in(h1))), "ffn_out"), "ln_ffn")
        got = encoder.layer(3, h, mask, pet)
    assert torch.allclose(got, expected, atol=1e-4)


def test_diff_export_keeps_top_k_of_the_dense_delta(encoder, inputs):
    pet = perturbed(create_pet(encoder, "diff", "classification", LABELS, targets=["q"], density=0.01))
    out = export(pet)
    delta = pet.tensors["layers.4.diff.q.delta"].detach().flatten()
    index = out.tensors["layers.4.diff.q.index"]
    assert index.dtype == torch.int32 and len(index) == math.ceil(0.01 * delta.numel())
    assert set(index.tolist()) == set(delta.abs().topk(len(index)).indices.tolist())
    kept = dict(pet.tensors)
    for i in (3, 4, 5):  # the dense reference: only the exported entries of each delta
        name = f"layers.{i}.diff.q.delta"
        sparse = torch.zeros(kept[name].numel())
        sparse[out.tensors[f"layers.{i}.diff.q.index"].long()] = out.tensors[f"layers.{i}.diff.q.value"]
        kept[name] = sparse.view_as(kept[name])
    dense = type(pet)(kept, pet.meta)
    assert torch.allclose(upper(encoder, inputs, out), upper(merged(encoder, dense), inputs), atol=1e-4)


def test_mask_export_zeroes_the_lowest_nonpositive_scores(encoder):
    pet = create_pet(encoder, "mask", "classification", LABELS, targets=["v"], layers=[5], density=0.5)
    with torch.no_grad():
        pet.tensors["layers.5.mask.v.score"].view(-1)[[7, 3, 11]] = torch.tensor([-1.0, -2.0, 0.0])
    assert export(pet).tensors["layers.5.mask.v.index"].tolist() == [3, 7, 11]
    pet.meta["density"] = 2 / 384**2  # the cap keeps the two lowest scores
    assert export(pet).tensors["layers.5.mask.v.index"].tolist() == [3, 7]


@pytest.mark.parametrize("pet_type", PET_TYPES)
def test_export_load_round_trip(encoder, inputs, pet_type):
    pet = export(perturbed(create_pet(encoder, pet_type, "tagging", LABELS)))
    blob, meta = save(pet.tensors), json.dumps(pet.meta)
    loaded = load_pet(encoder, load(blob), json.loads(meta))
    as_numpy = load_pet(encoder, {k: v.half().numpy() if v.is_floating_point() else v.numpy() for k, v in pet.tensors.items()}, pet.meta)
    assert all(v.dtype in (torch.float32, torch.int32) for v in as_numpy.tensors.values())
    assert loaded.tensors.keys() == pet.tensors.keys()
    assert torch.equal(head(loaded, upper(encoder, inputs, loaded)), head(pet, upper(encoder, inputs, pet)))


def test_heads_read_first_token_or_every_token(encoder, inputs):
    h = upper(encoder, inputs)
    cls = create_pet(encoder, "head", "classification", LABELS)
    tag = create_pet(encoder, "head", "tagging", LABELS)
    assert head(cls, h).shape == (2, 3) and head(tag, h).shape == (*h.shape[:2], 3)
    assert torch.allclose(head(cls, h), head(tag, h)[:, 0])


def test_load_rejects_what_does_not_fit(encoder):
    pet = export(create_pet(encoder, "lora", "classification", LABELS))
    with pytest.raises(ValueError, match="has shape"):
        load_pet(encoder, pet.tensors | {"head.bias": torch.zeros(5)}, pet.meta)
    with pytest.raises(ValueError, match="is not part of a lora PET"):
        load_pet(encoder, pet.tensors | {"layers.3.lora.k.A": torch.zeros(8, 384)}, pet.meta)
    with pytest.raises(ValueError, match="is not part of a lora PET"):
        load_pet(encoder, pet.tensors | {"layers.3.bias.q": torch.zeros(384)}, pet.meta)
    with pytest.raises(ValueError, match="PET lacks tensor head.weight"):
        load_pet(encoder, {k: v for k, v in pet.tensors.items() if k != "head.weight"}, pet.meta)
    with pytest.raises(ValueError, match="pet_type"):
        load_pet(encoder, pet.tensors, pet.meta | {"pet_type": "prompt"})
    with pytest.raises(ValueError, match="lora PET meta lacks scale"):
        load_pet(encoder, pet.tensors, {k: v for k, v in pet.meta.items() if k != "scale"})
    with pytest.raises(ValueError, match="not all upper layers"):
        load_pet(encoder, pet.tensors, pet.meta | {"layers": [2, 3]})
    diff = export(create_pet(encoder, "diff", "classification", LABELS, targets=["q"]))
    with pytest.raises(ValueError, match="indices outside"):
        load_pet(encoder, diff.tensors | {"layers.3.diff.q.index": torch.tensor([384 * 384], dtype=torch.int32)}, diff.meta)
    with pytest.raises(ValueError, match="values for"):
        load_pet(encoder, diff.tensors | {"layers.3.diff.q.value": torch.zeros(1)}, diff.meta)


def test_create_rejects_bad_requests(encoder):
    with pytest.raises(ValueError, match="unknown PET type"):
        create_pet(encoder, "prefix", "classification", LABELS)
    with pytest.raises(ValueError, match="unknown task"):
        create_pet(encoder, "lora", "regression", LABELS)
    with pytest.raises(ValueError, match="not all upper layers"):
        create_pet(encoder, "bitfit", "classification", LABELS, layers=[0])
    with pytest.raises(ValueError, match="unknown lora targets"):
        create_pet(encoder, "lora", "classification", LABELS, targets=["query"])
    with pytest.raises(ValueError, match="unknown adapter targets"):  # only outputs that join the residual
        create_pet(encoder, "adapter", "classification", LABELS, targets=["q"])
    with pytest.raises(ValueError, match="norms must be"):
        create_pet(encoder, "adapter", "classification", LABELS, norms=["ln_emb"])  # a lower-layer norm


def test_adapter_carries_both_layer_norms_and_old_packs_without_them_load(encoder, inputs):
    pet = export(perturbed(create_pet(encoder, "adapter", "classification", LABELS)))
    assert pet.meta["norms"] == list(NORMS)
    plain = {k: v for k, v in pet.tensors.items() if ".norm." not in k}
    meta = {k: v for k, v in pet.meta.items() if k != "norms"}  # a pack written before norms existed
    with pytest.raises(ValueError, match="lacks tensor layers.3.norm"):
        load_pet(encoder, plain, pet.meta)
    no_norms = load_pet(encoder, plain, meta)
    assert not torch.allclose(upper(encoder, inputs, no_norms), upper(encoder, inputs, pet), atol=1e-3)
