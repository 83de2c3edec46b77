"""Drive an ASGI app in-process: its lifespan (startup, shutdown) and one HTTP request at a time.

The Ray Serve replicas (runtime/serve/ray_app.py) run the very app of ``hkstore serve``
(runtime.serve.app.create_app) this way, so auth, validation, queue bounds, timeouts and
metrics are the same code on one machine and on a cluster.
"""

import asyncio


class Lifespan:
    """The ASGI lifespan protocol, as a server would run it."""

    def __init__(self, app):
        self.app = app
        self._to_app = asyncio.Queue()
        self._from_app = asyncio.Queue()
        self._task = None

    async def _exchange(self, message, expect):
        await self._to_app.put({"type": message})
        got = asyncio.ensure_future(self._from_app.get())
        done, _ = await asyncio.wait({got, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if got not in done:
            got.cancel()
            self._task.result()  # raises the app's error, if any
            raise RuntimeError(f"the app ended its lifespan before answering {message}")
        reply = got.result()
        if reply["type"] != expect:
            raise RuntimeError(f"{message}: {reply.get('message') or reply['type']}")

    async def startup(self):
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._exchange("lifespan.startup", "lifespan.startup.complete")

    async def shutdown(self):
        if self._task is None or self._task.done():
            return
        try:
            await self._exchange("lifespan.shutdown", "lifespan.shutdown.complete")
        finally:
            self._task = None


def _scope(method, path, query, headers, client):
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query, "root_path": "", "headers": [(k.lower(), v) for k, v in headers],
            "client": client, "server": ("hkstore-ray", 0), "state": {}}


def _receiver(body):
    """An ASGI receive: the whole body once, then wait (the caller stays connected; a
    cancellation ends the request)."""
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    return receive


async def stream(app, method, path, query=b"", headers=(), body=b"", client=("127.0.0.1", 0)):
    """One HTTP request through the app, its answer as the app sends it: (status, headers)
    first, then each body chunk (server-sent events as they are made). Closing the generator
    cancels the request, as a client going away would."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run():
        try:
            await app(_scope(method, path, query, headers, client), _receiver(body), queue.put)
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not None:
            if message["type"] == "http.response.start":
                yield int(message["status"]), list(message.get("headers") or [])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        if not task.done():
            task.cancel()


async def call(app, method, path, query=b"", headers=(), body=b"", client=("127.0.0.1", 0)):
    """One HTTP request through the app: (status, [(name, value)] as bytes, body bytes)."""
    scope = _scope(method, path, query, headers, client)
    receive = _receiver(body)

    out = {"status": 500, "headers": [], "body": []}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"], out["headers"] = int(message["status"]), list(message.get("headers") or [])
        elif message["type"] == "http.response.body":
            out["body"].append(message.get("body", b""))

    await app(scope, receive, send)
    return out["status"], out["headers"], b"".join(out["body"])
