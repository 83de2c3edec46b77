"""The HTTP front end (HMI §4): a dispatcher for infer requests and durable manage jobs.

    app = runtime.serve.app.create_app("STORE", admin_token="...")   # a FastAPI app; run it with uvicorn
    hkstore serve STORE [--host 127.0.0.1] [--port 8080] [--admin-token-file F]

**Infer.** ``POST /v1/tenants/{tenant}/infer`` with ``{"text": ...}`` or ``{"texts": [...]}``
answers ``{"tenant", "results": [...]}``, one result per text: the label (classification) or
the tags per word (tagging), with probabilities. The dispatcher puts each text on the
runtime's one queue (runtime.engine, through ``runtime.Runtime.submit``); a batch, mixed across
tenants, forms once it holds ``max_batch`` texts or its first text has waited ``max_wait_ms``,
and each result goes back to its caller. A request that would push the queue past
``queue_limit`` texts is answered 429 with Retry-After; one that is not answered within
``request_timeout_s`` gets 504 (its texts leave the queue if not yet started; under overload,
texts that could no longer finish in time are answered 504 when their batch forms, rather than
computed for nobody). A tenant with students (Student Parallelism) is answered by its teacher
or its first k students as the runtime's pruning policy decides per batch under the load;
``"students": k`` in the body pins it (0: the teacher; 422 for a tenant without students or k
above its group), and every result's ``students`` says how many answered (0: the teacher).

**Manage** (HMI §4.1 a-e) are durable jobs, admin only; each POST answers 202 with a job id:

    POST   /v1/domains                  create a domain: corpus upload, further pre-training, branch
    POST   /v1/domains/{name}/update    update a domain into a new sibling version
    POST   /v1/tenants                  create a tenant: labeled data upload, PET fine-tuning
                                        (the answer holds the tenant's API token, shown once)
    POST   /v1/tenants/{tenant}/update  continue a tenant's fine-tuning
    DELETE /v1/tenants/{tenant}         delete a tenant
    GET    /v1/jobs/{id}, /v1/jobs      state (queued, running, done, failed) and progress: one job is
                                        always {"job": {...}} (as the POSTs answer), a list {"jobs": [...]}

A job is STORE/jobs/<id>.json (written atomically: temporary file, fsync, rename, fsync of the
directory) with its uploads in STORE/jobs/<id>/. One runner thread takes the jobs in creation
order and hands each to a worker process (``python -m runtime.serve.jobs --job-worker``: started
ahead of time, so torch is imported when the job comes; it runs up to 20 jobs one after the
other, then a fresh one takes over) that calls runtime.construct.manager; the store's writer lock
serializes it with any other writer, and serving goes on meanwhile. When a job commits, the runtime refreshes its snapshot, so the new tenant or
version becomes visible at once and atomically. A server that restarts finds every job that
was running: a job whose change reached the store is finished, one that did not is queued
again (at most 3 attempts, then failed), so no job is silently lost. One server per store runs
jobs (STORE/jobs/LOCK); a second one serves and answers 503 to manage requests.

**Security.** Manage operations need the admin token (``Authorization: Bearer``). Each tenant
gets its own token at creation, ``<tenant>~<secret>``; STORE/tokens.json keeps only a salted
SHA-256 of it. A tenant token reaches only its own tenant (403 otherwise); the admin token
reaches every tenant. Names follow hkstore.store.check_name. Every request with a body is
authenticated from its Authorization header before one byte of the body is read (401 or 403,
and the connection closes): unauthenticated callers cannot make the server read, buffer or
parse anything, nor see a validation error. Bodies are bounded per route: infer 1 MiB, manage
requests carrying documents or examples 64 MiB (spooled to a temporary file while they
arrive), other manage requests 64 KiB. ``hkstore serve --header-timeout`` (10 s) closes
connections that do not send a whole request head in time; ``--body-timeout`` (30 s, plus 1 s
per ``--min-body-rate`` bytes received) answers 408 to a body that does not arrive in time,
whoever sent it (runtime.serve.cli.BodyDeadline). Every writer of STORE/tokens.json (the CLI's
``token issue/revoke``, this server's tenant jobs, any process) holds STORE/tokens.lock across its
update (hkstore.tokens), and every request re-reads the file when it changed: a revoked token is
refused once ``revoke`` returns. A damaged tokens.json refuses every tenant token (401) while the
admin token works; ``/healthz`` says degraded (the reason to the admin), ``/metrics`` has
``hkstore_tokens_damaged``.

**Answers to bad requests.** ``{"detail": ...}``; on the OpenAI-compatible routes OpenAI's
``{"error": {"message", "type", "param", "code"}}``. A body that is not JSON: 400; not UTF-8, or
not fitting the schema: 422 (booleans and integers are strict: ``0`` or ``"yes"`` is no boolean);
a method a path does not serve: 405 with every method it does in ``Allow``.

**Damage.** A CorruptError (a damaged or missing store file, a rolled-back CURRENT) answers
the requests it affects 503 "store damaged: run hkstore verify"; tenants and versions whose
data is intact keep being served (a batch that fails is split to find the damaged requests).
``/healthz`` reports ``degraded`` (the reason to the admin token) until the store changes, and
``/metrics`` counts it (``hkstore_store_damaged``, ``hkstore_store_degraded``).

**Observability.** ``/healthz`` and ``/info`` are open and show a caller without the admin
token no path, store content or reason of a damage: ``/healthz`` its ``status``, ``/info`` the
model's name, kind and dimension, the limits and the routes; the admin token sees the rest.
``/metrics`` (the admin token as a bearer token, or open with ``--metrics-public``) in the
Prometheus text format: queue depth, batch sizes, latencies, rejections, embeddings requests,
jobs, PET cache hits and any counters the runtime reports (``Runtime.stats()``: the GPU
executor's PLOT hot tier among them).

**Embeddings.** ``POST /v1/embeddings`` as OpenAI's (the official client's defaults included:
base64): ``model`` the base model (``base`` or its names) or a tenant; ``policy`` exact (the
whole encoder: the base model's own embedding, its default) or fast (the PLOT: a tenant's
default); ``dimensions``; token-id inputs (runtime.Runtime.embed).

Modules of runtime/serve/: dispatcher.py (the door to the engine's queue, the dedicated baseline), metrics.py,
jobs.py (durable jobs and their worker), tokens.py (tenant tokens), files.py (atomic small
files), schemas.py (request and response bodies), cli.py (the command); this one holds the
HTTP layer.

**Dedicated baseline.** ``mode="dedicated"`` emulates one full model per tenant (HMI's
baseline): batches hold one tenant only, one runs at a time, and a tenant whose model is not
among the ``dedicated_resident`` most recent ones first copies a full model's weights (the
swap); every text is answered at the exact level (every layer on its own context, no PLOT
lookup), and a request that asks for a policy, a level or students is refused.
"""

import asyncio
import base64
import codecs
import contextlib
import hmac
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from typing import Annotated, Literal, Optional

import numpy as np
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from hkstore.errors import CorruptError, StoreError, UnknownTenant
from hkstore.store import check_name
from runtime.serve.dispatcher import Dispatcher, Expired, PoolDispatcher
from runtime.serve.jobs import Jobs, JobsUnavailable
from runtime.serve.metrics import Metrics
from runtime.serve.schemas import (
    MAX_INFER_BODY,
    MAX_MANAGE_BODY,
    MAX_UPLOAD_BODY,
    NAME_PATTERN,
    ClassificationExample,
    DomainCreateBody,
    DomainUpdateBody,
    EmbeddingsBody,
    Health,
    InferBody,
    InferResponse,
    JobAccepted,
    JobList,
    JobView,
    TenantCreateBody,
    TenantJobAccepted,
    TenantUpdateBody,
)
from hkstore.tokens import TokenStore, hash_token, new_tenant_token, valid_name

log = logging.getLogger("hkstore.serve")


class HTTPError(Exception):
    def __init__(self, status, detail, headers=None):
        self.status, self.detail, self.headers = status, detail, headers


class Service:
    """Everything one app holds: runtime, dispatcher, jobs, tokens, metrics."""

    def __init__(self, store_path, *, admin_token, max_batch, max_wait_ms, queue_limit, request_timeout_s, device,
                 max_len, mode, dedicated_resident, job_threads, runtime_options, torch_threads, workers=1):
        self.store_path = os.path.abspath(store_path)
        self.admin_token = admin_token
        self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000.0
        self.queue_limit, self.request_timeout_s = queue_limit, request_timeout_s
        self.device, self.max_len, self.mode = device, max_len, mode
        self.dedicated_resident = dedicated_resident
        self.torch_threads = int(torch_threads)
        self.workers = int(workers)  # > 1: infer runs in worker processes (runtime.pool)
        self.runtime_options = dict(runtime_options or {})
        self.rt = None
        self.dispatcher = None
        self.tokens = TokenStore(self.store_path)
        self.jobs = Jobs(self.store_path, on_commit=self._committed, tokens=self.tokens, threads=job_threads)
        self.metrics = Metrics(self)
        self.metrics.queue_limit.set(queue_limit)
        self._current = None
        self._watch_task = None
        self._refresh = threading.Lock()
        self.damage = None  # (reason, unix time) of the last CorruptError seen, until the store changes
        self.taken_elsewhere = set  # tenant names of the other stores one server serves (runtime.serve.stores)
        # Manage jobs of this store run in another process that answers them (a Ray worker's
        # Manager replica, runtime/serve/ray_app.py): /healthz reports jobs as enabled.
        self.jobs_elsewhere = False

    async def start(self):
        import runtime

        if self.torch_threads > 0:
            import torch

            # The runtime computes from several threads (prepare, compute, prefetch); OpenMP pools
            # of 2+ threads in each contend badly on a small machine (100x slower batches seen).
            torch.set_num_threads(self.torch_threads)
        options = dict(self.runtime_options)
        options.setdefault("max_batch", max(self.max_batch, 1))
        # one queue, the engine's: it batches the server's texts (max_batch, max_wait_s)
        options.setdefault("max_wait_s", self.max_wait_s)
        if self.mode == "dedicated":
            options["batching"] = "tenant"
        self.rt = await asyncio.to_thread(runtime.open, self.store_path, self.device, max_len=self.max_len, **options)
        self._current = self._read_current()
        await asyncio.to_thread(self._warm_up)
        if self.workers > 1 and getattr(self.rt, "engine", None) is not None and self.mode == "shared":
            # This process keeps HTTP, tokens, jobs and metrics; the workers compute.
            self.dispatcher = await asyncio.to_thread(
                PoolDispatcher, self.store_path, self.metrics, workers=self.workers, queue_limit=self.queue_limit,
                device=self.rt.device, torch_threads=max(self.torch_threads, 1), max_len=self.max_len, **options)
        else:
            self.dispatcher = Dispatcher(self.rt, self.metrics, queue_limit=self.queue_limit, mode=self.mode,
                                         dedicated_resident=self.dedicated_resident)
        self.dispatcher.start()
        await asyncio.to_thread(self.jobs.start)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self):
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        await asyncio.to_thread(self.jobs.stop)
        if self.rt is not None:
            await asyncio.to_thread(self.rt.close)

    def _warm_up(self):
        """One request through the runtime, so the first caller does not pay for lazy init."""
        pets = self.rt.store.snapshot().pets
        if pets:
            with contextlib.suppress(Exception):
                self.rt.infer([{"tenant": next(iter(pets)), "text": "warm up"}])

    def _read_current(self):
        try:
            with open(os.path.join(self.store_path, "CURRENT"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def refresh(self):
        """Serve the store's newest manifest (thread-safe; cheap when nothing changed)."""
        with self._refresh:
            current = self._read_current()
            if current != self._current:
                try:
                    self.rt.refresh()
                except CorruptError as e:
                    # Keep serving the snapshot we hold; report the damage until CURRENT moves.
                    self._current = current
                    self.note_damage("refresh", e)
                    return
                self._current = current
                if self.dispatcher is not None:
                    self.dispatcher.refresh()
                if self.damage is not None:  # the store changed (repaired?): requests re-report what is left
                    self.damage = None
                    self.metrics.degraded.set(0)

    def runtime_stats(self) -> dict:
        """Runtime.stats() of what computes (the workers' summed, with --workers)."""
        return self.dispatcher.runtime_stats() if self.dispatcher is not None else self.rt.stats()

    def _committed(self, job):
        self.refresh()

    async def _watch(self):
        """Pick up commits made outside this server (the CLI) within a second, and segments
        rewritten in place (a stat each: Store.scrub), whose rows are then checked again."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self._read_current() != self._current:
                    await asyncio.to_thread(self.refresh)
                scrub = getattr(getattr(self.rt, "store", None), "scrub", None)
                if scrub is not None:
                    await asyncio.to_thread(scrub)
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("refreshing the store snapshot failed")

    # -- auth --

    def header_denial(self, authorization, admin):
        """Authenticate from the Authorization header alone, before any body is read: None if
        it may go on, else (status, detail). admin: the route needs the admin token."""
        scheme, _, token = (authorization or b"").decode("latin-1").strip().partition(" ")
        creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip()) \
            if scheme.lower() == "bearer" else None
        try:
            who = self.principal(creds)
        except HTTPError as e:
            return e.status, e.detail
        if admin and who != "admin":
            return 403, "this operation needs the admin token"
        return None

    # -- damage --

    def note_damage(self, where, error):
        """A CorruptError reached a request (or a refresh): /healthz says degraded until the
        store changes; the request gets 503."""
        reason = f"{where}: {error}"
        if self.damage is None or self.damage[0] != reason:
            log.error("store damaged (%s); run hkstore verify", reason)
        self.damage = (reason, time.time())
        self.metrics.damaged.labels(where.split(" ")[0]).inc()
        self.metrics.degraded.set(1)

    def damaged_error(self, where, error):
        self.note_damage(where, error)
        return HTTPError(503, f"store damaged: run hkstore verify ({error})", {"Retry-After": "60"})

    def principal(self, creds):
        """"admin", a tenant name, or an HTTPError 401."""
        token = creds.credentials if creds is not None else None
        if not token:
            raise HTTPError(401, "missing bearer token (Authorization: Bearer <token>)", {"WWW-Authenticate": "Bearer"})
        if hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return "admin"
        tenant = self.tokens.verify(token)
        if tenant is None:
            raise HTTPError(401, "invalid token", {"WWW-Authenticate": "Bearer"})
        return tenant

    def is_admin(self, creds) -> bool:
        """Whether creds hold the admin token (no error either way: for routes that are open
        and show more to the admin)."""
        token = creds.credentials if creds is not None else None
        return bool(token) and hmac.compare_digest(token.encode(), self.admin_token.encode())

    def require_admin(self, creds):
        who = self.principal(creds)
        if who != "admin":
            raise HTTPError(403, "this operation needs the admin token")

    def require_tenant(self, creds, tenant):
        who = self.principal(creds)
        if who != "admin" and who != tenant:
            raise HTTPError(403, f"this token does not give access to tenant {tenant!r}")
        if tenant not in self.rt.store.snapshot().pets:
            self.refresh()  # a job may have committed it a moment ago (its state says done first)
            if tenant not in self.rt.store.snapshot().pets:
                raise HTTPError(404, f"unknown tenant {tenant!r}")
        return who

    # -- future view of names, for conflicts at submission --

    def planned(self):
        """(tenants, versions) as they will be once every queued job has run."""
        snap = self.rt.store.snapshot()
        tenants, versions = set(snap.pets), set(snap.version_names)
        for job in self.jobs.pending():
            p = job["params"]
            if job["kind"] == "tenant_create":
                tenants.add(p["tenant"])
            elif job["kind"] == "tenant_rm":
                tenants.discard(p["tenant"])
            elif job["kind"] == "domain_create":
                versions.add(p["name"])
            elif job["kind"] == "domain_update":
                versions.add(p["new_name"])
        return tenants, versions


def _optional_creds(request):
    """The bearer token of an open route (/healthz, /info), which shows more to the admin: read
    from the header, not declared as a security scheme, since the route needs none."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    token = token.strip()
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) \
        if scheme.lower() == "bearer" and token else None


@contextlib.contextmanager
def _reported(report):
    """report(status) when the block ends: 200, an HTTPError's status, 500 for anything else."""
    status = 200
    try:
        yield
    except HTTPError as e:
        status = e.status
        raise
    except Exception:
        status = 500
        raise
    finally:
        report(status)


def _name(kind, name):
    try:
        check_name(kind, name)
    except StoreError as e:
        raise HTTPError(422, str(e)) from None
    if not valid_name(name):
        raise HTTPError(422, f"invalid {kind} name {name!r}")
    return name


def info_view(svc, admin=False) -> dict:
    """/info's answer. Open to everyone: the model's name (and the names a request may give),
    its kind and dimension, the limits a caller must respect and the routes; nothing of the
    machine. admin: also where the store and the model are on disk, the versions, the number
    of tenants, the device and the mode."""
    from hkstore.cli import model_source
    from hkstore.model_name import accepted_names, model_name
    from runtime.model.stored import is_decoder_store
    from runtime.serve.schemas import MAX_TEXT_CHARS, MAX_TEXTS

    rt = svc.rt
    snap = rt.store.snapshot()
    meta = snap.meta
    decoder = is_decoder_store(meta)
    model = {"name": model_name(meta), "names": sorted({"base"} | accepted_names(meta)),
             "kind": "decoder" if decoder else "encoder", "dimensions": int(meta["d"])}
    limits = {"max_batch": svc.max_batch, "queue_limit": svc.queue_limit, "request_timeout_s": svc.request_timeout_s}
    if decoder:
        # A decoder runtime has no per-text limit: a prompt and its completion share the context.
        limits["context_length"] = int(rt.decoder.config.max_len)
        routes = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions", "models": "/v1/models"}
    else:
        limits.update(max_len=rt.max_len, embeddings_max_len=rt.embed_max_len, truncate=rt.truncate,
                      max_texts_per_request=MAX_TEXTS, max_text_chars=MAX_TEXT_CHARS)
        routes = {"infer": "/v1/tenants/{tenant}/infer", "embeddings": "/v1/embeddings", "models": "/v1/models"}
    out = {"model": model, "limits": limits, "routes": routes}
    if admin:
        model.update(source=model_source(meta)["source"], model_path=meta.get("model_path"),
                     recorded_name=meta.get("base_model"))
        out.update(store=svc.store_path, versions=snap.version_names, tenants=len(snap.pets), device=rt.device,
                   mode=svc.mode)
    return out


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _precision(asked):
    """A tenant's asked precision, refused (422, the missing instruction set named) before its
    job queues when this machine cannot serve it: the job would fail after minutes of waiting."""
    from runtime.construct.manager import check_precision

    try:
        check_precision(asked)
    except ValueError as e:
        raise HTTPError(422, str(e)) from None


def _examples_file(examples):
    if isinstance(examples[0], ClassificationExample):
        return "train.jsonl", _jsonl({"text": e.text, "label": e.label} for e in examples)
    lines = []
    for e in examples:
        lines += [f"{w}\t{t}" for w, t in zip(e.tokens, e.tags)] + [""]
    return "train.conll", ("\n".join(lines) + "\n").encode()


def _result_view(r) -> dict:
    timings = {k: round(float(v) * 1000.0, 3) for k, v in (r.timings or {}).items()}
    out = {"task": r.task, "version": r.version, "labels": list(r.labels), "probabilities": r.probabilities,
           "batch_size": int(r.batch_size), "timings_ms": timings, "students": int(getattr(r, "students", 0))}
    if r.task == "classification":
        out["label"] = r.label
    else:
        out["tags"], out["tokens"] = list(r.tags), list(r.tokens)
    if getattr(r, "truncated", 0):
        out["truncated"] = int(r.truncated)
    if getattr(r, "confidence", None) is not None:
        out.update(level=int(r.level), confidence=float(r.confidence), pruned=int(r.pruned),
                   level_name=str(getattr(r, "level_name", "plot")))
    return out


_INFER_PATH = re.compile(r"^/v1/tenants/[^/]+/infer$")
_UPLOAD_PATH = re.compile(r"^/v1/(domains|tenants)(/[^/]+/update)?$")  # POSTs carrying documents or examples
_SPOOL_IN_MEMORY = 1 << 20  # an upload past this goes to a temporary file while it arrives
_TENANT_POSTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")  # beside infer


class _Gate:
    """ASGI middleware in front of every route that takes a body (POST, PUT, PATCH, DELETE):

    1. authentication from the Authorization header before one byte of the body is read
       (401 or 403 at once, and the connection is closed: an unauthenticated caller can make
       the server read, buffer or parse nothing, and learns nothing of the schema);
    2. a body limit by route: infer MAX_INFER_BODY, the manage requests that carry documents or
       examples MAX_UPLOAD_BODY (streamed into a temporary file while it arrives), any other
       MAX_MANAGE_BODY; 413 from Content-Length before reading, or as soon as a body without
       one passes its limit;
    3. a body that is not UTF-8 (JSON's encoding, RFC 8259) is answered 422 with the offending
       byte's offset, as text that is not valid Unicode is;
    4. a method a path does not serve is answered 405 with every method it serves in Allow
       (the router alone would name only the first route of the path)."""

    def __init__(self, app, service=None, infer_limit=MAX_INFER_BODY, upload_limit=MAX_UPLOAD_BODY,
                 manage_limit=MAX_MANAGE_BODY, routes=None):
        self.app, self.service, self.routes = app, service, routes
        self.infer_limit, self.upload_limit, self.manage_limit = infer_limit, upload_limit, manage_limit

    def _allowed(self, path):
        """The methods the routes of path serve (None: no route has that path)."""
        methods = None
        for route in (self.routes() if self.routes is not None else ()):
            regex, served = getattr(route, "path_regex", None), getattr(route, "methods", None)
            if regex is not None and served and regex.match(path):
                methods = (methods or set()) | set(served)
        return methods

    async def _refuse(self, send, path, status, detail, headers=()):
        if _INFER_PATH.match(path):
            self.service.metrics.count_request(path.split("/")[3], status)
        elif path == "/v1/embeddings":
            self.service.metrics.count_embeddings("other", status)  # the body (its model) is not read
        return await _send_json(send, status, error_body(path, status, detail), headers)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope["method"]
        allowed = self._allowed(path)
        if allowed is not None and method not in allowed:
            allow = ", ".join(sorted(allowed))
            return await _send_json(send, 405, error_body(path, 405, f"{method} is not served here (Allow: {allow})"),
                                    [(b"allow", allow.encode())])
        if method in ("GET", "HEAD", "OPTIONS") or self.service is None:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        infer = bool(_INFER_PATH.match(path)) or path in _TENANT_POSTS  # tenant tokens welcome
        if path.startswith("/v1/"):
            denied = self.service.header_denial(headers.get(b"authorization"), admin=not infer)
            if denied is not None:
                status, detail = denied
                extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
                return await self._refuse(send, path, status, detail, extra + [(b"connection", b"close")])
        upload = method == "POST" and bool(_UPLOAD_PATH.match(path))
        limit = self.infer_limit if infer else self.upload_limit if upload else self.manage_limit
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await self._refuse(send, path, 400, "invalid Content-Length", [(b"connection", b"close")])
            if n > limit:
                return await self._refuse(send, path, 413, f"request body of {n} bytes exceeds {limit} bytes",
                                          [(b"connection", b"close")])
        spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY) if upload else io.BytesIO()
        utf8 = codecs.getincrementaldecoder("utf-8")()
        try:
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                if size + len(chunk) > limit:
                    return await self._refuse(send, path, 413, f"request body exceeds {limit} bytes",
                                              [(b"connection", b"close")])
                more = bool(message.get("more_body"))
                pending = len(utf8.getstate()[0])  # bytes of a character the last chunk began
                try:
                    utf8.decode(chunk, final=not more)
                except UnicodeDecodeError as e:
                    return await self._refuse(
                        send, path, 422, f"the request body is not valid UTF-8 (byte {size - pending + e.start}: "
                                         f"{e.reason}): JSON text must be UTF-8", [(b"connection", b"close")])
                size += len(chunk)
                if chunk:
                    spool.write(chunk)  # a page-cache write: no need to leave the loop
                if not more:
                    break
            spool.seek(0)
            done = False

            async def replay():
                nonlocal done
                if done:
                    return await receive()
                chunk = spool.read(_SPOOL_IN_MEMORY)
                done = spool.tell() >= size
                return {"type": "http.request", "body": chunk, "more_body": not done}

            return await self.app(scope, replay, send)
        finally:
            spool.close()


OPENAI_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/embeddings"))
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_ERROR_CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "not_found", 413: "request_too_large",
                429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout"}


def error_body(path, status, detail) -> dict:
    """A 4xx/5xx answer's body: ``{"detail": ...}``, or on the OpenAI-compatible routes OpenAI's
    ``{"error": {"message", "type", "param", "code"}}`` (its clients show only that message)."""
    if path not in OPENAI_PATHS:
        return {"detail": detail}
    param = None
    if isinstance(detail, list):  # validation errors: [{loc, msg, type}]
        where = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in detail]
        message = "; ".join(f"{w}: {e.get('msg', '')}" if w else str(e.get("msg", ""))
                            for w, e in zip(where, detail)) or "invalid request"
        param = where[0] if where and where[0] else None
        code = detail[0].get("type") if detail else None
    else:
        message, code = str(detail), _ERROR_CODES.get(status)
        if status == 404 and message.startswith("unknown model"):
            code, param = "model_not_found", "model"
    kind = _ERROR_TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_json(send, status, obj, headers=()):
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def create_app(store_path, *, admin_token, max_batch=32, max_wait_ms=5, queue_limit=1024, request_timeout_s=30,
               device="auto", max_len=128, mode="shared", dedicated_resident=4, job_threads=1,
               torch_threads=1, runtime_options=None, metrics_public=False, workers=1) -> FastAPI:
    """The serving app over the store at store_path (see the module doc). The runtime opens
    when the app starts (uvicorn's lifespan) and closes when it stops.

    mode: "shared" (hPLM: one shared encoder, mixed-tenant batches) or "dedicated" (the
    baseline emulation). torch_threads: torch's intra-op threads in the server (0: torch's
    default); job_threads: in each job worker. runtime_options go to runtime.open
    (pet_cache_bytes, pipeline, ...). metrics_public: serve /metrics without a token (by default it
    needs the admin token, as a Prometheus scrape config's bearer token).
    """
    from contextlib import asynccontextmanager

    if not isinstance(admin_token, str) or len(admin_token) < 16:
        raise ValueError("the admin token must be a string of at least 16 characters")
    if not os.path.exists(os.path.join(store_path, "CURRENT")):
        raise StoreError(f"{store_path}: no store here (no CURRENT file)")
    if mode not in ("shared", "dedicated"):
        raise ValueError(f"mode must be shared or dedicated, got {mode!r}")
    if min(max_batch, queue_limit) < 1 or max_wait_ms < 0 or request_timeout_s <= 0:
        raise ValueError("max_batch and queue_limit must be positive, max_wait_ms >= 0, request_timeout_s > 0")
    svc = Service(store_path, admin_token=admin_token, max_batch=int(max_batch), max_wait_ms=float(max_wait_ms),
                  queue_limit=int(queue_limit), request_timeout_s=float(request_timeout_s), device=device,
                  max_len=int(max_len), mode=mode, dedicated_resident=dedicated_resident, job_threads=job_threads,
                  runtime_options=runtime_options, torch_threads=torch_threads, workers=workers)

    @asynccontextmanager
    async def lifespan(app):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="hkstore", version="1",
                  description="Multi-tenant inference over one shared encoder, with durable manage jobs (HMI §4).",
                  lifespan=lifespan)
    app.state.service = svc
    app.add_middleware(_Gate, service=svc, routes=lambda: app.routes)
    bearer = HTTPBearer(auto_error=False, description="The admin token, or a tenant's API token")

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return JSONResponse(error_body(request.url.path, exc.status, exc.detail), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(request.url.path, exc.status_code, exc.detail), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        status = 400 if any(e.get("type") == "json_invalid" for e in errors) else 422
        if _INFER_PATH.match(request.url.path):  # refused before the route ran: count it here
            svc.metrics.count_request(request.url.path.split("/")[3], status)
        elif request.url.path == "/v1/embeddings":
            svc.metrics.count_embeddings("other", status)
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors]
        return JSONResponse(error_body(request.url.path, status, detail), status_code=status)

    @app.exception_handler(CorruptError)
    async def _damaged(request, exc: CorruptError):
        e = svc.damaged_error(f"{request.method} {request.url.path}", exc)
        return JSONResponse(error_body(request.url.path, e.status, e.detail), status_code=e.status, headers=e.headers)

    @app.exception_handler(JobsUnavailable)
    async def _no_jobs(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "60"})

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(request.url.path, 500, "internal server error"), status_code=500)

    TenantPath = Annotated[str, Path(pattern=NAME_PATTERN, min_length=1, max_length=64)]
    not_json = {400: {"description": "the body is not JSON (or a Content-Length that is not a number)"}}
    errors_infer = {**not_json, 401: {"description": "missing or invalid token"},
                    403: {"description": "not this tenant's token"},
                    404: {"description": "unknown tenant"}, 413: {"description": "body too large"},
                    422: {"description": "invalid request"}, 429: {"description": "queue full (Retry-After)"},
                    504: {"description": "not answered within the request timeout"}}
    errors_admin = {401: {"description": "missing or invalid token"}, 403: {"description": "not the admin token"},
                    422: {"description": "invalid request"}}
    errors_manage = {**errors_admin, **not_json, 404: {"description": "unknown tenant or version"},
                     409: {"description": "the name is taken"}, 413: {"description": "body too large"},
                     503: {"description": "another server runs this store's jobs"}}

    @app.get("/healthz", response_model=Health, response_model_exclude_none=True, tags=["observability"])
    async def healthz(request: Request):
        """Open: ``status`` (ok or degraded). With the admin token also the reason of a damage,
        the device, the tenants and versions, the queue and the jobs."""
        reasons = [svc.damage[0]] if svc.damage else []
        if (tokens_problem := svc.tokens.problem()) is not None:
            reasons.append(f"tokens.json is damaged: {tokens_problem} (tenant tokens are refused; the admin token "
                           "works; issue them again with hkstore token issue)")
        out = {"status": "degraded" if reasons else "ok"}
        if svc.is_admin(_optional_creds(request)):
            snap = svc.rt.store.snapshot()
            out.update(reason="; ".join(reasons) or None, device=svc.rt.device, mode=svc.mode,
                       tenants=len(snap.pets), versions=len(snap.versions), queue_depth=svc.dispatcher.depth,
                       jobs=svc.jobs.counts(), jobs_enabled=bool(svc.jobs.enabled or svc.jobs_elsewhere),
                       workers=svc.dispatcher.workers())
        return out

    @app.get("/metrics", tags=["observability"], response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                        401: {"description": "missing or invalid token (unless the server was started with "
                                             "--metrics-public)"}, 403: {"description": "not the admin token"}})
    async def metrics(creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """Prometheus text format: queue, batches, latencies, rejections, embeddings, jobs, the PET
        cache and the runtime's counters. The admin token (open with ``--metrics-public``)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if not metrics_public:
            svc.require_admin(creds)
        data = await asyncio.to_thread(generate_latest, svc.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/info", tags=["observability"])
    async def info(request: Request) -> dict:
        """What this server serves and its limits (as TEI's /info): the model's name, kind and
        dimension, the limits and the routes. With the admin token also where the store and the
        model are on disk, the versions, the number of tenants, the device and the mode."""
        return info_view(svc, admin=svc.is_admin(_optional_creds(request)))

    @app.post("/v1/embeddings", tags=["infer"], responses={
        **not_json, 401: {"description": "missing or invalid token"}, 403: {"description": "not this tenant's token"},
        404: {"description": "unknown tenant (model)"}, 409: {"description": "the tenant's PET does not fit"},
        413: {"description": "body too large"}, 422: {"description": "invalid request"}})
    async def embeddings(body: EmbeddingsBody, creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        """OpenAI-compatible embeddings. ``model``: the base model (``base``, unless a tenant has
        that name, or the model's name as /info and /v1/models show it, e.g.
        ``sentence-transformers/all-MiniLM-L6-v2`` or ``all-MiniLM-L6-v2``) or a tenant (its PLOT
        version and PET). The mean-pooled, L2-normalized last hidden state; ``policy`` picks how
        the lower layers are computed (exact: the whole encoder, the base model's default, its
        own embedding as sentence-transformers computes it, and a tenant's top, its full-depth
        PET in every layer when it has a current one; fast: the PLOT, a tenant's default).
        ``encoding_format`` float or base64 (little-endian float32), ``dimensions`` truncates and
        re-normalizes. Any valid token may ask for the base model, a tenant's token only for its
        own tenant."""
        import runtime
        from hkstore.model_name import accepted_names

        t0 = time.perf_counter()
        label = "other"

        def report(status):
            svc.metrics.count_embeddings(label, status)
            svc.metrics.embeddings_latency.observe(time.perf_counter() - t0)

        with _reported(report):
            # A tenant of that name first; else "base" or the base model's own names ask for it.
            pets = svc.rt.store.snapshot().pets
            tenant = None if body.model in {"base"} | accepted_names(svc.rt.meta) and body.model not in pets \
                else body.model
            if tenant is None:
                svc.principal(creds)
                label = "base"
            else:
                try:
                    _name("tenant", tenant)
                except HTTPError:  # no tenant can have that name: an unknown model, as OpenAI says
                    if svc.principal(creds) != "admin":  # as for any other tenant's name: no enumeration
                        raise HTTPError(403, f"this token does not give access to model {body.model!r}") from None
                    raise HTTPError(404, f"unknown model {body.model!r}: not a tenant of this store, nor 'base' "
                                         "(GET /v1/models lists them)") from None
                who = svc.principal(creds)
                if who != "admin" and who != tenant:  # another tenant or none: the same answer
                    raise HTTPError(403, f"this token does not give access to model {body.model!r}")
                if tenant not in pets:
                    raise HTTPError(404, f"unknown model {body.model!r}: not a tenant of this store, nor 'base' "
                                         "(GET /v1/models lists them)")
                label = tenant
            inputs = body.all_inputs()
            d = int(svc.rt.meta.get("d") or 0)
            if body.dimensions is not None and d and body.dimensions > d:
                raise HTTPError(422, f"dimensions={body.dimensions} is more than the model's {d}")
            try:
                vectors, counts = await asyncio.to_thread(svc.rt.embed, inputs, tenant, truncate=body.truncate,
                                                          policy=body.policy)
            except UnknownTenant:
                raise HTTPError(404, f"unknown model {body.model!r}: not a tenant of this store, nor 'base' "
                                     "(GET /v1/models lists them)") from None
            except CorruptError as e:
                raise svc.damaged_error(f"embeddings {body.model}", e) from None
            except runtime.IncompatiblePet as e:  # as infer answers it
                raise HTTPError(409, str(e)) from None
            except (runtime.BadRequest, StoreError) as e:
                raise HTTPError(422, str(e)) from None
            if body.dimensions is not None:
                # Matryoshka-style shortening, as OpenAI's text-embedding-3 and TEI: cut, then unit length again.
                vectors = vectors[:, :body.dimensions]
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            if body.encoding_format == "base64":
                data = [base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
                        for v in vectors]
            else:
                data = [v.tolist() for v in vectors]
            svc.metrics.embedded.inc(len(data))
            return {"object": "list", "model": body.model,
                    "data": [{"object": "embedding", "index": j, "embedding": e} for j, e in enumerate(data)],
                    "usage": {"prompt_tokens": int(sum(counts)), "total_tokens": int(sum(counts))}}

    @app.post("/v1/tenants/{tenant}/infer", response_model=InferResponse, response_model_exclude_none=True,
              tags=["infer"], responses=errors_infer)
    async def infer(tenant: TenantPath, body: InferBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """Classify or tag ``text`` or ``texts`` with the tenant's PET: one result per text (label
        and probabilities, or tags per word; the level that answered). The tenant's token or the
        admin token; 429 when the queue is full, 504 past the request timeout."""
        import runtime

        t0 = time.perf_counter()
        m = svc.metrics

        def report(status):
            m.count_request(tenant, status)
            m.latency.observe(time.perf_counter() - t0)

        with _reported(report):
            _name("tenant", tenant)
            svc.require_tenant(creds, tenant)
            texts = body.all_texts()
            if len(texts) > svc.queue_limit:
                raise HTTPError(422, f"{len(texts)} texts, more than the queue holds ({svc.queue_limit})")
            entries = await svc.dispatcher.offer(tenant, texts, t0 + svc.request_timeout_s, truncate=body.truncate,
                                           policy=body.policy, students=body.students, level=body.level)
            if entries is None:
                m.rejected.labels("queue_full").inc()
                raise HTTPError(429, f"the input queue is full ({svc.queue_limit} texts); retry later",
                                {"Retry-After": "1"})
            remaining = svc.request_timeout_s - (time.perf_counter() - t0)
            try:
                outs = await asyncio.wait_for(asyncio.gather(*(e.future for e in entries), return_exceptions=True),
                                              max(remaining, 0.0))
            except asyncio.TimeoutError:
                svc.dispatcher.drop(entries)
                m.rejected.labels("timeout").inc()
                raise HTTPError(504, f"no answer within {svc.request_timeout_s:g} s") from None
            except asyncio.CancelledError:  # the client went away
                svc.dispatcher.drop(entries)
                status = 499
                raise
            if any(isinstance(out, Expired) for out in outs):
                svc.dispatcher.drop(entries)
                m.rejected.labels("timeout").inc()
                raise HTTPError(504, f"no answer within {svc.request_timeout_s:g} s (the queue is too long)")
            results = []
            for j, out in enumerate(outs):
                where = f"texts[{j}]: " if body.texts is not None else ""
                if isinstance(out, UnknownTenant):
                    raise HTTPError(404, f"unknown tenant {tenant!r}")
                if isinstance(out, CorruptError):
                    raise svc.damaged_error(f"infer {tenant}", out)
                if isinstance(out, runtime.Unavailable):
                    m.rejected.labels("worker_lost").inc()
                    raise HTTPError(503, str(out), {"Retry-After": "1"})
                if isinstance(out, runtime.IncompatiblePet):
                    raise HTTPError(409, where + str(out))
                if isinstance(out, (runtime.BadRequest, StoreError)):
                    raise HTTPError(422, where + str(out))
                if isinstance(out, BaseException):
                    raise out
                results.append(_result_view(out))
            m.texts.inc(len(results))
            return {"tenant": tenant, "results": results}

    @app.get("/v1/tenants", tags=["manage"], responses=errors_admin)
    async def list_tenants(creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        """Every tenant of the store and whether it has an API token. The admin token."""
        svc.require_admin(creds)
        snap = svc.rt.store.snapshot()
        tokens = svc.tokens.tenants()
        return {"tenants": [{"tenant": t, "has_token": t in tokens} for t in sorted(snap.pets)]}

    @app.get("/v1/tenants/{tenant}", tags=["manage"], responses={
        401: {"description": "missing or invalid token"},
        403: {"description": "neither the admin token nor this tenant's own token"},
        404: {"description": "unknown tenant (to the admin token or the tenant's own)"},
        422: {"description": "invalid request"}})
    async def get_tenant(tenant: TenantPath, creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        """A tenant's record: version, PET type, task, labels, created. The admin token, or the
        tenant's own token."""
        _name("tenant", tenant)
        svc.require_tenant(creds, tenant)
        try:
            record = await asyncio.to_thread(svc.rt.store.snapshot().read_pet, tenant)
        except UnknownTenant:
            raise HTTPError(404, f"unknown tenant {tenant!r}") from None
        keep = ("version", "pet_type", "task", "labels", "created")
        return {"tenant": tenant, **{k: record.meta.get(k) for k in keep}}

    @app.get("/v1/domains", tags=["manage"], responses=errors_admin)
    async def list_domains(creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        """Every version (domain) of the store: name, parent, created, segments, and its build info.
        The admin token."""
        svc.require_admin(creds)
        snap = svc.rt.store.snapshot()
        return {"versions": [{"name": v["name"], "parent": v["parent"], "created": v["created"],
                              "segments": len(v["segments"]),
                              "info": {k: v["info"][k] for k in ("alpha", "ngrams_kept", "documents", "updates")
                                       if k in v["info"]}} for v in snap.versions]}

    async def _submit(kind, params, uploads, extra=None):
        job = await asyncio.to_thread(svc.jobs.submit, kind, params, uploads, extra)
        return svc.jobs.view(job)

    def _check_jobs():
        if not svc.jobs.enabled:
            raise JobsUnavailable("this server does not run jobs: another server on this store does")

    @app.post("/v1/domains", status_code=202, response_model=JobAccepted, tags=["manage"], responses=errors_manage)
    async def domain_create(body: DomainCreateBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """A job that creates domain ``name`` from ``parent``: further pre-training on ``documents``,
        then a new PLOT branch. The admin token; 202 with the job."""
        svc.require_admin(creds)
        _check_jobs()
        _name("version", body.name)
        _, versions = svc.planned()
        if body.name in versions:
            raise HTTPError(409, f"version {body.name!r} already exists")
        if body.parent not in versions:
            raise HTTPError(404, f"unknown parent version {body.parent!r}")
        params = body.model_dump(exclude={"documents"})
        uploads = {"corpus.jsonl": _jsonl({"text": d} for d in body.documents)}
        return {"job": await _submit("domain_create", dict(params, documents=len(body.documents)), uploads)}

    @app.post("/v1/domains/{name}/update", status_code=202, response_model=JobAccepted, tags=["manage"],
              responses=errors_manage)
    async def domain_update(name: TenantPath, body: DomainUpdateBody,
                            creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """A job that updates domain ``name`` with ``documents`` into a new sibling version
        ``new_name``. The admin token; 202 with the job."""
        svc.require_admin(creds)
        _check_jobs()
        _name("version", name)
        _name("version", body.new_name)
        _, versions = svc.planned()
        if name not in versions:
            raise HTTPError(404, f"unknown version {name!r}")
        if body.new_name in versions:
            raise HTTPError(409, f"version {body.new_name!r} already exists")
        params = dict(body.model_dump(exclude={"documents"}), name=name, documents=len(body.documents))
        uploads = {"corpus.jsonl": _jsonl({"text": d} for d in body.documents)}
        return {"job": await _submit("domain_update", params, uploads)}

    @app.post("/v1/tenants", status_code=202, response_model=TenantJobAccepted, tags=["manage"],
              responses=errors_manage)
    async def tenant_create(body: TenantCreateBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """A job that creates ``tenant`` on ``version``, fine-tuning a PET (``pet_type``, LoRA by
        default as ``hkstore tenant create``) on ``examples``. The admin token; 202 with the job and
        the tenant's API token, shown only here and valid once the job is done."""
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", body.tenant)
        _name("version", body.version)
        tenants, versions = svc.planned()
        if body.tenant in tenants:
            raise HTTPError(409, f"tenant {body.tenant!r} already exists (or a queued job creates it)")
        if body.tenant in svc.taken_elsewhere():
            raise HTTPError(409, f"tenant {body.tenant!r} is a tenant of another store this server serves")
        if body.version not in versions:
            raise HTTPError(404, f"unknown version {body.version!r}")
        _precision(body.precision)
        name, data = _examples_file(body.examples)
        if (name == "train.conll") != (body.task == "tagging"):
            raise HTTPError(422, f"the examples do not fit task {body.task!r}")
        token = new_tenant_token(body.tenant)
        params = dict(body.model_dump(exclude={"examples"}), examples=len(body.examples))
        job = await _submit("tenant_create", params, {name: data}, {"token_hash": hash_token(token)})
        return {"job": job, "token": token}

    @app.post("/v1/tenants/{tenant}/update", status_code=202, response_model=JobAccepted, tags=["manage"],
              responses=errors_manage)
    async def tenant_update(tenant: TenantPath, body: TenantUpdateBody,
                            creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """A job that continues the tenant's fine-tuning on ``examples`` (and may move it to
        ``version``). The admin token; 202 with the job."""
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", tenant)
        tenants, versions = svc.planned()
        if tenant not in tenants:
            raise HTTPError(404, f"unknown tenant {tenant!r}")
        if body.version is not None and body.version not in versions:
            raise HTTPError(404, f"unknown version {body.version!r}")
        if body.precision is not None:
            _precision(body.precision)
        uploads = {}
        if body.examples:
            name, data = _examples_file(body.examples)
            uploads[name] = data
        params = dict(body.model_dump(exclude={"examples"}), tenant=tenant,
                      examples=len(body.examples) if body.examples else 0)
        return {"job": await _submit("tenant_update", params, uploads)}

    @app.delete("/v1/tenants/{tenant}", status_code=202, response_model=JobAccepted, tags=["manage"],
                responses=errors_manage)
    async def tenant_rm(tenant: TenantPath, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """A job that deletes the tenant (and its API token). The admin token; 202 with the job."""
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", tenant)
        tenants, _ = svc.planned()
        if tenant not in tenants:
            raise HTTPError(404, f"unknown tenant {tenant!r}")
        return {"job": await _submit("tenant_rm", {"tenant": tenant}, {})}

    @app.get("/v1/jobs/{job_id}", response_model=JobAccepted, tags=["manage"],
             responses={**errors_admin, 404: {"description": "unknown job"}})
    async def get_job(job_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")],
                      creds: HTTPAuthorizationCredentials = Depends(bearer)):
        """One job: state (queued, running, done, failed), progress, result or error. The admin token."""
        svc.require_admin(creds)
        job = svc.jobs.load(job_id)
        if job is None:
            raise HTTPError(404, f"unknown job {job_id!r}")
        return {"job": svc.jobs.view(job)}  # the envelope every job answer has (POSTs add their extras)

    @app.get("/v1/jobs", response_model=JobList, tags=["manage"], responses=errors_admin)
    async def list_jobs(creds: HTTPAuthorizationCredentials = Depends(bearer),
                        state: Optional[Literal["queued", "running", "done", "failed"]] = None,
                        limit: Annotated[int, Query(ge=1, le=1000)] = 50):
        """The newest jobs (``limit``, at most 1000), optionally in one ``state``. The admin token."""
        svc.require_admin(creds)
        jobs = await asyncio.to_thread(svc.jobs.list, limit, state)
        return {"jobs": [svc.jobs.view(j) for j in jobs]}

    from runtime.serve.openai_routes import add_openai_routes

    add_openai_routes(app, svc, bearer, HTTPError)  # /v1/completions, /v1/chat/completions, /v1/models
    return app
