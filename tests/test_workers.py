"""Worker processes (runtime.pool, runtime.open(workers=N), hkstore serve --workers N): the same
answers as one engine, a tenant's texts at its home worker until it falls behind, commits seen
by every worker, a killed worker answered 503 and started again, bad --workers refused.

The store is the tiny one of tests/test_manager.py (a d=32 BERT over stdlib docstrings)."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from runtime.construct import manager
from runtime.model.tiny import make_tiny_model
from runtime.pool import Pool, _Worker, check_workers
from test_manager import make_data
from test_serve import ADMIN, Server, auth

TENANTS = ("a", "b", "c")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("workers"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    store = os.path.join(root, "store")
    manager.build(store, model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, chunk=200,
                  progress=False)
    for t in TENANTS:
        # served fp32: a bf16 row's last bits depend on its batch, and these compare across batches
        manager.tenant_create(store, t, version="root", train_path=data["cls"], epochs=1, max_len=32, progress=False,
                              precision="fp32")
    data["store"] = store
    data["token_file"] = os.path.join(root, "admin.token")
    with open(data["token_file"], "w") as f:
        f.write(ADMIN + "\n")
    return data


@pytest.fixture(scope="module")
def one(env):
    with runtime.open(env["store"], "cpu", max_len=32) as rt:
        yield rt


@pytest.fixture(scope="module")
def pool(env):
    with runtime.open(env["store"], "cpu", max_len=32, workers=2) as p:
        yield p


def same(a, b):
    assert (a.tenant, a.label, a.tags, a.level) == (b.tenant, b.label, b.tags, b.level)
    # a batch of other company pads differently: the GEMMs' rounding may differ in the last bits
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(0, 31)), min_size=1, max_size=80))
def test_pool_answers_as_one_runtime(env, one, pool, picks):
    requests = [{"tenant": t, "text": env["texts"][i]} for t, i in picks]
    for a, b in zip(pool.infer(requests), one.infer(requests)):
        same(a, b)


def test_one_tenants_large_call_spreads(env, pool):
    texts = [env["texts"][i % 32] for i in range(400)]
    before = [w.process.pid for w in pool.workers]
    futures = pool.submit([{"tenant": "a", "text": t} for t in texts])
    assert min(w.outstanding for w in pool.workers) > 0  # both workers got pieces
    assert all(f.result(120).label for f in futures)
    assert [w.process.pid for w in pool.workers] == before


def test_pool_request_errors_are_the_requests(pool):
    with pytest.raises(runtime.UnknownTenant):
        pool.infer([{"tenant": "nobody", "text": "x"}])
    futures = pool.submit([{"tenant": "a", "text": "Return the cube root of x."}, {"tenant": "a", "text": ""},
                           {"tenant": "nobody", "text": "x"}])
    assert futures[0].result(30).label is not None  # the good text of the same tenant is answered
    assert isinstance(futures[1].exception(30), runtime.EmptyText)
    assert isinstance(futures[2].exception(30), runtime.UnknownTenant)


def test_check_workers():
    assert check_workers("auto", cores=6) == (6, None)
    assert check_workers(3, cores=6) == (3, None)
    n, warning = check_workers(8, cores=2)
    assert n == 8 and "2 usable cores" in warning
    for bad in (0, -1, "x"):
        with pytest.raises(ValueError):
            check_workers(bad, cores=2)


def fake_pool(n, slack):
    p = Pool.__new__(Pool)
    p.n, p.slack = n, slack
    p.workers = [_Worker(i) for i in range(n)]
    for w in p.workers:
        w.alive = True
    return p


@given(n=st.integers(1, 8), slack=st.integers(0, 16), loads=st.lists(st.integers(0, 64), min_size=8, max_size=8),
       dead=st.sets(st.integers(0, 7)), tenant=st.text(min_size=1, max_size=8))
def test_dispatch_home_until_it_falls_behind(n, slack, loads, dead, tenant):
    p = fake_pool(n, slack)
    for w, load in zip(p.workers, loads):
        w.outstanding = load
        w.alive = w.index not in dead
    chosen = p._choose(tenant)
    alive = [w for w in p.workers if w.alive]
    if not alive:
        assert chosen is None
        return
    home, least = p.workers[p.home(tenant)], min(w.outstanding for w in alive)
    if home.alive and home.outstanding <= least + slack:
        assert chosen is home
    else:  # behind (or dead): the least loaded takes it
        assert chosen.alive and chosen.outstanding == least


def test_home_is_stable_and_spread():
    p = fake_pool(4, 8)
    homes = [p.home(f"tenant-{i}") for i in range(400)]
    assert homes == [p.home(f"tenant-{i}") for i in range(400)]
    assert min(np.bincount(homes, minlength=4)) > 60  # no worker left out


def test_commit_seen_by_every_worker(env, tmp_path):
    """A tenant replaced under load after the pool started: once the commit returns, every
    worker answers with the new PET, with no refresh call (each worker looks at CURRENT before
    it queues)."""
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(env["store"], store)
    texts = env["texts"]
    with runtime.open(store, "cpu", max_len=32, workers=2, slack=0) as p:
        before = p.infer([{"tenant": "a", "text": t} for t in texts])
        stop = threading.Event()

        def load():  # the update happens under load: both workers busy with tenant b
            while not stop.is_set():
                for f in p.submit([{"tenant": "b", "text": t} for t in texts]):
                    f.result(60)

        busy = threading.Thread(target=load)
        busy.start()
        try:
            manager.tenant_rm(store, "a")
            manager.tenant_create(store, "a", version="root", train_path=env["cls"], epochs=3, max_len=32, seed=7,
                                  precision="fp32",
                                  progress=False)
        finally:
            stop.set()
            busy.join(120)
        with runtime.open(store, "cpu", max_len=32) as fresh:
            want = fresh.infer([{"tenant": "a", "text": t} for t in texts])
        for _ in range(3):  # slack 0: the texts spread over both workers
            futures = p.submit([{"tenant": "a", "text": t} for t in texts])
            assert len({id(f) for f in futures}) == len(texts)
            for f, w in zip(futures, want):
                same(f.result(60), w)
        assert any(not np.allclose(b.logits, w.logits) for b, w in zip(before, want))  # it did change


def test_killed_worker_fails_its_texts_and_starts_again(env):
    with runtime.open(env["store"], "cpu", max_len=32, workers=2) as p:
        victim = p.workers[0]
        pid = victim.process.pid
        futures = [f for _ in range(20) for f in p.submit([{"tenant": t, "text": env["texts"][0]} for t in TENANTS])]
        os.kill(pid, signal.SIGKILL)
        for f in futures:  # answered or Unavailable: none hangs
            exc = f.exception(60)
            assert exc is None or isinstance(exc, runtime.Unavailable), exc
        deadline = time.monotonic() + 120
        while not (victim.alive and victim.restarts == 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim.alive and victim.process.pid != pid
        requests = [{"tenant": t, "text": s} for t in TENANTS for s in env["texts"][:8]]
        with runtime.open(env["store"], "cpu", max_len=32) as rt:
            for a, b in zip(p.infer(requests), rt.infer(requests)):
                same(a, b)


# -- hkstore serve --workers ------------------------------------------------------------------------


def test_serve_workers(env):
    s = Server(env["store"], env["token_file"], "--workers", 2, "--max-wait-ms", 5)
    try:
        h = s.client.get("/healthz", headers=auth(ADMIN)).json()
        assert h["workers"]["workers"] == 2 and h["workers"]["alive"] == 2
        with runtime.open(env["store"], "cpu", max_len=32) as rt:
            want = rt.infer([{"tenant": "b", "text": t} for t in env["texts"]])
        r = s.client.post("/v1/tenants/b/infer", json={"texts": env["texts"]}, headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        assert [x["label"] for x in r.json()["results"]] == [w.label for w in want]
        metrics = s.client.get("/metrics", headers=auth(ADMIN)).text
        assert "hkstore_workers_alive 2.0" in metrics
        assert "hkstore_batch_size_count" in metrics and "hkstore_batch_size_count 0.0" not in metrics
        served = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('hkstore_runtime_stat{name="requests"}')]
        assert served and served[0] >= len(env["texts"])  # the workers' counters, summed

        pid = h["workers"]["pids"][1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        codes = set()
        while time.monotonic() < deadline:
            r = s.client.post("/v1/tenants/c/infer", json={"texts": env["texts"][:4]}, headers=auth(ADMIN))
            codes.add(r.status_code)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.headers["retry-after"]
            w = s.client.get("/healthz", headers=auth(ADMIN)).json()["workers"]
            if w["alive"] == 2 and w["restarts"] == 1:
                break
            time.sleep(0.1)
        assert w["alive"] == 2 and pid not in w["pids"]
        assert 200 in codes
    finally:
        s.stop()


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "runtime.serve.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


def test_serve_bad_workers_and_busy_port(env):
    r = run_cli(env["store"], "--workers", 0, "--admin-token-file", env["token_file"])
    assert r.returncode == 2 and "--workers" in r.stderr and "Traceback" not in r.stderr
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run_cli(env["store"], "--port", port, "--workers", 1, "--admin-token-file", env["token_file"])
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "serving" not in r.stderr and "Traceback" not in r.stderr
