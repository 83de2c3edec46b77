"""runtime.serve.ray_app on a real local Ray cluster (127.0.0.1): 2 TenantWorker replicas over one
store, a Manager, the Ingress. Many tenants, tenant affinity, a tenant added through a manage job
and served by every replica, a replica killed under load with no request lost. Also the pure
Punica ordering of runtime/serve/ray_router.py. Slow (a Ray cluster starts: ~20 s here); the
cluster tests skip when ray[serve] is not installed (pip install -e '.[ray]').
"""

import json
import os
import shutil
import socket
import tempfile
import threading
import time

import httpx
import pytest
from test_manager import make_data

ADMIN = "admin-token-for-tests-0123456789"
TENANTS = [f"t{i:02d}" for i in range(16)]
DEADLINE_S = 120.0  # any wait in this module gives up after this

pytestmark = pytest.mark.slow


def free_port():
    """A free port below the kernel's ephemeral range: ray.init starts many processes whose
    sockets take ephemeral ports, and one took a port picked from that range before Serve's
    proxy bound it ("Failed to bind")."""
    import random

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for port in random.Random().sample(range(max(low - 12000, 1024), low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def auth(token=ADMIN):
    return {"Authorization": f"Bearer {token}"} if token else {}


# -- the pure policy (no cluster) -----------------------------------------------------------------------


def test_punica_order_prefers_busiest_warm_then_fitting_then_migrates():
    from runtime.serve.routing import punica_order

    load = {"a": 3, "b": 7, "c": 1, "d": 8, "e": 0}
    cap = 8
    holds = {"a": {"x"}, "b": {"x"}, "c": set(), "d": {"x"}, "e": {"y", "z"}}
    full = {"e"}  # working set at capacity

    order = punica_order(list(load), "x", load.get, room=lambda r: load[r] < cap, holds=lambda r, t: t in holds[r],
                         fits=lambda r: r not in full)
    # warm with room (busiest first), then cold with room and space (busiest first); d is full of requests
    assert order[:3] == ["b", "a", "c"]
    assert set(order[3:]) == {"d", "e"} and order[3] == "e"  # the rest least busy first
    # a tenant no replica holds goes to the busiest replica that still fits: consolidation
    assert punica_order(list(load), "new", load.get, room=lambda r: load[r] < cap, holds=lambda r, t: False,
                        fits=lambda r: r not in full)[0] == "b"


def test_application_checks_its_options(tmp_path, monkeypatch):
    pytest.importorskip("ray.serve")
    from runtime.serve import ray_app

    with pytest.raises(ValueError, match="no store"):
        ray_app.application(str(tmp_path), ADMIN)
    (tmp_path / "CURRENT").write_text("x")
    with pytest.raises(ValueError, match="router"):
        ray_app.application(str(tmp_path), ADMIN, router="nearest")
    with pytest.raises(ValueError, match="unknown options"):
        ray_app.application(str(tmp_path), ADMIN, max_batchh=3)
    with pytest.raises(ValueError, match="admin token"):
        ray_app.application(str(tmp_path), "short")
    token = tmp_path / "admin.token"
    token.write_text(ADMIN + "\n")
    args = {"store": str(tmp_path), "replicas": "3", "router": "punica", "autoscale": "1:4",
            "max_len": "32"}  # what `serve run runtime.serve.ray_app:build_app k=v` passes
    ray_app.build_app(args)  # a real application: an option it cannot take raises
    seen = {}
    monkeypatch.setattr(ray_app, "application", lambda store, token, **kw: seen.update(kw, store=store, token=token))
    ray_app.build_app(args)
    assert seen == {"store": str(tmp_path), "token": ADMIN, "replicas": 3, "router": "punica", "autoscale": (1, 4),
                    "max_len": 32}
    assert ray_app.router_config("multiplex") is None
    assert ray_app.router_config("punica").request_router_kwargs == {"max_models": 4096}


def test_held_pet_handles_survive_a_reload():
    from runtime.serve.ray_app import _Pet, merge_metrics

    held = {}
    old = _Pet("acme", held)
    old.__del__()  # Ray's LRU eviction
    assert "acme" not in held
    new = _Pet("acme", held)  # loaded again
    del old  # the evicted handle's own finalizer must not unmark the new one
    assert held == {"acme": new}
    text = merge_metrics([("manager", b"# TYPE q gauge\nq 1.0\n"), ("w1", b"# TYPE q gauge\nq 2.0\n")]).decode()
    assert 'q{replica="manager"} 1.0' in text and 'q{replica="w1"} 2.0' in text and text.count("# TYPE q ") == 1


def test_serve_cli_has_the_ray_options():
    from click.testing import CliRunner

    from runtime.serve.cli import serve

    out = CliRunner().invoke(serve, ["--help"]).output
    assert all(opt in out for opt in ("--ray", "--replicas", "--ray-address", "--router", "--autoscale"))


# -- the cluster ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray.serve")
    import logging

    import ray
    from ray import serve

    from runtime.construct import manager
    from runtime.model.tiny import make_tiny_model
    from runtime.serve import ray_app

    root = str(tmp_path_factory.mktemp("ray"))
    data = make_data(root)
    model = make_tiny_model(os.path.join(root, "model"), data["texts"])
    store = os.path.join(root, "store")
    manager.build(store, model_path=model, corpus_paths=[data["corpus"]], max_len=32, chunk=200, progress=False)
    for i, tenant in enumerate(TENANTS):
        manager.tenant_create(store, tenant, version="root", train_path=data["cls"], epochs=1, max_len=32,
                              progress=False, seed=i)
    # Ray's socket paths must stay short: its session lives under a short /tmp directory.
    temp = tempfile.mkdtemp(prefix="hkray", dir="/tmp")
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        ray_app.run(store, ADMIN, port=port, blocking=False, replicas=2, device="cpu", max_len=32, max_wait_ms=5,
                    replica_cpus=1)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)
        yield {"client": client, "store": store, "data": data, "port": port}
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def infer(client, tenant, token=ADMIN, text="Return the sum of a list.", any_replica=False):
    headers = auth(token)
    if any_replica:
        headers["x-hkstore-route"] = "any"
    return client.post(f"/v1/tenants/{tenant}/infer", json={"text": text}, headers=headers)


def worker_replicas():
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if "#TenantWorker#" in a["name"]]


def wait_until(check, what, timeout=DEADLINE_S, every=0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = check()
        if out:
            return out
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_many_tenants_are_routed_to_the_replica_holding_their_pet(cluster):
    c = cluster["client"]
    assert c.get("/healthz").json() == {"status": "ok"}
    h = c.get("/healthz", headers=auth())
    assert h.status_code == 200 and h.json()["tenants"] == len(TENANTS)
    # Workers run no jobs, the Manager does: manage requests work, so the cluster says so.
    wait_until(lambda: c.get("/healthz", headers=auth()).json()["jobs_enabled"], "jobs_enabled from the Manager",
               timeout=10.0)
    first = {}
    for t in TENANTS:
        r = infer(c, t)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tenant"] == t and out["results"][0]["label"] in ("math", "path")
        first[t] = r.headers["x-hkstore-replica"]
    assert len(set(first.values())) == 2, f"the cold tenants spread over both replicas: {first}"
    time.sleep(1.5)  # replicas push their held tenants to Ray's routers
    served, warm = {t: set() for t in TENANTS}, 0
    for _ in range(3):
        for t in TENANTS:
            r = infer(c, t)
            assert r.status_code == 200, r.text
            served[t].add(r.headers["x-hkstore-replica"])
            warm += r.headers["x-hkstore-pet"] == "warm"
    assert warm == 3 * len(TENANTS), "every request went to a replica holding the tenant's PET"
    assert all(served[t] == {first[t]} for t in TENANTS), (first, served)
    assert c.get("/metrics").status_code == 401  # the same rule as hkstore serve: admin only
    m = c.get("/metrics", headers=auth()).text
    assert 'hkstore_ray_pet_routing_total{pet="warm"}' in m and "hkstore_ray_replica_requests_total" in m, m
    assert "hkstore_queue_depth" in m, m  # the Manager's app metrics follow the ingress's

    def workers_metrics():  # every worker pushes its metrics to the Manager every 2 s
        m = c.get("/metrics", headers=auth()).text
        texts = {}
        for line in m.splitlines():
            if line.startswith("hkstore_infer_texts_total{"):
                texts[line.split('replica="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return texts if set(first.values()) <= set(texts) and sum(texts.values()) >= 4 * len(TENANTS) else None

    texts = wait_until(workers_metrics, "both workers' metrics in /metrics", timeout=20.0, every=0.5)
    assert sum(v for r, v in texts.items() if r != "manager") == 4 * len(TENANTS), texts


def test_same_api_errors_and_bounds(cluster):
    c = cluster["client"]
    assert infer(c, "t00", token="").status_code == 401
    assert infer(c, "t00", token="nobody~secret").status_code == 401
    assert infer(c, "nosuch").status_code == 404
    r = c.post("/v1/tenants/t00/infer", json={"txt": "x"}, headers=auth())
    assert r.status_code == 422
    r = c.post("/v1/tenants/t00/infer", json={"texts": ["a b"] * 5000}, headers=auth())
    assert r.status_code in (413, 422)
    assert c.get("/v1/jobs", headers=auth("t00~wrong")).status_code == 401
    r = c.get("/v1/tenants", headers=auth())
    assert r.status_code == 200 and {t["tenant"] for t in r.json()["tenants"]} == set(TENANTS)
    r = c.post("/v1/embeddings", json={"model": "t03", "input": ["Return the sum.", "a path"]}, headers=auth())
    assert r.status_code == 200 and len(r.json()["data"]) == 2 and "x-hkstore-pet" in r.headers, r.text
    r = c.get("/info", headers=auth())
    assert r.status_code == 200 and r.json()["tenants"] >= len(TENANTS) and "x-hkstore-replica" in r.headers
    assert "store" not in c.get("/info").json()


def test_new_tenant_reaches_every_replica(cluster):
    c = cluster["client"]
    with open(cluster["data"]["cls"]) as f:
        examples = [json.loads(line) for line in f]
    r = c.post("/v1/tenants", json={"tenant": "fresh", "examples": examples, "epochs": 1, "max_len": 32},
               headers=auth())
    assert r.status_code == 202, r.text
    job, token = r.json()["job"]["id"], r.json()["token"]

    def done():
        j = c.get(f"/v1/jobs/{job}", headers=auth()).json()["job"]
        return j if j["state"] in ("done", "failed") else None

    j = wait_until(done, "the tenant job")
    assert j["state"] == "done" and j["attempts"] == 1, j
    # Within a bounded time (the replicas poll STORE/CURRENT each second) every replica lists it.
    seen = {}

    def everyone_knows():
        r = c.get("/healthz", headers={"x-hkstore-route": "any", **auth()})
        seen[r.headers["x-hkstore-replica"]] = r.json()["tenants"]
        return len(seen) == 2 and all(n == len(TENANTS) + 1 for n in seen.values())

    wait_until(everyone_knows, "both replicas see the new tenant", timeout=10.0, every=0.05)
    replicas = set()
    for _ in range(40):
        r = infer(c, "fresh", token=token, any_replica=True)
        assert r.status_code == 200, r.text
        replicas.add(r.headers["x-hkstore-replica"])
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, "the new tenant is served by every replica"
    assert infer(c, "t00", token=token).status_code == 403  # its token reaches only itself


def test_replica_killed_under_load_loses_no_request(cluster):
    import ray

    c = cluster["client"]
    replicas = worker_replicas()
    assert len(replicas) == 2
    victim = replicas[0]
    victim_id = victim["name"].rsplit("#", 1)[-1]
    statuses, stop = [], threading.Event()

    def load(k):
        with httpx.Client(base_url=str(c.base_url), timeout=60.0) as cl:
            i = k
            while not stop.is_set():
                r = infer(cl, TENANTS[i % len(TENANTS)])
                statuses.append((r.status_code, r.headers.get("x-hkstore-replica"), time.monotonic()))
                i += 3

    threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(DEADLINE_S)
    codes = [s for s, _, _ in statuses]
    assert codes and all(s == 200 for s in codes), f"{len(codes)} requests, not all 200: {sorted(set(codes))}"
    after = [rep for s, rep, t in statuses if t > t_kill + 1.0]
    assert after and victim_id not in after, "nothing is answered by the dead replica"
    # every tenant is still served (the survivor loads the PETs the dead one held)
    for t in TENANTS:
        assert infer(c, t).status_code == 200
    # Ray replaces the replica
    wait_until(lambda: len(worker_replicas()) == 2 and victim["name"] not in {a["name"] for a in worker_replicas()},
               "Ray starts a replacement replica")


def test_manager_killed_mid_job_the_job_still_finishes_once(cluster):
    import ray

    c = cluster["client"]
    with open(cluster["data"]["cls"]) as f:
        examples = [json.loads(line) for line in f]
    r = c.post("/v1/tenants", json={"tenant": "survivor", "examples": examples, "epochs": 3, "max_len": 32},
               headers=auth())
    assert r.status_code == 202, r.text
    job = r.json()["job"]["id"]
    wait_until(lambda: c.get(f"/v1/jobs/{job}", headers=auth()).json()["job"]["state"] != "queued", "the job starts",
               every=0.05)
    managers = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Manager#" in a["name"]]
    assert len(managers) == 1
    ray.kill(ray.get_actor(managers[0]["name"], namespace=managers[0]["namespace"]), no_restart=True)

    def finished():
        r = c.get(f"/v1/jobs/{job}", headers=auth())
        if r.status_code != 200:  # 503 while Ray starts a new Manager
            return None
        return r.json()["job"] if r.json()["job"]["state"] in ("done", "failed") else None

    j = wait_until(finished, "the job finishes on the new Manager", every=0.5)
    assert j["state"] == "done", j
    jobs = c.get("/v1/jobs", headers=auth()).json()["jobs"]
    assert sum(1 for x in jobs if x["params"].get("tenant") == "survivor") == 1
    wait_until(lambda: infer(c, "survivor").status_code == 200, "the tenant is served")


def _redeploy(cluster, **kw):
    from runtime.serve import ray_app

    ray_app.run(cluster["store"], ADMIN, port=cluster["port"], blocking=False, device="cpu", max_len=32,
                replica_cpus=1, **kw)
    wait_until(lambda: cluster["client"].get("/healthz").status_code == 200, "the redeployed app answers")


def test_punica_router_consolidates_on_the_busiest_replica(cluster):
    c = cluster["client"]
    _redeploy(cluster, replicas=2, router="punica")
    wait_until(lambda: len(worker_replicas()) == 2, "two workers")
    served = set()
    for t in TENANTS:  # one at a time: every replica is idle, the first in Punica's order takes it
        r = infer(c, t)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-hkstore-replica"])
    assert len(served) == 1, f"sequential requests consolidate on one replica: {served}"


def test_autoscaling_on_queue_length(cluster):
    c = cluster["client"]
    # target 2 ongoing requests per replica (max_batch 2): 8 closed-loop clients make Ray add one
    _redeploy(cluster, autoscale=(1, 2), max_batch=2)
    wait_until(lambda: len(worker_replicas()) == 1, "one worker to start with")
    stop = threading.Event()

    def load(k):
        with httpx.Client(base_url=str(c.base_url), timeout=60.0) as cl:
            while not stop.is_set():
                infer(cl, TENANTS[k % len(TENANTS)])

    threads = [threading.Thread(target=load, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(worker_replicas()) == 2, "Ray scales the workers to 2 under load", every=1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
