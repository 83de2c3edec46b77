"""A tenant's first use: its PET read from the pack into the host cache's form with no copy.

Property: for random PETs of every type (LoRA, adapter, BitFit, diff, mask, head alone; random
layers, targets, ranks, LayerNorm deltas; upper-only fp32 records and full-depth records with
fp16 layers), the ServingPet the CPU executor gets from a store read (a private mapping of the
pack for a big record, a buffer of its own for a small one) has exactly the parts, dtypes and
values of the old decode: tensors copied out of the record, prepared and never packed; each
layer's block holds its parts in its layout's order, and answers equal the old decode's.

A PET of the shipped recipes (the PLOT level's adapter with LayerNorm deltas, the full-depth
LoRA) lies in its record in block order, so its blocks are the record's own memory: no copy.
Writing into a record read so changes neither the pack nor a later read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
import hkstore.store
from formats import pack
from formats.pack import PetRecord
from runtime.construct.full import stored_tensors
from runtime.exec import cpu_batched
from runtime.exec.cpu import CpuExecutor
from runtime.exec.plan import prepare_pet
from runtime.model import pet as petlib
from tests.test_executor_cpu import random_pet, tiny_encoder

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KIND_OPTIONS = {"lora": "rank", "adapter": "bottleneck", "bitfit": None, "diff": "density", "mask": "density",
                "head": None}


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return tiny_encoder(tmp_path_factory.mktemp("first_use"))


@pytest.fixture(params=["mapped", "read"])
def read_path(request, monkeypatch):
    """Both ways PackFile.read hands a record over: every record mapped, or none."""
    monkeypatch.setattr(hkstore.store, "MAP_MIN", 0 if request.param == "mapped" else 1 << 40)
    return request.param


def new_store(path, enc):
    c = enc.config
    return hkstore.create(str(path), d=c.d, vocab_size=c.vocab_size, n=3, window="centered",
                          lower_layers=enc.lower_layers, pad_id=c.pad_id, base_model="tiny",
                          tokenizer_fingerprint=enc.tokenizer_fingerprint())


def as_record(tenant, pet, full=False):
    meta = dict(pet.meta, tenant=tenant, version="root", base_model="tiny", created=1.0)
    if full:
        return PetRecord(tenant, dict(meta, level="full", pet_created=1.0), stored_tensors(pet.tensors))
    return PetRecord(tenant, meta, {k: np.ascontiguousarray(v.numpy()) for k, v in pet.tensors.items()})


def served(enc, snap, tenant, full=False):
    """What the runtime's host cache holds for the record (runtime.serving's loading path)."""
    record = snap.read_full(tenant) if full else snap.read_pet(tenant)
    pet = petlib.load_pet(enc, record.tensors, petlib.pet_meta(record.meta), half=True)
    return CpuExecutor(enc).load_pet(pet, key=tenant)


def old_decode(enc, store_path, snap, tenant, full=False):
    """The reference: the record's bytes decoded into copies, prepared, not packed."""
    loc = (snap.full if full else snap.pets)[tenant]
    with open(f"{store_path}/packs/{loc['file']}", "rb") as f:
        f.seek(loc["offset"])
        record = pack.decode_record(f.read(loc["length"]))
    tensors = {k: v.copy() for k, v in record.tensors.items()}
    return prepare_pet(enc, petlib.load_pet(enc, tensors, petlib.pet_meta(record.meta), half=True), key=tenant)


def assert_same(got, want):
    assert got.parts.keys() == want.parts.keys()
    for part, arrays in want.parts.items():
        assert len(got.parts[part]) == len(arrays)
        for g, w in zip(got.parts[part], arrays):
            assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), part
            assert torch.equal(g, w), part
    for g, w in ((got.head_weight, want.head_weight), (got.head_bias, want.head_bias)):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert got.scale == want.scale and got.meta == want.meta
    # every float part of a layer is in that layer's block, at its place in the layout
    blocked = {p for p in got.parts if p[0] != "diff"}
    assert blocked == {p for _, layout in got.blocks.values() for p, _ in layout}
    for layer, (block, layout) in got.blocks.items():
        off = 0
        for part, shapes in layout:
            assert part[1] == layer
            for a, shape in zip(got.parts[part], shapes):
                n = int(np.prod(shape))
                assert a.data_ptr() == block[off:].data_ptr() and torch.equal(block[off:off + n].view(shape), a)
                off += n
        assert off == block.numel()


@st.composite
def pet_specs(draw):
    kind = draw(st.sampled_from(sorted(KIND_OPTIONS)))
    full = kind != "head" and draw(st.booleans())
    options = {}
    if kind not in ("head", "bitfit") or draw(st.booleans()):
        pool = range(0 if full else 2, 4)
        options["layers"] = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))
    allowed = petlib.ADAPTER_TARGETS if kind == "adapter" else petlib.TARGETS
    if kind not in ("head",):
        options["targets"] = tuple(draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=len(allowed),
                                                 unique=True)))
    if KIND_OPTIONS[kind] == "rank":
        options["rank"] = draw(st.integers(1, 5))
        options["scale"] = draw(st.sampled_from([0.5, 2.0]))
    elif KIND_OPTIONS[kind] == "bottleneck":
        options["bottleneck"] = draw(st.integers(1, 6))
    elif KIND_OPTIONS[kind] == "density":
        options["density"] = draw(st.sampled_from([0.02, 0.1]))
    if kind != "head":
        options["norms"] = tuple(draw(st.lists(st.sampled_from(petlib.NORMS), max_size=2, unique=True)))
    task = draw(st.sampled_from(["classification", "tagging"]))
    return kind, full, task, options, draw(st.integers(0, 10_000))


@SETTINGS
@given(specs=st.lists(pet_specs(), min_size=1, max_size=4))
def test_served_pet_equals_the_old_decode(enc, tmp_path_factory, read_path, specs):
    path = tmp_path_factory.mktemp("store")
    pets, records = [], []
    for j, (kind, full, task, options, seed) in enumerate(specs):
        pet = random_pet(enc, kind, task, seed, level="full" if full else None, **options)
        # a tenant's PET record first: a full-depth record needs one
        records.append(as_record(f"t{j}", random_pet(enc, "head", task, seed) if full else pet))
        if full:
            records.append(as_record(f"t{j}", pet, full=True))
        pets.append((f"t{j}", full))
    with new_store(path, enc) as store:
        store.put_pets(records)
    with hkstore.open(str(path)) as store:
        snap = store.snapshot()
        got = [served(enc, snap, t, full) for t, full in pets]
        want = [old_decode(enc, path, snap, t, full) for t, full in pets]
    for g, w in zip(got, want):
        assert_same(g, w)
    # answers: the same batch through the executor on either form
    ex = CpuExecutor(enc)
    torch.manual_seed(0)
    inputs, mask = torch.randn(len(got), 5, enc.config.d), torch.ones(len(got), 5, dtype=torch.bool)
    for a, b in zip(ex.run(inputs, mask, got), ex.run(inputs, mask, [cpu_batched.pack_layers(w) for w in want])):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def shipped(enc, seed):
    """The shipped recipes' kinds (runtime.construct.recipe): the PLOT level's adapter with both
    LayerNorm deltas, the full-depth LoRA on every projection of every layer; every tensor a
    multiple of the record's 64-byte alignment, as the shipped shapes are (no padding between)."""
    plot = random_pet(enc, "adapter", "classification", seed, bottleneck=16)
    full = random_pet(enc, "lora", "classification", seed, level="full", rank=4, targets=petlib.TARGETS)
    return plot, full


def test_shipped_pets_are_served_from_the_record_without_a_copy(enc, tmp_path, read_path):
    with new_store(tmp_path, enc) as store:
        for j in range(2):
            plot, full = shipped(enc, j)
            store.put_pets([as_record(f"t{j}", plot), as_record(f"t{j}", full, full=True)])
    with hkstore.open(str(tmp_path)) as store:
        snap = store.snapshot()
        for full in (False, True):
            pets = []
            for t in ("t0", "t1"):
                record = snap.read_full(t) if full else snap.read_pet(t)
                lo = min(a.ctypes.data for a in record.tensors.values())
                hi = max(a.ctypes.data + a.nbytes for a in record.tensors.values())
                pet = CpuExecutor(enc).load_pet(petlib.load_pet(enc, record.tensors, petlib.pet_meta(record.meta),
                                                                half=True), key=t)
                assert len(pet.blocks) == len(pet.meta["layers"])
                for block, _ in pet.blocks.values():
                    assert block.dtype == (torch.float16 if full else torch.float32)
                    # in the record's memory: a copy would be fresh memory, outside it
                    assert lo <= block.data_ptr() and block.data_ptr() + block.numel() * block.element_size() <= hi
                pets.append(pet)
            # tenants of one shape share their layouts (one object): a batch stacks each layer with one copy
            assert all(pets[0].blocks[i][1] is pets[1].blocks[i][1] for i in pets[0].blocks)


def test_writing_into_a_read_record_changes_neither_the_pack_nor_a_later_read(enc, tmp_path, read_path):
    plot, _ = shipped(enc, 0)
    with new_store(tmp_path, enc) as store:
        store.put_pets([as_record("t", plot)])
    with hkstore.open(str(tmp_path)) as store:
        snap = store.snapshot()
        first = snap.read_pet("t")
        before = {k: v.copy() for k, v in first.tensors.items()}
        for v in first.tensors.values():
            v[...] = 7
        again = snap.read_pet("t")
        for k, v in before.items():
            np.testing.assert_array_equal(again.tensors[k], v)
    with hkstore.open(str(tmp_path)) as store:
        for k, v in before.items():
            np.testing.assert_array_equal(store.snapshot().read_pet("t").tensors[k], v)
