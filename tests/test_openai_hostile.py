"""Hostile requests against the OpenAI routes of a real ``hkstore serve`` on a decoder store:
whatever the body (wrong types, huge or negative integers, NaN and infinities, lone surrogates
and other odd text, empty and long lists, unknown fields, bad JSON), /v1/completions,
/v1/chat/completions and /v1/models answer 2xx or 4xx, never 5xx, and a stream they accept
never carries a server error.

Two sources of requests: hypothesis strategies of JSON bodies built around each route's fields
(most of them near-valid, so the requests reach the engine, not only the schema), and
schemathesis from the server's own OpenAPI schema. The fast test sends a few hundred; the slow
one (pytest -m slow) well over a thousand.
"""

import json
import math

import httpx
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_serve import ADMIN, Server

from hkstore.tokens import issue
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import lm_tenant_create
from runtime.model.tiny_decoder import make_tiny_decoder

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
CONTEXT = 48  # a small context bounds every generation the fuzzer can ask for
QUEUE = 6


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("hostile")
    model = make_tiny_decoder(tmp / "m", TEXTS, d=16, layers=3, max_len=CONTEXT, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=1, progress=False)
    lm_tenant_create(tmp / "s", "acme", train_path=tmp / "c.txt", epochs=1, batch_size=2, progress=False)
    torch.set_num_threads(threads)
    (tmp / "admin.token").write_text(ADMIN)
    token = issue(str(tmp / "s"), "acme")["token"]
    server = Server(str(tmp / "s"), str(tmp / "admin.token"), "--queue-limit", QUEUE)
    yield {"server": server, "token": token}
    server.stop()


# -- the strategies -----------------------------------------------------------------------------

ODD_TEXT = ["", " ", "\x00", "a\x00b", "\u202e\u200b", "\ufffd", "😀" * 40, "the cat " * 300, "\n\nuser:",
            "ß" * 9, "[BOS]", "[EOS]", "##", "NaN", "{}", "the cat sat on", "a dog"]
NOT_UNICODE = ["\udc00", "the \udc00 cat", "\ud800\udc00", "\ud83d"]  # lone surrogates (JSON escapes them)
HUGE = [2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 2**70, 10**30, -2**63, -2**70, -10**30]
FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.0, 1e-9]

texts = st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=40))
bad_texts = st.one_of(st.sampled_from(NOT_UNICODE),
                      st.text(st.characters(codec=None, categories=["Cs", "Co", "Cc", "So"]), min_size=1, max_size=12))
integers = st.one_of(st.integers(-3, 70), st.sampled_from(HUGE), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from(FLOATS), st.floats())
scalars = st.one_of(st.none(), st.booleans(), integers, floats, texts, bad_texts)
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(texts, inner, max_size=4)), max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 40), st.integers(-2, 10**6), st.sampled_from(HUGE)), max_size=60)
prompts = st.one_of(texts, st.lists(texts, max_size=8), token_ids, st.lists(token_ids, max_size=4),
                    st.just([]), st.just([[]]), st.lists(st.sampled_from(["the cat", "a dog"]), min_size=60,
                                                        max_size=200))
small = st.one_of(st.integers(-2, 24), integers)
models = st.sampled_from(["acme", "acme", "acme", "base", "tiny-gpt2", "nobody", "", "ACME", "../acme"])


def valid_bodies(route):
    """Bodies the routes should serve (200) or refuse only for a reason of the store's (the
    context, a token id past the vocabulary): n, echo, logprobs, stop, streams, lists of prompts."""
    common = {"max_tokens": st.integers(0, 20), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
              "top_k": st.integers(-1, 10), "n": st.integers(1, 3), "seed": integers,
              "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "ignore_eos": st.booleans()}
    if route == "completions":
        ids = st.lists(st.integers(0, 16), min_size=1, max_size=12)
        prompt = st.one_of(texts, st.lists(texts, min_size=1, max_size=2), ids, st.lists(ids, min_size=1, max_size=2))
        return st.fixed_dictionaries({"model": st.sampled_from(["acme", "base"]), "prompt": prompt},
                                     optional={**common, "logprobs": st.integers(0, 5), "echo": st.booleans()})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": texts}), max_size=2))})
    return st.fixed_dictionaries({"model": st.sampled_from(["acme", "base"]),
                                  "messages": st.lists(message, min_size=1, max_size=3)},
                                 optional={**common, "max_tokens": st.integers(1, 20), "logprobs": st.booleans(),
                                           "top_logprobs": st.integers(0, 3)})


def bodies(route, hostile):
    """Bodies of route's fields. Plausible (hostile False): every field of its own JSON type,
    with hostile values of that type (NaN, huge integers, odd text, long lists); hostile: any
    field may be any JSON at all, text not valid Unicode included, and a required one missing."""

    def field(plausible):
        return st.one_of(plausible, plausible, plausible, anything) if hostile else plausible

    anytext = st.one_of(texts, texts, bad_texts) if hostile else texts
    common = {
        "max_tokens": field(st.one_of(st.integers(-2, 24), integers)),
        "temperature": field(st.one_of(st.floats(0, 2), floats)),
        "top_p": field(st.one_of(st.floats(0, 1), floats)),
        "top_k": field(small),
        "n": field(st.one_of(st.integers(-1, QUEUE + 1), integers)),
        "seed": field(integers),
        "stop": field(st.one_of(anytext, st.lists(anytext, max_size=6))),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
        "ignore_eos": field(st.booleans()),
        "presence_penalty": field(floats),
        "frequency_penalty": field(floats),
        "logit_bias": field(st.dictionaries(anytext, floats, max_size=3)),
        "user": field(anytext),
        "best_of": field(small),
    }
    if route == "completions":
        required = {"model": field(models), "prompt": field(st.one_of(prompts, bad_texts) if hostile else prompts)}
        optional = {**common, "logprobs": field(st.one_of(st.integers(-1, 6), integers)),
                    "echo": field(st.booleans()), "suffix": field(anytext)}
    else:
        parts = st.lists(st.fixed_dictionaries({"type": field(st.sampled_from(["text", "text", "image_url"]))},
                                               optional={"text": field(anytext), "image_url": anything}), max_size=3)
        messages = st.lists(st.fixed_dictionaries(
            {"role": field(st.sampled_from(["user", "system", "assistant", "tool"]))},
            optional={"content": field(st.one_of(anytext, parts, st.none())), "name": field(anytext)}), max_size=5)
        required = {"model": field(models), "messages": field(messages)}
        optional = {**common, "logprobs": field(st.booleans()), "top_logprobs": field(small),
                    "max_completion_tokens": field(small)}
    must = st.fixed_dictionaries(required, optional=optional)
    if not hostile:
        return must
    some = st.fixed_dictionaries({}, optional={**required, **optional})
    unknown = st.dictionaries(st.one_of(texts, st.sampled_from(["tools", "response_format", "functions"])), anything,
                              max_size=3)
    return st.tuples(st.one_of(must, must, must, some), unknown).map(lambda pair: {**pair[1], **pair[0]})


def encode(body, style):
    """The body as bytes: JSON (NaN and Infinity literals as Python writes them, a lone surrogate
    as its \\u escape), or broken on purpose."""
    text = json.dumps(body, allow_nan=True)
    if style == "truncated":
        return text[: max(1, len(text) // 2)].encode()
    if style == "not an object":
        return json.dumps([body], allow_nan=True).encode()
    if style == "latin-1":
        return text.encode("ascii").replace(b"\\u00e9", b"\xe9")
    return text.encode()


@st.composite
def hostile_requests(draw):
    route = draw(st.sampled_from(["completions"] * 5 + ["chat"] * 4 + ["models"]))
    who = draw(st.sampled_from(["admin"] * 6 + ["tenant"] * 2 + ["none", "garbage"]))
    if route == "models":
        query = draw(st.dictionaries(st.sampled_from(["limit", "after", "x"]), st.text("abc123", max_size=5),
                                     max_size=2))
        return route, who, None, query
    mode = draw(st.sampled_from(["valid", "plausible", "hostile"]))
    hostile = mode == "hostile"
    body = draw(valid_bodies(route) if mode == "valid" else bodies(route, hostile))
    style = draw(st.sampled_from(["json"] * 12 + ["truncated", "not an object", "latin-1"])) if hostile else "json"
    return route, who, encode(body, style), None


# -- the checks ---------------------------------------------------------------------------------


class Campaign:
    def __init__(self, env):
        self.env, self.sent, self.statuses = env, 0, {}
        self.client = httpx.Client(base_url=env["server"].url, timeout=60)

    def headers(self, who):
        token = {"admin": ADMIN, "tenant": self.env["token"], "garbage": "acme~not-the-token", "none": None}[who]
        return {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}

    def send(self, route, who, body, query):
        """One request; its status must not be 5xx, nor may a stream it accepts carry an error."""
        if route == "models":
            r = self.client.get("/v1/models", params=query, headers=self.headers(who))
            text = r.text
        else:
            path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
            with self.client.stream("POST", path, content=body, headers=self.headers(who)) as r:
                text = r.read().decode("utf-8", errors="replace")
        self.sent += 1
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (route, body, r.status_code, text[:500], self.env["server"].output())
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            assert '"server_error"' not in text and text.endswith("data: [DONE]\n\n"), (body, text[-500:])
        if r.status_code == 200 and route != "models" and not text.startswith("data:"):
            json.loads(text)  # a whole JSON answer
        return r.status_code


def run_campaign(env, examples):
    campaign = Campaign(env)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(hostile_requests())
    def one(request):
        campaign.send(*request)

    try:
        one()
    finally:
        campaign.client.close()
    assert campaign.sent >= examples, campaign.sent
    # Some requests got through to generation, others were refused at each stage.
    assert campaign.statuses.get(200, 0) >= examples // 10, campaign.statuses
    assert {400, 401, 422} <= set(campaign.statuses), campaign.statuses
    return campaign


def test_hostile_requests_get_no_5xx(env):
    run_campaign(env, 200)


@pytest.mark.slow
def test_hostile_requests_get_no_5xx_many(env):
    run_campaign(env, 1200)


def test_the_reported_requests(env):
    """The ones found first: a seed past 64 bits on both routes (200), a lone surrogate in a
    prompt (422), a tiny temperature (200: greedy), NaN and infinite sampling values (400),
    huge max_tokens, n and token ids (400)."""
    campaign = Campaign(env)
    seed = 1180591620717411303424
    chat = {"model": "acme", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3}
    done = {"model": "acme", "prompt": "the cat", "max_tokens": 3}
    for route, body, status in [("completions", dict(done, seed=seed), 200), ("chat", dict(chat, seed=seed), 200),
                                ("completions", dict(done, prompt="the \udc00 cat"), 422),
                                ("chat", dict(chat, messages=[{"role": "user", "content": "the \udc00 cat"}]), 422),
                                ("completions", dict(done, temperature=1e-9), 200),  # (NaN in the softmax)
                                ("chat", dict(chat, temperature=5e-324), 200),
                                ("completions", dict(done, temperature=math.nan), 400),
                                ("completions", dict(done, top_p=math.inf), 400),
                                ("chat", dict(chat, temperature=-math.inf), 400),
                                ("completions", dict(done, max_tokens=2**70), 400),
                                ("completions", dict(done, n=2**70), 400),
                                ("completions", dict(done, prompt=[2**70]), 400)]:
        assert campaign.send(route, "admin", json.dumps(body, allow_nan=True).encode(), None) == status, body
    campaign.client.close()


# -- schemathesis: the same routes from the server's own schema ------------------------------------

try:
    import schemathesis
except ImportError:  # the test extra brings it: pip install -e '.[test]'
    schemathesis = None

if schemathesis is not None:

    @pytest.fixture(scope="module")
    def openai_schema(env):
        from schemathesis import GenerationMode

        loaded = schemathesis.openapi.from_url(f"{env['server'].url}/openapi.json")
        loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
        return loaded

    schema = schemathesis.pytest.from_fixture("openai_schema").include(
        path_regex=r"^/v1/(completions|chat/completions|models)$")

    @schema.parametrize()
    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    def test_schemathesis_openai_routes_no_server_errors(case, env):
        """Generated from the OpenAPI schema, valid and not, with the admin token: never a 5xx."""
        response = case.call(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code}: {response.text[:500]}\n"
            f"{env['server'].output()}")
