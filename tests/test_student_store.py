"""The students record in the store (FORMAT.md section 5, Students): no torch needed."""

import json
import os

import numpy as np
import pytest

import hkstore
from formats.pack import PetRecord
from hkstore.diff import diff_pets
from hkstore.errors import StoreError, UnknownTenant


def _pet(tenant):
    return PetRecord(tenant, {"pet_type": "head", "task": "classification", "labels": ["a"]},
                     {"head.weight": np.ones((1, 4), np.float32)})


def _students(tenant, value=1.0):
    return PetRecord(tenant, {"pet_type": "students", "students": 1, "complete": True},
                     {"multiplier": np.full(1, value, np.float32)})


def _live(path):
    with open(os.path.join(path, "CURRENT")) as f:
        current = f.read().strip()
    with open(os.path.join(path, current)) as f:
        return json.loads(f.read().rsplit("\n#xxh64:", 1)[0])


def test_students_live_beside_the_pet_and_go_with_the_tenant(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(_pet("t"))
        assert "students" not in _live(path)  # a store without students writes the manifest as before
        with pytest.raises(UnknownTenant):
            st.put_students(_students("nobody"))
        with pytest.raises(StoreError):
            st.put_students(_pet("t"))
        st.put_students(_students("t"))
        old = st.snapshot()
        assert st.get_students("t").meta["students"] == 1 and set(st.snapshot().pets) == {"t"}
        st.put_students(_students("t", 2.0))
        assert diff_pets(old, st.snapshot())["students"]["changed"] == ["t"]
        st.delete_students("t")  # only the students: the tenant stays
        assert set(st.snapshot().pets) == {"t"} and not st.snapshot().students
        assert "students" not in _live(path)
        st.put_students(_students("t"))
        st.delete_pet("t")  # the tenant: its students too
        assert not st.snapshot().pets and not st.snapshot().students
    assert hkstore.verify(path)["ok"]


def test_a_students_record_under_pets_is_reported_by_verify(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=10) as st:
        st.put_pet(_pet("t"))
        st.put_students(_students("t"))
        swapped = dict(_live(path))
    swapped["pets"], swapped["students"] = swapped["students"], swapped["pets"]
    from formats import manifest as mf

    mf.commit(path, dict(swapped, generation=swapped["generation"] + 1))
    problems = hkstore.verify(path)["problems"]
    assert any("students record" in p for p in problems) and any("live record" in p for p in problems)
