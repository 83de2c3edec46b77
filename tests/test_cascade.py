"""The cascade (runtime.engine, runtime.level.serve, runtime.serving): a tenant's top is its
current full-depth PET when it has one, else exact; policy exact pins it, Tabi's gate and
re-routing go to it, bursts keep auto requests at level 1, answers name their level,
profiling measures level 2 on the top, and a students-first policy starts from the tenant's
students (only the ones it was profiled on; else its PLOT-first fallback).

The routing tests run the engine with a fake executor that computes nothing: each row's logits
say which input source computed it, and its lookup serves every window at one order. The end
to end tests serve a copy of the tiny store whose tenants get random full-depth PETs (one of
them stale): policy exact against the whole encoder's forward with the PET, mixed batches
against one request at a time, profiling against the top, and the engine's plans on the
emulated GPU executor against the CPU one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engine import Ask, Engine, _row
from runtime.exec.rows import Gathered, Prepared, Row
from runtime.level import profile
from runtime.level.serve import NAMES, levels, policy_of, single, temperature
from runtime.sched.load import Load, LoadMeter

N = 3  # the PLOT's full order
LOGITS = {"plot": [2.0, 0.0], "students": [1.0, 0.0], "context": [0.0, 1.0], "full": [0.0, 3.0]}


class Fake:
    """An executor that computes nothing: a row's logits are its source's (LOGITS)."""

    def __init__(self, order: int = N):
        self.order = order  # the order every window of a lookup is served at
        self.batches = []

    def gather(self, snapshot, rows):
        served = [(np.zeros(len(r.ids)), np.full(len(r.ids), self.order)) if r.reads_plot() else None
                  for r in rows]
        return Gathered([], None, served)

    def prepare(self, gathered, rows):
        return Prepared(rows, served=gathered.served)

    def compute(self, prepared):
        self.batches.append(list(prepared.rows))
        return [np.array(LOGITS[r.source], dtype=np.float32) for r in prepared.rows]


class Meter(LoadMeter):
    """The load meter, with the oldest wait a test sets (a burst)."""

    wait = 0.0

    def take(self, tokens, oldest, now):
        load = super().take(tokens, oldest, now)
        return Load(load.queued, load.queued_tokens, self.wait, load.arrival_rate, load.now)


def _pet(policy=None, top="exact", created=1.0, full_created=None):
    meta = {"created": created}
    if policy is not None:
        meta["levels"] = {"levels": [1, 2], "temperature": {"1": 1.0, "2": 1.0}, "policy": policy,
                          "profile": {"top": top, "full_created": full_created}}
    return SimpleNamespace(meta=meta, task="classification", version="v1", labels=["a", "b"], key="t")


def _full(created=7.0):
    return SimpleNamespace(meta={"created": created, "pet_created": 1.0, "level": "full"}, task="classification",
                           version="v1", labels=["a", "b"], key="t/full")


def _engine(fake=None, **options):
    engine = Engine(fake or Fake(), lambda: SimpleNamespace(meta={"n": N}), max_batch=8, pipeline=False,
                    batching="fifo", **options)
    engine.load = Meter()
    return engine


def _ask(pet, policy, full=None, students=None):
    name, chosen = policy_of(pet, policy, full)
    return Ask("t", [101, 7, 8, 9, 102], None, pet, name, chosen, students, full)


GATED = {"c": 0.0, "k": 100.0, "alpha": 0.0, "w": 0.0, "gate": 0.5}  # coverage under 0.5: the top
REROUTE = {"c": 1.01, "k": 100.0, "alpha": 0.0, "w": 0.25, "gate": 0.0}  # every answer to the top
ALL_UP = {"c": 0.0, "k": 100.0, "alpha": 0.0, "w": 0.0, "gate": 1.01}  # every request to the top


# -- routing, as data -------------------------------------------------------------------------


@pytest.mark.parametrize("full", [None, _full()], ids=["exact", "full"])
def test_each_policy_routes_to_its_level(full):
    top = "exact" if full is None else "full"
    fast = _row(_ask(_pet(), "fast", full), None)
    exact = _row(_ask(_pet(), "exact", full), None)
    up = _row(_ask(_pet(ALL_UP, top, full_created=7.0), "auto", full), None)
    gated = _row(_ask(_pet(GATED, top, full_created=7.0), "auto", full), None)
    assert (fast.source, fast.pet.key, fast.gate) == ("plot", "t", 0.0)
    for r in (exact, up):  # the top: the full-depth PET's row, else the context row with the tenant's PET
        want = ("context", "t", "v1") if full is None else ("full", "t/full", "v1")
        assert (r.source, r.pet.key, r.version) == want
    assert (gated.source, gated.gate, gated.pet.key) == ("plot", 0.5, "t")


def test_a_record_profiled_against_another_top_is_not_followed():
    full = _full(created=7.0)
    exact_record = _pet(REROUTE, "exact")
    full_record = _pet(REROUTE, "full", full_created=7.0)
    assert policy_of(exact_record, None, None) == ("auto", REROUTE)
    assert policy_of(exact_record, None, full) == ("fast", None)  # profiled on exact: the tenant's top is full now
    assert policy_of(full_record, None, full) == ("auto", REROUTE)
    assert policy_of(full_record, None, None) == ("fast", None)  # the full-depth PET was removed or is stale
    assert policy_of(full_record, "auto", _full(created=8.0)) == ("fast", None)  # retrained since
    old = _pet()
    old.meta["levels"] = {"policy": REROUTE, "temperature": {"2": 2.0}}  # before tops were recorded: exact
    assert levels(old, None) and not levels(old, full)
    # the temperatures fitted at create are the exact level's: level 2 of a full top without a record is at T = 1
    old.meta["calibration"] = {"temperature": {"1": 1.5, "2": 3.0}}
    old.meta.pop("levels")
    assert (temperature(old, 1, full), temperature(old, 2, full), temperature(old, 2, None)) == (1.5, 1.0, 3.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["plot", "context", "students", "full"]), st.floats(0, 1.2),
                          st.floats(0, 1), st.booleans()), min_size=1, max_size=8))
def test_the_gate_sends_exactly_the_rows_under_it_to_their_top(rows):
    """Engine.gate against a loop: a plot row whose coverage is under its gate becomes its top's
    row (the given one, else a context row); every other row stays as it was."""
    plan, served, tops = [], [], []
    for source, gate, share, has_top in rows:
        ids = list(range(10))
        plan.append(Row(ids, "pet", "v", source, gate=gate, attention=True))
        served.append((np.zeros(10), np.where(np.arange(10) < round(10 * share), N, N - 1)))
        tops.append(Row(ids, "full-pet", "v", "full") if has_top else None)
    got = Engine.gate(plan, served, N, tops)
    for r, s, top, g in zip(plan, served, tops, got):
        under = r.source == "plot" and r.gate > 0 and (s[1] >= N).mean() < r.gate
        if not under:
            assert g is r
        elif top is not None:
            assert g is top
        else:
            assert (g.source, g.pet, g.gate, g.attention) == ("context", "pet", 0.0, False)


# -- the engine: gate, re-route, bursts -------------------------------------------------------


@pytest.mark.parametrize("full", [None, _full()], ids=["exact", "full"])
def test_the_gate_and_the_reroute_go_to_the_top(full):
    top = "exact" if full is None else "full"
    source = "context" if full is None else "full"
    fake = Fake(order=N - 1)  # nothing served at full order: coverage 0
    engine = _engine(fake)
    gating, rerouting = _pet(GATED, top, full_created=7.0), _pet(REROUTE, top, full_created=7.0)
    try:
        gated, = engine.serve([_ask(gating, "auto", full)])
        assert [[r.source for r in b] for b in fake.batches] == [[source]]  # the gate, in the same batch
        assert fake.batches[0][0].pet is (full or gating)
        fake.batches.clear()
        fake.order = N
        up, = engine.serve([_ask(rerouting, "auto", full)])
        exact, = engine.serve([_ask(_pet(), "exact", full)])
    finally:
        engine.close()
    assert [[r.source for r in b] for b in fake.batches] == [["plot"], [source], [source]]
    assert fake.batches[1][0].pet is (full or rerouting) and fake.batches[1][0].ids == [101, 7, 8, 9, 102]
    assert (gated.level, gated.level_name) == (2, top)
    assert (up.level, up.level_name) == (2, top)
    assert (exact.level, exact.level_name) == (2, top)
    # the re-routed answer ensembles level 1 (weight w) with the top's
    p1 = _softmax(LOGITS["plot"])
    np.testing.assert_allclose(up.probs, 0.25 * p1 + 0.75 * _softmax(LOGITS[source]), rtol=1e-5)


def test_bursts_keep_auto_requests_at_level_1_and_the_end_of_a_burst_reroutes_again():
    full = _full()
    fake = Fake(order=N - 1)
    engine = _engine(fake, overload_s=0.5)
    pets = [_pet(REROUTE, "full", full_created=7.0), _pet(GATED, "full", full_created=7.0),
            _pet(ALL_UP, "full", full_created=7.0)]
    try:
        served = []
        for wait in (2.0, 0.1):  # a batch whose oldest request waited past overload_s, then one that did not
            engine.load.wait = wait
            fake.batches.clear()
            answers = engine.serve([_ask(p, "auto", full) for p in pets] + [_ask(_pet(), "exact", full)])
            served.append(([a.level_name for a in answers], [r.source for b in fake.batches for r in b]))
    finally:
        engine.close()
    burst, calm = served
    # under the burst: the auto requests at level 1, no gate, no re-route; exact still pins the top
    assert burst == (["plot", "plot", "plot", "full"], ["plot", "plot", "plot", "full"])
    assert calm[0] == ["full", "full", "full", "full"]
    # the gated and the all-up requests in the batch, then the re-route
    assert calm[1] == ["plot", "full", "full", "full", "full"]


class Pricing:
    """The students' side of the engine as the pruning policy sees it: always the teacher, and
    the batches it is told about."""

    policy = SimpleNamespace(target_s=math.inf)

    def __init__(self):
        self.seen = []

    def choose(self, load):
        return "teacher"

    def observe(self, level, lengths, seconds):
        self.seen.append((level, len(lengths)))


def test_only_batches_at_the_pruning_policys_levels_price_them():
    pricing, full = Pricing(), _full()
    asker = SimpleNamespace(asked=None, k=lambda level: 0)
    engine = _engine(students=pricing)
    try:
        up = engine.serve([_ask(_pet(ALL_UP, "full", full_created=7.0), "auto", full, asker) for _ in range(3)])
        assert [a.level_name for a in up] == ["full"] * 3 and pricing.seen == []
        fast = engine.serve([_ask(_pet(), "fast", full, asker) for _ in range(3)])
        assert [a.level_name for a in fast] == ["plot"] * 3 and pricing.seen == [("teacher", 3)]
    finally:
        engine.close()


def test_the_engine_is_overloaded_when_the_pruning_policy_prunes_or_the_oldest_waits_too_long():
    engine = _engine(students=SimpleNamespace(policy=SimpleNamespace(target_s=0.3)))
    try:
        def load(wait):
            return Load(1, 5, wait, 0.0, 0.0)

        assert engine.overload_s == 0.3  # the students' latency target
        assert not engine.overloaded(load(0.1), None) and not engine.overloaded(load(0.1), "teacher")
        assert engine.overloaded(load(0.1), 2)  # students answer the batch
        assert engine.overloaded(load(0.4), None) and engine.overloaded(load(0.4), "teacher")
    finally:
        engine.close()
    engine = _engine()
    try:
        assert engine.overload_s == math.inf and not engine.overloaded(load(1e6), None)
    finally:
        engine.close()
    engine = _engine(overload_s=0.3, max_wait_s=1.0)  # waiting for company is no burst
    try:
        assert not engine.overloaded(load(1.2), None) and engine.overloaded(load(1.4), None)
    finally:
        engine.close()


# -- answers name their level -----------------------------------------------------------------


def test_answers_and_results_name_the_level_that_answered():
    from runtime.infer_cli import result_view
    from runtime.serve.app import _result_view
    from runtime.serving import Runtime

    pet = _pet()
    for source, name in NAMES.items():
        out = SimpleNamespace(logits=np.array(LOGITS[source]), timings={}, batch_size=1, source=source)
        a = single(pet, out, None, 2 if source == "students" else 0)
        assert (a.level, a.level_name) == ((2 if name in ("exact", "full") else 1), name)
        r = Runtime._result(None, ("t", [101, 102], None, None, False, 0, None, None), pet, a)
        assert (r.level, r.level_name) == (a.level, name)
        assert _result_view(r)["level_name"] == name and _result_view(r)["level"] == a.level
        assert result_view(r)["level_name"] == name


# -- serving: the top of a tenant ---------------------------------------------------------------


def test_the_runtime_serves_the_current_full_depth_pet_and_never_a_stale_one():
    from runtime.sched.pet_cache import PetCache
    from runtime.serving import Runtime

    loads = []

    class Served(Runtime):
        def __init__(self, fulls):
            self.pets = PetCache()
            self.store = SimpleNamespace(snapshot=lambda: SimpleNamespace(full=fulls))

        def _load_full(self, snap, tenant, token):
            loads.append((tenant, token))
            return SimpleNamespace(meta={"pet_created": 1.0, "created": 5.0}, key=f"{tenant}/full", nbytes=8)

    rt = Served({"t": {"file": "p0", "offset": 64, "length": 8}})
    pet = _pet(created=1.0)
    full = rt.full("t", pet)
    assert full.key == "t/full" and rt.full("t", pet) is full and loads == [("t", ("p0", 64))]  # cached
    assert rt.full("t", _pet(created=2.0)) is None  # the PET was retrained since: stale, not served
    assert rt.full("other", pet) is None  # no full record
    # the PET cache holds both of a tenant's PETs, under keys that never collide
    rt.pets.get("t", ("p0", 64), lambda: SimpleNamespace(key="t", nbytes=8))
    assert rt.pets.get("t/full", ("p0", 64), lambda: None) is full and len(rt.pets) == 2
    assert Served({}).full("t", pet) is None


# -- profiling against the top --------------------------------------------------------------------


class Recording:
    """An engine for collect: runs rows on the fake executor's logits, recording them."""

    def __init__(self):
        self.rows = []

    def run(self, rows):
        from runtime.engine import Output

        self.rows += rows
        return [Output(np.array(LOGITS[r.source]), {"retrieval": 0.0}, (np.zeros(len(r.ids)), np.full(len(r.ids), N)),
                       len(rows), np.ones(len(r.ids)) if r.attention else None, r.source) for r in rows]


@pytest.mark.parametrize("full", [None, _full()], ids=["exact", "full"])
def test_profiling_measures_level_2_on_the_top_and_records_it(full):
    pet = _pet()
    engine = Recording()
    queries = [([101, 5, 6, 102], None), ([101, 7, 102], None)]
    saved = profile.collect(engine, pet, queries, alphas=[0.0], n=N, full=full)
    level2 = [r for r in engine.rows if r.source != "plot"]
    assert {r.source for r in level2} == {"context" if full is None else "full"}
    assert all(r.pet is (full if full is not None else pet) for r in level2)
    np.testing.assert_allclose(saved.logits2[0.0][0], LOGITS[level2[0].source])
    chosen = {"c": 0.5, "k": 10.0, "alpha": 0.0, "w": 0.0, "gate": 0.0, "metric": 0.9, "cost": 0.4, "reroute": 0.1}
    result = {"level1": {"metric": 0.8, "cost": 0.3}, "level2": {"metric": 0.9, "cost": 1.0}, "met": True}
    rec = profile.record({"1": 1.0, "2": 1.0}, {}, chosen, result, 0.005, 2, full=full)
    assert rec["profile"]["top"] == ("exact" if full is None else "full")
    assert rec["profile"].get("full_created") == (None if full is None else 7.0)
    served = _pet()
    served.meta["levels"] = rec
    assert levels(served, full) == rec and not levels(served, _full() if full is None else None)


def _softmax(z):
    e = np.exp(np.asarray(z, dtype=np.float64) - max(z))
    return e / e.sum()


# -- end to end on a tiny store ---------------------------------------------------------------------


def put_full_pet(store_path, tenant, seed, pet_created=None, fp16=False):
    """A random full-depth LoRA PET on every layer of the tenant's encoder, stored beside its PET
    (pet_created: the PET it claims to be trained with; default the tenant's current one), in
    fp32 as older writers stored it or (fp16) as tenant create stores it now."""
    import time

    import torch

    import hkstore
    from formats.pack import PetRecord
    from runtime.construct.full import stored_tensors
    from runtime.model import pet as petlib
    from runtime.model.stored import base_encoder

    with hkstore.open(store_path, writable=True) as st:
        meta = st.get_pet(tenant).meta
        encoder = base_encoder(st)
        pet = petlib.create_pet(encoder, "lora", meta["task"], meta["labels"], level="full", rank=2,
                                targets=petlib.TARGETS, seed=seed)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in pet.tensors.items():
                if name.endswith(".B"):  # B = 0 would leave every layer as the base model's
                    t.copy_(0.3 * torch.randn(t.shape, generator=g))
        tensors = {k: v.detach().numpy() for k, v in petlib.export(pet).tensors.items()}
        if fp16:
            tensors = stored_tensors(tensors)
        full = dict(pet.meta, tenant=tenant, base_model=meta["base_model"], version=meta["version"],
                    created=time.time(), pet_created=meta["created"] if pet_created is None else pet_created)
        st.put_full(PetRecord(tenant, full, tensors))


def whole_encoder_logits(store_path, tenant, ids):
    """The reference of a full-depth tenant: the base embeddings, every layer with its full-depth PET, its head."""
    import torch

    import hkstore
    from runtime.model import pet as petlib
    from runtime.model.stored import base_encoder

    with hkstore.open(store_path) as st:
        record = st.get_full(tenant)
        encoder = base_encoder(st)
        pet = petlib.load_pet(encoder, record.tensors, petlib.pet_meta(record.meta))
    x = torch.tensor([ids])
    mask = torch.ones_like(x, dtype=torch.bool)
    with torch.no_grad():
        return petlib.head(pet, encoder.full(encoder.embed(x), mask, pet))[0].numpy()


FULL_TENANTS = ("lora-cls", "bitfit-tag")  # with a current full-depth PET; adapter-cls has a stale one
FP16_TENANTS = ("bitfit-tag",)  # its record as tenant create writes it now (fp16 layers); lora-cls's an older fp32 one


@pytest.fixture(scope="module")
def full_store(tmp_path_factory):
    import shutil

    import runtime
    from test_runtime import shared_tiny_store

    tiny = shared_tiny_store()
    store = tmp_path_factory.mktemp("cascade") / "store"
    shutil.copytree(tiny[0], store)
    for j, tenant in enumerate(FULL_TENANTS):
        put_full_pet(store, tenant, seed=j, fp16=tenant in FP16_TENANTS)
    put_full_pet(store, "adapter-cls", seed=5, pet_created=1.0)  # trained with an earlier PET: never served
    with runtime.open(store, device="cpu", max_len=48) as rt:
        yield store, rt, tiny[1]["texts"]


def test_policy_exact_of_a_full_depth_tenant_is_the_whole_encoder_with_its_pet(full_store):
    store, rt, texts = full_store
    ids = rt.encoder.tokenize(texts[:3], max_len=rt.max_len)
    got = rt.infer([{"tenant": "lora-cls", "ids": i, "policy": "exact"} for i in ids])
    for i, r in zip(ids, got):
        assert (r.level, r.level_name) == (2, "full")
        np.testing.assert_allclose(r.logits, whole_encoder_logits(store, "lora-cls", i), rtol=1e-4, atol=1e-4)
    # a stale full-depth record is not served: exact is the full-context level, as without one
    stale = rt.infer([{"tenant": "adapter-cls", "ids": ids[0], "policy": "exact"}])[0]
    plain = rt.infer([{"tenant": "head-cls", "ids": ids[0], "policy": "exact"}])[0]
    assert (stale.level_name, plain.level_name) == ("exact", "exact")
    assert not np.allclose(got[0].logits, whole_encoder_logits(store, "lora-cls", ids[1]))  # the check can fail


def test_an_fp16_full_depth_record_serves_its_pet_from_half_the_bytes(full_store):
    """bitfit-tag's record is fp16 (lora-cls's, fp32, is served above as before): the runtime
    answers with its PET as stored (read back in fp32: the reference) and its host cache holds
    the record's own bytes, fp16 layers and an fp32 head."""
    import hkstore

    store, rt, texts = full_store
    with hkstore.open(store) as st:
        record = st.get_full("bitfit-tag")
    assert {v.dtype for k, v in record.tensors.items() if k.startswith("layers.")} == {np.dtype(np.float16)}
    ids = rt.encoder.tokenize(texts[:3], max_len=rt.max_len)
    for i, r in zip(ids, rt.infer([{"tenant": "bitfit-tag", "ids": i, "level": "full"} for i in ids])):
        assert r.level_name == "full"
        np.testing.assert_allclose(r.logits, whole_encoder_logits(store, "bitfit-tag", i), rtol=1e-4, atol=1e-4)
    held = rt.full("bitfit-tag", rt.pet("bitfit-tag"))
    assert held.nbytes == sum(v.nbytes for v in record.tensors.values())
    wide = sum(4 * v.size for v in record.tensors.values())
    head = record.tensors["head.weight"].nbytes + record.tensors["head.bias"].nbytes
    assert held.nbytes - head == (wide - head) // 2


def test_exact_embeddings_of_a_full_depth_tenant_come_from_its_top(full_store):
    import torch

    import hkstore
    from runtime.model import pet as petlib
    from runtime.model.stored import base_encoder

    store, rt, texts = full_store
    ids = rt.encoder.tokenize(texts[:2], max_len=rt.max_len)
    with hkstore.open(store) as st:
        encoder = base_encoder(st)
        pets = {t: petlib.load_pet(encoder, st.get_full(t).tensors, petlib.pet_meta(st.get_full(t).meta))
                for t in ("lora-cls", "adapter-cls")}

    def whole(tenant, i):
        x = torch.tensor([i])
        with torch.no_grad():
            h = encoder.full(encoder.embed(x), torch.ones_like(x, dtype=torch.bool), pets[tenant])
        return torch.nn.functional.normalize(h.mean(1), dim=-1)[0].numpy()

    got, _ = rt.embed(ids, "lora-cls", policy="exact")
    for i, vector in zip(ids, got):
        np.testing.assert_allclose(vector, whole("lora-cls", i), rtol=1e-4, atol=1e-5)
    # adapter-cls's full-depth record is stale: exact stays the full-context lower layers + its PET
    stale, _ = rt.embed(ids, "adapter-cls", policy="exact")
    assert not np.allclose(stale[0], whole("adapter-cls", ids[0]), atol=1e-3)


def test_a_pinned_level_is_served_by_that_level_or_refused(full_store):
    import runtime

    store, rt, texts = full_store
    ids = rt.encoder.tokenize(texts[:1], max_len=rt.max_len)[0]
    by_pin = {level: rt.infer([{"tenant": "lora-cls", "ids": ids, "level": level}])[0]
              for level in ("plot", "exact", "full")}
    assert {k: (r.level_name, r.level) for k, r in by_pin.items()} == {
        "plot": ("plot", 1), "exact": ("exact", 2), "full": ("full", 2)}
    np.testing.assert_allclose(by_pin["full"].logits, whole_encoder_logits(store, "lora-cls", ids), rtol=1e-4,
                               atol=1e-4)
    (fast,) = rt.infer([{"tenant": "lora-cls", "ids": ids, "policy": "fast"}])
    np.testing.assert_allclose(by_pin["plot"].logits, fast.logits, rtol=1e-5, atol=1e-6)
    assert not np.allclose(by_pin["exact"].logits, by_pin["full"].logits, atol=1e-3)
    # a tenant with exact as its top can pin exact, and nothing serves a missing or stale full level
    assert rt.infer([{"tenant": "head-cls", "ids": ids, "level": "exact"}])[0].level_name == "exact"
    for tenant, why in (("adapter-cls", "stale"), ("head-cls", "no full-depth level")):
        with pytest.raises(runtime.BadRequest, match=why):
            rt.infer([{"tenant": tenant, "ids": ids, "level": "full"}])
    for bad in ({"level": "top"}, {"level": "plot", "policy": "auto"}, {"level": "plot", "students": 2}):
        with pytest.raises(runtime.BadRequest):
            rt.infer([{"tenant": "lora-cls", "ids": ids, **bad}])


def test_the_cli_refuses_a_pin_to_a_missing_level_in_one_line(full_store):
    from click.testing import CliRunner

    from tools.cli import main

    store, _, texts = full_store
    r = CliRunner().invoke(main, ["infer", str(store), "--tenant", "adapter-cls", "--level", "full", "--device", "cpu",
                                  "--max-len", "48", texts[0]])
    assert r.exit_code != 0 and "stale" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    ok = CliRunner().invoke(main, ["infer", str(store), "--tenant", "lora-cls", "--level", "full", "--device", "cpu",
                                   "--max-len", "48", "--json", texts[0]])
    assert ok.exit_code == 0 and '"level_name": "full"' in ok.output, ok.output


def _full_requests():
    return st.builds(lambda tenant, text, policy: {"tenant": tenant, "text": text, "policy": policy},
                     st.sampled_from([*FULL_TENANTS, "adapter-cls", "head-cls"]), st.integers(0, 40),
                     st.sampled_from(["fast", "exact"]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_full_requests(), min_size=2, max_size=8))
def test_a_mixed_batch_of_tops_answers_each_request_as_alone(full_store, requests):
    _, rt, texts = full_store
    requests = [dict(r, text=texts[r["text"] % len(texts)]) for r in requests]
    together = rt.infer(requests)
    for request, got in zip(requests, together):
        (alone,) = rt.infer([request])
        top = "full" if request["tenant"] in FULL_TENANTS else "exact"
        assert got.level_name == alone.level_name == ("plot" if request["policy"] == "fast" else top)
        assert (got.label, got.tags) == (alone.label, alone.tags)
        np.testing.assert_allclose(got.logits, alone.logits, rtol=1e-4, atol=1e-4)


def test_profiling_a_full_depth_tenant_against_its_top(full_store, tmp_path):
    """hkstore levels profile measures level 2 on the full-depth PET and says so; serving follows
    the record, and stops following it once the tenant's top is another."""
    import json

    import hkstore
    from click.testing import CliRunner
    from tools.cli import main

    store, rt, texts = full_store
    labels = list(rt.pet("lora-cls").labels)
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": t, "label": labels[j % len(labels)]}) + "\n"
                           for j, t in enumerate(texts[:16])))
    r = CliRunner().invoke(main, ["levels", "profile", str(store), "lora-cls", "--dev", str(dev), "--device", "cpu",
                                  "--json", "--assurance", "0"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    with hkstore.open(store) as st:
        full_created = st.get_full("lora-cls").meta["created"]
    assert (rec["profile"]["top"], rec["profile"]["full_created"]) == ("full", full_created)
    rt.refresh()
    pet = rt.pet("lora-cls")
    assert policy_of(pet, None, rt.full("lora-cls", pet))[0] == "auto"
    human = CliRunner().invoke(main, ["levels", "profile", str(store), "lora-cls", "--dev", str(dev), "--device", "cpu",
                                      "--assurance", "0"])
    assert human.exit_code == 0 and "level 2 is full" in human.output
    # the tenant's top changes (its full-depth PET removed): the record is stale, auto serves as fast
    with hkstore.open(store, writable=True) as st:
        st.delete_full("lora-cls")
    rt.refresh()
    pet = rt.pet("lora-cls")
    assert rt.full("lora-cls", pet) is None and policy_of(pet, None, None) == ("fast", None)
    assert rt.infer([{"tenant": "lora-cls", "text": texts[0]}])[0].level_name == "plot"
    put_full_pet(store, "lora-cls", seed=0)  # leave the module's store as it was
    rt.refresh()


def test_the_cascade_on_the_emulated_gpu_executor_equals_the_cpu_one(full_store):
    """The engine's plans for tenants with and without a full-depth PET (exact, fast, the
    coverage gate, re-routes with words pruned) computed by the GPU executor (its kernels on the
    CUDA-on-CPU emulation) answer as the CPU executor's."""
    import dataclasses

    from runtime.exec.emu.module import compiler_missing_reason

    if compiler_missing_reason() is not None:
        pytest.skip(f"CUDA emulation unavailable: {compiler_missing_reason()}")
    from runtime.construct import manager
    from runtime.exec import ops_gpu
    from runtime.exec.context import ContextInputs
    from runtime.exec.emu import cupy_standin
    from runtime.exec.gpu import GpuExecutor
    from runtime.model import pet as petlib

    _, rt, texts = full_store
    tenants = ("lora-cls", "bitfit-tag", "adapter-cls")
    requests = [{"tenant": tenants[j % 3], "text": texts[j], "policy": ("exact", "fast", "auto")[min(j, 2)]}
                for j in range(9)]
    pruning = dict(REROUTE, alpha=0.9)
    _, asks = rt._asks([dict(r, policy="fast" if r["policy"] == "auto" else r["policy"]) for r in requests])
    asks = [dataclasses.replace(a, policy="auto", chosen=pruning if j % 2 else GATED) if r["policy"] == "auto" else a
            for j, (a, r) in enumerate(zip(asks, requests))]
    with ops_gpu.use_cupy(cupy_standin):
        gpu = GpuExecutor(rt.encoder, _cupy=cupy_standin, _ops=ops_gpu, hot_tier_rows=0, max_batch=16, max_len=48,
                          context=ContextInputs(rt.store, rt.encoder))

        def on_gpu(served, stored):
            """The GPU executor's copy of a ServingPet the runtime loaded (stored: the PET it decoded)."""
            if served is None:
                return None
            copy = gpu.load_pet(stored, key=served.key, token=served.token)
            copy.meta, copy.version = dict(served.meta), served.version
            return copy

        pets, fulls = {}, {}
        for a in asks:
            if a.tenant not in pets:
                pets[a.tenant] = on_gpu(a.pet, manager.load_tenant(rt.store, a.tenant, rt.encoder)[1])
                record = rt.store.get_full(a.tenant)
                stored = petlib.load_pet(rt.encoder, record.tensors, petlib.pet_meta(record.meta))
                fulls[a.tenant] = on_gpu(a.full, stored)
        answers = {}
        for name, ex, these in (("cpu", rt.executor, asks),
                                ("gpu", gpu, [dataclasses.replace(a, pet=pets[a.tenant], full=fulls[a.tenant])
                                              for a in asks])):
            engine = Engine(ex, rt.store.snapshot, max_batch=16, pipeline=False)
            try:
                answers[name] = engine.serve(these)
            finally:
                engine.close()
    names = [a.level_name for a in answers["cpu"]]
    assert {"full", "exact", "plot"} <= set(names)
    assert any(a.pruned and a.level_name == "full" for a in answers["cpu"])  # a re-route to the full-depth PET
    for c, g in zip(answers["cpu"], answers["gpu"]):
        assert (g.level, g.level_name, g.pruned) == (c.level, c.level_name, c.pruned)
        np.testing.assert_allclose(g.logits, c.logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g.probs, c.probs, rtol=1e-4, atol=1e-5)


# -- students first: level 1 from the tenant's students ------------------------------------------------

GROUP = SimpleNamespace(meta={"version": "v1", "created": 5.0, "task": "classification"}, size=2)


def _students_first(c, k=1000.0, w=0.0, created=5.0):
    """A students-first policy profiled on GROUP (created), its PLOT-first fallback re-routing everything."""
    return {"level1": "students", "students": 2, "students_created": created, "c": c, "k": k, "alpha": 0.0, "w": w,
            "gate": 0.0, "plot": dict(REROUTE, level1="plot")}


def _served_ask(pet, full=None, students=None):
    """An auto ask as runtime.serving builds it: the policy its students let it follow."""
    from runtime.level.serve import follow

    name, chosen = policy_of(pet, None, full)
    chosen = follow(chosen, students)
    return Ask("t", [101, 7, 8, 9, 102], None, pet, name if chosen else "fast", chosen, students, full)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.0, 1.01), st.sampled_from([10.0, 1000.0]), st.sampled_from([0.0, 0.5]), st.booleans(),
       st.booleans())
def test_auto_answers_confident_queries_from_the_students_and_reroutes_the_rest(c, k, w, has_full, burst):
    """A students-first tenant: its students answer (the profiled k, no gate, no attention); the
    dispatcher sends exactly the answers Eq. 4 draws up to the top, ensembled with weight w;
    under a burst they all stay with the students."""
    from runtime.level import dispatch
    from runtime.student.serve import Students

    full = _full() if has_full else None
    top = "full" if has_full else "context"
    fake = Fake()
    engine = _engine(fake, overload_s=0.5)
    engine.load.wait = 2.0 if burst else 0.0
    pet = _pet(_students_first(c, k, w), "full" if has_full else "exact", full_created=7.0)
    try:
        answer, = engine.serve([_served_ask(pet, full, Students(GROUP, 2))])
    finally:
        engine.close()
    first = fake.batches[0][0]
    assert (first.source, first.k, first.gate, first.attention, first.group) == ("students", 2, 0.0, False, GROUP)
    p_students = _softmax(LOGITS["students"])
    up = not burst and dispatch.reroute("t", [101, 7, 8, 9, 102], p_students.max(), c, k)
    assert [[r.source for r in b] for b in fake.batches] == [["students"]] + ([[top]] if up else [])
    if up:
        assert (answer.level, answer.level_name, answer.students) == (2, "full" if has_full else "exact", 0)
        np.testing.assert_allclose(answer.probs, w * p_students + (1 - w) * _softmax(LOGITS[top]), rtol=1e-5)
    else:
        assert (answer.level, answer.level_name, answer.students) == (1, "students", 2)
        np.testing.assert_allclose(answer.probs, p_students, rtol=1e-5)


def test_stale_or_other_students_are_never_used_and_the_plot_first_fallback_is_followed():
    """Students-first needs the students it was profiled on: with none servable (stale,
    unfinished: runtime.student.serve gives no Students record), other ones, or a request for
    the teacher, the record's PLOT-first policy serves (here: re-route everything)."""
    from runtime.student.serve import Students

    pet = _pet(_students_first(c=0.0))  # students-first would never re-route
    fake = Fake()
    engine = _engine(fake)
    other = SimpleNamespace(meta=dict(GROUP.meta, created=6.0), size=2)  # distilled again since
    try:
        for students in (None, Students(other, 2)):
            fake.batches.clear()
            ask = _served_ask(pet, None, students)
            assert ask.chosen == dict(REROUTE, level1="plot")
            answer, = engine.serve([ask])
            assert [[r.source for r in b] for b in fake.batches] == [["plot"], ["context"]]
            assert answer.level_name == "exact"
        fake.batches.clear()  # the profiled students, pinned to one: answered by it, never re-routed
        pinned, = engine.serve([_served_ask(pet, None, Students(GROUP, 2, asked=1))])
        assert [[(r.source, r.k) for r in b] for b in fake.batches] == [[("students", 1)]]
        assert (pinned.level_name, pinned.students) == ("students", 1)
    finally:
        engine.close()
    no_fallback = _pet({k: v for k, v in _students_first(c=0.0).items() if k != "plot"})
    ask = _served_ask(no_fallback, None, None)
    assert (ask.policy, ask.chosen) == ("fast", None)


def test_an_old_record_without_level1_means_plot():
    from runtime.level.serve import follow, level1
    from runtime.student.serve import Students

    students = Students(GROUP, 2)
    assert level1(REROUTE) == "plot" and level1(None) == "plot" and follow(REROUTE, students) == REROUTE
    row = _row(_served_ask(_pet(REROUTE), None, students), "teacher")
    assert (row.source, row.k) == ("plot", 0)  # the tenant has students; its record starts from the PLOT
    fake = Fake()
    engine = _engine(fake)
    try:
        answer, = engine.serve([_served_ask(_pet(REROUTE), None, students)])
    finally:
        engine.close()
    assert [[r.source for r in b] for b in fake.batches] == [["plot"], ["context"]] and answer.level_name == "exact"


def test_profiling_runs_the_students_level_as_rows_it_routes_itself():
    engine = Recording()
    queries = [([101, 5, 6, 102], None), ([101, 7, 102], None), ([101, 8, 102], None)]
    saved = profile.collect(engine, _pet(), queries, alphas=[0.0], n=N, batch=2, students=(GROUP, 2))
    students = [r for r in engine.rows if r.source == "students"]
    assert [(r.ids, r.k, r.group, r.version) for r in students] == [(ids, 2, GROUP, "v1") for ids, _ in queries]
    assert [r.source for r in engine.rows[:3]] == ["plot", "plot", "students"]  # interleaved, chunk by chunk
    assert saved.group == {"k": 2, "created": 5.0} and "students" in saved.seconds
    for z in saved.students:
        np.testing.assert_allclose(z, LOGITS["students"])
    assert profile.collect(Recording(), _pet(), queries, alphas=[0.0], n=N).students is None
