"""A tenant's full-depth PET in the store (FORMAT.md section 5, Full-depth PET): a record named
by the manifest's `full` map beside the tenant's PET and students. No torch needed."""

import json
import os
import tempfile

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import hkstore
import hkstore.store
from formats import manifest as mf
from formats.pack import PetRecord
from hkstore.cli import main as cli
from hkstore.diff import diff_pets
from hkstore.errors import StoreError, UnknownTenant

KINDS = ("pet", "students", "full")
MAPS = {"pet": "pets", "students": "students", "full": "full"}
TENANTS = ("a", "b", "c")


def record(kind, tenant, value, pet_created=None):
    meta = {"pet": {"pet_type": "lora", "created": value},
            "students": {"pet_type": "students", "students": 1, "complete": True},
            "full": {"pet_type": "lora", "level": "full", "layers": list(range(6)), "pet_created": pet_created}}[kind]
    return PetRecord(tenant, {"tenant": tenant, **meta}, {"w": np.full(3, value, np.float32)})


def tombstone(kind, tenant):
    meta = {"pet": {}, "students": {"pet_type": "students"}, "full": {"level": "full"}}[kind]
    return PetRecord(tenant, meta, {}, tombstone=True)


def live(path):
    return mf.load(path)


def read(store, kind, tenant):
    return {"pet": store.get_pet, "students": store.get_students, "full": store.get_full}[kind](tenant)


def apply(model, kind, tenant, value):
    """The reference: FORMAT.md section 5's tombstone rules on a plain dict (value None: a tombstone)."""
    if value is not None:
        model[kind][tenant] = value
    else:
        for k in (KINDS if kind == "pet" else [kind]):
            model[k].pop(tenant, None)


class FullRecordMachine(RuleBasedStateMachine):
    """put / delete / raw tombstones / batches / reopen against a dict per record kind."""

    def __init__(self):
        super().__init__()
        self.tmp = None

    @initialize()
    def setup(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "s")
        self.store = hkstore.create(self.path, d=4, vocab_size=10)
        self.model = {k: {} for k in KINDS}
        self.counter = 0

    def teardown(self):
        if self.tmp:
            self.store.close()
            self.tmp.cleanup()

    def fresh(self):
        self.counter += 1
        return float(self.counter)

    @rule(kind=st.sampled_from(KINDS), tenant=st.sampled_from(TENANTS))
    def put(self, kind, tenant):
        value = self.fresh()
        put = {"pet": self.store.put_pet, "students": self.store.put_students, "full": self.store.put_full}[kind]
        if kind != "pet" and tenant not in self.model["pet"]:
            with pytest.raises(UnknownTenant, match=f"unknown tenant '{tenant}'"):
                put(record(kind, tenant, value))
            return
        put(record(kind, tenant, value))
        apply(self.model, kind, tenant, value)

    @rule(kind=st.sampled_from(KINDS), tenant=st.sampled_from(TENANTS))
    def delete(self, kind, tenant):
        delete = {"pet": self.store.delete_pet, "students": self.store.delete_students,
                  "full": self.store.delete_full}[kind]
        if tenant not in self.model[kind]:
            with pytest.raises(UnknownTenant):
                delete(tenant)
            return
        delete(tenant)
        apply(self.model, kind, tenant, None)

    @rule(kind=st.sampled_from(KINDS), tenant=st.sampled_from(TENANTS))
    def raw_tombstone(self, kind, tenant):
        self.store.put_pets([tombstone(kind, tenant)])  # whether or not there is anything to remove
        apply(self.model, kind, tenant, None)

    @rule(steps=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(TENANTS), st.booleans()), max_size=5))
    def batch(self, steps):
        """One commit of several records, applied in order; a students or full-depth record
        whose tenant has no PET at that point refuses the whole commit."""
        model = {k: dict(v) for k, v in self.model.items()}
        records, refused = [], False
        for kind, tenant, dead in steps:
            value = None if dead else self.fresh()
            records.append(tombstone(kind, tenant) if dead else record(kind, tenant, value))
            refused |= not dead and kind != "pet" and tenant not in model["pet"]
            apply(model, kind, tenant, value)
        generation = live(self.path)["generation"]
        if refused:
            with pytest.raises(UnknownTenant):
                self.store.put_pets(records)
            assert live(self.path)["generation"] == generation  # nothing committed
            return
        self.store.put_pets(records)
        self.model = model

    @rule()
    def reopen(self):
        self.store.close()
        self.store = hkstore.open(self.path, writable=True)

    @invariant()
    def the_store_holds_what_the_model_does(self):
        if self.tmp is None:
            return
        manifest = live(self.path)
        for kind in KINDS:
            assert (MAPS[kind] in manifest) == (kind == "pet" or bool(self.model[kind]))  # empty maps omitted
        with hkstore.open(self.path) as reader:
            snap = reader.snapshot()
            assert dict(snap.pets) == manifest["pets"] and snap.full == manifest.get("full", {})
            assert reader.fulls() == snap.full
            for kind in KINDS:
                assert set(manifest.get(MAPS[kind], {})) == set(self.model[kind])
                for tenant in TENANTS:
                    if tenant in self.model[kind]:
                        assert read(reader, kind, tenant).tensors["w"][0] == self.model[kind][tenant]
                    else:
                        with pytest.raises(UnknownTenant):
                            read(reader, kind, tenant)


TestFullRecordMachine = FullRecordMachine.TestCase
TestFullRecordMachine.settings = settings(max_examples=30, stateful_step_count=15, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def store_path(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(record("pet", "t", 1.0))
        st.put_students(record("students", "t", 2.0))
        st.put_full(record("full", "t", 3.0, pet_created=1.0))
    return path


def rewrite_manifest(path, change):
    manifest = mf.load(path)
    change(manifest)
    with open(os.path.join(path, mf.current_name(path)), "wb") as f:
        f.write(mf.encode(manifest))


@pytest.mark.parametrize("slot,holder", [("full", "pet"), ("pet", "full"), ("full", "students"), ("students", "full")])
def test_a_record_in_another_kinds_slot_is_refused_never_served(store_path, slot, holder):
    rewrite_manifest(store_path, lambda m: m[MAPS[slot]].__setitem__("t", m[MAPS[holder]]["t"]))
    store = hkstore.open(store_path)  # the store opens; the slot is refused where it is read
    found = {"pet": "", "students": "students ", "full": "full-depth PET "}[holder]
    wanted = {"pet": "PET", "students": "students", "full": "full-depth PET"}[slot]
    with pytest.raises(hkstore.CorruptError, match=f"is tenant 't''s {found}record, not tenant 't''s {wanted} record"):
        read(store, slot, "t")
    assert read(store, holder, "t").tensors["w"][0] == {"pet": 1.0, "students": 2.0, "full": 3.0}[holder]
    problems = hkstore.verify(store_path)["problems"]
    assert len(problems) == 1 and "tenant t:" in problems[0], problems


def test_a_full_slot_holding_another_tenants_full_record_is_refused(store_path):
    with hkstore.open(store_path, writable=True) as st:
        st.put_pet(record("pet", "u", 4.0))
        st.put_full(record("full", "u", 5.0, pet_created=4.0))
    rewrite_manifest(store_path, lambda m: m["full"].__setitem__("t", m["full"]["u"]))
    with pytest.raises(hkstore.CorruptError, match="is tenant 'u''s full-depth PET record, not tenant 't''s"):
        hkstore.open(store_path).get_full("t")


def test_put_full_refuses_what_is_no_full_record_of_a_stored_tenant(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        with pytest.raises(UnknownTenant, match="unknown tenant 'x': a full-depth PET is stored beside the tenant's PET"):
            st.put_full(record("full", "x", 1.0))
        st.put_pet(record("pet", "x", 1.0))
        for bad in (record("pet", "x", 2.0), record("students", "x", 2.0), tombstone("full", "x"),
                    PetRecord("x", {"pet_type": "students", "level": "full"}, {})):
            with pytest.raises(StoreError, match="meta level 'full'"):
                st.put_full(bad)
        generation = live(path)["generation"]
        with pytest.raises(UnknownTenant):  # the tenant goes earlier in the same commit: nothing is written
            st.put_pets([tombstone("pet", "x"), record("full", "x", 3.0)])
        assert live(path)["generation"] == generation and set(st.pets()) == {"x"}
        st.put_pets([record("pet", "y", 4.0), record("full", "y", 5.0, pet_created=4.0)])  # its PET just before
        assert st.get_full("y").meta["layers"] == list(range(6))  # lower layers included, as stored
    assert hkstore.verify(path)["ok"]


def test_manifests_without_full_read_as_none_and_writers_omit_it(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(record("pet", "t", 1.0))
        assert "full" not in live(path)  # as an older writer wrote it
        assert st.fulls() == {} and st.snapshot().full == {}
        with pytest.raises(UnknownTenant, match="tenant 't' has no full-depth PET"):
            st.get_full("t")
        with pytest.raises(UnknownTenant, match="tenant 't' has no full-depth PET"):
            st.delete_full("t")
        st.put_full(record("full", "t", 2.0, pet_created=1.0))
        assert set(live(path)["full"]) == {"t"}
        st.delete_full("t")  # only the full-depth PET: the tenant stays
        assert "full" not in live(path) and set(st.pets()) == {"t"}
    with hkstore.open(path) as reader:
        assert reader.fulls() == {}


def test_gc_keeps_a_live_full_record_and_moves_it_out_of_a_dead_pack(tmp_path, monkeypatch):
    monkeypatch.setattr(hkstore.store, "PACK_ROLL_BYTES", 3 * 4096)  # three one-page records a pack
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(record("pet", "t", 1.0))
        st.put_pet(record("pet", "u", 2.0))
        st.put_full(record("full", "u", 3.0, pet_created=2.0))
        first = st.fulls()["u"]["file"]
        st.put_full(record("full", "t", 4.0, pet_created=1.0))  # the next pack
        second = st.fulls()["t"]["file"]
        st.put_pet(record("pet", "t", 1.0))  # the PETs' first records dead: the first pack is a third live
        st.put_pet(record("pet", "u", 2.0))
        st.put_pet(record("pet", "w", 7.0))  # the newest pack, never rewritten
        assert first != second
        before = st.fulls()
        out = hkstore.gc(st)
    assert first in out["packs_rewritten"] and second not in out["packs_rewritten"]
    assert f"packs/{first}" in out["removed"] and f"packs/{second}" not in out["removed"]
    with hkstore.open(path) as reader:
        after = reader.fulls()
        assert after["t"] == before["t"] and after["u"]["file"] != first
        assert reader.get_full("u").tensors["w"][0] == 3.0 and reader.get_full("t").tensors["w"][0] == 4.0
    report = hkstore.verify(path)
    assert report["ok"] and report["checked"]["pets"] == 5  # t: PET + full, u: PET + full, w: PET


def test_cli_lists_and_diffs_full_records(store_path, tmp_path):
    def run(*args):
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, result.output
        return result.output

    rows = json.loads(run("pack", "ls", store_path, "--json"))
    assert [(r["pet_type"], r.get("level"), r.get("state")) for r in rows] == \
        [("lora", None, None), ("students", None, "stale"), ("lora", "full", "ready")]
    assert rows[2]["layers"] == list(range(6)) and rows[2]["bytes"] == live(store_path)["full"]["t"]["length"]
    assert "full depth" in run("pack", "ls", store_path) and "(stale)" not in run("pack", "ls", store_path).split("\n")[3]
    with hkstore.open(store_path, writable=True) as st:
        old = st.snapshot()
        st.put_pet(record("pet", "t", 9.0))  # retrained: the full-depth PET was trained with the old one
        assert diff_pets(old, st.snapshot())["full"] == {"added": [], "removed": [], "changed": [], "unchanged": 1}
    rows = json.loads(run("pack", "ls", store_path, "--json"))
    assert rows[2]["state"] == "stale"
    assert "full depth (stale)" in run("pack", "ls", store_path)
    run("pack", "rm", store_path, "t")  # the tenant: its full-depth PET too
    assert json.loads(run("pack", "ls", store_path, "--json")) == [] and "full" not in live(store_path)
    assert "ok" in run("verify", store_path)
