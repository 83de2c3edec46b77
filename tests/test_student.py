"""Student Parallelism (issue 18): the students' math, virtual stacking against the loop over
students, boosting, pruning, and construction over a tiny store end to end."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hkstore
from runtime.construct import manager
from runtime.model.tiny import make_tiny_model
from runtime.exec import students as stack
from runtime.model import student as model
from runtime.student import prune
from runtime.student.build import _record, students_create
from runtime.student.record import load_group
from runtime.student.train import (
    StudentConfig,
    boost,
    distance,
    student_outputs,
    teacher_states,
)
from tests.test_manager import make_data


def random_group(m, layers, d, heads, ffn, labels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    students = []
    for _ in range(m):
        w = {}
        for l in range(layers):
            for name, (o, i) in {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "ffn_in": (ffn, d),
                                 "ffn_out": (d, ffn)}.items():
                w[f"layers.{l}.{name}.weight"] = torch.randn(o, i, generator=g) / i ** 0.5
                w[f"layers.{l}.{name}.bias"] = torch.randn(o, generator=g) * 0.1
            for name in model.NORMS:
                w[f"layers.{l}.{name}.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
                w[f"layers.{l}.{name}.bias"] = 0.1 * torch.randn(d, generator=g)
        students.append(w)
    mult = (torch.rand(m, generator=g) + 0.1).tolist()
    meta = {"task": "tagging", "labels": [str(i) for i in range(labels)], "layers": layers, "heads": heads,
            "eps": 1e-12, "ffn": ffn}
    return model.stack_students(students, mult, torch.randn(labels, d, generator=g), torch.randn(labels, generator=g),
                                meta)


def random_batch(b, length, d, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, length, d, generator=g)
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    return x, torch.arange(length)[None, :] < lengths[:, None]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 4), k=st.integers(1, 4), layers=st.integers(1, 2), b=st.integers(1, 3),
       length=st.integers(1, 6), heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_virtual_stacking_equals_the_loop_over_students(m, k, layers, b, length, heads, seed):
    k = min(k, m)
    group = random_group(m, layers, d=8, heads=heads, ffn=12, seed=seed)
    x, mask = random_batch(b, length, 8, seed)
    expected = model.ensemble(group, x, mask, k)
    got = stack.ensemble(group, x, mask, k)
    real = mask[..., None]
    torch.testing.assert_close(got * real, expected * real, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(ks=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2)), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_many_tenants_in_one_stacked_step(ks, seed):
    """Tenants with different batches, lengths, k and student depths (one forward per depth):
    each answer its own loop's."""
    parts = []
    for t, (k, layers) in enumerate(ks):
        group = random_group(3, layers, d=8, heads=2, ffn=12, seed=seed + t)
        x, mask = random_batch(1 + t, 2 + 2 * t, 8, seed + t)
        parts.append((group, k, x, mask))
    for (group, k, x, mask), got in zip(parts, stack.ensembles(parts)):
        real = mask[..., None]
        torch.testing.assert_close(got * real, model.ensemble(group, x, mask, k) * real, atol=1e-5, rtol=1e-5)


def test_group_shapes_are_checked():
    group = random_group(2, 1, d=8, heads=2, ffn=12)
    model.check_group(group.tensors, group.meta | {"students": 2}, 8)
    bad = dict(group.tensors, multiplier=torch.ones(3))
    with pytest.raises(ValueError, match="multiplier"):
        model.check_group(bad, group.meta | {"students": 2}, 8)
    with pytest.raises(ValueError, match="lacks"):
        model.check_group({k: v for k, v in group.tensors.items() if k != "head.bias"}, group.meta | {"students": 2}, 8)


def test_best_k_prefers_fewer_students_on_ties():
    assert prune.best_k([0.5, 0.7, 0.7, 0.6]) == 2
    assert prune.best_k([0.9]) == 1


# -- on a tiny model and store ----------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("students"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, chunk=200,
                  progress=False)
    manager.tenant_create(data["store"], "cls", version="root", train_path=data["cls"], epochs=2, progress=False)
    manager.tenant_create(data["store"], "tag", version="root", train_path=data["tag"], task="tagging", epochs=2,
                          progress=False)
    with hkstore.open(data["store"]) as store:
        from runtime.model.stored import base_encoder
        from runtime.plot.retrieve import retrieve_list

        encoder = base_encoder(store)
        meta, pet = manager.load_tenant(store, "cls", encoder)
        ids, _ = manager.encode_task(encoder, manager.read_task(data["cls"], "classification")[0], "classification",
                                     meta["labels"], 32)
        data["encoder"], data["pet"] = encoder, pet
        data["inputs"] = retrieve_list(store.snapshot(), "root", ids)
    return data


def test_a_fresh_student_is_the_first_upper_layer(env):
    enc, x = env["encoder"], env["inputs"][:4]
    w = model.init_student(enc, 1)
    from runtime.construct.train import _pad_inputs

    h, mask = _pad_inputs(x)
    got = model.student_forward(w, h, mask, enc.config.heads, enc.config.eps)[-1]
    torch.testing.assert_close(got, enc.layer(enc.lower_layers, h, mask))


def test_boosting_lowers_the_distance_and_eta_is_the_line_search_optimum(env):
    enc, x = env["encoder"], env["inputs"]
    h = teacher_states(enc, env["pet"], x)
    cfg = StudentConfig(max_students=2, layers=2, epochs=2, lr=1e-3, min_gain=0.0, progress=False)
    students, history = boost(enc, h, h, x, x, "classification", cfg)
    assert students and all(r["val_distance"] < r["val_distance_before"] for r in history if r["kept"])
    # eta minimizes the squared residual of its student: moving it either way can only hurt.
    w, eta = students[0]
    out = student_outputs(w, x, enc.config.heads, enc.config.eps)
    err = {e: distance([e * o for o in out], h, "classification") for e in (eta * 0.9, eta, eta * 1.1)}
    assert err[eta] <= min(err[eta * 0.9], err[eta * 1.1])


@pytest.fixture(scope="module")
def tag_students(env):
    return students_create(env["store"], "tag", dev_path=env["tag"], students=2, layers=1, epochs=2, lr=1e-3,
                           head_epochs=3, progress=False)


def test_students_create_stores_a_servable_group_and_the_store_tools_see_it(env, tag_students):
    from click.testing import CliRunner

    from tools.cli import main

    out = tag_students
    assert 1 <= out["students"] <= 2 and len(out["scores"]) == out["students"] and 1 <= out["best_k"] <= out["students"]
    with hkstore.open(env["store"]) as store:
        group = load_group(store.snapshot(), "tag", env["encoder"].config.d)
        assert group.size == out["students"] and group.meta["complete"]
    listed = CliRunner().invoke(main, ["pack", "ls", env["store"], "--json"])
    assert listed.exit_code == 0 and '"students"' in listed.output
    assert hkstore.verify(env["store"])["ok"]
    # gc rewrites mostly-dead packs: the students record must move with the live PETs.
    with hkstore.open(env["store"], writable=True) as store:
        for _ in range(3):
            store.put_pet(store.get_pet("cls"))
        hkstore.gc(store)
    with hkstore.open(env["store"]) as store:
        assert load_group(store.snapshot(), "tag", env["encoder"].config.d).size == out["students"]
    assert hkstore.verify(env["store"])["ok"]


def test_an_unfinished_group_resumes_and_is_never_served(env):
    enc = env["encoder"]
    w = {k: v + 0.01 for k, v in model.init_student(enc, 1).items()}
    head = env["pet"].tensors
    meta = {"tenant": "cls", "base_model": "x", "version": "root", "task": "classification",
            "labels": env["pet"].meta["labels"], "layers": 1, "heads": enc.config.heads, "eps": enc.config.eps,
            "ffn": enc.config.ffn, "complete": False}
    with hkstore.open(env["store"], writable=True) as store:
        store.put_students(_record("cls", [(w, 0.5)], head["head.weight"], head["head.bias"], meta))
    with hkstore.open(env["store"]) as store, pytest.raises(ValueError, match="unfinished"):
        load_group(store.snapshot(), "cls", enc.config.d)
    out = students_create(env["store"], "cls", dev_path=env["cls"], students=2, layers=1, epochs=1, lr=1e-3,
                          min_gain=-1.0, head_epochs=2, progress=False)
    assert out["resumed"] and out["students"] == 2
    with hkstore.open(env["store"]) as store:
        group = load_group(store.snapshot(), "cls", enc.config.d)
    torch.testing.assert_close(group.student(0)["layers.0.q.weight"], w["layers.0.q.weight"])
    assert float(group.tensors["multiplier"][0]) == 0.5


def test_removing_the_tenant_removes_its_students(env):
    manager.tenant_create(env["store"], "gone", version="root", train_path=env["cls"], epochs=1, progress=False)
    students_create(env["store"], "gone", dev_path=env["cls"], students=1, epochs=1, head_epochs=1, progress=False)
    with hkstore.open(env["store"]) as store:
        before = store.snapshot()
        assert "gone" in before.students
    manager.tenant_rm(env["store"], "gone")
    with hkstore.open(env["store"]) as store:
        assert "gone" not in store.snapshot().students and "gone" not in store.snapshot().pets
        assert np.isfinite(before.read_students("gone").tensors["multiplier"]).all()  # the old snapshot still reads it


# -- serving: buffer, policy, engine ----------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=50), max_batch=st.integers(1, 8),
       fifo=st.booleans())
def test_length_buffer_serves_everyone_once_oldest_first(lengths, max_batch, fifo):
    from runtime.student.buffer import LengthBuffer

    buf = LengthBuffer(bin_width=8, fifo=fifo)
    for i, n in enumerate(lengths):
        buf.add(n, i)
    served = []
    while len(buf):
        oldest = buf.items[0][1]
        batch = buf.pop(max_batch)
        assert oldest in batch and 1 <= len(batch) <= max_batch and batch == sorted(batch)
        served += batch
    assert sorted(served) == list(range(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=50), max_batch=st.integers(1, 8))
def test_the_runtimes_batcher_pads_no_more_than_first_come_first_served(lengths, max_batch):
    """runtime.Runtime cuts what waits with the buffer: every request once, the oldest first, as
    many batches as FIFO chunks (the padding it saves is a benchmark's, BENCHMARKS issue 18: a
    greedy cut can pad more on some queues)."""
    from runtime.student.buffer import length_batches, padded_tokens

    cuts = length_batches(lengths, max_batch)
    assert 0 in cuts[0] and sorted(i for c in cuts for i in c) == list(range(len(lengths)))
    assert all(1 <= len(c) <= max_batch for c in cuts)
    fifo = [lengths[i:i + max_batch] for i in range(0, len(lengths), max_batch)]
    assert len(cuts) == len(fifo)
    if len(set(lengths)) == 1 or max_batch == 1:
        assert padded_tokens([[lengths[i] for i in c] for c in cuts]) == padded_tokens(fifo)


@settings(max_examples=60, deadline=None)
@given(queued=st.integers(0, 5000), more=st.integers(0, 5000), wait=st.floats(0, 1), rate=st.integers(0, 20000))
def test_policy_serves_more_load_with_fewer_students_and_restores_the_group(queued, more, wait, rate):
    from runtime.student.policy import PruningPolicy

    costs = {"teacher": 4e-4, 3: 3e-4, 2: 2e-4, 1: 1e-4}
    order = list(costs)
    pol = PruningPolicy(order, target_s=0.3, cost=dict(costs), rate_window_s=1.0)
    pol.arrived(rate, now=10.0)
    light = pol.choose(queued, wait, now=10.5)
    heavy = pol.choose(queued + more, wait, now=10.5)
    assert order.index(heavy) >= order.index(light)
    assert pol.choose(0, 0.0, now=20.0) == "teacher"  # the burst has passed: the most accurate level again


def test_engine_answers_like_the_reference_and_says_how_many_students(env, tag_students):
    from benchmarks.student_engine import StudentEngine
    from runtime.student.evaluate import students_eval

    ids = env["inputs"]  # only for the count
    with hkstore.open(env["store"]) as store:
        from runtime.model.stored import base_encoder

        enc = base_encoder(store)
        texts = manager.read_task(env["tag"], "tagging")[0]
        tag_ids, _ = manager.encode_task(enc, texts, "tagging", manager.load_tenant(store, "tag", enc)[0]["labels"], 32)
    assert ids
    for mode in ("teacher", 1):
        with StudentEngine(env["store"], ["tag"], mode=mode, max_batch=4) as engine:
            answers = [f.result() for f in [engine.submit("tag", s) for s in tag_ids[:10]]]
            assert all(a.students == (0 if mode == "teacher" else 1) for a in answers)
            assert all(len(a.prediction) == len(s) for a, s in zip(answers, tag_ids))
            # batching does not change an answer: one request alone gets the same prediction
            alone = engine.submit("tag", tag_ids[3]).result()
            assert alone.prediction == answers[3].prediction
    report = students_eval(env["store"], "tag", env["tag"])
    assert set(report["students"]) == set(range(1, len(report["students"]) + 1))
    with StudentEngine(env["store"], ["tag"], mode="adaptive", target_s=10.0) as engine:
        assert engine.submit("tag", tag_ids[0]).result().students == 0  # idle: the policy lets the teacher answer


def test_students_cli_scores_removes_and_fails_in_one_line(env, tag_students):
    from click.testing import CliRunner

    from tools.cli import main

    run = CliRunner().invoke
    scored = run(main, ["students", "eval", env["store"], "tag", "--test", env["tag"], "--json"])
    assert scored.exit_code == 0, scored.output
    assert '"teacher"' in scored.output and '"students"' in scored.output
    for args in (["students", "eval", env["store"], "nobody", "--test", env["tag"]],
                 ["students", "create", env["store"], "nobody", "--dev", env["tag"], "-q"],
                 ["students", "rm", env["store"], "nobody"]):
        bad = run(main, args)
        assert bad.exit_code == 1 and len(bad.output.strip().splitlines()) == 1, bad.output
    assert run(main, ["students", "rm", env["store"], "tag"]).exit_code == 0
    with hkstore.open(env["store"]) as store:
        assert "tag" not in store.snapshot().students and "tag" in store.snapshot().pets


@pytest.mark.parametrize("task,layers", [("tagging", 1), ("classification", 2)])
def test_device_students_equal_virtual_stacking(task, layers):
    """runtime.exec.students_gpu on the GPU executor's device (the CUDA-on-CPU emulation, the
    fused GELU kernel included) equals stack.ensemble + model.head, for every k."""
    from runtime.exec.emu.module import compiler_missing_reason

    if compiler_missing_reason() is not None:
        pytest.skip(f"CUDA emulation unavailable: {compiler_missing_reason()}")
    import types

    from runtime.exec import ops_gpu
    from runtime.exec.emu import cupy_standin
    from runtime.exec.students_gpu import DeviceStudents

    group = random_group(4, layers, 16, 2, 32, seed=3)
    group.meta["task"] = task
    ex = types.SimpleNamespace(cp=cupy_standin, ops=ops_gpu, _device=lambda: cupy_standin.cuda.Device(0),
                               compute_stream=cupy_standin.cuda.Stream())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, generator=g)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 4, 1])[:, None]
    x[~mask] = 0
    with ops_gpu.use_cupy(cupy_standin):
        dev = DeviceStudents(ex)
        for k in range(1, group.size + 1):
            want = model.head(group, stack.ensemble(group, x, mask, k)).numpy()
            got = dev.logits(group, k, x.numpy(), mask.numpy())
            real = mask.numpy() if task == "tagging" else np.ones(3, bool)
            np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_tenant_create_with_students_trains_both_resumes_and_checks_first(env):
    """`hkstore tenant create/update --students`: construction's command, then the students;
    a mistake is found before any training, and a run cut off after the PET keeps it."""
    import json

    from click.testing import CliRunner

    from tools.cli import main

    run = CliRunner().invoke
    create = ["tenant", "create", env["store"], "both", "--version", "root", "--train", env["cls"], "--epochs", "1",
              "-q", "--json"]
    for extra, says in ((["--students", "1"], "--students-dev"),
                        (["--students", "1", "--students-dev", env["cls"] + ".missing"], "no such file"),
                        (["--students-dev", env["cls"]], "go with --students")):
        bad = run(main, create + extra)
        assert bad.exit_code == 1 and len(bad.output.strip().splitlines()) == 1 and says in bad.output, bad.output
    with hkstore.open(env["store"]) as store:
        assert "both" not in store.snapshot().pets  # nothing was trained
    made = run(main, create + ["--students", "1", "--students-dev", env["cls"]])
    assert made.exit_code == 0, made.output
    out = json.loads(made.output)
    assert out["tenant"] == "both" and out["students"]["students"] == 1 and not out["students"]["resumed"]
    listed = json.loads(run(main, ["students", "ls", env["store"], "--json"]).output)
    assert {r["tenant"]: r["state"] for r in listed["tenants"]}["both"] == "ready"
    # Without --students it is construction's command as before: an existing tenant is refused.
    again = run(main, create)
    assert again.exit_code == 1 and "already exists" in again.output

    # Cut off after the PET: a tenant without its students. Run again, the PET stays as it was.
    manager.tenant_create(env["store"], "cut", version="root", train_path=env["cls"], epochs=1, progress=False)
    with hkstore.open(env["store"]) as store:
        pet_before = dict(store.snapshot().pets["cut"])
    resumed = run(main, ["tenant", "create", env["store"], "cut", "--version", "root", "--train", env["cls"], "-q",
                         "--json", "--students", "1", "--students-dev", env["cls"]])
    assert resumed.exit_code == 0, resumed.output
    assert "kept" in json.loads(resumed.output)["pet"]
    with hkstore.open(env["store"]) as store:
        assert dict(store.snapshot().pets["cut"]) == pet_before and "cut" in store.snapshot().students
    other = run(main, ["tenant", "create", env["store"], "cut", "--version", "root", "--train", env["tag"],
                       "--task", "tagging", "-q", "--students", "1", "--students-dev", env["tag"]])
    assert other.exit_code == 1 and "already exists" in other.output  # another --train: not a resume

    # update: the new PET makes the students stale; --students distills them again (settings reused).
    updated = run(main, ["tenant", "update", env["store"], "both", "--epochs", "1", "-q", "--json", "--students", "1"])
    assert updated.exit_code == 0, updated.output
    listed = json.loads(run(main, ["students", "ls", env["store"], "--json"]).output)
    assert {r["tenant"]: r["state"] for r in listed["tenants"]}["both"] == "ready"
    assert json.loads(updated.output)["students"]["students"] == 1
