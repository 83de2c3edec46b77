"""One ``hkstore serve`` over several stores side by side, as HMI serves a BERT root and a GPT
root from one machine: ``hkstore serve ENCODER_STORE DECODER_STORE``.

Each store keeps its own app (runtime.serve.app.create_app: runtime, dispatcher or generation
engine, jobs, tenant tokens, metrics); this front only picks the app a request goes to. Tenant
names are unique across the stores (checked at startup, and when a tenant is created through
the server), so a tenant names its store:

- ``/v1/tenants/{tenant}[/...]``: the store holding the tenant (infer, get, update, delete);
- ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``: the store holding the
  tenant ``model`` names; ``base`` is the first decoder store's base model for the generation
  routes and the first encoder store's for embeddings, a base model's own name its store's.
  A tenant of the other kind gets its own store's 4xx (an encoder tenant does not generate, a
  decoder tenant does not classify or embed). The token is checked from the header before the
  body is read, as by each app;
- ``GET /v1/models``: every store's models this token reaches; ``/healthz`` and ``/info``: every
  store's, under "stores" (what the token may see of each);
- ``/stores/{name}/...``: everything of one store (``name``: its directory's name), e.g.
  ``POST /stores/{name}/v1/tenants`` to create a tenant there, ``/stores/{name}/metrics``.
  Other store-wide routes at the top (``/metrics``, manage listings and creation)
  answer 400 naming these paths: which store is meant is not guessed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

from runtime.serve.app import _send_json, create_app, error_body
from runtime.serve.asgi_call import Lifespan, call
from runtime.serve.schemas import MAX_INFER_BODY

_TENANT_PATH = re.compile(r"^/v1/tenants/([^/]+)(/.*)?$")
_GENERATE = ("/v1/completions", "/v1/chat/completions")
_SHARED_GETS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def read_stores(paths) -> dict[str, dict]:
    """{name: {"path", "decoder", "tenants", "base"}} of the stores ("base": the names a request may
    give for the store's base model), or ValueError when two share a directory name or a tenant name."""
    import hkstore
    from hkstore.model_name import accepted_names
    from runtime.model.stored import is_decoder_store

    stores, owner = {}, {}
    for path in paths:
        name = os.path.basename(os.path.normpath(os.path.abspath(path)))
        if name in stores:
            raise ValueError(f"two stores are named {name!r} ({stores[name]['path']}, {path}): serve stores whose "
                             "directories have different names")
        with hkstore.open(path) as st:
            snap = st.snapshot()
            stores[name] = {"path": os.path.abspath(path), "decoder": is_decoder_store(snap.meta),
                            "tenants": set(snap.pets), "base": accepted_names(snap.meta)}
        for t in sorted(stores[name]["tenants"]):
            if t in owner:
                raise ValueError(f"tenant {t!r} is in both {owner[t]} and {name}: tenant names must be unique across "
                                 "the stores one server serves")
            owner[t] = name
    return stores


def create_stores_app(paths, **options):
    """An ASGI app serving every store of paths (see the module doc); options as create_app's."""
    return StoresApp(read_stores(paths), options)


class StoresApp:
    def __init__(self, stores: dict[str, dict], options):
        self.stores = stores
        self.apps = {name: create_app(s["path"], **options) for name, s in stores.items()}
        self.first = next(iter(self.apps))
        for name, app in self.apps.items():
            app.state.service.taken_elsewhere = lambda name=name: self.tenants(but=name)

    # -- which store --

    def service(self, name):
        return self.apps[name].state.service

    def tenants(self, but=None) -> set:
        """Tenant names of every store (but one), as their runtimes see them now."""
        out = set()
        for name in self.apps:
            rt = self.service(name).rt
            if name != but and rt is not None:
                out |= set(rt.store.snapshot().pets)
        return out

    def owner(self, tenant):
        for name in self.apps:
            rt = self.service(name).rt
            if rt is not None and tenant in rt.store.snapshot().pets:
                return name
        return None

    def for_model(self, model, decoder: bool):
        """The store a request naming `model` goes to: the tenant's, else the one whose base
        model it names (the route's kind first), else the route's kind's first (its 404)."""
        if isinstance(model, str) and (name := self.owner(model)) is not None:
            return name
        kind = [n for n, s in self.stores.items() if s["decoder"] == decoder]
        for name in kind + [n for n in self.apps if n not in kind]:
            if model in self.stores[name]["base"] or (model == "base" and name in kind):
                return name
        return (kind or [self.first])[0]

    def denial(self, headers, admin):
        """None if some store accepts the Authorization header, else the first store's answer."""
        first = None
        for name in self.apps:
            d = self.service(name).header_denial(headers.get(b"authorization"), admin=admin)
            if d is None:
                return None
            first = first or d
        return first

    # -- ASGI --

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return await self.apps[self.first](scope, receive, send)
        path, method = scope.get("path", ""), scope["method"]
        if path.startswith("/stores/"):
            name, _, rest = path[len("/stores/"):].partition("/")
            if name not in self.apps:
                return await _send_json(send, 404, {"detail": f"unknown store {name!r}; this server serves "
                                                              f"{', '.join(self.apps)}"})
            prefix = f"/stores/{name}"
            sub = dict(scope, path="/" + rest, raw_path=("/" + rest).encode(),
                       root_path=scope.get("root_path", "") + prefix)
            return await self.apps[name](sub, receive, send)
        if m := _TENANT_PATH.match(path):
            return await self.apps[self.owner(m.group(1)) or self.first](scope, receive, send)
        if method == "POST" and (path in _GENERATE or path == "/v1/embeddings"):
            return await self.by_model(scope, receive, send, decoder=path in _GENERATE)
        if method == "GET" and path == "/v1/models":
            return await self.models(scope, send)
        if method == "GET" and path in ("/healthz", "/info"):
            return await self.each(scope, send, path)
        if method == "GET" and path in _SHARED_GETS:
            return await self.apps[self.first](scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if path.startswith("/v1/") and (denied := self.denial(headers, admin=True)) is not None:
            return await _send_json(send, denied[0], {"detail": denied[1]}, [(b"connection", b"close")])
        return await _send_json(send, 400 if path.startswith("/v1/") or path == "/metrics" else 404,
                                {"detail": f"this server serves several stores ({', '.join(self.apps)}): send "
                                           f"{path} to /stores/<name>{path}"})

    async def by_model(self, scope, receive, send, decoder):
        headers = dict(scope.get("headers") or [])
        if (denied := self.denial(headers, admin=False)) is not None:
            extra = [(b"www-authenticate", b"Bearer")] if denied[0] == 401 else []
            return await _send_json(send, denied[0], error_body(scope["path"], *denied),
                                    extra + [(b"connection", b"close")])
        body = bytearray()
        while True:  # the body is bounded as infer's; the store's own gate checks it again
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_INFER_BODY:
                return await _send_json(send, 413, error_body(scope["path"], 413, f"request body exceeds "
                                                                             f"{MAX_INFER_BODY} bytes"),
                                        [(b"connection", b"close")])
            if not message.get("more_body"):
                break
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None  # the store's app answers the malformed body
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.apps[self.for_model(model, decoder)](scope, replay, send)

    async def models(self, scope, send):
        headers = list(scope.get("headers") or [])
        answers = await asyncio.gather(*(call(app, "GET", "/v1/models", headers=headers)
                                         for app in self.apps.values()))
        rows, seen = [], set()
        for status, _, body in answers:
            if status == 200:
                for row in json.loads(body)["data"]:
                    if row["id"] not in seen:
                        seen.add(row["id"])
                        rows.append(row)
        if not seen:
            status, _, body = answers[0]
            return await _send_json(send, status, json.loads(body))
        return await _send_json(send, 200, {"object": "list", "data": rows})

    async def each(self, scope, send, path):
        """/healthz or /info of every store, as the caller's token sees them (the admin token
        sees more), under "stores"; /healthz's status is ok when every store's is."""
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() == b"authorization"]
        answers = await asyncio.gather(*(call(app, "GET", path, headers=headers) for app in self.apps.values()))
        each = {name: json.loads(body) for name, (_, _, body) in zip(self.apps, answers)}
        if path == "/info":
            return await _send_json(send, 200, {"stores": each})
        ok = all(h.get("status") == "ok" for h in each.values())
        return await _send_json(send, 200, {"status": "ok" if ok else "degraded", "stores": each})

    async def lifespan(self, receive, send):
        spans = []
        message = await receive()  # lifespan.startup
        try:
            for app in self.apps.values():
                span = Lifespan(app)
                await span.startup()
                spans.append(span)
        except Exception as e:  # noqa: BLE001 - reported to the server, which exits
            for span in reversed(spans):
                await span.shutdown()
            return await send({"type": "lifespan.startup.failed", "message": str(e)})
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        assert message["type"] == "lifespan.shutdown"
        for span in reversed(spans):
            await span.shutdown()
        await send({"type": "lifespan.shutdown.complete"})
