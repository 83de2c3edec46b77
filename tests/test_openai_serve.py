"""hkstore serve on a decoder store through the official openai client: /v1/completions,
/v1/chat/completions (streamed and not), /v1/models, and the 4xx answers (raw httpx)."""

import json
import time

import httpx
import openai
import pytest
import torch
from test_serve import ADMIN, Server, auth

import runtime
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import lm_tenant_create
from runtime.model.tiny_decoder import make_tiny_decoder
from hkstore.tokens import issue

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("oai")
    model = make_tiny_decoder(tmp / "m", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=1024, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2, progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    lm_tenant_create(tmp / "s", "acme", train_path=tmp / "acme.txt", epochs=5, batch_size=4, lr=1e-2, progress=False)
    torch.set_num_threads(threads)
    (tmp / "admin.token").write_text(ADMIN)
    token = issue(str(tmp / "s"), "acme")["token"]
    server = Server(str(tmp / "s"), str(tmp / "admin.token"), "--queue-limit", 4)
    yield {"store": str(tmp / "s"), "server": server, "token": token, "tmp": tmp}
    server.stop()


def test_python_cli_and_http_give_the_same_greedy_text(env):
    """runtime.open(...).generate, hkstore generate and /v1/completions run the same engine
    (runtime.gen.engine): the same prompt and tenant give the same greedy text."""
    from click.testing import CliRunner

    from tools.cli import main

    with runtime.open(env["store"], device="cpu") as rt:
        py = rt.generate([{"tenant": "acme", "prompt": "a dog ran", "max_tokens": 7}])[0]
    r = CliRunner().invoke(main, ["generate", env["store"], "a dog ran", "--tenant", "acme", "--max-tokens", "7",
                                  "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output)
    http = httpx.post(env["server"].url + "/v1/completions", headers=auth(ADMIN), timeout=30,
                      json={"model": "acme", "prompt": "a dog ran", "max_tokens": 7, "temperature": 0}).json()
    assert cli["ids"] == py["ids"] and cli["text"] == py["text"] == http["choices"][0]["text"]
    assert http["usage"]["completion_tokens"] == len(py["ids"])


def client(env, token):
    return openai.OpenAI(base_url=env["server"].url + "/v1", api_key=token, max_retries=0, timeout=30)


def test_completions_and_chat_with_the_openai_client(env):
    with runtime.open(env["store"]) as rt:  # the same greedy text in process
        want = rt.generate([{"tenant": "acme", "prompt": "the cat sat on", "max_tokens": 6}])[0]
    c = client(env, env["token"])  # the tenant's own token
    r = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0, logprobs=2)
    assert r.choices[0].text == want["text"] and r.choices[0].finish_reason in ("length", "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, len(want["ids"]),
                                                                                        5 + len(want["ids"]))
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want["logprobs"], abs=1e-4) and all(len(t) == 2 for t in lp.top_logprobs)

    # Streamed: the deltas make the same text, then [DONE] (the client ends the iteration there).
    chunks = list(c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
    assert chunks[-1].usage.completion_tokens == len(want["ids"])

    # Seeded sampling repeats; stop ends the text before the stop sequence.
    a, b = (c.completions.create(model="tiny-gpt2", prompt="a dog", max_tokens=8, temperature=1.5, top_p=0.9,
                                 seed=7).choices[0].text for _ in range(2))
    assert a == b
    r = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0, stop=["mat"])
    assert "mat" not in r.choices[0].text and r.choices[0].finish_reason == "stop" or "mat" not in want["text"]

    # Chat: the template's prompt, streamed or not, with logprobs.
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "the dog sat on"}]
    r = c.chat.completions.create(model="acme", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=1)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    stream = c.chat.completions.create(model="acme", messages=messages, max_tokens=5, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == text
    with runtime.open(env["store"]) as rt:
        prompt = "system: the cat\nuser: the dog sat on\nassistant:"
        assert rt.generate([{"tenant": "acme", "prompt": prompt, "max_tokens": 5}])[0]["text"] == text

    # Models: a tenant's token sees the base model and its own tenant; the admin every one.
    assert [m.id for m in c.models.list()] == ["tiny-gpt2", "acme"]
    assert {m.id for m in client(env, ADMIN).models.list()} == {"tiny-gpt2", "acme"}


def test_the_openai_client_with_default_arguments(env):
    """completions.create and chat.completions.create with nothing but model and prompt or
    messages: OpenAI's defaults (temperature 1, max_tokens 16 or the rest of the context)."""
    c = client(env, env["token"])
    r = c.completions.create(model="acme", prompt="the cat")
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 16 and r.usage.prompt_tokens == 3 and r.choices[0].logprobs is None
    r = c.chat.completions.create(model="acme", messages=[{"role": "user", "content": "the cat"}])
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert [m.id for m in c.models.list()] == ["tiny-gpt2", "acme"]


def test_a_completion_keeps_the_space_after_its_prompt(env):
    """prompt + completion is the text of all the tokens: decoded in the prompt's context, not
    alone ("the cat sat on" + "the mat" lost its space), streamed or not."""
    c = client(env, env["token"])
    with runtime.open(env["store"]) as rt:
        want = rt.generate([{"tenant": "acme", "prompt": "the cat sat on", "max_tokens": 6}])[0]
        prompt = rt.decoder.tokenize(["the cat sat on"])[0]
        assert rt.decoder.decode(prompt) + want["text"] == rt.decoder.decode(prompt + want["ids"])
    r = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0)
    assert r.choices[0].text == want["text"] and r.choices[0].text.startswith(" ")
    streamed = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want["text"]


def test_n_choices_prompt_lists_and_token_ids_through_the_client(env):
    """As vLLM serves them: n choices per prompt at index prompt_i * n + j, choice j seeded with
    seed + j; prompts as strings, a list of strings, token ids, lists of token ids; usage counts
    each prompt once and every choice's tokens."""
    c = client(env, ADMIN)
    prompts = ["the cat sat on", "a dog"]
    with runtime.open(env["store"]) as rt:
        ids = [rt.decoder.tokenize([p])[0] for p in prompts]
        want = rt.generate([{"tenant": "acme", "prompt": p, "max_tokens": 5, "temperature": 1.3, "seed": 7 + j}
                            for p in prompts for j in range(2)])
    r = c.completions.create(model="acme", prompt=prompts, n=2, max_tokens=5, temperature=1.3, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [w["text"] for w in want]
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert r.usage.completion_tokens == sum(len(w["ids"]) for w in want)
    assert r.choices[0].text != r.choices[1].text or want[0]["ids"] == want[1]["ids"]  # seed + j: they differ
    by_ids = c.completions.create(model="acme", prompt=ids, n=2, max_tokens=5, temperature=1.3, seed=7)
    assert [ch.text for ch in by_ids.choices] == [w["text"] for w in want] and by_ids.usage == r.usage
    one = c.completions.create(model="acme", prompt=ids[1], max_tokens=5, temperature=1.3, seed=7)
    assert one.choices[0].text == want[2]["text"]

    # Streamed with n > 1: every chunk carries its choice's index; each choice's pieces make its text.
    chunks = list(c.completions.create(model="acme", prompt=prompts, n=2, max_tokens=5, temperature=1.3, seed=7,
                                       stream=True, stream_options={"include_usage": True}))
    texts, reasons = {}, {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert texts == {k: w["text"] for k, w in enumerate(want)} and set(reasons) == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    # Chat: n choices of the one prompt, seeded the same way.
    messages = [{"role": "user", "content": "the dog sat on"}]
    r = c.chat.completions.create(model="acme", messages=messages, n=2, max_tokens=4, temperature=1.3, seed=3)
    with runtime.open(env["store"]) as rt:
        want = rt.generate([{"tenant": "acme", "prompt": "user: the dog sat on\nassistant:", "max_tokens": 4,
                             "temperature": 1.3, "seed": 3 + j} for j in range(2)])
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.message.content for ch in r.choices] == [w["text"] for w in want]
    assert r.usage.completion_tokens == sum(len(w["ids"]) for w in want)
    stream = c.chat.completions.create(model="acme", messages=messages, n=2, max_tokens=4, temperature=1.3, seed=3,
                                       stream=True)
    got = {}
    for ch in stream:
        for choice in ch.choices:
            got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
    assert got == {0: want[0]["text"], 1: want[1]["text"]}


def test_echo_with_and_without_logprobs(env):
    """echo puts the prompt's text before the completion's (a string as sent, token ids decoded);
    with logprobs, the prompt tokens' logprobs come first (the first null), the same values the
    completion of a shorter prompt reports for those tokens; max_tokens 0 scores the prompt."""
    c = client(env, ADMIN)
    with runtime.open(env["store"]) as rt:
        want = rt.generate([{"tenant": "acme", "prompt": "the cat sat on", "max_tokens": 4, "logprobs": 1}])[0]
        prompt = rt.decoder.tokenize(["the cat sat on"])[0]
        decode = rt.decoder.decode
    r = c.completions.create(model="acme", prompt="the cat sat on", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == "the cat sat on" + want["text"] and r.choices[0].logprobs is None
    r = c.completions.create(model="acme", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == decode(prompt) + want["text"]
    assert len(lp.tokens) == len(prompt) + len(want["ids"]) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[len(prompt):] == pytest.approx(want["logprobs"], abs=1e-4)
    # Scoring: the whole text's logprobs, without generating; they match what generation reported.
    scored = c.completions.create(model="acme", prompt=prompt + want["ids"], max_tokens=0, echo=True, logprobs=0)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs[len(prompt):] == pytest.approx(want["logprobs"], abs=1e-4)
    assert scored.choices[0].logprobs.token_logprobs[1:len(prompt)] == \
        pytest.approx(lp.token_logprobs[1:len(prompt)], abs=1e-6)
    # Streamed: each choice's prompt first, then its tokens.
    chunks = list(c.completions.create(model="acme", prompt="the cat sat on", n=2, max_tokens=4, temperature=0,
                                       echo=True, stream=True))
    texts = {}
    for ch in chunks:
        texts[ch.choices[0].index] = texts.get(ch.choices[0].index, "") + ch.choices[0].text
    assert texts == {0: "the cat sat on" + want["text"], 1: "the cat sat on" + want["text"]}


def test_any_integer_seed_and_text_that_is_not_unicode(env):
    """A seed past 64 bits is taken (modulo 2**64: the same text every time); a prompt or message
    holding a lone surrogate (JSON's \\udc00) is refused with the encoder routes' 422."""
    s = env["server"]
    seed = 1180591620717411303424  # 2**70
    body = {"model": "acme", "prompt": "a dog", "max_tokens": 5, "temperature": 1.2, "seed": seed}
    chat = {"model": "acme", "messages": [{"role": "user", "content": "a dog"}], "max_tokens": 5,
            "temperature": 1.2, "seed": seed}
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        first, again = (s.client.post(path, json=b, headers=auth(ADMIN)) for _ in range(2))
        assert first.status_code == again.status_code == 200, first.text
        key = "text" if path == "/v1/completions" else "message"
        assert first.json()["choices"][0][key] == again.json()["choices"][0][key]
    with runtime.open(env["store"]) as rt:
        same = rt.generate([{"prompt": "a dog", "max_tokens": 5, "temperature": 1.2, "seed": 0, "tenant": "acme"}])
    r = s.client.post("/v1/completions", json=dict(body, seed=-seed), headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == same[0]["text"]  # -2**70 = 0 (mod 2**64)
    lone = "the \udc00 cat"
    for path, b in (("/v1/completions", dict(body, prompt=lone)), ("/v1/completions", dict(body, prompt=[lone])),
                    ("/v1/completions", dict(body, stop=[lone])),
                    ("/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": lone}])),
                    ("/v1/chat/completions", dict(chat, messages=[{"role": "user",
                                                                   "content": [{"type": "text", "text": lone}]}]))):
        r = s.client.post(path, content=json.dumps(b),  # (httpx's json= would not encode the surrogate)
                          headers=dict(auth(ADMIN), **{"content-type": "application/json"}))
        assert r.status_code == 422 and "unable to parse raw data as a unicode string" in r.text, (path, r.text)


def test_bad_requests_get_clear_4xx(env):
    s = env["server"]
    ok = {"model": "acme", "prompt": "the cat"}
    cases = [({"model": "nobody", "prompt": "x"}, 404, "unknown model"),
             (dict(ok, n=0), 400, "n must be between 1 and 128"),
             (dict(ok, n=5), 400, "more than the server's queue holds"),  # (--queue-limit 4)
             (dict(ok, prompt=["a", "b", "c"], n=2), 400, "6 sequences"),
             (dict(ok, prompt=[]), 400, "empty list"),
             (dict(ok, prompt=[[]]), 400, "empty prompt"),
             (dict(ok, prompt=[2, 10**6]), 400, "token ids"),
             (dict(ok, max_tokens=0), 400, "0 only with echo"),
             (dict(ok, best_of=2), 400, "best_of"),
             (dict(ok, suffix="x"), 400, "suffix"),
             (dict(ok, prompt="the cat " * 600), 400, "context"),  # 1200 tokens, a context of 1024
             (dict(ok, max_tokens=1100), 400, "context"),
             (dict(ok, temperature=-1), 400, "temperature"),
             (dict(ok, top_p=0), 400, "top_p"),
             (dict(ok, logprobs=9), 400, "logprobs"),
             ({"prompt": "x"}, 422, "model")]
    for body, status, words in cases:
        r = s.client.post("/v1/completions", json=body, headers=auth(ADMIN))
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
    chat = {"model": "acme", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}
    for body, words in [(dict(chat, messages=[]), "at least one message"), (dict(chat, max_tokens=0), "max_tokens"),
                        (dict(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "text content"),
                        (dict(chat, n=5), "queue holds")]:
        r = s.client.post("/v1/chat/completions", json=body, headers=auth(ADMIN))
        assert r.status_code == 400 and words in r.text, (body, r.status_code, r.text)
    assert s.client.post("/v1/completions", json=ok).status_code == 401
    assert s.client.post("/v1/completions", json=ok, headers=auth("acme~wrong")).status_code == 401
    with pytest.raises(openai.NotFoundError, match="unknown model 'nobody'"):  # the client shows the reason
        client(env, ADMIN).completions.create(model="nobody", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 128"):
        client(env, ADMIN).completions.create(model="acme", prompt="x", n=0)
    with pytest.raises(openai.PermissionDeniedError, match="does not give access to model 'nobody'"):
        client(env, env["token"]).completions.create(model="nobody", prompt="x")  # as for another tenant


def wait_for_a_place(s):
    for _ in range(100):
        r = s.client.post("/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 1},
                          headers=auth(ADMIN))
        if r.status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(r.text)


def test_queue_bound_429_and_a_disconnect_cancels(env):
    """The server holds four sequences (--queue-limit 4): a stream of four choices in progress
    keeps every place, another request gets 429; the stream's client going away frees them."""
    s = env["server"]
    body = {"model": "acme", "prompt": "the cat", "max_tokens": 1000, "temperature": 0, "stream": True}
    # (greedy, this tenant never chooses EOS: about a second of tokens)
    with httpx.Client(base_url=s.url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=dict(body, n=4), headers=auth(ADMIN)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        full = s.client.post("/v1/completions", json={"model": "acme", "prompt": "x"}, headers=auth(ADMIN))
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    # The place frees when the server sees the disconnect, and the sequence stops early; so with
    # a client that stops waiting for an answer that is not streamed.
    wait_for_a_place(s)
    with pytest.raises(httpx.ReadTimeout):
        s.client.post("/v1/completions", json=dict(body, stream=False), headers=auth(ADMIN), timeout=0.3)
    wait_for_a_place(s)
    metrics = s.client.get("/metrics", headers=auth(ADMIN)).text
    assert 'hkstore_gen_requests_total{route="completions",status="429"}' in metrics
    assert 'hkstore_gen_requests_total{route="completions",status="499"} 2.0' in metrics  # both cancelled
    tokens = float(metrics.split("\nhkstore_gen_tokens_total ")[1].split()[0])
    assert tokens < 1500, tokens  # both stopped well before their 1000 tokens
    assert "hkstore_gen_time_to_first_token_seconds_count" in metrics and "hkstore_gen_running_sequences 0.0" in metrics


def test_an_encoder_store_refuses_to_generate(tmp_path):
    from runtime.construct.manager import build
    from runtime.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", TEXTS, d=16, layers=2)
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build(tmp_path / "s", model_path=model, corpus_paths=[tmp_path / "c.txt"], lower_layers=1, progress=False)
    (tmp_path / "admin.token").write_text(ADMIN)
    s = Server(str(tmp_path / "s"), str(tmp_path / "admin.token"))
    try:
        r = s.client.post("/v1/completions", json={"model": "base", "prompt": "x"}, headers=auth(ADMIN))
        assert r.status_code == 400 and "encoder store" in r.text
    finally:
        s.stop()


def test_an_app_streams_chunk_by_chunk_in_process_and_closing_cancels(env):
    """runtime.serve.asgi_call.stream (what a Ray worker's handle_stream runs): the status and
    headers first, then the events one by one while the sequence still generates; closing the
    generator early cancels the sequence (499), as a client going away does."""
    import asyncio

    from runtime.serve.app import create_app
    from runtime.serve.asgi_call import Lifespan, call, stream

    async def main():
        app = create_app(env["store"], admin_token=ADMIN, device="cpu", max_len=32)
        span = Lifespan(app)
        await span.startup()
        try:
            body = json.dumps({"model": "acme", "prompt": "the cat", "max_tokens": 900, "temperature": 0,
                               "stream": True}).encode()
            headers = [(b"authorization", f"Bearer {ADMIN}".encode()), (b"content-type", b"application/json")]
            gen = stream(app, "POST", "/v1/completions", headers=headers, body=body)
            status, out_headers = await gen.__anext__()
            assert status == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in out_headers
            chunks = [await gen.__anext__() for _ in range(3)]
            assert all(c.startswith(b"data: {") for c in chunks)
            await gen.aclose()
            for _ in range(100):
                _, _, text = await call(app, "GET", "/metrics", headers=headers[:1])
                if b'hkstore_gen_requests_total{route="completions",status="499"}' in text:
                    break
                await asyncio.sleep(0.05)
            assert b'hkstore_gen_requests_total{route="completions",status="499"}' in text
            tokens = float(text.split(b"\nhkstore_gen_tokens_total ")[1].split()[0])
            assert tokens < 900  # stopped well before its 900 tokens
        finally:
            await span.shutdown()

    asyncio.run(main())


def test_the_engine_keeps_an_idle_batcher_until_a_commit_lands(env, tmp_path):
    """Between requests the engine keeps its batcher (and KV pool: allocating one per request
    cost tens of ms of time to first token) while the store's snapshot is the newest; once a
    commit lands and the runtime refreshes, the next request gets a batcher on the new one."""
    import shutil
    import threading

    import hkstore
    import runtime

    path = tmp_path / "s"
    shutil.copytree(env["store"], path)
    rt = runtime.open(str(path), device="cpu")
    engine = rt.generation_engine(queue_limit=8)
    try:
        def run_one():
            done = threading.Event()

            def sink(event):
                if event["type"] == "error" or event.get("finished"):
                    done.set()

            engine.submit([{"prompt": "the cat", "max_tokens": 3}], sink)
            assert done.wait(60)
            for _ in range(100):  # the engine retires the batcher's work right after the last event
                with engine.cond:
                    batchers = dict(engine.batchers)
                if batchers and not any(b.busy for b in batchers.values()):
                    return batchers
                threading.Event().wait(0.01)
            return batchers

        first = run_one()
        (version, b1), = first.items()
        assert b1.pool is not None
        second = run_one()
        assert second[version] is b1  # the same batcher, its pool kept
        with hkstore.open(str(path), writable=True) as st:
            st.set_version_info(version, note="a commit")
        rt.refresh()
        third = run_one()
        assert third[version] is not b1
        assert third[version].gen.snapshot.manifest["generation"] > b1.gen.snapshot.manifest["generation"]
    finally:
        rt.close()  # (stops its engine)
