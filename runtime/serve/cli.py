"""`hkstore serve`: the admin token and the uvicorn server around runtime.serve.app."""

import asyncio
import json
import logging
import os
import secrets

import click

from hkstore.errors import StoreError
from runtime.serve.app import create_app
from hkstore.files import atomic_write
from runtime.serve.stores import create_stores_app, read_stores

log = logging.getLogger("hkstore.serve")

DEFAULT_BODY_TIMEOUT = 30  # seconds
DEFAULT_MIN_BODY_RATE = 1024  # bytes per second


def resolve_admin_token(store, token_file=None) -> str:
    """The admin token: --admin-token-file, else $HKSTORE_ADMIN_TOKEN, else STORE/admin.token
    (made with a fresh random token, mode 0600, on first use)."""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    elif os.environ.get("HKSTORE_ADMIN_TOKEN"):
        token = os.environ["HKSTORE_ADMIN_TOKEN"].strip()
    else:
        path = os.path.join(store, "admin.token")
        if not os.path.exists(path):
            atomic_write(path, (secrets.token_urlsafe(32) + "\n").encode(), mode=0o600)
            click.echo(f"admin token written to {path}", err=True)
        with open(path) as f:
            token = f.read().strip()
    if len(token) < 16:
        raise click.ClickException("the admin token must be at least 16 characters")
    return token


def admin_token_source(store, token_file=None) -> str:
    """Where resolve_admin_token reads the admin token from, for people."""
    if token_file:
        return os.path.abspath(token_file)
    if os.environ.get("HKSTORE_ADMIN_TOKEN"):
        return "$HKSTORE_ADMIN_TOKEN"
    return os.path.abspath(os.path.join(store, "admin.token"))


@click.command("serve")
@click.argument("stores", nargs=-1, required=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told otherwise).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--admin-token-file", type=click.Path(dir_okay=False, exists=True),
              help="File holding the admin token (default: $HKSTORE_ADMIN_TOKEN, else STORE/admin.token).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-batch", type=click.IntRange(1, 4096), default=32, show_default=True)
@click.option("--max-wait-ms", type=click.FloatRange(0, 60_000), default=5, show_default=True)
@click.option("--queue-limit", type=click.IntRange(1, 1 << 20), default=1024, show_default=True)
@click.option("--batching", type=click.Choice(["length", "coordinated", "fifo"]), default="length", show_default=True,
              help="Which waiting texts form a batch: similar lengths (Student Parallelism's buffer), PetS's "
                   "coordinated batching, or first come first served (BENCHMARKS, One engine).")
@click.option("--request-timeout", type=click.FloatRange(0.001, 3600), default=30, show_default=True,
              help="Seconds before an infer request gets 504.")
@click.option("--max-len", type=click.IntRange(3, 4096), default=128, show_default=True, help="Tokens per text.")
@click.option("--truncate/--no-truncate", default=False, show_default=True,
              help="Cut texts over --max-len tokens instead of answering 422 (a request's \"truncate\" overrides).")
@click.option("--mode", type=click.Choice(["shared", "dedicated"]), default="shared", show_default=True,
              help="shared: hPLM; dedicated: the per-tenant full-model baseline (emulated).")
@click.option("--dedicated-resident", type=click.IntRange(1, 100_000), default=4, show_default=True,
              help="dedicated mode: full models kept loaded.")
@click.option("--job-threads", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Torch threads of a job worker.")
@click.option("--torch-threads", type=click.IntRange(0, 256), default=1, show_default=True,
              help="Torch intra-op threads of the server, of each worker with --workers (0: torch's default).")
@click.option("--workers", default="auto", show_default=True, metavar="N|auto",
              help="Engine worker processes behind the one port (auto: one per core this process may use). "
                   "The server's process keeps HTTP, tokens, jobs and metrics; a tenant's texts go to its home "
                   "worker while it keeps up. One store, encoder, CPU, shared mode; else one engine.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="On the CPU: auto serves each tenant (each level of an encoder tenant) at the precision its "
                   "record names (bf16 where tenant create measured it loses nothing, fp32 otherwise and for "
                   "tenants never measured); fp32 or bf16 serve every tenant so (bf16 needs AVX512_BF16 or "
                   "AMX-BF16).")
@click.option("--metrics-public", is_flag=True,
              help="Serve /metrics without a token (default: it needs the admin token as a bearer token).")
@click.option("--header-timeout", type=click.FloatRange(0.1, 3600), default=10, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@click.option("--body-timeout", type=click.FloatRange(0.1, 3600), default=DEFAULT_BODY_TIMEOUT, show_default=True,
              help="Seconds a request's body may take to arrive, plus one for every --min-body-rate bytes "
                   "received; past that it is answered 408 and its connection closed, whatever its token.")
@click.option("--min-body-rate", type=click.FloatRange(1, 1 << 30), default=DEFAULT_MIN_BODY_RATE,
              show_default=True, help="Bytes per second a request body must keep up on average past "
                                      "--body-timeout (a slow upload may go on as long as it keeps this rate).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="warning",
              show_default=True)
@click.option("--access-log/--no-access-log", default=False, show_default=True)
@click.option("--ray", "use_ray", is_flag=True,
              help="Serve on a Ray cluster: --replicas workers over this (shared) store (Ray's proxy holds the "
                   "connections: --header-timeout and --body-timeout do not apply).")
@click.option("--replicas", type=click.IntRange(1, 4096), default=2, show_default=True, help="--ray: worker replicas.")
@click.option("--ray-address", default=None,
              help="--ray: the cluster to join (auto, ray://HOST:10001); default: a local one.")
@click.option("--router", type=click.Choice(["multiplex", "punica", "round_robin"]), default="multiplex",
              show_default=True, help="--ray: routing among replicas (multiplex: by tenant, Ray's default).")
@click.option("--autoscale", default=None, metavar="MIN:MAX", help="--ray: autoscale the workers on queue length.")
def serve(stores, host, port, admin_token_file, device, max_batch, max_wait_ms, queue_limit, batching, request_timeout,
          max_len,
          truncate, mode, dedicated_resident, job_threads, torch_threads, metrics_public, header_timeout, body_timeout,
          min_body_rate, log_level, access_log, use_ray, workers, precision, **ray_options):
    """Serve STORE over HTTP: POST /v1/tenants/TENANT/infer for every tenant, POST /v1/embeddings,
    manage jobs (/v1/tenants, /v1/domains, /v1/jobs), /healthz, /info, /metrics; the OpenAPI
    description at /docs;
    on a decoder store the OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models).
    Several stores (an encoder and a decoder store side by side): requests go to the store of
    the tenant they name, each store's own routes under /stores/NAME/;
    tenant names must be unique across them. Tenants' tokens: hkstore token issue STORE TENANT."""
    import uvicorn

    import hkstore

    for store in stores:  # stores, before anything (an admin token) is written into a directory
        try:
            hkstore.open(store).close()
        except (StoreError, OSError) as e:
            raise click.ClickException(f"{e}" if "store" in str(e) else f"{store}: not a store ({e})") from None
        if not os.path.exists(os.path.join(store, "CURRENT")):
            raise click.ClickException(f"{store}: not a store (no CURRENT); make one with hkstore build or hkstore init")
    if len(stores) > 1 and use_ray:
        raise click.ClickException("--ray serves one store")
    if use_ray and batching != "length":
        raise click.ClickException("--batching: Ray replicas batch by length")
    if len(stores) > 1:
        try:
            read_stores(stores)  # unique names, before an admin token is written
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    store = stores[0]  # the admin token's default home
    if device == "cuda":
        from runtime import _cuda_available

        if not _cuda_available():
            raise click.ClickException("--device cuda: no CUDA GPU with CuPy here (pip install 'hkstore[gpu]'); "
                                       "use --device cpu or auto")

    workers = _workers(workers, stores, device, mode, use_ray)
    # auto is the runtimes' own default: passed on only when asked otherwise (the GPU has its own)
    precise = {} if precision == "auto" else {"dtype": _precision(precision, stores, device)}
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: binding {host}, not loopback: the server is reachable from other hosts", err=True)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if use_ray:
        from runtime.serve.ray_app import cli_run

        return cli_run(store, resolve_admin_token(store, admin_token_file), host=host, port=port, device=device,
                       token_source=admin_token_source(store, admin_token_file),
                       max_batch=max_batch, max_wait_ms=max_wait_ms, queue_limit=queue_limit,
                       request_timeout_s=request_timeout, max_len=max_len, mode=mode,
                       dedicated_resident=dedicated_resident, job_threads=job_threads, torch_threads=torch_threads,
                       metrics_public=metrics_public,
                       runtime_options={**precise, **({"truncate": True} if truncate else {})} or None,
                       **ray_options)
    try:
        options = {"admin_token": resolve_admin_token(store, admin_token_file), "max_batch": max_batch,
                   "max_wait_ms": max_wait_ms, "queue_limit": queue_limit, "request_timeout_s": request_timeout,
                   "device": device, "max_len": max_len, "mode": mode, "dedicated_resident": dedicated_resident,
                   "job_threads": job_threads, "torch_threads": torch_threads, "metrics_public": metrics_public,
                   "runtime_options": {"batching": batching, **precise, **({"truncate": True} if truncate else {})}}
        app = create_app(store, workers=workers, **options) if len(stores) == 1 \
            else create_stores_app(stores, **options)
    except (StoreError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    sock = _bind(host, port)
    click.echo(f"serving {', '.join(stores)} on http://{host}:{port}"
               f"{f' with {workers} workers' if workers > 1 else ''} (admin token: "
               f"{admin_token_source(store, admin_token_file)}; tenant tokens: hkstore token issue "
               f"{store if len(stores) == 1 else 'STORE'} TENANT)", err=True)
    config = uvicorn.Config(BodyDeadline(app, body_timeout, min_body_rate), log_level=log_level,
                            access_log=access_log, timeout_graceful_shutdown=5,
                            http=header_timeout_protocol(header_timeout))
    uvicorn.Server(config).run(sockets=[sock])


def _workers(workers, stores, device, mode, use_ray) -> int:
    """--workers as a count: auto is one per usable core where workers apply (one encoder store
    on the CPU, shared mode, no Ray), else 1; a count where they do not apply is refused."""
    from runtime.pool import check_workers, is_decoder_store, usable_cores

    try:
        n, warning = check_workers(workers)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--workers") from None
    why = ("several stores" if len(stores) > 1 else "--ray (use --replicas)" if use_ray
           else "--device cuda (one GPU takes one engine)" if device == "cuda"
           else "--mode dedicated" if mode == "dedicated"
           else "a decoder store (one generation engine keeps every stream in one batch)"
           if is_decoder_store(stores[0]) else None)
    if why is None and device == "auto":
        from runtime import _cuda_available

        why = "a GPU (one GPU takes one engine)" if _cuda_available() else None
    if why is not None:
        if workers not in (None, "auto") and n > 1:
            raise click.BadParameter(f"{n} workers: not with {why}", param_hint="--workers")
        return 1
    if warning:
        click.echo(f"warning: {warning}", err=True)
    if workers in (None, "auto"):
        n = usable_cores()
    return n


def _bind(host, port):
    """The listening socket, bound before the runtime and the workers start, so a busy port
    is one line and exit status 1, not a traceback after a minute of loading."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class BodyDeadline:
    """ASGI middleware: a deadline for every request's body, authenticated or not. uvicorn
    waits forever for a body that stops short of its Content-Length (its timeouts cover idle
    keep-alive connections only), so a caller holding any valid token could keep connections
    and their buffers open at will.

    The body must have arrived `seconds` after the request's head, plus 1 s for every
    `min_rate` bytes received (Apache mod_reqtimeout's rule: a large upload may take as long as
    it keeps up the rate, a trickle is cut). Past the deadline the app's pending receive gets
    ``http.disconnect`` (the app stops as for a caller that went away) and the caller gets 408
    with ``Connection: close``, unless the app had answered already; the connection closes."""

    def __init__(self, app, seconds=DEFAULT_BODY_TIMEOUT, min_rate=DEFAULT_MIN_BODY_RATE):
        if seconds <= 0 or min_rate <= 0:
            raise ValueError("the body timeout and the minimum body rate must be positive")
        self.app, self.seconds, self.min_rate = app, float(seconds), float(min_rate)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        start = loop.time()
        received, complete, expired, answered = 0, False, False, False

        async def timed_receive():
            nonlocal received, complete, expired
            if expired:
                return {"type": "http.disconnect"}
            if complete:  # after the body the app only waits for a disconnect: no deadline
                return await receive()
            left = start + self.seconds + received / self.min_rate - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                expired = True
                log.info("%s %s: the request body did not arrive in time (%d bytes)", scope.get("method"),
                         scope.get("path"), received)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
            await send(message)

        await self.app(scope, timed_receive, tracked_send)
        if expired and not answered:
            body = json.dumps({"detail": f"the request body did not arrive in time ({received} bytes in "
                                         f"{loop.time() - start:.1f} s)"}).encode()
            await send({"type": "http.response.start", "status": 408,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(seconds):
    """uvicorn's HTTP protocol, plus a deadline for request headers: a connection that has not
    sent a whole request head `seconds` after it opened (or after its last response) is closed.
    uvicorn alone waits forever for a half-sent head (its keep-alive timeout stops at the first
    byte), so half-open connections could pile up."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc):
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self):
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(seconds, self._header_deadline, self.cycle)

        def _header_deadline(self, cycle):
            # Still the cycle of the timer's start: no new request head has come in since.
            if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def _precision(precision, stores, device) -> str:
    """--precision other than auto: for stores on the CPU, and bf16 only where the CPU has it."""
    from runtime import resolve_precision

    if device == "cuda":
        raise click.ClickException(f"--precision {precision}: only the CPU takes a precision (the GPU keeps its own)")
    try:
        return resolve_precision(precision)
    except ValueError as e:
        raise click.ClickException(f"--precision {precision}: {e}") from None


def main(argv=None):
    serve.main(args=argv, prog_name="hkstore serve")


if __name__ == "__main__":
    main()


__all__ = ["create_app", "resolve_admin_token", "serve"]

