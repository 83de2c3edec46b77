"""OpenAI-compatible text generation on ``hkstore serve`` over a decoder store.

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed",
                                 "n", "echo", "logprobs", "stream", ...}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "n", ..., "logprobs", "top_logprobs"}
    GET  /v1/models             the models this token reaches: the base model and tenants

``model`` names a tenant (its lm PET and PLOT version) or the base model (``base``, unless a
tenant has that name, or the base model's own name as /v1/models lists it). A tenant's token
reaches its own tenant and the base model; the admin token reaches every one. Any other model
named with a tenant's token is 403, whether it is a tenant or not (tenant names are not
enumerable); the admin token gets 404 for an unknown one. Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so its clients show the reason.

**Prompts and choices** (as vLLM serves them). ``prompt`` is a string, a list of strings, a list
of token ids or a list of lists of token ids (ids are taken as they are: no BOS is added); each
prompt gets ``n`` choices (at most 128), choice j of prompt i at index i * n + j. A seeded
request draws choice j with seed + j (the n samples differ and repeat); any integer seed is
taken (modulo 2**64). ``echo`` puts the prompt's text before each choice's (a string prompt as
sent, token ids decoded) and, with ``logprobs``, the prompt tokens' logprobs before the
completion's (the first token's is null: nothing comes before it; one pass of the upper
layers over the prompt, as its prefill, computes them); ``max_tokens: 0`` with
``echo`` scores the prompt without generating. ``usage`` counts each prompt once and every
choice's tokens. Chat takes ``n`` the same way (choice j at index j).

**Text.** A completion's text is decoded in its prompt's context (runtime.gen.detok), so prompt
text + completion text is the text of all the tokens: "the archive is" + " a string." Streamed
pieces concatenate to the same text.

**Chat template.** The messages become one prompt: a line ``<role>: <content>`` per message,
then ``assistant:``; the completion of that prompt is the assistant's answer (pass
``stop: ["\\nuser:"]`` to end it at the next turn). Content is a string or text parts.

**Engine.** The store's runtime's one generation engine (runtime.gen.engine, which
runtime.open(...).generate and hkstore generate use too) runs every request of the server in a
continuous batch per PLOT version: requests join and leave between decoding steps; this module
is only HTTP (schemas, validation, JSON and SSE answers). A request
whose sequences (prompts x n) would bring the server's sequences (waiting and running) past
its queue limit is answered 429 with Retry-After; one with more sequences than the limit, 400.
``stream: true`` answers server-sent events, one ``data: {chunk}`` per token carrying its
choice's index (with echo, first each choice's prompt) and a final ``data: [DONE]``; a client
that disconnects cancels its sequences. Extensions beside OpenAI's fields: ``top_k`` (0 or -1:
all) and vLLM's ``ignore_eos`` (run to max_tokens or a stop). temperature defaults to 1 and
max_tokens to 16 (completions) or what is left of the context, at most 256 (chat), as
OpenAI's. Bad requests are refused before anything runs: unknown model 404; a body that does
not fit the schema (text that is not valid Unicode, or a body that is not UTF-8, included) 422;
a body that is not JSON 400; prompt or prompt + max_tokens
beyond the context, token ids outside the vocabulary, invalid sampling values, best_of other
than n, suffix, penalties, logit_bias, an encoder tenant or store asked to generate: 400.
/metrics gains the running and waiting sequences, tokens made, time to first token and
inter-token latency.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Annotated, Union

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ConfigDict, StrictBool, StringConstraints

MAX_N = 128  # choices per prompt, OpenAI's bound
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# A length bound makes pydantic check that a string is valid Unicode (a lone surrogate, which
# JSON's \udc00 escape can carry, is refused with 422 as on the encoder routes; the tokenizer
# and the JSON encoder of an answer would fail on it). The body limit bounds it anyway.
Text = Annotated[str, StringConstraints(max_length=1 << 20)]
Name = Annotated[str, StringConstraints(max_length=256)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Name
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: an extension (0 or -1: all)
    ignore_eos: StrictBool | None = None  # not OpenAI's: vLLM's extension (run to max_tokens or a stop sequence)
    n: int | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: Text | None = None


class CompletionBody(_Body):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: StrictBool | None = None
    best_of: int | None = None
    suffix: Text | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Name
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Name
    content: Text | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def chat_prompt(messages) -> str:
    """The documented template: "<role>: <content>" lines, then "assistant:"."""
    lines = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # content parts: text only (a text model)
            kinds = sorted({p.type for p in content} - {"text"})
            if kinds:
                raise ValueError(f"only text content parts are served, got {', '.join(map(repr, kinds))}")
            content = "".join(p.text or "" for p in content)
        lines.append(f"{m.role}: {content or ''}\n")
    return "".join(lines) + "assistant:"


def _metrics(registry):
    from prometheus_client import Counter, Gauge, Histogram

    return {"running": Gauge("hkstore_gen_running_sequences", "Sequences being decoded", registry=registry),
            "waiting": Gauge("hkstore_gen_waiting_sequences", "Sequences waiting for KV memory or a slot",
                             registry=registry),
            "tokens": Counter("hkstore_gen_tokens", "Tokens generated (rate(): tokens/s)", registry=registry),
            "ttft": Histogram("hkstore_gen_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=registry),
            "itl": Histogram("hkstore_gen_inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=ITL_BUCKETS, registry=registry),
            "requests": Counter("hkstore_gen_requests", "Generation requests by route and status",
                                ["route", "status"], registry=registry)}


def _observe(m, turn):
    """One engine turn into the Prometheus metrics."""
    m["running"].set(turn["running"])
    m["waiting"].set(turn["waiting"])
    if turn["tokens"]:
        m["tokens"].inc(turn["tokens"])
    for x in turn["ttft"]:
        m["ttft"].observe(x)
    for x in turn["itl"]:
        m["itl"].observe(x)


def add_openai_routes(app, svc, bearer, HTTPError):
    """Mount /v1/completions, /v1/chat/completions and /v1/models on app (runtime.serve.app's
    create_app calls it with its Service, bearer scheme and HTTPError)."""
    from hkstore.errors import CorruptError, UnknownTenant
    from runtime import BadRequest

    metrics = _metrics(svc.metrics.registry)
    observed = set()  # ids of the engines whose turns feed this app's metrics
    lock = threading.Lock()

    def engine():
        """The runtime's generation engine (it stops when the runtime closes), with the server's
        queue limit and this app's metrics."""
        eng = svc.rt.generation_engine(queue_limit=svc.queue_limit)
        with lock:
            if id(eng) not in observed:
                observed.add(id(eng))
                eng.observe(lambda turn: _observe(metrics, turn))
        return eng

    def base_names():
        from hkstore.model_name import accepted_names

        return {"base"} | accepted_names(svc.rt.store.snapshot().meta)

    def resolve(model, creds):
        """The tenant model names (None: the base model), after the token's check."""
        who = svc.principal(creds)
        pets = svc.rt.store.snapshot().pets
        base = model in base_names() and model not in pets
        if who != "admin" and not base and model != who:
            # The same answer whether the model is another tenant or none at all: a tenant's
            # token must not learn which names are tenants.
            raise HTTPError(403, f"this token does not give access to model {model!r}")
        if model in pets:
            tenant = model
        elif base:
            tenant = None
        else:
            raise HTTPError(404, f"unknown model {model!r}: not a tenant of this store, nor 'base' "
                                 "(GET /v1/models lists them)")
        if getattr(svc.rt, "decoder", None) is None:
            raise HTTPError(400, "this is an encoder store: its tenants classify (POST /v1/tenants/{tenant}/infer), "
                                 "they do not generate")
        return tenant

    def common(body: _Body, tenant, max_tokens, logprobs) -> dict:
        """The sampling fields every choice of the request shares (runtime.gen.api's request)."""
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_N:
            raise HTTPError(400, f"n must be between 1 and {MAX_N}, got {n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise HTTPError(400, f"{name} is not supported (0 only)")
        if body.logit_bias:
            raise HTTPError(400, "logit_bias is not supported")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        req = {"temperature": 1.0 if body.temperature is None else body.temperature,
               "top_p": 1.0 if body.top_p is None else body.top_p, "stop": stop, "logprobs": logprobs}
        if tenant is not None:
            req["tenant"] = tenant
        req["max_tokens"] = max_tokens  # None: what is left of the context (runtime.gen.engine)
        if body.top_k is not None:
            req["top_k"] = 0 if body.top_k == -1 else body.top_k  # vLLM's -1: no cut
        if body.ignore_eos:
            req["ignore_eos"] = True
        return req

    def choices(body: _Body, shared: dict, prompts: list) -> list[dict]:
        """One request per choice: prompt i's choice j at i * n + j, seeded with seed + j."""
        n = 1 if body.n is None else body.n
        if len(prompts) * n > svc.queue_limit:
            raise HTTPError(400, f"{len(prompts)} prompt(s) x n = {n} make {len(prompts) * n} sequences, more than "
                                 f"the server's queue holds ({svc.queue_limit})")
        out = []
        for p in prompts:
            for j in range(n):
                r = dict(shared, prompt=p)
                if body.seed is not None:
                    r["seed"] = body.seed + j
                out.append(r)
        return out

    async def run(route, body, request, subs, n, want_logprobs, prompt_logprobs, render):
        """Submit, wait for admission (4xx before any byte), then answer at once or by SSE."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        eng = engine()
        h = eng.submit(subs, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), prompt_logprobs,
                       zero_tokens=True)
        if h is None:
            metrics["requests"].labels(route, "429").inc()
            svc.metrics.rejected.labels("queue_full").inc()
            raise HTTPError(429, f"the generation queue is full ({svc.queue_limit} sequences); retry later",
                            {"Retry-After": "1"})
        streaming = False
        try:
            response = await answer(route, body, request, h, eng, queue, subs, n, want_logprobs, render)
            streaming = isinstance(response, _Stream)  # it releases h once sent or abandoned
            return response
        finally:
            if not streaming:
                eng.release(h)

    async def answer(route, body, request, h, eng, queue, subs, n, want_logprobs, render):
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            eng.cancel(h)
            raise
        if first["type"] == "error":
            e = first["error"]
            status = 404 if isinstance(e, UnknownTenant) else 503 if isinstance(e, CorruptError) else \
                400 if isinstance(e, (BadRequest, ValueError)) else 500
            metrics["requests"].labels(route, str(status)).inc()
            if status == 503:
                raise svc.damaged_error(f"{route} {body.model}", e)
            if status == 500:
                raise e
            raise HTTPError(status, str(e))
        prompts = first["prompts"]
        k = len(subs)
        prompt_tokens = sum(len(prompts[i]) for i in range(0, k, n))  # each prompt once, not per choice
        cid, created = f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        token_text = svc.rt.decoder.decode

        def logprob_view(ev):
            if not want_logprobs or ev.get("token") is None:
                return None
            return {"token": token_text([ev["token"]]), "logprob": ev["logprob"],
                    "top": [(token_text([t]), lp) for t, lp in ev["top"]]}

        def prompt_view(c):
            """Choice c's echo: (the prompt's text, its tokens' logprob views or None)."""
            p = subs[c]["prompt"]
            text = p if isinstance(p, str) else token_text(p)
            plps = first["prompt_logprobs"][c]
            if plps is None:
                return text, None
            return text, [{"token": token_text([t]), "logprob": None if x is None else x[0],
                           "top": None if x is None else [(token_text([a]), lp) for a, lp in x[1]]}
                          for t, x in zip(prompts[c], plps)]

        def usage(completion_tokens):
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        if not body.stream:
            waiter = asyncio.ensure_future(_disconnected(request))
            lps = [[] for _ in range(k)]
            last = [None] * k
            try:
                while any(x is None for x in last):
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        eng.cancel(h)
                        metrics["requests"].labels(route, "499").inc()
                        return Response(status_code=499)  # nobody reads it
                    ev = getter.result()
                    if ev["type"] == "error":
                        eng.cancel(h)  # (the other choices)
                        raise ev["error"]
                    c = ev["index"]
                    if (lp := logprob_view(ev)) is not None:
                        lps[c].append(lp)
                    if ev["finished"]:
                        last[c] = ev
            except asyncio.CancelledError:
                eng.cancel(h)
                raise
            finally:
                waiter.cancel()
            metrics["requests"].labels(route, "200").inc()
            out = [{"index": c, "text": last[c]["text"], "finish_reason": last[c]["finish_reason"],
                    "logprobs": lps[c] if want_logprobs else None, "echo": prompt_view(c) if render.echo else None}
                   for c in range(k)]
            return render.final(cid, created, out, usage(sum(x["completion_tokens"] for x in last)))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stops = subs[0].get("stop") or []

        async def events():
            sent, finished, made = [""] * k, [False] * k, [0] * k
            try:
                for c in range(k):
                    head = render.head(cid, created, c, prompt_view(c) if render.echo else None)
                    if head is not None:
                        yield _sse(head)
                while not all(finished):
                    ev = await queue.get()
                    if ev["type"] == "error":
                        yield _sse({"error": {"message": str(ev["error"]), "type": "server_error"}})
                        break
                    c, text = ev["index"], ev["text"]
                    upto = len(text) if ev["finished"] else len(text) - _stop_prefix(text, stops)
                    delta = text[len(sent[c]):upto] if text.startswith(sent[c]) else text[len(sent[c]):]
                    if delta or ev["finished"] or (want_logprobs and ev.get("token") is not None):
                        sent[c] += delta
                        yield _sse(render.chunk(cid, created, c, delta,
                                                ev["finish_reason"] if ev["finished"] else None, logprob_view(ev)))
                    if ev["finished"]:
                        finished[c], made[c] = True, ev["completion_tokens"]
                if all(finished):
                    eng.release(h)  # its sequences are done: free their places before the client reads the end
                    if include_usage:
                        yield _sse({"id": cid, "object": _chunk_object(route), "created": created,
                                    "model": body.model, "choices": [], "usage": usage(sum(made))})
                    yield "data: [DONE]\n\n"
                    metrics["requests"].labels(route, "200").inc()
            finally:
                if not all(finished):  # the client went away (or an error): free the sequences
                    eng.cancel(h)
                    metrics["requests"].labels(route, "499").inc()

        def closed():
            eng.cancel(h)  # nothing left to cancel when it finished
            eng.release(h)

        return _Stream(events(), closed, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    errors = {400: {"description": "invalid request: a body that is not JSON, sampling values, n, prompt or "
                                   "max_tokens beyond the context, token ids outside the vocabulary, an encoder "
                                   "tenant or store"},
              401: {"description": "missing or invalid token"}, 403: {"description": "not this tenant's token"},
              404: {"description": "unknown model"}, 422: {"description": "invalid request body"},
              429: {"description": "the generation queue is full (Retry-After)"}}

    @app.post("/v1/completions", tags=["generate"], responses=errors)
    async def completions(body: CompletionBody, request: Request, creds: HTTPAuthorizationCredentials = Depends(bearer)):  # noqa: B008
        """OpenAI-compatible text completion of ``prompt`` by ``model`` (a tenant or the base model)."""
        tenant = resolve(body.model, creds)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]  # one text, or one prompt of token ids
        else:
            prompts = list(prompt)
        if not prompts:
            raise HTTPError(400, "prompt is an empty list: give a string, strings, token ids or lists of them")
        n = 1 if body.n is None else body.n
        if body.suffix:
            raise HTTPError(400, "suffix is not supported")
        if body.best_of is not None and body.best_of != n:
            raise HTTPError(400, f"best_of must equal n ({n}) when given: ranking extra samples is not supported")
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise HTTPError(400, f"logprobs must be between 0 and 5, got {body.logprobs}")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise HTTPError(400, "max_tokens must be at least 1 (0 only with echo: the prompt's logprobs alone)")
        want = body.logprobs is not None
        subs = choices(body, common(body, tenant, max_tokens, body.logprobs or 0), prompts)
        render = _CompletionRender(body.model, bool(body.echo))
        return await run("completions", body, request, subs, n, want,
                         body.logprobs if want and body.echo else None, render)

    @app.post("/v1/chat/completions", tags=["generate"], responses=errors)
    async def chat_completions(body: ChatBody, request: Request, creds: HTTPAuthorizationCredentials = Depends(bearer)):  # noqa: B008
        """OpenAI-compatible chat: the messages through the module's template ("<role>: <content>"
        lines, then "assistant:"), completed by ``model`` (a tenant or the base model)."""
        tenant = resolve(body.model, creds)
        if not body.messages:
            raise HTTPError(400, "messages must hold at least one message")
        top = body.top_logprobs or 0
        if not 0 <= top <= 20 or (top and not body.logprobs):
            raise HTTPError(400, "top_logprobs must be between 0 and 20, and needs logprobs: true")
        try:
            prompt = chat_prompt(body.messages)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise HTTPError(400, f"max_tokens must be a positive integer, got {max_tokens}")
        subs = choices(body, common(body, tenant, max_tokens, top), [prompt])
        return await run("chat", body, request, subs, len(subs), bool(body.logprobs), None, _ChatRender(body.model))

    @app.get("/v1/models", tags=["generate"], responses={401: {"description": "missing or invalid token"}})
    async def models(creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:  # noqa: B008
        """The models this token may name: the base model and every tenant (the admin token) or
        its own tenant (a tenant's token)."""
        who = svc.principal(creds)
        snap = svc.rt.store.snapshot()
        from hkstore.model_name import model_name

        base = model_name(snap.meta) or "base"
        tenants = sorted(snap.pets) if who == "admin" else [t for t in snap.pets if t == who]
        rows = [{"id": base, "object": "model", "created": 0, "owned_by": "hkstore", "root": base}]
        for t in tenants:
            meta = snap.read_pet(t).meta
            rows.append({"id": t, "object": "model", "created": int(meta.get("created") or 0)
                         if isinstance(meta.get("created"), (int, float)) else 0, "owned_by": t, "root": base,
                         "parent": base, "task": meta.get("task")})
        return {"object": "list", "data": rows}


class _CompletionRender:
    """/v1/completions' answer and chunks."""

    def __init__(self, model, echo):
        self.model, self.echo = model, echo

    def final(self, cid, created, choices, usage):
        rows = []
        for ch in choices:
            text, lps = ch["text"], ch["logprobs"]
            if ch["echo"] is not None:
                prompt_text, prompt_lps = ch["echo"]
                text = prompt_text + text
                lps = (prompt_lps or []) + lps if lps is not None else None
            rows.append({"index": ch["index"], "text": text, "finish_reason": ch["finish_reason"],
                         "logprobs": _completion_logprobs(lps) if lps is not None else None})
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model, "choices": rows,
                "usage": usage}

    def head(self, cid, created, index, echo):
        if echo is None:
            return None
        text, lps = echo
        return self._chunk(cid, created, index, text, None, _completion_logprobs(lps) if lps is not None else None)

    def chunk(self, cid, created, index, delta, reason, lp):
        return self._chunk(cid, created, index, delta, reason, _completion_logprobs([lp]) if lp is not None else None)

    def _chunk(self, cid, created, index, text, reason, logprobs):
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}]}


class _ChatRender:
    """/v1/chat/completions' answer and chunks."""

    echo = False

    def __init__(self, model):
        self.model = model

    def final(self, cid, created, choices, usage):
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [{"index": ch["index"], "message": {"role": "assistant", "content": ch["text"]},
                             "finish_reason": ch["finish_reason"],
                             "logprobs": {"content": [_chat_logprob(x) for x in ch["logprobs"]]}
                             if ch["logprobs"] is not None else None} for ch in choices],
                "usage": usage}

    def head(self, cid, created, index, echo):
        return self._chunk(cid, created, index, {"role": "assistant", "content": ""}, None, None)

    def chunk(self, cid, created, index, delta, reason, lp):
        return self._chunk(cid, created, index, {"content": delta} if delta else {}, reason, lp)

    def _chunk(self, cid, created, index, delta, reason, lp):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "finish_reason": reason,
                             "logprobs": {"content": [_chat_logprob(lp)]} if lp is not None else None}]}


class _Stream(StreamingResponse):
    """Server-sent events that call on_close once the response is over, sent or not."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _disconnected(request: Request):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk_object(route):
    return "chat.completion.chunk" if route == "chat" else "text_completion"


def _stop_prefix(text: str, stops: list[str]) -> int:
    """How many characters at text's end could begin a stop sequence (held back while streaming)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _completion_logprobs(lps):
    return {"tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps],
            "top_logprobs": [None if x["top"] is None else {t: lp for t, lp in x["top"]} for x in lps],
            "text_offset": None}


def _chat_logprob(x):
    return {"token": x["token"], "logprob": x["logprob"], "bytes": list(x["token"].encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in x["top"]]}
