"""One `hkstore serve` over an encoder store and a decoder store side by side (a real server on
loopback): each tenant's routes reach its own store, the openai client generates with the
decoder tenant and embeds with the encoder one, the wrong kind of request is a clear 4xx, and
a tenant name in both stores is refused at startup in one line."""

import shutil

import openai
import pytest
import torch
from click.testing import CliRunner
from test_serve import ADMIN, Server, auth

import runtime
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import lm_tenant_create
from runtime.construct.manager import build, tenant_create
from runtime.model.tiny import make_tiny_model
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.serve.cli import serve
from hkstore.tokens import issue

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("stores")
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    dec_model = make_tiny_decoder(tmp / "dm", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=64, scale=1.0)
    build_decoder(tmp / "gpt", model_path=dec_model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2,
                  progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    lm_tenant_create(tmp / "gpt", "writer", train_path=tmp / "acme.txt", epochs=2, batch_size=4, lr=1e-2,
                     progress=False)
    enc_model = make_tiny_model(tmp / "em", TEXTS, d=16, layers=2)
    build(tmp / "bert", model_path=enc_model, corpus_paths=[tmp / "c.txt"], lower_layers=1, progress=False)
    (tmp / "cls.jsonl").write_text("".join(f'{{"text": "{t}", "label": "{"pos" if i % 2 else "neg"}"}}\n'
                                           for i, t in enumerate(TEXTS * 4)))
    tenant_create(tmp / "bert", "labeler", version="root", train_path=tmp / "cls.jsonl", epochs=1, max_len=32,
                  progress=False)
    torch.set_num_threads(threads)
    (tmp / "admin.token").write_text(ADMIN)
    tokens = {"writer": issue(str(tmp / "gpt"), "writer")["token"],
              "labeler": issue(str(tmp / "bert"), "labeler")["token"]}
    server = Server(str(tmp / "bert"), str(tmp / "admin.token"), str(tmp / "gpt"))
    yield {"tmp": tmp, "server": server, "tokens": tokens}
    server.stop()


def client(env, token):
    return openai.OpenAI(base_url=env["server"].url + "/v1", api_key=token, max_retries=0, timeout=30)


def test_each_tenant_reaches_its_own_store(env):
    s, tokens = env["server"], env["tokens"]
    health = s.client.get("/healthz").json()
    assert health == {"status": "ok", "stores": {"bert": {"status": "ok"}, "gpt": {"status": "ok"}}}
    health = s.client.get("/healthz", headers=auth(ADMIN)).json()  # the admin sees each store's details
    assert health["stores"]["gpt"]["tenants"] == 1 and health["stores"]["bert"]["jobs_enabled"] is True

    # The decoder tenant generates through the openai client, with its own token, as in process.
    with runtime.open(env["tmp"] / "gpt") as rt:
        want = rt.generate([{"tenant": "writer", "prompt": "the cat sat on", "max_tokens": 5}])[0]["text"]
    c = client(env, tokens["writer"])
    assert c.completions.create(model="writer", prompt="the cat sat on", max_tokens=5,
                                temperature=0).choices[0].text == want
    stream = c.chat.completions.create(model="writer", messages=[{"role": "user", "content": "the dog"}],
                                       max_tokens=4, temperature=0, stream=True)
    assert sum(1 for _ in stream) >= 2
    base = c.completions.create(model="base", prompt="the cat", max_tokens=3, temperature=0)  # the GPT root's
    assert base.usage.completion_tokens >= 1

    # The encoder tenant classifies and embeds (its own token), through the same server.
    r = s.client.post("/v1/tenants/labeler/infer", json={"text": "the cat sat"}, headers=auth(tokens["labeler"]))
    assert r.status_code == 200 and r.json()["results"][0]["label"] in ("pos", "neg"), r.text
    e = client(env, tokens["labeler"]).embeddings.create(model="labeler", input=["the cat"],
                                                              encoding_format="float")
    assert len(e.data[0].embedding) == 16

    # /v1/models: every store's models this token reaches.
    ids = {m.id for m in client(env, ADMIN).models.list()}
    assert {"writer", "labeler"} <= ids
    assert "labeler" not in {m.id for m in c.models.list()}

    # Each store's own routes under /stores/NAME/; a store-wide route at the top names them.
    assert s.client.get("/stores/gpt/v1/tenants", headers=auth(ADMIN)).json()["tenants"][0]["tenant"] == "writer"
    assert "hkstore_gen_tokens_total" in s.client.get("/stores/gpt/metrics", headers=auth(ADMIN)).text
    r = s.client.get("/v1/tenants", headers=auth(ADMIN))
    assert r.status_code == 400 and "/stores/<name>/v1/tenants" in r.text
    assert s.client.get("/stores/nope/healthz").status_code == 404


def test_info_of_each_store_and_of_the_server(env):
    """/info on a decoder store, an encoder store and the server over both: the model and the
    limits for everyone, no path on disk without the admin token."""
    s = env["server"]
    gpt = s.client.get("/stores/gpt/info")
    assert gpt.status_code == 200, gpt.text
    assert gpt.json()["model"] == {"name": "tiny-gpt2", "names": ["base", "tiny-gpt2"], "kind": "decoder",
                                   "dimensions": 32}
    assert gpt.json()["limits"]["context_length"] == 64 and "completions" in gpt.json()["routes"]
    bert = s.client.get("/stores/bert/info").json()
    assert bert["model"]["kind"] == "encoder" and bert["limits"]["max_len"] == 32
    both = s.client.get("/info")
    assert both.status_code == 200 and both.json() == {"stores": {"bert": bert, "gpt": gpt.json()}}
    assert str(env["tmp"]) not in both.text
    admin = s.client.get("/info", headers=auth(ADMIN)).json()["stores"]
    assert admin["gpt"]["store"] == str(env["tmp"] / "gpt") and admin["gpt"]["tenants"] == 1
    assert admin["bert"]["model"]["model_path"] == str(env["tmp"] / "em")
    assert s.client.get("/stores/gpt/info", headers=auth(ADMIN)).json() == admin["gpt"]


def test_the_wrong_kind_of_request_is_a_clear_4xx(env):
    s, tokens = env["server"], env["tokens"]
    r = s.client.post("/v1/completions", json={"model": "labeler", "prompt": "x"}, headers=auth(ADMIN))
    assert r.status_code == 400 and "encoder store" in r.text, r.text
    r = s.client.post("/v1/chat/completions", json={"model": "labeler", "messages": [{"role": "user", "content": "x"}]},
                      headers=auth(ADMIN))
    assert r.status_code == 400 and "do not generate" in r.text
    r = s.client.post("/v1/tenants/writer/infer", json={"text": "x"}, headers=auth(ADMIN))
    assert r.status_code == 422 and "does not classify" in r.text, r.text
    r = s.client.post("/v1/embeddings", json={"model": "writer", "input": "x"}, headers=auth(ADMIN))
    assert r.status_code == 422 and "does not embed" in r.text, r.text
    with pytest.raises(openai.NotFoundError):
        client(env, ADMIN).completions.create(model="nobody", prompt="x")
    # A tenant's token reaches its own tenant only, whichever store the other one is in.
    r = s.client.post("/v1/completions", json={"model": "writer", "prompt": "x"}, headers=auth(tokens["labeler"]))
    assert r.status_code in (401, 403)
    assert s.client.post("/v1/completions", json={"model": "writer", "prompt": "x"}).status_code == 401
    # A tenant made through the server may not take a name of the other store.
    r = s.client.post("/stores/bert/v1/tenants", json={"tenant": "writer", "examples": [{"text": "a", "label": "x"}]},
                      headers=auth(ADMIN))
    assert r.status_code == 409 and "another store" in r.text, r.text


def test_a_tenant_in_two_stores_is_refused_at_startup(env, tmp_path):
    other = tmp_path / "gpt2"
    shutil.copytree(env["tmp"] / "gpt", other)
    r = CliRunner().invoke(serve, [str(env["tmp"] / "gpt"), str(other), "--admin-token-file",
                                   str(env["tmp"] / "admin.token")])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert "tenant 'writer' is in both gpt and gpt2" in r.output
    same = tmp_path / "x" / "gpt"
    shutil.copytree(env["tmp"] / "bert", same)
    r = CliRunner().invoke(serve, [str(env["tmp"] / "gpt"), str(same)])
    assert r.exit_code == 1 and "two stores are named 'gpt'" in r.output
