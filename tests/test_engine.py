"""The engine (runtime.engine): the calls from infer to the executor, and a mixed batch answering
every request as it would be answered alone, whatever its tenant, level and students.

The store of the property test is tests/test_student_serve.py's (tenants "cls" and "tag" with
two students each, "plain" without), copied, with Tabi levels records so that policy auto
routes: "cls" gates on coverage and never re-routes on confidence, "tag" re-routes every
answer, its words pruned by level 1's attention.
"""

import pathlib
import shutil
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from test_runtime import requests_for, shared_tiny_store
from test_student_serve import env, short_texts  # noqa: F401 - env: the store with students

RUNTIME = pathlib.Path(runtime.__file__).resolve().parent


def _runtime_calls(stack, last_name):
    """The functions of runtime/ on a stack, outermost first, up to the one named last_name."""
    names = [f"{pathlib.Path(f.filename).stem}.{f.name}" for f in stack
             if pathlib.Path(f.filename).resolve().is_relative_to(RUNTIME)]
    return names[:names.index(last_name) + 1]


def test_four_calls_and_one_queue_from_infer_to_compute():
    """runtime.infer -> Runtime.infer -> Engine.serve -> Engine.submit, the queue, then
    Engine._compute_loop -> executor.compute: four calls (runtime.engine's doc)."""
    from runtime.sched.load import LoadMeter

    stacks = {}

    class SpyMeter(LoadMeter):
        def arrived(self, tokens, now):
            stacks.setdefault("queue", traceback.extract_stack()[:-1])
            super().arrived(tokens, now)

    tiny = shared_tiny_store()
    with runtime.open(tiny[0], device="cpu", max_len=48) as rt:
        real = rt.engine.executor

        class Spy:
            gather, prepare = real.gather, real.prepare

            def compute(self, prepared):
                stacks.setdefault("compute", traceback.extract_stack()[:-1])
                return real.compute(prepared)

        rt.engine.executor, rt.engine.load = Spy(), SpyMeter()
        results = rt.infer(requests_for(tiny, 6))
    assert len(results) == 6
    caller = _runtime_calls(stacks["queue"], "engine.submit")
    worker = _runtime_calls(stacks["compute"], "engine._compute_loop")
    assert caller == ["serving.infer", "engine.serve", "engine.submit"]
    assert worker == ["engine._compute_loop"]
    # runtime.infer -> Runtime.infer, the caller's two, the worker's loop -> compute
    assert 1 + (len(caller) - 1) + len(worker) == 4


@pytest.fixture(scope="module")
def mixed_store(env, tmp_path_factory):  # noqa: F811
    from runtime.level import profile

    store = str(tmp_path_factory.mktemp("engine") / "store")
    shutil.copytree(env["store"], store)
    profile.save(store, "cls", {"levels": [1, 2], "temperature": {"1": 1.2, "2": 0.9},
                                "policy": {"c": 0.0, "k": 100.0, "alpha": 0.0, "w": 0.0, "gate": 0.85}})
    profile.save(store, "tag", {"levels": [1, 2], "temperature": {"1": 1.0, "2": 1.1},
                                "policy": {"c": 1.01, "k": 100.0, "alpha": 0.9, "w": 0.3, "gate": 0.0}})
    with runtime.open(store, device="cpu", max_len=32) as rt:
        yield rt, short_texts(env)


def _requests():
    """A request of any tenant at any policy; tenants with students pinned to 0, 1 or 2 of them
    (the pruning policy's own choice depends on the load, which differs between the two runs)."""
    def one(tenant, text, policy, k):
        request = {"tenant": tenant, "text": text}
        if policy is not None:
            request["policy"] = policy
        if tenant != "plain":
            request["students"] = 0 if policy == "exact" else k
        return request

    return st.builds(one, st.sampled_from(["cls", "tag", "plain"]), st.integers(0, 11),
                     st.sampled_from([None, "fast", "auto", "exact"]), st.integers(0, 2))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_requests(), min_size=2, max_size=8))
def test_a_mixed_batch_answers_each_request_as_alone(mixed_store, requests):
    rt, texts = mixed_store
    requests = [dict(r, text=texts[r["text"] % len(texts)]) for r in requests]
    together = rt.infer(requests)
    for request, got in zip(requests, together):
        (alone,) = rt.infer([request])
        assert (got.level, got.students, got.pruned, got.label, got.tags) == \
            (alone.level, alone.students, alone.pruned, alone.label, alone.tags), request
        np.testing.assert_allclose(got.logits, alone.logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.probabilities, alone.probabilities, rtol=1e-4, atol=1e-5)


def test_the_mixed_store_routes_every_way(mixed_store):
    """The property test's store reaches every route: students, level 1, the coverage gate's
    level 2, exact, and re-routed answers with pruned words."""
    rt, texts = mixed_store
    gated = [{"tenant": "cls", "text": t, "policy": "auto", "students": 0} for t in texts[:8]]
    requests = gated + [{"tenant": "tag", "text": t, "policy": "auto", "students": 0} for t in texts[:8]] + \
        [{"tenant": "tag", "text": texts[0], "students": 2}]
    got = rt.infer(requests)
    cls, tag, students = got[:8], got[8:16], got[16]
    assert {r.level for r in cls} == {1, 2}  # the gate sent some to level 2, in the same batch
    assert {r.level for r in tag} == {2} and any(r.pruned for r in tag)  # re-routed, words pruned
    assert students.students == 2 and students.level == 1
    # plot rows the gate sent to level 2 read the full-context lower layers, as policy exact does,
    # in a batch of gated rows alone too (every row of its plan was a plot row when it was looked up)
    exact = rt.infer([dict(q, policy="exact") for q in gated])
    fast = rt.infer([dict(q, policy="fast") for q in gated])
    for r, e, f in zip(cls + rt.infer(gated), exact + exact, fast + fast):
        np.testing.assert_allclose(r.logits, (e if r.level == 2 else f).logits, rtol=1e-4, atol=1e-4)
