"""OpenAI-compatible text generation on ``hkstore serve`` over a decoder store.

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed",
                                 "logprobs", "stream", ...}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ..., "logprobs", "top_logprobs"}
    GET  /v1/models             the models this token reaches: the base model and tenants

``model`` names a tenant (its lm PET and PLOT version) or the base model (``base``, unless a
tenant has that name, or the base model's own name as /v1/models lists it). A tenant's token
reaches its own tenant and the base model; the admin token reaches every one.

**Chat template.** The messages become one prompt: a line ``<role>: <content>`` per message,
then ``assistant:``; the completion of that prompt is the assistant's answer (pass
``stop: ["\\nuser:"]`` to end it at the next turn).

**Engine.** One thread runs a continuous batcher (runtime.gen.batcher, one per PLOT version)
for every request of the server: requests join and leave between decoding steps. A request
that would hold more than the server's queue limit of sequences (waiting and running) is
answered 429 with Retry-After. ``stream: true`` answers server-sent events, one ``data: {chunk}``
per token and a final ``data: [DONE]``; a client that disconnects cancels its sequence.
Extensions beside OpenAI's fields: ``top_k`` and vLLM's ``ignore_eos`` (run to max_tokens or a stop).
Only n = 1 (400 otherwise); temperature defaults to 1 and max_tokens to 16 (completions) or
what is left of the context, at most 256 (chat), as OpenAI's. Bad requests (unknown model:
404; prompt or prompt + max_tokens beyond the context, invalid sampling values, an encoder
tenant or store asked to generate: 400) are refused before anything runs. /metrics gains the
running and waiting sequences, tokens made, time to first token and inter-token latency.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ConfigDict

CHAT_DEFAULT_MAX_TOKENS = 256
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: an extension (0: all)
    ignore_eos: bool | None = None  # not OpenAI's: vLLM's extension (run to max_tokens or a stop sequence)
    n: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def chat_prompt(messages) -> str:
    """The documented template: "<role>: <content>" lines, then "assistant:"."""
    lines = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        lines.append(f"{m.role}: {content or ''}\n")
    return "".join(lines) + "assistant:"


class _Handle:
    __slots__ = ("cancelled", "key", "released", "request", "sink")

    def __init__(self, request, sink):
        self.request, self.sink, self.key, self.cancelled, self.released = request, sink, None, False, False


def _stale(batcher, snap) -> bool:
    """An idle batcher over an older snapshot than snap: replaced by one on snap. One over the
    newest stays, with its KV pool (allocating and zeroing a pool per request cost tens of
    milliseconds of time to first token)."""
    return not batcher.busy and batcher.gen.snapshot.manifest.get("generation") != snap.manifest.get("generation")


class GenEngine:
    """One thread, one continuous batcher per PLOT version, for every generation request.

    submit(request, sink) -> handle or None (the queue is full); sink(event) is called from the
    engine thread: {"type": "accepted", "prompt_tokens"}, then {"type": "token", ...} per token
    (the last with finished True), or {"type": "error", "error": exception} instead."""

    def __init__(self, rt, metrics, queue_limit: int):
        self.rt, self.queue_limit = rt, queue_limit
        self.cond = threading.Condition()
        self.inbox: list[_Handle] = []
        self.cancels: list[_Handle] = []
        self.live = 0  # requests submitted and not finished (inbox, waiting, running)
        self.batchers: dict[str, object] = {}
        self.handles: dict[tuple[str, int], _Handle] = {}
        self.stopping = False
        self.m = metrics
        self.thread = threading.Thread(target=self._run, name="hkstore-gen", daemon=True)
        self.thread.start()

    def submit(self, request: dict, sink):
        with self.cond:
            if self.live >= self.queue_limit:
                return None
            self.live += 1
            h = _Handle(request, sink)
            self.inbox.append(h)
            self.cond.notify()
            return h

    def cancel(self, h: _Handle):
        with self.cond:
            if not h.cancelled:
                h.cancelled = True
                self.cancels.append(h)
                self.cond.notify()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(30)

    def release(self, h: _Handle):
        """The request's HTTP answer is over (sent, refused or abandoned): its place in the queue
        frees. A stream holds its place until its client has read it all or gone away."""
        with self.cond:
            if not h.released:
                h.released = True
                self.live -= 1

    def _admit(self, h: _Handle):
        import runtime

        try:
            rt = self.rt
            snap = rt.store.snapshot()
            request = h.request
            c = rt.decoder.config
            prompt = rt.decoder.tokenize([request["prompt"]], max_len=1 << 30)[0]
            if not c.rotary and len(prompt) >= c.max_len:
                raise runtime.BadRequest(f"the prompt is {len(prompt)} tokens, the model's context holds {c.max_len}")
            if request.get("max_tokens") is None:
                request = dict(request, max_tokens=max(1, min(CHAT_DEFAULT_MAX_TOKENS, c.max_len - len(prompt)))
                               if not c.rotary else CHAT_DEFAULT_MAX_TOKENS)
            version, prompt, params, pet = rt.parse(snap, request)
            batcher = self.batchers.get(version)
            if batcher is None or _stale(batcher, snap):
                batcher = self.batchers[version] = rt.batcher(snap, version)
            try:
                rid = batcher.submit(prompt, params, pet)
            except ValueError as e:
                raise runtime.BadRequest(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the request's answer (4xx or 500), the engine goes on
            h.sink({"type": "error", "error": e})
            return
        h.key = (version, rid)
        self.handles[h.key] = h
        h.sink({"type": "accepted", "prompt_tokens": len(prompt)})

    def _run(self):
        while True:
            with self.cond:
                while not (self.inbox or self.cancels or self.stopping or any(b.busy for b in self.batchers.values())):
                    self.cond.wait()
                if self.stopping:
                    break
                inbox, self.inbox = self.inbox, []
                cancels, self.cancels = self.cancels, []
            for h in inbox:
                if not h.cancelled:
                    self._admit(h)
            for h in cancels:
                if h.key is not None and self.handles.get(h.key) is h:  # not finished (batchers' ids recur)
                    del self.handles[h.key]
                    version, rid = h.key
                    b = self.batchers.get(version)
                    if b is not None:
                        b.cancel(rid)
                        b.done.pop(rid, None)  # a waiting one is done at once; a running one at its next step
            newest = self.rt.store.snapshot()
            for version, b in list(self.batchers.items()):
                if b.busy:
                    self._step(version, b)
                if _stale(b, newest):
                    del self.batchers[version]
            self._gauges()
        for key, h in list(self.handles.items()):
            h.sink({"type": "error", "error": RuntimeError("the server is shutting down")})

    def _step(self, version, b):
        try:
            events = b.step()
        except Exception as e:  # noqa: BLE001 - every sequence of the batcher gets the error, the engine goes on
            for key in [k for k in self.handles if k[0] == version]:
                h = self.handles.pop(key)
                h.sink({"type": "error", "error": e})
            del self.batchers[version]
            return
        running = {r.id: r for r in b.running}
        for e in events:
            h = self.handles.get((version, e.id))
            req = running.get(e.id) or b.done.get(e.id)
            if e.finished:
                b.done.pop(e.id, None)
            if h is None:  # cancelled
                continue
            out = {"type": "token", "token": e.token, "text": e.text, "finished": e.finished,
                   "finish_reason": e.finish_reason, "completion_tokens": len(req.ids) if req else 0}
            if e.token is not None and req is not None:
                out["logprob"], out["top"] = req.logprobs[-1], req.top[-1]
                self.m["tokens"].inc()
            if e.finished:
                del self.handles[(version, e.id)]
            h.sink(out)
        for x in b.ttft:
            self.m["ttft"].observe(x)
        for x in b.itl:
            self.m["itl"].observe(x)
        b.ttft.clear()
        b.itl.clear()

    def _gauges(self):
        self.m["running"].set(sum(len(b.running) for b in self.batchers.values()))
        self.m["waiting"].set(sum(len(b.waiting) for b in self.batchers.values()) + len(self.inbox))


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


def add_openai_routes(app, svc, bearer, HTTPError):
    """Mount /v1/completions, /v1/chat/completions and /v1/models on app (runtime.serve.app's
    create_app calls it with its Service, bearer scheme and HTTPError)."""
    from hkstore.errors import CorruptError, UnknownTenant
    from runtime import BadRequest

    metrics = _metrics(svc.metrics.registry)
    state = {"engine": None}
    lock = threading.Lock()

    def engine() -> GenEngine:
        with lock:
            if state["engine"] is None:
                state["engine"] = GenEngine(svc.rt, metrics, svc.queue_limit)
            return state["engine"]

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as value:
            try:
                yield value
            finally:
                if state["engine"] is not None:
                    await asyncio.to_thread(state["engine"].stop)

    app.router.lifespan_context = lifespan

    def base_names():
        from hkstore.model_name import accepted_names

        return {"base"} | accepted_names(svc.rt.store.snapshot().meta)

    def resolve(model, creds):
        """The tenant model names (None: the base model), after the token's check."""
        who = svc.principal(creds)
        pets = svc.rt.store.snapshot().pets
        if model in pets:
            if who != "admin" and who != model:
                raise HTTPError(403, f"this token does not give access to model {model!r}")
            tenant = model
        elif model in base_names():
            tenant = None
        else:
            raise HTTPError(404, f"unknown model {model!r}: not a tenant of this store, nor 'base' "
                                 "(GET /v1/models lists them)")
        if getattr(svc.rt, "decoder", None) is None:
            raise HTTPError(400, "this is an encoder store: its tenants classify (POST /v1/tenants/{tenant}/infer), "
                                 "they do not generate")
        return tenant

    def common(body: _Body, tenant, prompt, max_tokens, logprobs):
        if body.n not in (None, 1):
            raise HTTPError(400, f"n must be 1 (one completion per request), got {body.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise HTTPError(400, f"{name} is not supported (0 only)")
        if body.logit_bias:
            raise HTTPError(400, "logit_bias is not supported")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        req = {"prompt": prompt, "temperature": 1.0 if body.temperature is None else body.temperature,
               "top_p": 1.0 if body.top_p is None else body.top_p, "stop": stop, "logprobs": logprobs}
        if tenant is not None:
            req["tenant"] = tenant
        if max_tokens is not None:
            req["max_tokens"] = max_tokens
        if body.seed is not None:
            req["seed"] = body.seed
        if body.top_k is not None:
            req["top_k"] = body.top_k
        if body.ignore_eos:
            req["ignore_eos"] = True
        return req

    async def run(route, body, request, creds, tenant, gen_request, want_logprobs, render_final, render_chunk):
        """Submit, wait for admission (4xx before any byte), then answer at once or by SSE."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        eng = engine()
        h = eng.submit(gen_request, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        if h is None:
            metrics["requests"].labels(route, "429").inc()
            svc.metrics.rejected.labels("queue_full").inc()
            raise HTTPError(429, f"the generation queue is full ({svc.queue_limit} sequences); retry later",
                            {"Retry-After": "1"})
        streaming = False
        try:
            response = await answer(route, body, request, h, eng, queue, gen_request, want_logprobs, render_final,
                                    render_chunk)
            streaming = isinstance(response, _Stream)  # it releases h once sent or abandoned
            return response
        finally:
            if not streaming:
                eng.release(h)

    async def answer(route, body, request, h, eng, queue, gen_request, want_logprobs, render_final, render_chunk):
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
        prompt_tokens = first["prompt_tokens"]
        cid, created = f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        token_text = svc.rt.decoder.decode

        def logprob_view(ev):
            if not want_logprobs or ev.get("token") is None:
                return None
            return {"token": token_text([ev["token"]]), "logprob": ev["logprob"],
                    "top": [(token_text([t]), lp) for t, lp in ev["top"]]}

        def usage(completion_tokens):
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        if not body.stream:
            waiter = asyncio.ensure_future(_disconnected(request))
            try:
                lps, last = [], None
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        eng.cancel(h)
                        metrics["requests"].labels(route, "499").inc()
                        return Response(status_code=499)  # nobody reads it
                    ev = getter.result()
                    if ev["type"] == "error":
                        raise ev["error"]
                    if (lp := logprob_view(ev)) is not None:
                        lps.append(lp)
                    if ev["finished"]:
                        last = ev
                        break
            except asyncio.CancelledError:
                eng.cancel(h)
                raise
            finally:
                waiter.cancel()
            metrics["requests"].labels(route, "200").inc()
            return render_final(cid, created, last["text"], last["finish_reason"], lps if want_logprobs else None,
                                usage(last["completion_tokens"]))

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        stops = gen_request.get("stop") or []

        async def events():
            sent, finished = "", False
            try:
                head = render_chunk(cid, created, None, None, None, first=True)
                if head is not None:
                    yield _sse(head)
                while True:
                    ev = await queue.get()
                    if ev["type"] == "error":
                        yield _sse({"error": {"message": str(ev["error"]), "type": "server_error"}})
                        break
                    text = ev["text"]
                    upto = len(text) if ev["finished"] else len(text) - _stop_prefix(text, stops)
                    delta = text[len(sent):upto] if text.startswith(sent) else text[len(sent):]
                    if delta or ev["finished"] or (want_logprobs and ev.get("token") is not None):
                        sent += delta
                        yield _sse(render_chunk(cid, created, delta, ev["finish_reason"] if ev["finished"] else None,
                                                logprob_view(ev)))
                    if ev["finished"]:
                        finished = True
                        if include_usage:
                            yield _sse({"id": cid, "object": _chunk_object(route), "created": created,
                                        "model": body.model, "choices": [], "usage": usage(ev["completion_tokens"])})
                        break
                yield "data: [DONE]\n\n"
                metrics["requests"].labels(route, "200").inc()
            finally:
                if not finished:  # the client went away (or an error): free the sequence
                    eng.cancel(h)
                    metrics["requests"].labels(route, "499").inc()

        def closed():
            eng.cancel(h)  # nothing left to cancel when it finished
            eng.release(h)

        return _Stream(events(), closed, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    errors = {400: {"description": "invalid request: sampling values, n != 1, prompt or max_tokens beyond the "
                                   "context, an encoder tenant or store"},
              401: {"description": "missing or invalid token"}, 403: {"description": "not this tenant's token"},
              404: {"description": "unknown model"}, 422: {"description": "invalid request body"},
              429: {"description": "the generation queue is full (Retry-After)"}}

    @app.post("/v1/completions", tags=["generate"], responses=errors)
    async def completions(body: CompletionBody, request: Request, creds: HTTPAuthorizationCredentials = Depends(bearer)):  # noqa: B008
        """OpenAI-compatible text completion of ``prompt`` by ``model`` (a tenant or the base model)."""
        tenant = resolve(body.model, creds)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise HTTPError(400, "prompt must be one string (or a list of exactly one)")
            prompt = prompt[0]
        if body.echo or body.suffix or (body.best_of or 1) != 1:
            raise HTTPError(400, "echo, suffix and best_of > 1 are not supported")
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise HTTPError(400, f"logprobs must be between 0 and 5, got {body.logprobs}")
        want = body.logprobs is not None
        req = common(body, tenant, prompt, 16 if body.max_tokens is None else body.max_tokens, body.logprobs or 0)

        def final(cid, created, text, reason, lps, use):
            return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason,
                                 "logprobs": _completion_logprobs(lps) if lps is not None else None}],
                    "usage": use}

        def chunk(cid, created, delta, reason, lp, first=False):
            if first:
                return None
            return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": delta, "finish_reason": reason,
                                 "logprobs": _completion_logprobs([lp]) if lp is not None else None}]}

        return await run("completions", body, request, creds, tenant, req, want, final, chunk)

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
        want = bool(body.logprobs)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = common(body, tenant, chat_prompt(body.messages), max_tokens, top)

        def final(cid, created, text, reason, lps, use):
            return {"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": reason,
                                 "logprobs": {"content": [_chat_logprob(x) for x in lps]} if lps is not None else None}],
                    "usage": use}

        def chunk(cid, created, delta, reason, lp, first=False):
            d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": 0, "delta": d, "finish_reason": reason,
                                 "logprobs": {"content": [_chat_logprob(lp)]} if lp is not None else None}]}

        return await run("chat", body, request, creds, tenant, req, want, final, chunk)

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
            "top_logprobs": [{t: lp for t, lp in x["top"]} for x in lps], "text_offset": None}


def _chat_logprob(x):
    return {"token": x["token"], "logprob": x["logprob"], "bytes": list(x["token"].encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in x["top"]]}
