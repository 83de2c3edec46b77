"""Students served through the runtime (issue 18): runtime.open(store).infer and hkstore serve.

The store is the tiny one of tests/test_manager.py with three tenants: "cls" (classification)
and "tag" (tagging) with two students each, "plain" without students.
"""

import os
import time

import numpy as np
import pytest
import torch

import hkstore
import runtime
from runtime.construct import manager
from runtime.model.tiny import make_tiny_model
from runtime.model import student as model
from runtime.sched.load import Load, LoadMeter
from runtime.student.build import students_create
from runtime.student.record import load_group
from runtime.student.serve import Students, StudentServing
from tests.test_manager import make_data


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("student-serve"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, chunk=200,
                  progress=False)
    for name, path, task in (("cls", data["cls"], "classification"), ("tag", data["tag"], "tagging"),
                             ("plain", data["cls"], "classification")):
        manager.tenant_create(data["store"], name, version="root", train_path=path, task=task, epochs=1,
                              levels=("plot",), progress=False,  # the exact level is their top
                              precision="fp32")  # served fp32: answers compare exactly across batches
    for name, path in (("cls", data["cls"]), ("tag", data["tag"])):
        # min_gain < 0 keeps both students whatever the validation says: every k is servable
        students_create(data["store"], name, dev_path=path, students=2, epochs=1, lr=1e-3, min_gain=-1.0,
                        head_epochs=2, progress=False)
    return data


def reference_logits(store_path, tenant, ids, k):
    """The first k students' logits by the loop over students (model.ensemble), one request alone."""
    from runtime.plot.retrieve import retrieve

    with hkstore.open(store_path) as store:
        snap = store.snapshot()
        group = load_group(snap, tenant, snap.meta["d"])
        x, mask, _ = retrieve(snap, group.meta["version"], [ids])
        with torch.no_grad():
            return model.head(group, model.ensemble(group, x, mask, k))[0].numpy()


def short_texts(env, max_len=32):
    with hkstore.open(env["store"]) as store:
        from runtime.model.stored import base_encoder

        tok = base_encoder(store).tokenizer
    return [t for t in env["texts"] if len(tok.encode(t).ids) <= max_len]


@pytest.mark.parametrize("k", [1, 2])
def test_infer_with_k_students_equals_the_reference_and_the_engine(env, k):
    from benchmarks.student_engine import StudentEngine

    texts = short_texts(env)[:6]
    requests = [{"tenant": t, "text": x, "students": k} for x in texts for t in ("cls", "tag")]
    requests += [{"tenant": "plain", "text": texts[0]}, {"tenant": "cls", "text": texts[1], "students": 0}]
    with runtime.open(env["store"], device="cpu", max_len=32) as rt:
        results = rt.infer(requests)
        teacher = rt.infer([{"tenant": "cls", "text": texts[1], "policy": "fast"}])[0]
        ids = [rt.encoder.tokenizer.encode(r["text"]).ids for r in requests]
    assert [r.students for r in results] == [k] * (2 * len(texts)) + [0, 0]
    for r, q, s in zip(results, requests, ids):
        if q.get("students"):
            ref = reference_logits(env["store"], q["tenant"], s, k)
            np.testing.assert_allclose(r.logits, ref, rtol=1e-4, atol=1e-4)
    # students=0 is the teacher's answer, as a request of a tenant without students gets
    np.testing.assert_allclose(results[-1].logits, teacher.logits, rtol=1e-5, atol=1e-5)
    # the engine (its own loop, same k) predicts what the runtime answered
    with StudentEngine(env["store"], ["cls", "tag"], mode=k) as engine:
        best = engine.best
        batch = [type("W", (), {"tenant": q["tenant"], "ids": s})() for q, s in zip(requests, ids) if q.get("students")]
        predicted = engine.compute(batch, k)
    for r, w, p in zip([r for r, q in zip(results, requests) if q.get("students")], batch, predicted):
        if k <= best[w.tenant]:  # the engine gives a group at most its best k
            assert np.asarray(r.logits).argmax(-1).tolist() == p


def test_bad_students_requests_are_refused_with_the_reason(env):
    with runtime.open(env["store"], device="cpu", max_len=32) as rt:
        text = env["texts"][0]
        for request, reason in (({"tenant": "plain", "students": 1}, "has no students"),
                                ({"tenant": "cls", "students": 3}, "has 2 students, 3"),
                                ({"tenant": "cls", "students": -1}, "whole number"),
                                ({"tenant": "cls", "students": "2"}, "whole number"),
                                ({"tenant": "cls", "students": 1, "policy": "exact"}, "not at policy exact")):
            with pytest.raises(runtime.BadRequest, match=reason):
                rt.infer([dict(request, text=text)])
        assert rt.infer([{"tenant": "plain", "text": text, "students": 0}])[0].students == 0


def test_under_policy_auto_students_answer_a_burst_and_tabi_the_rest(env, tmp_path):
    """A tenant profiled for Tabi (auto by default) keeps its students: pinned or under load
    they answer (never re-routed); otherwise the teacher answers as the dispatcher says."""
    import shutil

    from runtime.level import profile

    store = str(tmp_path / "store")
    shutil.copytree(env["store"], store)
    profile.save(store, "cls", {"levels": [1, 2], "temperature": {"1": 1.0, "2": 1.0},  # re-route every answer
                                "policy": {"c": 1.01, "k": 100.0, "alpha": 0.0, "w": 0.0, "gate": 0.0}})
    texts = short_texts(env)[:4]
    with runtime.open(store, device="cpu", max_len=32) as rt:
        pinned = rt.infer([{"tenant": "cls", "text": x, "students": 1} for x in texts])
        idle = rt.infer([{"tenant": "cls", "text": x} for x in texts])  # no cost measured yet: the teacher
        exact = rt.infer([{"tenant": "cls", "text": x, "policy": "exact"} for x in texts])
        rt.students.policy.target_s = 0.0  # no level holds the target: the cheapest answers
        levels = rt.students.policy.levels  # the teacher, then fewer and fewer students: cheaper each
        rt.students.policy.cost.update({level: 1e-3 / (j + 1) for j, level in enumerate(levels)})
        burst = rt.infer([{"tenant": "cls", "text": x} for x in texts])
        ids = [rt.encoder.tokenizer.encode(x).ids for x in texts]
    for p, i in zip(pinned, ids):
        assert (p.students, p.level, p.pruned) == (1, 1, 0)
        np.testing.assert_allclose(p.logits, reference_logits(store, "cls", i, 1), rtol=1e-4, atol=1e-4)
    for a, e in zip(idle, exact):  # the teacher under auto: Tabi re-routed it to level 2
        assert (a.students, a.level) == (0, 2)
        np.testing.assert_allclose(a.probabilities, e.probabilities, atol=1e-5)
    for b, p in zip(burst, pinned):
        assert (b.students, b.level) == (1, 1)
        np.testing.assert_allclose(b.logits, p.logits, rtol=1e-5, atol=1e-5)


# -- the policy under a simulated queue (unit) ----------------------------------------------------


def test_the_policy_prices_a_batch_as_a_fixed_part_plus_its_tokens():
    """Small batches are mostly fixed cost: at low load the teacher must not look dearer per
    token than it is at the margin (the average of 1-3 request batches priced it at 2-5x)."""
    from runtime.student.policy import PruningPolicy

    policy = PruningPolicy(["teacher", 1], target_s=1.0)
    for n in (10, 40, 20, 30, 10, 40):  # the teacher: 10 ms a batch + 0.2 ms a token
        policy.observe("teacher", n, 0.010 + 2e-4 * n)
    policy.observe(1, 20, 0.004)
    assert policy.cost["teacher"] == pytest.approx(2e-4, rel=1e-6)
    assert policy.fixed["teacher"] == pytest.approx(0.010, rel=1e-6)
    # 1,500 tokens/s: at the average cost of a 10-token batch (1.2 ms/token) it could not keep up,
    # in full 40-token batches (0.45 ms/token) it can; at 2,000 tokens/s not even those can
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.0, rate=1500.0) == "teacher"
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.0, rate=2000.0) == 1
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.995, rate=1500.0) == 1  # its fixed part misses the target
    for _ in range(20):  # then only full batches, twice as slow: what it predicts for one follows
        policy.observe("teacher", 40, 2 * (0.010 + 2e-4 * 40))
    assert policy.fixed["teacher"] + 40 * policy.cost["teacher"] == pytest.approx(0.036, rel=1e-3)


def test_the_policy_gives_fewer_students_as_the_queue_grows_and_the_full_group_when_it_drains(env):
    with hkstore.open(env["store"]) as store:
        snap = store.snapshot()
        serving = StudentServing(snap.meta["d"], target_s=0.5)
        pet_meta = snap.read_pet("cls").meta
        group, why = serving.group(snap, "cls", pet_meta)
    assert why is None and group.size == 2
    group.meta["best_k"] = 2
    serving.policy.levels = ["teacher", 2, 1]
    serving.policy.cost.update({"teacher": 1e-3, 2: 4e-4, 1: 2e-4})  # seconds per padded token

    def served(queued_tokens, rate, wait=0.0):
        asks = [Students(group, 2)] * 4 + [Students(group, 2, asked=1)]
        chosen = serving.choose(Load(queued_tokens // 10, queued_tokens, wait, rate, 0.0))
        assert asks[-1].k(chosen) == 1  # a pinned request keeps its k whatever the load
        return chosen, {a.k(chosen) for a in asks[:-1]}

    assert served(40, 0.0) == ("teacher", {0})  # idle: the teacher answers
    assert served(1000, 0.0) == (2, {2})  # 1000 tokens x 1 ms > 0.5 s: the full group
    assert served(2000, 0.0) == (1, {1})  # more queued: one student
    assert served(100, 3000.0) == (1, {1})  # arrivals 3000 tok/s: only k=1 keeps up (0.6 < 0.8)
    assert served(40, 10.0) == ("teacher", {0})  # the burst passed: the teacher again
    serving.observe(1, [10, 10], 0.02)  # 20 padded tokens in 20 ms: k=1 costs more now
    assert serving.policy.cost[1] > 2e-4


def test_the_engine_measures_the_queue_and_the_arrivals_for_its_routing():
    from types import SimpleNamespace

    from runtime.engine import Ask, Engine
    from runtime.exec.rows import Gathered, Prepared

    class Echo:
        def gather(self, snapshot, rows):
            return Gathered([], None, [None] * len(rows))

        def prepare(self, gathered, rows):
            return Prepared(rows)

        def compute(self, prepared):
            return [np.zeros(1) for _ in prepared.rows]

    class Recorder:  # the students' serving, as the engine sees it
        def __init__(self):
            self.loads, self.observed = [], []

        def choose(self, load):
            self.loads.append(load)
            return len(self.loads)

        def observe(self, level, lengths, seconds):
            self.observed.append((level, len(lengths)))

    rec = Recorder()
    pet = SimpleNamespace(meta={}, task="classification", version="root")
    group = SimpleNamespace(meta={"version": "root"})
    engine = Engine(Echo(), lambda: None, max_batch=3, pipeline=False, batching="fifo", students=rec)
    try:
        answers = engine.serve([Ask("t", list(range(5)), None, pet, "fast", None, Students(group, 3))
                                for _ in range(7)])
    finally:
        engine.close()
    # one submit of 7 asks: batches of 3, 3, 1; each sees what is still queued, its own included
    assert [ld.queued for ld in rec.loads] == [7, 4, 1] and [ld.queued_tokens for ld in rec.loads] == [35, 20, 5]
    assert all(ld.arrival_rate == 35.0 for ld in rec.loads)  # 35 tokens in the last second
    assert rec.observed == [(1, 3), (2, 3), (3, 1)]
    assert [a.students for a in answers] == [1, 1, 1, 2, 2, 2, 3]  # the level chosen for each batch
    meter = LoadMeter(window_s=1.0)
    meter.arrived([4, 6], now=0.0)
    meter.arrived([5], now=0.9)
    assert meter.take([4, 6], oldest=0.0, now=1.5) == Load(3, 15, 1.5, 5.0, 1.5)  # the first arrivals aged out


def test_the_servers_texts_wait_in_the_engines_queue(env):
    """hkstore serve submits its texts to the engine's one queue: the load the routing reads
    counts them (requests and tokens), a text whose caller gives up leaves it, and a request
    that would overfill it is refused before anything is queued."""
    import asyncio

    from runtime.serve.dispatcher import Dispatcher
    from runtime.serve.metrics import Metrics

    texts = short_texts(env)[:5]
    # batches wait 30 s for company: nothing runs while the test reads the queue
    with runtime.open(env["store"], device="cpu", max_wait_s=30.0) as rt:
        tokens = [len(ids) for ids in rt.encoder.tokenize(texts, max_len=rt.max_len)]

        def queued():
            now = time.perf_counter()
            load = rt.engine.load.take([], oldest=now, now=now)
            return load.queued, load.queued_tokens

        async def offer_and_read():
            d = Dispatcher(rt, Metrics(None), queue_limit=8)
            first = await d.offer("cls", texts[:3])
            rest = await d.offer("tag", texts[3:])
            assert d.depth == 5 and queued() == (5, sum(tokens))
            d.drop(first[:2])
            assert d.depth == 3 and queued() == (3, sum(tokens[2:]))
            assert await d.offer("cls", texts + texts[:1]) is None  # 3 + 6 > 8: refused, nothing queued
            assert d.depth == 3
            d.drop(first[2:] + rest)
            assert d.depth == 0 and queued() == (0, 0)
            await d.stop()

        asyncio.run(offer_and_read())


# -- over HTTP ------------------------------------------------------------------------------------


def test_students_over_http(env, tmp_path):
    from test_serve import ADMIN, Server, auth

    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN + "\n")
    server = Server(env["store"], str(token_file))
    try:
        text = short_texts(env)[0]

        def post(tenant, **body):
            return server.client.post(f"/v1/tenants/{tenant}/infer", json={"text": text, **body}, headers=auth(ADMIN))

        answers = {k: post("tag", students=k) for k in (0, 1, 2)}
        for r in answers.values():
            assert r.status_code == 200, r.text
        assert {k: r.json()["results"][0]["students"] for k, r in answers.items()} == {0: 0, 1: 1, 2: 2}
        assert post("plain").json()["results"][0]["students"] == 0  # no students: the teacher, and it says so
        idle = post("cls").json()["results"][0]  # idle server: the policy lets the teacher answer
        assert idle["students"] == 0
        for body, reason in (({"students": 1}, "has no students"), ({"students": -1}, "greater than or equal")):
            bad = post("plain", **body)
            assert bad.status_code == 422 and reason in bad.text, bad.text
        bad = post("cls", students=5)
        assert bad.status_code == 422 and "has 2 students" in bad.text
        schema = server.client.get("/openapi.json").json()["components"]["schemas"]
        assert "students" in schema["InferBody"]["properties"] and "students" in schema["InferResult"]["properties"]
    finally:
        server.stop()


# -- staleness ------------------------------------------------------------------------------------


def test_students_of_an_updated_pet_are_stale_until_distilled_again(env):
    import json

    from click.testing import CliRunner

    from tools.cli import main

    store, text = env["store"], short_texts(env)[0]
    manager.tenant_create(store, "upd", version="root", train_path=env["cls"], epochs=1, progress=False)
    students_create(store, "upd", dev_path=env["cls"], students=1, epochs=1, lr=1e-3, min_gain=-1.0, head_epochs=1,
                    progress=False)
    cli = CliRunner().invoke

    def states():
        packs = json.loads(cli(main, ["pack", "ls", store, "--json"]).output)
        listed = json.loads(cli(main, ["students", "ls", store, "--json"]).output)["tenants"]
        return ({r["tenant"]: r["state"] for r in packs if r["pet_type"] == "students"},
                {r["tenant"]: r["state"] for r in listed})

    assert states()[0]["upd"] == states()[1]["upd"] == "ready"
    with runtime.open(store, device="cpu", max_len=32) as rt:
        assert rt.infer([{"tenant": "upd", "text": text, "students": 1}])[0].students == 1
        updated = manager.tenant_update(store, "upd", epochs=1, progress=False)
        assert "stale" in updated["students"]
        rt.refresh()
        assert states()[0]["upd"] == states()[1]["upd"] == "stale"
        with pytest.raises(runtime.BadRequest, match="stale"):
            rt.infer([{"tenant": "upd", "text": text, "students": 1}])
        snap = rt.store.snapshot()
        assert rt.students.ask(snap, "upd", rt.pet("upd").meta, None, "fast") is None  # the policy never gets it
        assert rt.infer([{"tenant": "upd", "text": text}])[0].students == 0
        # distilled again with the stored settings (no --dev): served again
        again = cli(main, ["students", "create", store, "upd", "-q", "--json"])
        assert again.exit_code == 0, again.output
        assert states()[0]["upd"] == "ready"
        rt.refresh()
        assert rt.infer([{"tenant": "upd", "text": text, "students": 1}])[0].students == 1
    bad = cli(main, ["students", "create", store, "plain", "-q"])
    assert bad.exit_code == 1 and "--dev is needed" in bad.output and len(bad.output.strip().splitlines()) == 1


# -- students first: profiling chooses the cascade's level 1 ----------------------------------------


def _profile(store, tenant, dev, target, seconds, monkeypatch, as_json=True):
    """hkstore levels profile --json with each level's measured seconds set to `seconds` (per
    row, by its source): the costs are the test's, the outputs the tenant's own."""
    import json

    from click.testing import CliRunner

    from runtime.level import profile
    from tools.cli import main

    monkeypatch.setattr(profile, "_timed", lambda engine, rows: (engine.run(rows), seconds[rows[0].source] * len(rows)))
    r = CliRunner().invoke(main, ["levels", "profile", store, tenant, "--dev", dev, "--device", "cpu",
                                  "--assurance", "0", "--target", str(target)] + (["--json"] if as_json else []))
    assert r.exit_code == 0, r.output
    return json.loads(r.output) if as_json else r.output


def _auto_against_the_levels_alone(rt, tenant, texts, policy):
    """Each auto answer against its level alone: the students' (pinned to the policy's k) where
    Eq. 4 keeps it, else the ensemble of theirs and the top's (policy exact)."""
    from runtime.level import dispatch

    auto = rt.infer([{"tenant": tenant, "text": x} for x in texts])
    alone = rt.infer([{"tenant": tenant, "text": x, "students": policy["students"]} for x in texts])
    exact = rt.infer([{"tenant": tenant, "text": x, "policy": "exact"} for x in texts])
    ids = [rt.encoder.tokenizer.encode(x).ids for x in texts]
    for a, s, e, i in zip(auto, alone, exact, ids):
        if dispatch.reroute(tenant, i, s.confidence, policy["c"], policy["k"]):
            assert (a.level_name, a.students) == ("exact", 0)
            np.testing.assert_allclose(a.probabilities, policy["w"] * np.asarray(s.probabilities)
                                       + (1 - policy["w"]) * np.asarray(e.probabilities), atol=1e-5)
        else:
            assert (a.level_name, a.students) == ("students", policy["students"])
            np.testing.assert_allclose(a.logits, s.logits, rtol=1e-5, atol=1e-5)
    return [a.level_name for a in auto]


@pytest.mark.parametrize("tenant", ["cls", "tag"])
def test_a_profiled_tenant_with_students_serves_auto_from_the_level_1_it_chose(env, tmp_path, monkeypatch, tenant):
    """Students cheaper than the PLOT: the profile starts the cascade from them, auto answers
    from them where they are sure and from the top elsewhere; students dearer: from the PLOT,
    never the students. Distilled again, the students the record was profiled on are gone: the
    PLOT-first fallback serves."""
    import shutil

    from runtime.level import profile

    store = str(tmp_path / "store")
    shutil.copytree(env["store"], store)
    dev = env["cls"] if tenant == "cls" else env["tag"]
    texts = short_texts(env)[:8]
    with hkstore.open(store) as st:
        group = st.snapshot().read_students(tenant).meta
    cheap = {"plot": 0.6, "students": 0.2, "context": 1.0, "full": 1.0}
    rec = _profile(store, tenant, dev, 100.0, cheap, monkeypatch)  # any cascade meets it: the cheapest wins
    policy = rec["policy"]
    assert (policy["level1"], policy["students"], policy["gate"], policy["alpha"]) == \
        ("students", int(group.get("best_k") or group["students"]), 0.0, 0.0)
    assert policy["students_created"] == group["created"] and policy["plot"]["level1"] == "plot"
    assert rec["profile"]["students_cost"] == pytest.approx(0.2) and rec["profile"]["level1_cost"] == pytest.approx(0.6)
    assert rec["profile"]["expected_cost"] < 0.5
    human = _profile(store, tenant, dev, 100.0, cheap, monkeypatch, as_json=False)
    assert f"level 1 students ({policy['students']} student" in human
    assert "at cost 0.20" in human and "at cost 0.60" in human  # the students' level and the PLOT's, alone
    with runtime.open(store, device="cpu", max_len=32) as rt:
        names = _auto_against_the_levels_alone(rt, tenant, texts, policy)
        assert set(names) <= {"students", "exact"} and "students" in names
        # the same record cut at the students' median confidence: half of the answers go up
        sure = sorted(a.confidence for a in rt.infer([{"tenant": tenant, "text": x, "students": policy["students"]}
                                                       for x in texts]))
        cut = dict(policy, c=sure[len(sure) // 2], k=1000.0, w=0.25)
        profile.save(store, tenant, dict(rec, policy=cut))
        rt.refresh()
        names = _auto_against_the_levels_alone(rt, tenant, texts, cut)
        assert 0 < names.count("exact") < len(names)
        dear = _profile(store, tenant, dev, 100.0, dict(cheap, students=0.9), monkeypatch)
        assert dear["policy"]["level1"] == "plot" and "students" not in dear["policy"]
        rt.refresh()
        auto = rt.infer([{"tenant": tenant, "text": x} for x in texts])
        fast = rt.infer([{"tenant": tenant, "text": x, "policy": "fast"} for x in texts])
        assert all(a.level_name == "plot" for a in auto)  # c = 0 at any target: the PLOT alone
        for a, f in zip(auto, fast):
            np.testing.assert_allclose(a.logits, f.logits, rtol=1e-5, atol=1e-5)
        rec = _profile(store, tenant, dev, 100.0, cheap, monkeypatch)
        students_create(store, tenant, dev_path=dev, students=2, epochs=1, lr=1e-3, min_gain=-1.0, head_epochs=1,
                        progress=False)
        rt.refresh()
        auto = rt.infer([{"tenant": tenant, "text": x} for x in texts])
        assert {a.level_name for a in auto} == {"plot"}  # the fallback: the cheapest PLOT-first policy
        assert rt.infer([{"tenant": tenant, "text": texts[0], "students": 1}])[0].students == 1  # the new ones serve


@pytest.mark.parametrize("tenant", ["cls", "tag"])
def test_students_under_the_emulated_gpu_executor_equal_the_cpu_ones(env, tenant):
    """The GPU executor (runtime.exec.students_gpu, the CUDA-on-CPU emulation) answers students
    rows as the CPU executor does, for every k."""
    from runtime.exec.emu.module import compiler_missing_reason

    if compiler_missing_reason() is not None:
        pytest.skip(f"CUDA emulation unavailable: {compiler_missing_reason()}")
    from runtime.engine import Engine
    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin
    from runtime.exec.gpu import GpuExecutor
    from runtime.exec.rows import Row

    texts = short_texts(env)[:5]
    with runtime.open(env["store"], device="cpu", max_len=32) as rt, ops_gpu.use_cupy(cupy_standin):
        snap = rt.store.snapshot()
        group = load_group(snap, tenant, snap.meta["d"])
        ids = [rt.encoder.tokenizer.encode(t).ids for t in texts]
        gpu = GpuExecutor(rt.encoder, _cupy=cupy_standin, _ops=ops_gpu, hot_tier_rows=0, max_batch=8, max_len=32)
        out = {}
        for name, ex in (("cpu", rt.executor), ("gpu", gpu)):
            engine = Engine(ex, rt.store.snapshot, max_batch=8, pipeline=False)
            try:
                for k in (1, 2):
                    rows = [Row(s, None, group.meta["version"], "students", group=group, k=k) for s in ids]
                    out[(name, k)] = [o.logits for o in engine.run(rows)]
            finally:
                engine.close()
        assert gpu.students is not None  # the students ran on the (emulated) device
        for k in (1, 2):
            for a, b in zip(out[("cpu", k)], out[("gpu", k)]):
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_the_policy_never_picks_a_level_dearer_than_a_more_accurate_one():
    """Two 2-layer students cost more than a 3-layer teacher (BENCHMARKS, session 12): when the
    teacher cannot hold the target, the answer is one student, never the dearer pair."""
    from runtime.student.policy import PruningPolicy

    policy = PruningPolicy(["teacher", 2, 1], target_s=0.5)
    for level, fixed, per_token in (("teacher", 0.02, 1.0e-4), (2, 0.0, 1.4e-4), (1, 0.0, 0.65e-4)):
        for n in (512, 2048):
            policy.observe(level, n, fixed + per_token * n)
    assert policy.choose(queued_tokens=100, oldest_wait_s=0.0, rate=1000.0) == "teacher"
    # the teacher's fixed part misses the target with this queue (0.502 s), the pair would drain
    # it in time (0.498 s) but is dearer per token in a full batch: one student
    assert policy.choose(queued_tokens=400, oldest_wait_s=0.442, rate=1000.0) == 1
    policy.levels = [2, 1]  # without the teacher above it, the pair is chosen for the same load
    assert policy.choose(queued_tokens=400, oldest_wait_s=0.442, rate=1000.0) == 2
    # nothing keeps up: the cheapest level answers, not the last in the list
    policy.levels = ["teacher", 2, 1]
    for _ in range(10):
        policy.observe(1, 2048, 0.5)
    assert policy.cost[1] + policy.fixed.get(1, 0.0) / 2048 > 1.1e-4
    assert policy.choose(queued_tokens=100, oldest_wait_s=0.0, rate=1e6) == "teacher"


def test_students_worse_than_the_plot_level_never_take_a_burst(env, tmp_path):
    """A tenant whose profile measured its students more than its target below its PLOT level
    keeps the PLOT level when the pruning policy hands a batch to students; a client's pin
    still reaches them, and a students-first cascade still starts from them."""
    import shutil

    from runtime.level import profile
    from runtime.student.serve import below_plot

    store = str(tmp_path / "store")
    shutil.copytree(env["store"], store)
    record = {"levels": [1, 2], "policy": {"level1": "plot", "c": 0.0, "k": 10.0, "alpha": 0.0, "w": 0.0, "gate": 0.0},
              "profile": {"target": 0.01, "level1_metric": 0.60, "students_metric": 0.30}}
    assert below_plot({"levels": record}) and not below_plot({})
    assert not below_plot({"levels": dict(record, profile={**record["profile"], "students_metric": 0.595})})
    assert not below_plot({"levels": dict(record, policy={"level1": "students"})})
    profile.save(store, "cls", record)
    with runtime.open(store, device="cpu", max_len=32) as rt:
        rt.students.policy.choose = lambda *a, **k: 1  # a burst: the policy hands every batch to one student
        texts = env["texts"][:4]
        burst = rt.infer([{"tenant": t, "text": x} for t in ("cls", "tag") for x in texts])
        assert [a.students for a in burst] == [0] * 4 + [1] * 4  # tag has no record: its students answer
        assert all(a.level_name == "plot" for a in burst[:4])
        assert rt.infer([{"tenant": "cls", "text": texts[0], "students": 1}])[0].students == 1


def test_a_level_shut_out_by_one_slow_batch_is_measured_again():
    """One slow students batch (a process-wide pause) priced them above the teacher, and the
    rule that skips a dearer, less accurate level kept them out for the rest of a burst: one
    batch moves an estimate at most so far, and a skipped level is measured again in time."""
    from runtime.student.policy import PruningPolicy

    policy = PruningPolicy(["teacher", 1], target_s=0.2, stale_s=1.0)
    for n in (512, 1024):
        policy.observe("teacher", n, 1e-4 * n, now=0.0)
        policy.observe(1, n, 0.4e-4 * n, now=0.0)
    burst = dict(queued_tokens=3000, oldest_wait_s=0.05, rate=5000.0)
    assert policy.choose(**burst, now=0.1) == 1
    policy.observe(1, 1024, 0.5, now=0.2)  # the pause counts as 3x the prediction: still cheaper
    assert policy.choose(**burst, now=0.3) == 1
    for _ in range(3):  # a real slowdown: 3x, then 9x, ... the estimate follows within batches
        policy.observe(1, 1024, 0.5, now=0.4)
    assert policy.choose(**burst, now=0.5) == "teacher"  # cheapest by the estimates
    assert policy.choose(**burst, now=1.3) == "teacher"
    assert policy.choose(**burst, now=1.5) == 1  # its estimate is 1.1 s old: measure it again
    for _ in range(10):
        policy.observe(1, 1024, 0.4e-4 * 1024, now=1.6)
    assert policy.choose(**burst, now=1.7) == 1  # back at its real price, it serves the burst


def test_the_policy_prices_arrivals_with_the_padding_batches_have_had():
    """Arrivals are counted in their requests' tokens, costs per padded token: at 1.6x padding
    the teacher keeps up with 1/1.6 of the tokens it would without padding."""
    from runtime.student.policy import PruningPolicy

    policy = PruningPolicy(["teacher", 1], target_s=1.0)
    for n in (1000, 2000):
        policy.observe("teacher", n, 1e-4 * n, tokens=n)  # no padding yet
        policy.observe(1, n, 0.3e-4 * n, tokens=n)
    assert policy.padding == pytest.approx(1.0)
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.0, rate=7000.0) == "teacher"  # 0.7 of its time
    for _ in range(30):
        policy.observe("teacher", 1600, 1e-4 * 1600, tokens=1000)
    assert policy.padding == pytest.approx(1.6, rel=1e-3)
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.0, rate=7000.0) == 1  # 1.12 of its time
    assert policy.choose(queued_tokens=10, oldest_wait_s=0.0, rate=4000.0) == "teacher"
