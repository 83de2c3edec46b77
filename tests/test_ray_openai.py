"""The OpenAI routes of a decoder store under `hkstore serve --ray` (runtime/serve/ray_app.py):
the openai client against a local Ray Serve cluster, streamed answers chunk by chunk through
Ray's streaming handle, requests routed by model to the workers, the same 4xx as one server."""

import os
import shutil
import tempfile
import time

import pytest
import torch
from test_ray_serve import free_port  # below the ephemeral range Ray's processes draw from
from test_serve import ADMIN, auth

pytestmark = pytest.mark.slow

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray.serve")
    import logging

    import httpx
    import ray
    from ray import serve

    from runtime.construct.decoder_store import build_decoder
    from runtime.construct.decoder_tenant import lm_tenant_create
    from runtime.model.tiny_decoder import make_tiny_decoder
    from runtime.serve import ray_app

    tmp = tmp_path_factory.mktemp("rayoai")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_decoder(tmp / "m", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=1024, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2, progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    lm_tenant_create(tmp / "s", "acme", train_path=tmp / "acme.txt", epochs=3, batch_size=4, lr=1e-2, progress=False)
    torch.set_num_threads(threads)
    temp = tempfile.mkdtemp(prefix="hkray", dir="/tmp")
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        ray_app.run(str(tmp / "s"), ADMIN, port=port, blocking=False, replicas=1, device="cpu", max_len=32,
                    replica_cpus=1)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)
        yield {"client": client, "store": str(tmp / "s"), "url": f"http://127.0.0.1:{port}"}
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_completions_streamed_and_not_through_ray(cluster):
    import openai

    import runtime

    with runtime.open(cluster["store"]) as rt:
        want = rt.generate([{"tenant": "acme", "prompt": "the cat sat on", "max_tokens": 6}])[0]["text"]
    c = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=ADMIN, max_retries=0, timeout=60)
    r = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0)
    assert r.choices[0].text == want
    chunks = list(c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and len(chunks) >= 2
    stream = c.chat.completions.create(model="acme", messages=[{"role": "user", "content": "the dog"}],
                                       max_tokens=4, temperature=0, stream=True)
    assert sum(1 for _ in stream) >= 2
    assert {m.id for m in c.models.list()} >= {"acme"}


def _worker_counts(client):
    """(499s, tokens) the workers report in the cluster's /metrics (pushed every 2 s)."""
    cancelled = tokens = 0.0
    for line in client.get("/metrics", headers=auth(ADMIN)).text.splitlines():
        if line.startswith("hkstore_gen_requests_total{") and 'status="499"' in line:
            cancelled += float(line.split()[-1])
        elif line.startswith("hkstore_gen_tokens_total{"):
            tokens += float(line.split()[-1])
    return cancelled, tokens


def test_a_client_leaving_a_stream_cancels_it_on_the_worker(cluster):
    """The stream comes chunk by chunk: a client that leaves after the first event cancels the
    sequence on its worker (counted 499 there) long before its 1000 tokens. ignore_eos keeps the
    sequence going whatever the tenant learnt (greedy, this one ends by EOS after 5 tokens: that
    race with the client's leaving was the old xfail)."""
    c = cluster["client"]
    _, before = _worker_counts(c)
    body = {"model": "acme", "prompt": "the cat", "max_tokens": 1000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with c.stream("POST", "/v1/completions", json=body, headers=auth(ADMIN)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text_completion"' in first
    deadline = time.monotonic() + 60
    while _worker_counts(c)[0] < 1:
        assert time.monotonic() < deadline, "no sequence was cancelled on the worker"
        time.sleep(0.5)
    time.sleep(2 * 2.5)  # the worker's next metrics push: the tokens made up to the cancel
    made = _worker_counts(c)[1] - before
    assert made < 500, made  # cut well before its 1000 tokens


def test_generation_errors_under_ray_are_the_single_servers_4xx(cluster):
    c = cluster["client"]
    assert c.post("/v1/completions", json={"model": "nobody", "prompt": "x"}, headers=auth(ADMIN)).status_code == 404
    r = c.post("/v1/completions", json={"model": "acme", "prompt": "x", "n": 0}, headers=auth(ADMIN))
    assert r.status_code == 400 and "n must be between 1 and 128" in r.text
    assert c.post("/v1/completions", json={"model": "acme", "prompt": "x"}).status_code == 401
    assert os.path.isdir(cluster["store"])


# -- without a cluster: the pieces the streamed route is made of ------------------------------------


def test_the_ingress_routes_generation_by_model_and_streams_only_when_asked():
    from runtime.serve.ray_app import Ingress, _streamed

    ing = Ingress.__new__(Ingress)
    ing.workers, ing.manager = "workers", "manager"
    body = b'{"model": "acme", "prompt": "x", "stream": true}'
    assert ing._target("POST", "/v1/completions", {}, body) == ("workers", "acme", "generate", True)
    assert ing._target("POST", "/v1/chat/completions", {"x-hkstore-route": "any"}, body)[:3] == \
        ("workers", "", "generate")
    assert ing._target("GET", "/v1/models", {})[:3] == ("workers", "", "health")
    assert _streamed(body) and not _streamed(b'{"model": "acme"}') and not _streamed(b"not json")
