"""The HTTP server's answers where trust is at stake, in process (runtime.serve.app over a tiny
encoder store with two tenants, through starlette's TestClient, lifespan included):

- a damaged tokens.json never makes a 5xx: tenant tokens get 401, the admin token works, and
  /healthz says degraded (the reason to the admin only); any bytes at all (hypothesis);
- the OpenAI-compatible routes answer errors in OpenAI's shape, which the official client shows;
- a tenant's token cannot tell another tenant from no tenant on those routes;
- a body that is not UTF-8 is 422 with a reason, one that is not JSON 400 (and documented);
- the OpenAPI description agrees with the server (schemathesis' conformance checks)."""

import json
import os

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from hkstore.tokens import issue
from runtime.construct.manager import build, tenant_create
from runtime.model.tiny import make_tiny_model
from runtime.serve.app import create_app

ADMIN = "admin-token-for-tests-0123456789"
TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]


def auth(token):
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("trust")
    (tmp / "c.txt").write_text("\n".join(TEXTS))
    model = make_tiny_model(tmp / "m", TEXTS, d=16, layers=2)
    build(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], lower_layers=1, progress=False)
    (tmp / "cls.jsonl").write_text("".join(json.dumps({"text": t, "label": "pos" if i % 2 else "neg"}) + "\n"
                                           for i, t in enumerate(TEXTS * 4)))
    for tenant in ("acme", "beta"):
        tenant_create(tmp / "s", tenant, version="root", train_path=tmp / "cls.jsonl", epochs=1, max_len=32,
                      levels=("plot",), progress=False)
    torch.set_num_threads(threads)
    store = str(tmp / "s")
    tokens = {t: issue(store, t)["token"] for t in ("acme", "beta")}
    app = create_app(store, admin_token=ADMIN, device="cpu", max_len=32)
    with TestClient(app) as client:
        yield {"store": store, "client": client, "tokens": tokens, "app": app}


@pytest.fixture
def damaged_tokens(env):
    """Restores tokens.json after a test that damages it."""
    path = os.path.join(env["store"], "tokens.json")
    saved = open(path, "rb").read()
    yield path
    with open(path, "wb") as f:
        f.write(saved)


def write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def tenant_requests(env):
    """(method, path, json) a tenant token sends: infer, tenant info, embeddings, models."""
    return [("POST", "/v1/tenants/acme/infer", {"text": "the cat"}), ("GET", "/v1/tenants/acme", None),
            ("POST", "/v1/embeddings", {"model": "acme", "input": "the cat"}), ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": "acme", "prompt": "x"})]


def test_a_damaged_token_file_refuses_tenant_tokens_keeps_the_admin_and_says_degraded(env, damaged_tokens, caplog):
    c, token = env["client"], env["tokens"]["acme"]
    assert c.post("/v1/tenants/acme/infer", json={"text": "the cat"}, headers=auth(token)).status_code == 200
    assert c.get("/healthz").json() == {"status": "ok"}
    for data in (b"{not json", b"\x00\xff" * 50, b'{"format": 1, "tenants": []}', b"[]",
                 b'{"format": 1, "tenants": {"acme": {"salt": "not hex", "hash": 7}}}'):
        write(damaged_tokens, data)
        for method, path, body in tenant_requests(env):
            for tok in (token, "acme~wrong", "nobody~x"):
                r = c.request(method, path, json=body, headers=auth(tok))
                assert r.status_code == 401, (data, path, r.status_code, r.text)
        r = c.post("/v1/tenants/acme/infer", json={"text": "the cat"}, headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        assert c.get("/healthz").json() == {"status": "degraded"}  # no reason without the admin token
        health = c.get("/healthz", headers=auth(ADMIN)).json()
        assert health["status"] == "degraded" and "tokens.json is damaged" in health["reason"], health
        assert "hkstore_tokens_damaged 1.0" in c.get("/metrics", headers=auth(ADMIN)).text
    assert any("tokens.json is damaged" in r.getMessage() for r in caplog.records)


def test_a_token_file_repaired_works_again(env, damaged_tokens):
    c, token = env["client"], env["tokens"]["acme"]
    saved = open(damaged_tokens, "rb").read()
    write(damaged_tokens, b"garbage")
    assert c.post("/v1/tenants/acme/infer", json={"text": "the cat"}, headers=auth(token)).status_code == 401
    write(damaged_tokens, saved)
    assert c.post("/v1/tenants/acme/infer", json={"text": "the cat"}, headers=auth(token)).status_code == 200
    assert c.get("/healthz", headers=auth(ADMIN)).json()["status"] == "ok"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.binary(max_size=400) | st.builds(
    lambda tenants: json.dumps({"format": 1, "tenants": tenants}).encode(),
    st.dictionaries(st.text(max_size=8), st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=70),
                                                      lambda k: st.lists(k, max_size=3)
                                                      | st.dictionaries(st.sampled_from(["salt", "hash", "x"]), k),
                                                      max_leaves=6), max_size=3)))
def test_any_bytes_in_the_token_file_never_make_a_5xx(env, damaged_tokens, data):
    c, token = env["client"], env["tokens"]["acme"]
    write(damaged_tokens, data)
    for method, path, body in tenant_requests(env)[:3]:
        for tok in (token, "acme~wrong"):
            r = c.request(method, path, json=body, headers=auth(tok))
            assert r.status_code in (401, 200, 400), (data, path, r.status_code, r.text)
    assert c.get("/healthz", headers=auth(ADMIN)).status_code == 200
    assert c.post("/v1/tenants/acme/infer", json={"text": "the cat"}, headers=auth(ADMIN)).status_code == 200


# -- the OpenAI-compatible routes ------------------------------------------------------------------


def openai_client(env, token):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=token, max_retries=0, http_client=env["client"])


def test_openai_routes_answer_errors_in_openais_shape_and_the_client_shows_the_reason(env):
    c = env["client"]
    cases = [("/v1/embeddings", {"model": "acme", "input": "x", "dimensions": 10_000}, ADMIN, 422, "dimensions"),
             ("/v1/embeddings", {"model": "ghost", "input": "x"}, ADMIN, 404, "unknown model"),
             ("/v1/embeddings", {"model": "acme", "input": []}, ADMIN, 422, "input"),
             ("/v1/embeddings", {"model": "acme", "input": "x"}, "acme~wrong", 401, "invalid token"),
             ("/v1/completions", {"model": "acme", "prompt": "x"}, ADMIN, 400, "encoder store"),
             ("/v1/completions", {"prompt": "x"}, ADMIN, 422, "model")]
    for path, body, token, status, words in cases:
        r = c.post(path, json=body, headers=auth(token))
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    headers = dict(auth(ADMIN), **{"content-type": "application/json"})
    r = c.post("/v1/embeddings", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert c.get("/v1/models").json()["error"]["type"] == "authentication_error"
    # Other routes keep {"detail": ...}
    assert "detail" in c.post("/v1/tenants/acme/infer", json={}, headers=auth(ADMIN)).json()

    admin = openai_client(env, ADMIN)
    with pytest.raises(openai.UnprocessableEntityError, match="dimensions=10000 is more than the model's"):
        admin.embeddings.create(model="acme", input="the cat", dimensions=10_000)
    with pytest.raises(openai.NotFoundError, match="unknown model 'ghost'"):
        admin.embeddings.create(model="ghost", input="the cat")
    with pytest.raises(openai.BadRequestError, match="encoder store"):
        admin.completions.create(model="acme", prompt="x")
    with pytest.raises(openai.AuthenticationError, match="invalid token"):
        openai_client(env, "acme~wrong").embeddings.create(model="acme", input="the cat")
    assert len(openai_client(env, env["tokens"]["acme"]).embeddings.create(model="acme", input="the cat").data) == 1


def test_a_tenant_token_cannot_tell_another_tenant_from_no_tenant(env):
    c, token = env["client"], env["tokens"]["acme"]
    for path, key in (("/v1/completions", "prompt"), ("/v1/chat/completions", None), ("/v1/embeddings", "input")):
        answers = []
        for model in ("beta", "ghost", "no/such"):
            body = {"model": model, **({key: "x"} if key else {"messages": [{"role": "user", "content": "x"}]})}
            r = c.post(path, json=body, headers=auth(token))
            answers.append((r.status_code, r.json()["error"]["message"].replace(repr(model), "M")))
        assert answers[0] == answers[1] == answers[2] and answers[0][0] == 403, (path, answers)
    assert c.get("/v1/tenants/beta", headers=auth(token)).status_code == \
        c.get("/v1/tenants/ghost", headers=auth(token)).status_code == 403
    assert c.post("/v1/completions", json={"model": "ghost", "prompt": "x"}, headers=auth(ADMIN)).status_code == 404
    assert c.get("/v1/tenants/acme", headers=auth(token)).status_code == 200  # its own, as documented


# -- bodies and the schema ---------------------------------------------------------------------------


def test_a_body_that_is_not_utf8_is_422_with_a_reason_and_not_json_400(env):
    c = env["client"]
    headers = dict(auth(ADMIN), **{"content-type": "application/json"})
    for path in ("/v1/tenants/acme/infer", "/v1/embeddings", "/v1/completions"):
        body = b'{"text": "caf\xe9", "model": "acme", "input": "x", "prompt": "x"}'
        r = c.post(path, content=body, headers=headers)
        assert r.status_code == 422 and "not valid UTF-8 (byte 13" in r.text, (path, r.status_code, r.text)
        assert c.post(path, content=b'{"text": ', headers=headers).status_code == 400
    r = c.post("/v1/tenants/acme/infer", content='{"text": "café"}'.encode(), headers=headers)
    assert r.status_code == 200, r.text


def test_strict_booleans_one_of_text_and_texts_and_the_cli_default_pet(env):
    c = env["client"]
    for body in ({"text": "a", "truncate": 0}, {"text": "a", "truncate": "yes"}, {"text": "a", "texts": ["b"]},
                 {"text": None, "texts": ["b"]}):
        r = c.post("/v1/tenants/acme/infer", json=body, headers=auth(ADMIN))
        assert r.status_code == 422, (body, r.text)
    r = c.post("/v1/tenants/acme/infer", json={"text": "a", "truncate": True}, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    schema = c.get("/openapi.json").json()
    infer = schema["components"]["schemas"]["InferBody"]
    assert infer["oneOf"] == [{"required": ["text"]}, {"required": ["texts"]}]
    assert infer["properties"]["text"]["type"] == "string"  # not nullable: null counts as given
    from runtime.construct.recipe import PLOT_PET_TYPE

    assert schema["components"]["schemas"]["TenantCreateBody"]["properties"]["pet_type"]["default"] == PLOT_PET_TYPE


def test_openapi_agrees_on_auth_errors_and_methods(env):
    c = env["client"]
    schema = c.get("/openapi.json").json()
    for path in ("/healthz", "/info"):
        assert "security" not in schema["paths"][path]["get"], path
        assert c.get(path).status_code == 200
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if "requestBody" in op:
                assert "400" in op["responses"], (method, path)
    get_tenant = schema["paths"]["/v1/tenants/{tenant}"]["get"]
    assert "tenant's own token" in get_tenant["responses"]["403"]["description"]
    for path, want in (("/v1/tenants", "GET, POST"), ("/v1/tenants/acme", "DELETE, GET"),
                       ("/v1/tenants/acme/infer", "POST"), ("/healthz", "GET")):
        for method in ("OPTIONS", "PUT", "PATCH"):
            r = c.request(method, path)
            assert r.status_code == 405 and r.headers["allow"] == want, (method, path, r.status_code, r.headers)


# -- schemathesis: the server does what its OpenAPI description says ------------------------------

try:
    import schemathesis
except ImportError:  # the test extra brings it: pip install -e '.[test]'
    schemathesis = None


@pytest.fixture(scope="module")
def fuzz_client(env):
    """A second app on the store: env's holds STORE/jobs/LOCK, so this one runs no jobs (a valid
    manage request is answered 503, as documented) and fuzzing trains nothing."""
    app = create_app(env["store"], admin_token=ADMIN, device="cpu", max_len=32)
    with TestClient(app) as client:
        yield client


@pytest.mark.slow  # 15 s to a minute on two busy cores
@pytest.mark.skipif(schemathesis is None, reason="schemathesis is not installed (pip install -e '.[test]')")
def test_schemathesis_conformance(fuzz_client):
    """Every operation, with inputs the schema allows and inputs it does not, with the admin
    token: the status code is documented, a valid request is not refused (unless for what only
    the store knows), an invalid one is."""
    from hypothesis import Phase
    from hypothesis.errors import Unsatisfiable

    from schemathesis import GenerationMode
    from schemathesis.specs.openapi import checks

    schema = schemathesis.openapi.from_dict(fuzz_client.get("/openapi.json").json())
    shared = [checks.status_code_conformance, checks.content_type_conformance, checks.response_schema_conformance]
    # What only the store knows, or no schema can say: the model's dimension and vocabulary, text
    # that is only whitespace, a word with a space in it, as many tags as words, a name that is
    # no tenant.
    semantic = ("more than the model's", "token ids must lie in", "is blank", "must not hold whitespace",
                "tokens but", "a classification example is", "a tagging example is", "examples mix",
                "unknown tenant", "unknown model", "unknown version", "does not fit task")
    failures = []

    def send(case, mode):
        kwargs = case.as_transport_kwargs(base_url="http://testserver")
        kwargs.pop("cookies", None)
        if "data" in kwargs:
            kwargs["content"] = kwargs.pop("data")
        if "Authorization" in (case.headers or {}):  # (a negative case may leave it out: then so do we)
            kwargs["headers"] = dict(kwargs.get("headers") or {}, Authorization=f"Bearer {ADMIN}")
        response = fuzz_client.request(**kwargs)
        if mode == GenerationMode.NEGATIVE:
            run = shared + [checks.negative_data_rejection]
        elif response.status_code == 422 and any(words in response.text for words in semantic):
            run = shared
        else:
            run = shared + [checks.positive_data_acceptance]
        try:
            case.validate_response(response, checks=run, headers=kwargs.get("headers"))
        except BaseExceptionGroup as e:  # schemathesis' failures: collect them all, then report
            failures.append(f"{mode.value} {case.method} {case.formatted_path} {kwargs.get('json')!r:.200} -> "
                            f"{response.status_code} {response.text[:300]}: "
                            f"{' / '.join(str(x).splitlines()[0] for x in e.exceptions)}")

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=15, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def each(case):
                send(case, mode)

            try:
                each()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                pass
    assert not failures, "\n".join(failures[:20])
