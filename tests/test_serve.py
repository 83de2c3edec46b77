"""runtime.serve end to end: real servers (python -m runtime.serve.cli) on loopback ports.

The store is the tiny one of tests/test_manager.py (runtime.model.tiny) (a d=32 BERT over stdlib docstrings), so
every job trains in seconds. Servers: the main one (manage jobs, infer, isolation, bad
input); a second on the same store with tiny limits (429, 504; it runs no jobs: 503); one
killed with SIGKILL in the middle of a job and restarted (the job resumes); one fuzzed by
schemathesis against its own OpenAPI schema (no 5xx).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from runtime.construct import manager
from runtime.model.tiny import make_tiny_model
from test_manager import make_data
from benchmarks import reliability_http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "admin-token-for-tests-0123456789"
JOB_TIMEOUT = 90.0


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_with_parent():
    """In a server child (Linux): SIGTERM when pytest dies, so no server outlives the tests."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """`python -m runtime.serve.cli STORE` in a subprocess on a free loopback port."""

    def __init__(self, store, token_file, *args):
        self.store, self.port = store, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.path.dirname(store), f"server-{self.port}.log"), "wb")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.serve.cli", store, "--port", str(self.port), "--admin-token-file", token_file,
             "--device", "cpu", "--max-len", "32", *map(str, args)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=end_with_parent)
        self.client = httpx.Client(base_url=self.url, timeout=30.0)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.output()}")

    def output(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.client.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.client.close()
        self.log.close()


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return False


def auth(token):
    return {"Authorization": f"Bearer {token}"}


def wait_job(server, job_id, timeout=JOB_TIMEOUT, until=("done", "failed")):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = server.client.get(f"/v1/jobs/{job_id}", headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        job = r.json()["job"]  # the same envelope as the POST that made it
        if job["state"] in until:
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} still {job['state']} after {timeout} s: {job}\n{server.output()}")


def classification_examples(data):
    with open(data["cls"]) as f:
        return [json.loads(line) for line in f]


def tagging_examples(data):
    out, tokens, tags = [], [], []
    with open(data["tag"]) as f:
        for line in f:
            cols = line.split()
            if not cols:
                if tokens:
                    out.append({"tokens": tokens, "tags": tags})
                tokens, tags = [], []
                continue
            tokens.append(cols[0])
            tags.append(cols[-1])
    return out


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("serve"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    base = os.path.join(root, "base")
    manager.build(base, model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, chunk=200,
                  progress=False)
    # One tenant made without the server (it has no API token: only the admin reaches it).
    manager.tenant_create(base, "base", version="root", train_path=data["cls"], epochs=1, max_len=32, progress=False)
    for name in ("main", "restart", "fuzz"):  # each server gets a store of its own
        shutil.copytree(base, os.path.join(root, name, "store"))
        data[name] = os.path.join(root, name, "store")
    data["token_file"] = os.path.join(root, "admin.token")
    with open(data["token_file"], "w") as f:
        f.write(ADMIN + "\n")
    return data


@pytest.fixture(scope="module")
def server(env):
    s = Server(env["main"], env["token_file"], "--max-wait-ms", 20, "--header-timeout", 3, "--body-timeout", 3)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tenants(server, env):
    """Two tenants created through the API (jobs), with their tokens."""
    jobs, tokens = {}, {}
    bodies = {"alpha": {"tenant": "alpha", "examples": classification_examples(env), "epochs": 2, "max_len": 32},
              "beta": {"tenant": "beta", "task": "tagging", "pet_type": "lora", "examples": tagging_examples(env),
                       "epochs": 2, "max_len": 32}}
    for name, body in bodies.items():
        r = server.client.post("/v1/tenants", json=body, headers=auth(ADMIN))
        assert r.status_code == 202, r.text
        out = r.json()
        assert out["job"]["state"] in ("queued", "running") and out["token"].startswith(name + "~")
        jobs[name], tokens[name] = out["job"]["id"], out["token"]
    for name, job_id in jobs.items():
        job = wait_job(server, job_id)
        assert job["state"] == "done", job
        assert job["result"]["tenant"] == name and job["progress"]["stage"] == "done"
    return tokens


# -- infer and manage -------------------------------------------------------------------------------


def test_health_metrics_and_schema(server):
    assert server.client.get("/healthz").json() == {"status": "ok"}  # open, and minimal
    h = server.client.get("/healthz", headers=auth(ADMIN)).json()
    assert h["status"] == "ok" and h["tenants"] >= 1 and h["jobs_enabled"] and h["mode"] == "shared"
    r = server.client.post("/v1/tenants/base/infer", json={"text": "Return the sum of a list."}, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    assert server.client.get("/metrics").status_code == 401  # the admin token, unless --metrics-public
    m = server.client.get("/metrics", headers=auth(ADMIN))
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("hkstore_queue_depth", "hkstore_batch_size_bucket", "hkstore_request_latency_seconds_bucket",
                 "hkstore_queue_wait_seconds_bucket", 'hkstore_pet_cache_hits_total{cache="host"}', "hkstore_tenants",
                 'hkstore_infer_requests_total{code="200",tenant="base"}', 'hkstore_jobs{state="queued"}'):
        assert name in m.text, name
    paths = server.client.get("/openapi.json").json()["paths"]
    assert {"/v1/tenants/{tenant}/infer", "/v1/tenants", "/v1/domains", "/v1/jobs/{job_id}"} <= set(paths)


def test_tenant_job_then_infer_with_its_token(server, tenants, env):
    r = server.client.post("/v1/tenants/alpha/infer", json={"text": env["texts"][0]}, headers=auth(tenants["alpha"]))
    assert r.status_code == 200, r.text
    (res,) = r.json()["results"]
    assert res["task"] == "classification" and res["label"] in ("math", "path") and res["version"] == "root"
    assert sorted(res["labels"]) == ["math", "path"] and abs(sum(res["probabilities"]) - 1) < 1e-4

    texts = env["texts"][:5]
    r = server.client.post("/v1/tenants/beta/infer", json={"texts": texts}, headers=auth(tenants["beta"]))
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 5 and all(x["task"] == "tagging" for x in results)
    assert all(len(x["tags"]) == len(x["tokens"]) == len(x["probabilities"]) > 0 for x in results)
    assert set(t for x in results for t in x["tags"]) <= {"O", "B-RET"}

    info = server.client.get("/v1/tenants/beta", headers=auth(tenants["beta"])).json()
    assert info["task"] == "tagging" and info["pet_type"] == "lora"
    listed = server.client.get("/v1/tenants", headers=auth(ADMIN)).json()["tenants"]
    assert {"tenant": "alpha", "has_token": True} in listed and {"tenant": "base", "has_token": False} in listed

    # Concurrent requests of several tenants share batches and each gets its own answer.
    def one(name, token, text, out):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            out.append((name, c.post(f"/v1/tenants/{name}/infer", json={"text": text}, headers=auth(token))))

    out, threads = [], []
    for i in range(12):
        name = ("alpha", "beta", "base")[i % 3]
        token = tenants.get(name, ADMIN)
        threads.append(threading.Thread(target=one, args=(name, token, env["texts"][i], out)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 12 and all(r.status_code == 200 for _, r in out)
    assert all(r.json()["results"][0]["task"] == ("tagging" if n == "beta" else "classification") for n, r in out)


def test_the_load_generators_client_reads_the_servers_answers(server, tenants, env):
    """benchmarks.loadgen.Client (the benchmarks' lean HTTP/1.1 client) against the real server:
    keep-alive requests with body fields, the answer's body handed back, a 4xx reported."""
    import asyncio

    from benchmarks.loadgen import Client

    async def go():
        client = Client(server.url, tenants["alpha"], env["texts"][:3], timeout=30)
        try:
            first = await client.call("alpha", {"text": env["texts"][0], "truncate": True})
            again = await client.one("alpha")  # the same connection, a text of the client's own
            bad = await client.call("alpha", {"text": env["texts"][0], "students": 1})  # alpha has none
            return first, again, bad
        finally:
            await client.close()

    first, again, bad = asyncio.run(go())
    assert first[0] == 200 and json.loads(first[4])["results"][0]["students"] == 0
    assert again[0] == 200 and len(again) == 4
    assert bad[0] == 422 and b"students" in bad[4]


def test_tenant_isolation(server, tenants):
    text = {"text": "Return the sum of a list."}
    a, b = tenants["alpha"], tenants["beta"]
    c = server.client
    assert c.post("/v1/tenants/alpha/infer", json=text, headers=auth(a)).status_code == 200
    assert c.post("/v1/tenants/beta/infer", json=text, headers=auth(a)).status_code == 403
    assert c.post("/v1/tenants/alpha/infer", json=text, headers=auth(b)).status_code == 403
    assert c.post("/v1/tenants/base/infer", json=text, headers=auth(a)).status_code == 403
    assert c.post("/v1/tenants/nobody/infer", json=text, headers=auth(a)).status_code == 403  # no existence leak
    assert c.get("/v1/tenants/beta", headers=auth(a)).status_code == 403
    assert c.post("/v1/tenants/alpha/infer", json=text).status_code == 401
    assert c.post("/v1/tenants/alpha/infer", json=text, headers=auth("not-a-token")).status_code == 401
    forged = "beta~" + a.split("~", 1)[1]  # alpha's secret under beta's name
    assert c.post("/v1/tenants/beta/infer", json=text, headers=auth(forged)).status_code == 401
    assert c.post("/v1/tenants/alpha/infer", json=text, headers={"Authorization": "Basic " + a}).status_code == 401
    # Tenants cannot manage; the admin reaches every tenant.
    assert c.delete("/v1/tenants/beta", headers=auth(a)).status_code == 403
    assert c.get("/v1/jobs", headers=auth(a)).status_code == 403
    assert c.post("/v1/tenants/beta/infer", json=text, headers=auth(ADMIN)).status_code == 200
    assert c.post("/v1/tenants/nobody/infer", json=text, headers=auth(ADMIN)).status_code == 404
    # Tokens are stored hashed.
    stored = open(os.path.join(server.store, "tokens.json")).read()
    assert a.split("~", 1)[1] not in stored and b.split("~", 1)[1] not in stored
    assert json.loads(stored)["tenants"]["alpha"]["scheme"] == "sha256-salted"


def request_counts(server):
    """hkstore_infer_requests_total by (code, tenant)."""
    import re

    text = server.client.get("/metrics", headers=auth(ADMIN)).text
    return {(code, tenant): float(v) for code, tenant, v in
            re.findall(r'hkstore_infer_requests_total\{code="(\d+)",tenant="([^"]*)"\} (\S+)', text)}


def test_a_pinned_level_answers_and_names_itself(server):
    """The env's tenant 'base' has both levels (tenant create's default): each pin is served by its level."""
    c, h = server.client, auth(ADMIN)
    got = {}
    for level in ("plot", "exact", "full"):
        r = c.post("/v1/tenants/base/infer", json={"text": "a short text", "level": level}, headers=h)
        assert r.status_code == 200, r.text
        got[level] = r.json()["results"][0]
        assert got[level]["level_name"] == level
    top = c.post("/v1/tenants/base/infer", json={"text": "a short text", "policy": "exact"}, headers=h).json()
    assert top["results"][0]["probabilities"] == got["full"]["probabilities"]
    assert got["plot"]["probabilities"] != got["full"]["probabilities"]


def test_bad_requests_get_clear_4xx(server):
    c, h = server.client, auth(ADMIN)
    url = "/v1/tenants/base/infer"
    before = request_counts(server)
    bad_json = c.post(url, content=b'{"text": ', headers=dict(h, **{"content-type": "application/json"}))
    assert bad_json.status_code == 400 and "JSON" in bad_json.text
    cases = [{"text": 5}, {"texts": "one"}, {"texts": []}, {"text": "a", "texts": ["b"]}, {}, {"text": ""},
             {"text": "   "}, {"text": "a", "tenant": "x"}, {"texts": ["a"] * 1025}, {"text": "x" * 20000},
             {"text": "a", "truncate": "sometimes"}, {"text": "a", "level": "top"},
             {"text": "a", "level": "plot", "policy": "exact"}]
    for body in cases:
        r = c.post(url, json=body, headers=h)
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert r.json()["detail"]
    assert c.post("/v1/tenants/made-up-name/infer", json={"text": "a"}).status_code == 401
    # Every refusal is counted under its own code, per tenant; a made-up tenant is "other".
    after = request_counts(server)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {("400", "base"): 1, ("422", "base"): len(cases), ("401", "other"): 1}, grew
    r = c.post(url, json={"text": "word " * 100}, headers=h)  # more tokens than --max-len 32
    assert r.status_code == 422 and "max_len" in r.text
    r = c.post(url, json={"texts": ["fine", "word " * 100]}, headers=h)
    assert r.status_code == 422 and "texts[1]" in r.text
    for name in ("-bad", "a" * 65, "..", "a%2Fb", "x%0A"):
        r = c.post(f"/v1/tenants/{name}/infer", json={"text": "a"}, headers=h)
        assert r.status_code in (404, 422), (name, r.status_code)
    r = c.post(url, content=b"x" * (2 << 20), headers=dict(h, **{"content-type": "application/json"}))
    assert r.status_code == 413
    r = c.post("/v1/tenants", json={"tenant": "../etc", "examples": [{"text": "a", "label": "b"}]}, headers=h)
    assert r.status_code == 422
    r = c.post("/v1/tenants", json={"tenant": "t", "task": "tagging", "examples": [{"text": "a", "label": "b"}]},
               headers=h)
    assert r.status_code == 422
    r = c.post("/v1/tenants", json={"tenant": "t", "task": "tagging",
                                    "examples": [{"tokens": ["a b"], "tags": ["O"]}]}, headers=h)
    assert r.status_code == 422
    r = c.post("/v1/tenants", json={"tenant": "base", "examples": [{"text": "a", "label": "b"}]}, headers=h)
    assert r.status_code == 409
    r = c.post("/v1/tenants", json={"tenant": "t", "version": "nope", "examples": [{"text": "a", "label": "b"}]},
               headers=h)
    assert r.status_code == 404
    assert c.get("/v1/jobs/0123456789abcdef", headers=h).status_code == 404
    assert c.get("/v1/jobs/..%2F..%2FCURRENT", headers=h).status_code in (404, 422)
    assert c.post("/v1/tenants/nobody/update", json={}, headers=h).status_code == 404


def test_many_texts_are_split_into_batches_and_truncate_cuts(server):
    c, h = server.client, auth(ADMIN)
    url = "/v1/tenants/base/infer"
    texts = [f"Return the sum of {i} numbers." for i in range(100)]  # more than a batch (--max-batch 32)
    r = c.post(url, json={"texts": texts}, headers=h)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 100 and max(x["batch_size"] for x in results) <= 32
    r = c.post(url, json={"text": "word " * 100, "truncate": True}, headers=h)  # over --max-len 32
    assert r.status_code == 200 and r.json()["results"][0]["truncated"] > 0, r.text
    assert "truncated" not in c.post(url, json={"text": "word"}, headers=h).json()["results"][0]


def test_info_and_openai_embeddings(server, tenants):
    c, h = server.client, auth(ADMIN)
    info = c.get("/info").json()
    assert info["model"] == {"name": "tiny-bert", "names": ["base", "tiny-bert"], "kind": "encoder", "dimensions": 32}
    assert info["limits"]["max_len"] == 32 and info["limits"]["max_texts_per_request"] >= 64
    assert info["routes"]["embeddings"] == "/v1/embeddings" and "store" not in info and "versions" not in info
    admin = c.get("/info", headers=h).json()
    assert admin["versions"][0] == "root" and admin["store"] == os.path.abspath(server.store)
    texts = ["Return the sum of a list.", "Return the cosine of x."]
    r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": texts}, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    vectors = np.array([d["embedding"] for d in body["data"]])
    assert vectors.shape[0] == 2 and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert body["usage"]["prompt_tokens"] > 2
    one = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": texts[0]}, headers=h).json()
    assert np.allclose(one["data"][0]["embedding"], vectors[0], atol=1e-5)
    # A tenant's embedding (its PET in the upper layers), with its own token; not another's.
    tenant, token = next(iter(tenants.items()))
    mine = c.post("/v1/embeddings", json={"model": tenant, "input": texts[0]}, headers=auth(token))
    assert mine.status_code == 200 and not np.allclose(mine.json()["data"][0]["embedding"], vectors[0], atol=1e-4)
    assert c.post("/v1/embeddings", json={"model": "base", "input": "x"}, headers=auth(token)).status_code == 403
    assert c.post("/v1/embeddings", json={"model": "tiny-bert", "input": "x"}).status_code == 401
    assert c.post("/v1/embeddings", json={"model": "nobody", "input": "x"}, headers=h).status_code == 404
    assert c.post("/v1/embeddings", json={"model": "tiny-bert", "input": " "}, headers=h).status_code == 422


def test_manage_domains_and_tenant_update_and_delete(server, tenants, env):
    c, h = server.client, auth(ADMIN)
    docs = open(env["domain"]).read().split("\n")
    more = [d for d in open(env["more"]).read().split("\n") if d]
    r = c.post("/v1/domains", json={"name": "bio", "documents": [d for d in docs if d], "mlm_steps": 2, "alpha": 40,
                                    "max_len": 32}, headers=h)
    assert r.status_code == 202, r.text
    create = r.json()["job"]["id"]
    assert c.post("/v1/domains", json={"name": "bio", "documents": ["x y z"]}, headers=h).status_code == 409
    # Queued after the create, so "bio" is known by then.
    r = c.post("/v1/domains/bio/update", json={"new_name": "bio-2", "documents": more, "mlm_steps": 1}, headers=h)
    assert r.status_code == 202, r.text
    update = r.json()["job"]["id"]
    r = c.post("/v1/tenants/alpha/update", json={"version": "bio-2", "epochs": 1}, headers=h)
    assert r.status_code == 202, r.text
    moved = r.json()["job"]["id"]
    r = c.delete("/v1/tenants/beta", headers=h)
    assert r.status_code == 202, r.text
    removed = r.json()["job"]["id"]
    assert c.delete("/v1/tenants/beta", headers=h).status_code == 404  # already being removed

    for job_id in (create, update, moved, removed):
        job = wait_job(server, job_id)
        assert job["state"] == "done", job
    versions = {v["name"]: v for v in c.get("/v1/domains", headers=h).json()["versions"]}
    assert versions["bio"]["parent"] == "root" and versions["bio-2"]["parent"] == "root"
    assert versions["bio"]["info"]["alpha"] == 40

    # The new version serves at once; the removed tenant is gone, and its token with it.
    r = c.post("/v1/tenants/alpha/infer", json={"text": env["texts"][1]}, headers=auth(tenants["alpha"]))
    assert r.status_code == 200 and r.json()["results"][0]["version"] == "bio-2", r.text
    r = c.post("/v1/tenants/beta/infer", json={"text": "x"}, headers=auth(tenants["beta"]))
    assert r.status_code == 401
    assert c.post("/v1/tenants/beta/infer", json={"text": "x"}, headers=h).status_code == 404
    states = [j["state"] for j in c.get("/v1/jobs", headers=h, params={"limit": 100}).json()["jobs"]]
    assert states and all(s == "done" for s in states)

    # A job that fails says why.
    r = c.post("/v1/tenants", json={"tenant": "gamma", "examples": [{"text": "a", "label": "x"}], "max_len": 8,
                                    "version": "bio", "epochs": 1, "lr": 1.0, "batch_size": 1}, headers=h)
    assert r.status_code == 202
    job = wait_job(server, r.json()["job"]["id"])
    assert job["state"] in ("done", "failed") and (job["state"] == "done" or job["error"])


def test_queue_full_429_and_timeout_504(server, env):
    """A second server on the same store with tiny limits: a queue of one text whose batch waits
    1.5 s for company, and a 0.6 s timeout. It runs no jobs (the first one does): 503."""
    s = Server(env["main"], env["token_file"], "--queue-limit", 1, "--max-wait-ms", 1500, "--request-timeout", 0.6)
    try:
        h = auth(ADMIN)
        first = {}

        def send():
            with httpx.Client(base_url=s.url, timeout=30) as c:
                first["r"] = c.post("/v1/tenants/base/infer", json={"text": "Return the sum."}, headers=h)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 10
        while s.client.get("/healthz", headers=h).json()["queue_depth"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        full = s.client.post("/v1/tenants/base/infer", json={"text": "Join two paths."}, headers=h)
        assert full.status_code == 429, full.text
        assert int(full.headers["Retry-After"]) >= 1
        t.join(30)
        assert first["r"].status_code == 504, first["r"].text
        assert s.client.get("/healthz", headers=h).json()["queue_depth"] == 0  # the timed-out text left the queue
        m = s.client.get("/metrics", headers=h).text
        assert 'hkstore_rejected_total{reason="queue_full"} 1.0' in m
        assert 'hkstore_rejected_total{reason="timeout"} 1.0' in m
        r = s.client.post("/v1/tenants", json={"tenant": "t9", "examples": [{"text": "a", "label": "b"}]}, headers=h)
        assert r.status_code == 503
        assert s.client.get("/healthz", headers=h).json()["jobs_enabled"] is False
    finally:
        s.stop()


def test_dedicated_mode_batches_one_tenant_at_a_time_and_swaps(server, tenants, env):
    """--mode dedicated (the per-tenant full-model baseline): the engine batches one tenant at a
    time and, before a batch computes, swaps in its tenant's emulated model when it is not resident."""
    s = Server(env["main"], env["token_file"], "--mode", "dedicated", "--dedicated-resident", 1, "--max-wait-ms", 20)
    try:
        h = auth(ADMIN)
        for tenant in ("base", "alpha", "base"):
            r = s.client.post(f"/v1/tenants/{tenant}/infer", json={"texts": ["Return the sum.", "Join two paths."]},
                              headers=h)
            assert r.status_code == 200, r.text
            assert [x["batch_size"] for x in r.json()["results"]] == [2, 2]
            assert [x["level_name"] for x in r.json()["results"]] == ["exact", "exact"]  # no PLOT lookup
        for asks in ({"policy": "fast"}, {"level": "plot"}, {"students": 1}):
            r = s.client.post("/v1/tenants/base/infer", json={"texts": ["Return the sum."], **asks}, headers=h)
            assert r.status_code == 422 and "dedicated" in r.json()["detail"], r.text
        assert s.client.get("/healthz", headers=h).json()["mode"] == "dedicated"  # details: the admin token
        assert "hkstore_dedicated_swaps_total 3.0" in s.client.get("/metrics", headers=h).text
    finally:
        s.stop()


# -- hardening ---------------------------------------------------------------------------------------------


def test_unauthenticated_bodies_are_refused_before_they_are_read(server):
    """60 MB declared (Content-Length or chunked), 1 MiB sent, no token: 401 at once, and no
    422 that would show the schema; a tenant token on a manage route: 403."""
    for path, framing, line, seconds in reliability_http.unauthenticated_bodies(server.url):
        assert " 401 " in line + " " and seconds < 5, (path, framing, line, seconds)
    for token in (None, "nope-nope"):
        r = server.client.post("/v1/tenants", content=b'{"tenant": 5}', headers=auth(token) if token else {})
        assert r.status_code == 401 and "tenant" not in r.text and r.headers["connection"] == "close", r.text
    r = server.client.post("/v1/tenants/base/update", json={"epochs": 1, "x": "a" * (100 << 10)}, headers=auth(ADMIN))
    assert r.status_code == 422  # an upload route: a body past the manage limit still reaches validation
    r = server.client.request("DELETE", "/v1/tenants/nobody", content=b"x" * (100 << 10), headers=auth(ADMIN))
    assert r.status_code == 413  # any other manage body is bounded by what a manage request needs


def test_probes_never_get_a_5xx(server):
    result = reliability_http.run_probes(server.url, ADMIN, tenant="base")
    assert result["5xx"] == 0 and not result["failures"], result["failures"]
    assert result["probes"] >= 100 and result["unauthenticated_fast"] == 10


def test_half_open_connection_is_closed_by_the_header_timeout(server):
    seconds = reliability_http.half_open(server.url, bound=20)
    assert 2 < seconds < 8, seconds  # --header-timeout 3
    assert server.client.get("/healthz").status_code == 200


def _stalled_bodies(url, headers, n, sent, promised, bound):
    """n connections that send a whole head with `headers` and `sent` of `promised` body bytes,
    then nothing: per connection (status line or "" if closed without one, seconds to the end)."""
    host, port = url.split("//")[1].split(":")
    head = (f"POST /v1/tenants/base/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {promised}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    socks = []
    start = time.monotonic()
    try:
        for _ in range(n):
            sock = socket.create_connection((host, int(port)), timeout=bound)
            sock.sendall(head.encode() + b'{"text": "x' + b"x" * (sent - 11))
            socks.append(sock)
        out = []
        for sock in socks:
            sock.settimeout(max(bound - (time.monotonic() - start), 0.1))
            data = b""
            try:
                while chunk := sock.recv(4096):
                    data += chunk
            except socket.timeout:
                out.append(("still open", time.monotonic() - start))
                continue
            out.append((data.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - start))
        return out
    finally:
        for sock in socks:
            sock.close()


def test_authenticated_bodies_that_stall_are_answered_408_by_the_body_timeout(server, tenants):
    """50 connections with a valid token send 12 of 100 promised bytes and stall: each is
    answered 408 and closed at --body-timeout (3 s), not held while the client waits; a tenant's
    token the same; a trickle below --min-body-rate too; the server serves all along."""
    for token in (ADMIN, tenants["alpha"]):
        out = _stalled_bodies(server.url, auth(token), 50 if token == ADMIN else 5, 12, 100, bound=20)
        assert all(status.startswith("HTTP/1.1 408") for status, _ in out), out
        assert all(2.5 < seconds < 10 for _, seconds in out), out
    r = server.client.post("/v1/tenants/base/infer", json={"text": "Return the sum."}, headers=auth(ADMIN))
    assert r.status_code == 200, r.text

    # A trickle: 1 byte every 0.25 s (4 B/s, far under the minimum rate) is cut near the deadline.
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(f"POST /v1/tenants/base/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000\r\n"
                     f"Authorization: Bearer {ADMIN}\r\n\r\n".encode())
        start, answer, closed = time.monotonic(), b"", False
        sock.settimeout(0.25)
        while not closed and time.monotonic() - start < 15:
            try:
                chunk = sock.recv(4096)
                answer += chunk
                closed = not chunk
                continue
            except socket.timeout:
                pass
            except ConnectionResetError:  # our byte crossed the server's close: the answer may be lost
                closed = True
                continue
            try:
                sock.sendall(b" ")
            except OSError:
                closed = True
        seconds = time.monotonic() - start
        assert closed and 2.5 < seconds < 8, (seconds, answer)
        assert answer.startswith(b"HTTP/1.1 408") or not answer, answer


def test_damaged_pet_answers_503_others_are_served_and_healthz_degrades(server, env):
    import hkstore
    from formats.pack import PetRecord

    def writer():
        deadline = time.monotonic() + JOB_TIMEOUT
        while True:
            try:
                return hkstore.open(env["main"], writable=True)
            except hkstore.StoreLocked:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    with writer() as st:
        base = st.get_pet("base")
        st.put_pet(PetRecord("dmg", dict(base.meta, tenant="dmg"), base.tensors))
        loc = st.pets()["dmg"]
    pack_path = os.path.join(env["main"], "packs", loc["file"])
    at = loc["offset"] + loc["length"] // 2
    with open(pack_path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    try:
        c, h = server.client, auth(ADMIN)
        deadline = time.monotonic() + 10
        while c.get("/v1/tenants/dmg", headers=h).status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.2)  # the server picks the commit up within a second
        r = c.post("/v1/tenants/dmg/infer", json={"text": "Return the sum."}, headers=h)
        assert r.status_code == 503 and "store damaged: run hkstore verify" in r.json()["detail"], r.text
        assert c.get("/v1/tenants/dmg", headers=h).status_code == 503
        ok = c.post("/v1/tenants/base/infer", json={"text": "Return the sum."}, headers=h)
        assert ok.status_code == 200, ok.text  # tenants whose data is intact are served
        assert c.get("/healthz").json() == {"status": "degraded"}  # the reason names files: the admin's
        health = c.get("/healthz", headers=h).json()
        assert health["status"] == "degraded" and "dmg" in health["reason"], health
        metrics = c.get("/metrics", headers=h).text
        assert "hkstore_store_degraded 1.0" in metrics and "hkstore_store_damaged_total" in metrics
    finally:
        with open(pack_path, "r+b") as f:
            f.seek(at)
            f.write(byte)
        with writer() as st:
            st.delete_pet("dmg")
    deadline = time.monotonic() + 10
    while server.client.get("/healthz").json()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.client.get("/healthz").json()["status"] == "ok"


def test_restart_in_the_middle_of_a_job(env):
    store = env["restart"]
    s = Server(store, env["token_file"])
    body = {"tenant": "slow", "examples": classification_examples(env), "epochs": 150, "max_len": 32}
    r = s.client.post("/v1/tenants", json=body, headers=auth(ADMIN))
    assert r.status_code == 202, r.text
    job_id, token = r.json()["job"]["id"], r.json()["token"]
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while True:  # wait until it trains, then pull the plug
            job = s.client.get(f"/v1/jobs/{job_id}", headers=auth(ADMIN)).json()["job"]
            if job["state"] == "running" and job["progress"].get("step", 0) >= 1:
                break
            assert job["state"] != "done", "the job finished before the kill: make it longer"
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        s.kill()
    except BaseException:
        s.stop()
        raise
    on_disk = json.load(open(os.path.join(store, "jobs", f"{job_id}.json")))
    assert on_disk["state"] == "running" and on_disk["attempts"] == 1
    deadline = time.monotonic() + 15  # the worker dies with its server
    while alive(on_disk["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(on_disk["pid"])

    s2 = Server(store, env["token_file"])
    try:
        job = wait_job(s2, job_id, timeout=2 * JOB_TIMEOUT)
        assert job["state"] == "done", job
        assert job["attempts"] == 2
        r = s2.client.post("/v1/tenants/slow/infer", json={"text": "Return the sum."}, headers=auth(token))
        assert r.status_code == 200, r.text
    finally:
        s2.stop()


# -- schemathesis: no 5xx for any input the schema allows (or not) ------------------------------------

try:
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
except ImportError:  # the test extra brings it: pip install -e '.[test]'
    schemathesis = None


@pytest.fixture(scope="module")
def fuzz_server(env):
    s = Server(env["fuzz"], env["token_file"], "--request-timeout", 10)
    yield s
    s.stop()


if schemathesis is None:

    @pytest.mark.skip(reason="schemathesis is not installed (pip install -e '.[test]')")
    def test_schemathesis_no_server_errors():
        pass

else:

    @pytest.fixture(scope="module")
    def fuzz_schema(fuzz_server):
        from schemathesis import GenerationMode

        loaded = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
        loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
        return loaded

    schema = schemathesis.pytest.from_fixture("fuzz_schema")

    def _no_server_error(case, fuzz_server):
        """Every operation, generated inputs valid and not, with the admin token and without,
        and once more for a tenant that exists: never a 5xx."""
        for headers in (auth(ADMIN), {}):
            response = case.call(headers=headers, timeout=30)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
                f"{fuzz_server.output()}")
        if isinstance(case.path_parameters, dict) and "tenant" in case.path_parameters:
            case.path_parameters["tenant"] = "base"
            response = case.call(headers=auth(ADMIN), timeout=30)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}")

    @schema.parametrize()
    @settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    def test_schemathesis_no_server_errors(case, fuzz_server):
        _no_server_error(case, fuzz_server)

    @pytest.mark.slow
    @schema.parametrize()
    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    def test_schemathesis_no_server_errors_many(case, fuzz_server):
        """The same with five times the examples: over a thousand requests."""
        _no_server_error(case, fuzz_server)