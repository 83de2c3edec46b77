"""hkstore on a Ray Serve cluster: N replicas over one shared store, routed by tenant.

    hkstore serve STORE --ray --replicas 2                      # a local Ray cluster, or RAY_ADDRESS's
    serve run runtime.serve.ray_app:build_app store=/shared/STORE replicas=8 router=punica

Three deployments make the application ``hkstore``:

- ``TenantWorker`` (N replicas, or autoscaled on queue length): each opens the same store
  path (a shared filesystem: immutable segments + an atomically swapped manifest, so readers on
  many machines are safe) and runs the app of ``hkstore serve`` (runtime.serve.app.create_app)
  in-process, manage jobs off. Every replica serves every tenant. A tenant's PET is the
  multiplexed "model" (``@serve.multiplexed``, up to ``max_models`` per replica, default 4096,
  LRU): loading it decodes the PET into the runtime's host cache, and Ray learns which replica
  holds which tenant.
- ``Ingress`` (the HTTP entry; Ray's proxy sends every request here): an infer request for
  ``/v1/tenants/{tenant}/infer`` goes to the workers with ``multiplexed_model_id=tenant`` (what
  the ``serve_multiplexed_model_id`` header does for direct callers), so it reaches a replica
  that already holds the tenant's PET, and any replica when none does or those are full. Reads
  that fail because a replica died are retried on another (infer has no side effect). Ray's
  backpressure (``max_queued_requests``) answers 429, like the single server's queue bound.
  The OpenAI routes of a decoder store (``/v1/completions``, ``/v1/chat/completions``) are routed
  by their ``model`` the same way; ``stream: true`` answers come through Ray's streaming handle
  chunk by chunk (``TenantWorker.handle_stream``), and a client that goes away cancels the
  sequence on its worker. ``GET /v1/models`` goes to any worker.
- ``Manager`` (one replica): the same app with manage jobs on; its ``/metrics`` (what the
  Ingress's ``/metrics`` appends to its routing metrics) merges every worker's, which each pushes
  every 2 s, labelled ``replica="..."`` (the Manager's own ``replica="manager"``). It alone holds STORE/jobs/LOCK
  and runs jobs, so a job runs once across the cluster and only one place writes; a Manager
  replica that dies is restarted by Ray and resumes its jobs from STORE/jobs (runtime/serve/jobs.py).
  Its answer to each push says whether it runs the jobs, which the workers' ``/healthz``
  reports as ``jobs_enabled``.

Store changes reach every worker within about a second: each polls STORE/CURRENT (the app's
watcher) and refreshes its snapshot when it changes; a tenant unknown to a worker's snapshot
makes it refresh at once (runtime.Runtime.pet).

Routing policy among worker replicas (``router=``): ``multiplex`` (Ray's default: replicas holding
the tenant, then those holding fewest, power of two choices on queue length), ``punica`` (Punica
§5: the busiest replica that still has room, runtime/serve/ray_router.py), ``round_robin``.

Responses carry ``x-hkstore-replica`` (which worker answered) and ``x-hkstore-pet`` (``warm``:
the replica held the tenant's PET before this request; ``cold``: it loaded it now). A request
with header ``x-hkstore-route: any`` skips tenant routing (tests and benchmarks use it).
"""

import asyncio
import json
import logging
import os
import re
import time

from runtime.serve import asgi_call

log = logging.getLogger("hkstore.serve.ray")

APP_NAME = "hkstore"
INFER_PATH = re.compile(r"^/v1/tenants/([^/]+)/infer$")
TENANT_PATH = re.compile(r"^/v1/tenants/([^/]+)$")
ROUTERS = ("multiplex", "punica", "round_robin")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")  # decoder stores: routed by model, as embeddings
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}
DEFAULT_MAX_MODELS = 4096
METRICS_PUSH_S = 2.0  # a worker sends its metrics to the Manager this often
METRICS_STALE_S = 30.0  # and they count until this old (a dead replica's fade out)


def merge_metrics(texts) -> bytes:
    """Prometheus texts of several replicas, [(replica, bytes)], as one exposition: every sample
    gains a replica="..." label, samples of one family under one HELP/TYPE."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families = {}
    for replica, text in texts:
        for fam in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                merged.add_sample(smp.name, {**smp.labels, "replica": replica}, smp.value, smp.timestamp,
                                  smp.exemplar)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


def _serve():
    from ray import serve

    return serve


class _Pet:
    """What Ray's multiplexing holds per tenant: the PET lives in the runtime's host cache; this
    handle marks the tenant held by this replica (evicted LRU past max_models)."""

    def __init__(self, tenant, held):
        self.tenant, self._held = tenant, held
        held[tenant] = self

    def __del__(self):
        # Ray calls this on LRU eviction, and Python again when the object goes: only the handle
        # that is still the tenant's unmarks it (a reloaded tenant has a new one).
        if self._held.get(self.tenant) is self:
            del self._held[self.tenant]


class _AppReplica:
    """The app of `hkstore serve`, run in-process in a Ray replica."""

    jobs = False

    async def _open(self, store, admin_token, options):
        from runtime.serve.app import create_app

        self.app = create_app(store, admin_token=admin_token, **options)
        self.service = self.app.state.service
        if not self.jobs:
            # Manage jobs run in the Manager deployment only (one writer, jobs run once).
            self.service.jobs.start = lambda: False
        self.lifespan = asgi_call.Lifespan(self.app)
        await self.lifespan.startup()
        try:
            self.replica = _serve().get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (unit use)
            self.replica = f"pid{os.getpid()}"

    async def _call(self, method, path, query, headers, body, extra=()):
        status, out_headers, out_body = await asgi_call.call(self.app, method, path, query, headers, body)
        out_headers = [(k, v) for k, v in out_headers if k.lower() not in HOP_HEADERS]
        out_headers.append((b"x-hkstore-replica", self.replica.encode()))
        out_headers.extend(extra)
        return status, out_headers, out_body

    async def __del__(self):
        task = getattr(self, "_push_task", None)
        if task is not None:
            task.cancel()
        lifespan = getattr(self, "lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()


class TenantWorker(_AppReplica):
    """A worker replica: every tenant, infer and reads; its held PETs are Ray multiplexed models."""

    async def __init__(self, store, admin_token, options, max_models=DEFAULT_MAX_MODELS, manager=None):
        await self._open(store, admin_token, options)
        self.manager = manager
        self._push_task = asyncio.get_running_loop().create_task(self._push_metrics()) if manager else None
        if manager is not None:
            asyncio.get_running_loop().create_task(self._ask_jobs())
        self.held = {}  # tenant -> its _Pet, while Ray's multiplexing holds it
        held, rt = self.held, self.service.rt

        async def load_pet(tenant):
            await asyncio.to_thread(rt.pet, tenant)
            return _Pet(tenant, held)

        self._load = _serve().multiplexed(max_num_models_per_replica=int(max_models))(load_pet)

    async def handle(self, method, path, query, headers, body):
        extra = []
        tenant = _serve().get_multiplexed_model_id()
        if tenant:
            warm = tenant in self.held
            if not warm and tenant in self.service.rt.store.snapshot().pets:
                try:
                    await self._load(tenant)
                except Exception:
                    log.debug("loading tenant %r's PET failed", tenant, exc_info=True)
            extra.append((b"x-hkstore-pet", b"warm" if warm else b"cold"))
        return await self._call(method, path, query, headers, body, extra)

    async def handle_stream(self, method, path, query, headers, body):
        """As handle, for a streamed answer (server-sent events): yields (status, headers), then
        the body's chunks as the app sends them; closed early, the request is cancelled."""
        tenant = _serve().get_multiplexed_model_id()
        if tenant and tenant not in self.held and tenant in self.service.rt.store.snapshot().pets:
            try:
                await self._load(tenant)
            except Exception:
                log.debug("loading tenant %r's PET failed", tenant, exc_info=True)
        async for item in asgi_call.stream(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                status, out_headers = item
                out_headers = [(k, v) for k, v in out_headers if k.lower() not in HOP_HEADERS]
                yield status, out_headers + [(b"x-hkstore-replica", self.replica.encode())]
            else:
                yield item

    def held_tenants(self):
        return sorted(self.held)

    async def _ask_jobs(self):
        """Whether the Manager runs the store's jobs, once at start (the metrics pushes keep it
        current): manage requests sent here reach it through the Ingress."""
        try:
            self.service.jobs_elsewhere = await self.manager.options(method_name="jobs_enabled").remote()
        except Exception:
            log.debug("asking the manager about jobs failed", exc_info=True)

    async def _push_metrics(self):
        """This replica's /metrics text to the Manager every METRICS_PUSH_S, which merges every
        replica's into the cluster's /metrics (labelled replica=...); its answer says whether
        it runs the store's jobs."""
        from prometheus_client import generate_latest

        while True:
            await asyncio.sleep(METRICS_PUSH_S)
            try:
                text = await asyncio.to_thread(generate_latest, self.service.metrics.registry)
                self.service.jobs_elsewhere = bool(
                    await self.manager.options(method_name="put_metrics").remote(self.replica, text))
            except Exception:
                log.debug("pushing metrics failed", exc_info=True)


class Manager(_AppReplica):
    """The one replica that runs manage jobs (and answers their reads)."""

    jobs = True

    async def __init__(self, store, admin_token, options):
        await self._open(store, admin_token, options)
        self.worker_metrics = {}  # replica -> (monotonic time, Prometheus text)

    def put_metrics(self, replica, text):
        """A worker's metrics; answers whether this replica runs the store's jobs (it may not:
        another hkstore serve on the store holds STORE/jobs/LOCK), which the worker's
        /healthz reports as jobs_enabled."""
        self.worker_metrics[replica] = (time.monotonic(), text)
        return bool(self.service.jobs.enabled)

    def jobs_enabled(self):
        return bool(self.service.jobs.enabled)

    async def handle(self, method, path, query, headers, body):
        status, out_headers, out_body = await self._call(method, path, query, headers, body)
        if path == "/metrics" and status == 200:
            now = time.monotonic()
            texts = [("manager", out_body)]
            texts += [(r, t) for r, (at, t) in sorted(self.worker_metrics.items()) if now - at < METRICS_STALE_S]
            out_body = await asyncio.to_thread(merge_metrics, texts)
        return status, out_headers, out_body


class Ingress:
    """HTTP entry: tenant-routed infer to the workers, manage to the Manager."""

    def __init__(self, workers, manager, request_timeout_s=30.0, retries=2, max_body=None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        from runtime.serve.metrics import LATENCY_BUCKETS
        from runtime.serve.schemas import MAX_UPLOAD_BODY

        self.workers, self.manager = workers, manager
        self.timeout_s = float(request_timeout_s) + 5.0
        self.retries = int(retries)
        self.max_body = int(max_body or MAX_UPLOAD_BODY)
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.m_requests = Counter("hkstore_ray_requests", "Requests through the ingress by target and status",
                                  ["target", "code"], registry=r)
        self.m_latency = Histogram("hkstore_ray_request_latency_seconds", "Latency through the ingress",
                                   ["target"], buckets=LATENCY_BUCKETS, registry=r)
        self.m_pet = Counter("hkstore_ray_pet_routing", "Infer requests by whether the replica held the PET",
                             ["pet"], registry=r)
        self.m_replica = Counter("hkstore_ray_replica_requests", "Requests answered per worker replica",
                                 ["replica"], registry=r)
        self.m_retries = Counter("hkstore_ray_retries", "Requests retried after a replica died", registry=r)
        self.m_rejected = Counter("hkstore_ray_rejected", "Requests rejected by the ingress", ["reason"], registry=r)

    def _target(self, method, path, headers, body=b""):
        """(handle, tenant or "", target name, idempotent). Compute and reads go to the workers
        (tenant-routed where the request names a tenant), manage to the Manager."""
        route_any = headers.get("x-hkstore-route", "").lower() == "any"
        m = INFER_PATH.match(path)
        if m and method == "POST":
            return self.workers, "" if route_any else m.group(1), "infer", True
        if path in GENERATE_PATHS + ("/v1/embeddings",) and method == "POST":
            model = ""
            if not route_any:
                try:
                    model = json.loads(body).get("model", "") or ""
                except (ValueError, AttributeError):
                    model = ""  # the worker's app answers the bad body
            model = model if isinstance(model, str) and len(model) <= 64 else ""
            return self.workers, model, "generate" if path in GENERATE_PATHS else "infer", True
        m = TENANT_PATH.match(path)
        if m and method == "GET":
            return self.workers, "" if route_any else m.group(1), "read", True
        if path in ("/healthz", "/info", "/v1/models") and method == "GET":
            return self.workers, "", "health", True
        return self.manager, "", "manage", method in ("GET", "HEAD")

    async def __call__(self, request):
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import JSONResponse, Response

        from runtime.serve.app import error_body  # the OpenAI routes' errors in OpenAI's shape

        t0 = time.perf_counter()
        method, path = request.method, request.url.path
        if path == "/metrics" and method == "GET":
            return await self._metrics(request)
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            self.m_requests.labels("any", "413").inc()
            return JSONResponse(error_body(path, 413, f"request body of {length} bytes exceeds {self.max_body} bytes"),
                                413)
        body = await request.body()
        handle, tenant, target, idempotent = self._target(method, path, request.headers, body)
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items() if k.lower() != "x-hkstore-route"]
        args = (method, path, request.url.query.encode(), headers, body)
        opts = {"method_name": "handle"}
        if tenant:
            opts["multiplexed_model_id"] = tenant
        if target == "generate" and _streamed(body):
            return await self._stream(handle, opts, args, t0)
        attempt = 0
        while True:
            try:
                resp = handle.options(**opts).remote(*args)
                status, out_headers, out_body = await asyncio.wait_for(_result(resp), self.timeout_s)
                break
            except BackPressureError:
                self.m_rejected.labels("backpressure").inc()
                self.m_requests.labels(target, "429").inc()
                return JSONResponse(error_body(path, 429, "every replica's queue is full; retry later"), 429,
                                    headers={"Retry-After": "1"})
            except asyncio.TimeoutError:
                self.m_rejected.labels("timeout").inc()
                self.m_requests.labels(target, "504").inc()
                return JSONResponse(error_body(path, 504, "no answer from the replicas in time"), 504)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                if not idempotent or attempt >= self.retries:
                    self.m_requests.labels(target, "503").inc()
                    log.warning("%s %s: replica lost (%s)", method, path, type(e).__name__)
                    return JSONResponse(error_body(path, 503, "the replica serving this request died; retry"), 503,
                                        headers={"Retry-After": "1"})
                attempt += 1
                self.m_retries.inc()
        headers_out = {}
        for k, v in out_headers:
            headers_out[k.decode("latin-1")] = v.decode("latin-1")
        if target in ("infer", "read", "health") and "x-hkstore-replica" in headers_out:
            self.m_replica.labels(headers_out["x-hkstore-replica"]).inc()
        if "x-hkstore-pet" in headers_out:
            self.m_pet.labels(headers_out["x-hkstore-pet"]).inc()
        self.m_requests.labels(target, str(status)).inc()
        self.m_latency.labels(target).observe(time.perf_counter() - t0)
        media = headers_out.pop("content-type", None)
        return Response(out_body, status_code=status, headers=headers_out, media_type=media)

    async def _stream(self, handle, opts, args, t0):
        """A streamed generation: the worker's answer chunk by chunk (Ray's streaming handle);
        the client going away closes the worker's generator, which cancels the sequence."""
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import JSONResponse, StreamingResponse

        from runtime.serve.app import error_body

        gen = handle.options(**dict(opts, method_name="handle_stream", stream=True)).remote(*args)
        try:
            status, out_headers = await asyncio.wait_for(gen.__anext__(), self.timeout_s)
        except BackPressureError:
            self.m_rejected.labels("backpressure").inc()
            self.m_requests.labels("generate", "429").inc()
            return JSONResponse(error_body(args[1], 429, "every replica's queue is full; retry later"), 429,
                                headers={"Retry-After": "1"})
        except asyncio.TimeoutError:
            gen.cancel()
            self.m_requests.labels("generate", "504").inc()
            return JSONResponse(error_body(args[1], 504, "no answer from the replicas in time"), 504)
        headers_out = {k.decode("latin-1"): v.decode("latin-1") for k, v in out_headers}
        media = headers_out.pop("content-type", None)
        self.m_requests.labels("generate", str(status)).inc()

        async def body():
            try:
                async for chunk in gen:
                    yield chunk
            finally:
                gen.cancel()  # (nothing left to cancel once it ended)
                self.m_latency.labels("generate").observe(time.perf_counter() - t0)

        return StreamingResponse(body(), status_code=status, headers=headers_out, media_type=media)

    async def _metrics(self, request):
        """The Manager's /metrics (its app decides who may read them: the same auth as `hkstore
        serve`), after the ingress's routing metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import JSONResponse, Response

        headers = [(k.encode(), v.encode()) for k, v in request.headers.items()]
        try:
            status, out_headers, body = await asyncio.wait_for(_result(self.manager.options(
                method_name="handle").remote("GET", "/metrics", request.url.query.encode(), headers, b"")), 10.0)
        except Exception:
            log.warning("the manager's metrics did not answer", exc_info=True)
            return JSONResponse({"detail": "the manager did not answer"}, 503, headers={"Retry-After": "1"})
        if status != 200:
            keep = {k.decode("latin-1"): v.decode("latin-1") for k, v in out_headers
                    if k.lower() in (b"www-authenticate", b"retry-after")}
            return Response(body, status_code=status, headers=keep, media_type="application/json")
        text = await asyncio.to_thread(generate_latest, self.registry)
        return Response(text + body, media_type=CONTENT_TYPE_LATEST)


async def _result(resp):
    return await resp


def _streamed(body) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


# -- building the application ---------------------------------------------------------------------

def _app_options():
    """The keyword options of runtime.serve.app.create_app (what workers and the Manager take)."""
    import inspect

    from runtime.serve.app import create_app

    params = inspect.signature(create_app).parameters
    return {k for k, p in params.items() if p.kind == p.KEYWORD_ONLY and k != "admin_token"}


def router_config(router, max_models=DEFAULT_MAX_MODELS):
    """Ray's RequestRouterConfig for a routing policy name (None: Ray's default)."""
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if router == "multiplex":
        return None
    if router == "punica":
        from runtime.serve.ray_router import PunicaRouter

        return RequestRouterConfig(request_router_class=PunicaRouter,
                                   request_router_kwargs={"max_models": int(max_models)})
    from ray.serve.experimental.round_robin_router import RoundRobinRouter

    return RequestRouterConfig(request_router_class=RoundRobinRouter)


def application(store, admin_token, *, replicas=2, router="multiplex", max_models=DEFAULT_MAX_MODELS,
                autoscale=None, replica_cpus=1.0, max_ongoing=None, max_queued=-1, retries=2, ingress_replicas=1,
                **options):
    """The Ray Serve application (bind it with serve.run). autoscale: (min, max) replicas,
    scaled on ongoing requests per replica (Ray's queue-length autoscaling, target max_batch)."""
    serve = _serve()
    store = os.path.abspath(store)
    if not os.path.exists(os.path.join(store, "CURRENT")):
        raise ValueError(f"{store}: no store here (no CURRENT file)")
    unknown = set(options) - _app_options()
    if unknown:
        raise ValueError(f"unknown options: {', '.join(sorted(unknown))}")
    if len(admin_token or "") < 16:
        raise ValueError("the admin token must be a string of at least 16 characters")
    max_batch = int(options.get("max_batch", 32))
    # A replica takes a few batches at once (its dispatcher batches them); more waits in the router.
    max_ongoing = int(max_ongoing or 4 * max_batch)
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    worker_opts = {"name": "TenantWorker", "max_ongoing_requests": max_ongoing,
                   "max_queued_requests": int(max_queued), "ray_actor_options": {"num_cpus": float(replica_cpus)},
                   "graceful_shutdown_timeout_s": 10, "logging_config": quiet}
    if autoscale:
        lo, hi = (int(x) for x in autoscale)
        worker_opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                             "target_ongoing_requests": max_batch,
                                             "upscale_delay_s": 5, "downscale_delay_s": 60}
    else:
        worker_opts["num_replicas"] = int(replicas)
    config = router_config(router, max_models)
    if config is not None:
        worker_opts["request_router_config"] = config
    manager = serve.deployment(Manager).options(name="Manager", num_replicas=1,
                                                ray_actor_options={"num_cpus": 0}, logging_config=quiet,
                                                graceful_shutdown_timeout_s=15).bind(store, admin_token, options)
    workers = serve.deployment(TenantWorker).options(**worker_opts).bind(store, admin_token, options, int(max_models),
                                                                         manager)
    ingress = serve.deployment(Ingress).options(name="Ingress", num_replicas=int(ingress_replicas),
                                                max_ongoing_requests=100_000,
                                                ray_actor_options={"num_cpus": 0}, logging_config=quiet)
    return ingress.bind(workers, manager, float(options.get("request_timeout_s", 30.0)), int(retries))


def _admin_token(store, token_file=None):
    """admin_token_file, else $HKSTORE_ADMIN_TOKEN, else STORE/admin.token (as `hkstore serve`;
    run that once, or write the file, to make one)."""
    if token_file:
        with open(token_file) as f:
            return f.read().strip()
    if os.environ.get("HKSTORE_ADMIN_TOKEN"):
        return os.environ["HKSTORE_ADMIN_TOKEN"].strip()
    path = os.path.join(store, "admin.token")
    if not os.path.exists(path):
        raise ValueError(f"no admin token: give admin_token_file=F, set HKSTORE_ADMIN_TOKEN or write {path}")
    with open(path) as f:
        return f.read().strip()


def build_app(args: dict):
    """`serve run runtime.serve.ray_app:build_app store=PATH [replicas=N] [router=punica]
    [max_models=4096] [autoscale=MIN:MAX] [admin_token_file=F] [max_batch=32] [max_wait_ms=5]
    [queue_limit=1024] [request_timeout_s=30] [max_len=128] [device=auto] [replica_cpus=1]
    [ingress_replicas=1]`"""
    args = dict(args)
    store = args.pop("store")
    token = _admin_token(store, args.pop("admin_token_file", None))
    kw = {}
    for key in ("replicas", "max_models", "max_batch", "queue_limit", "max_len", "torch_threads", "max_ongoing",
                "max_queued", "retries", "ingress_replicas"):
        if key in args:
            kw[key] = int(args.pop(key))
    for key in ("max_wait_ms", "request_timeout_s", "replica_cpus"):
        if key in args:
            kw[key] = float(args.pop(key))
    if "autoscale" in args:
        kw["autoscale"] = tuple(int(x) for x in str(args.pop("autoscale")).split(":"))
    if "runtime_options" in args:
        kw["runtime_options"] = json.loads(args.pop("runtime_options"))
    kw.update(args)  # router, device, mode
    return application(store, token, **kw)


def announce(what, host, port, tail="", stream=None) -> str:
    """One line for people about the Ray server, written to stream (default stderr) and
    flushed at once: a piped stdout would hold it back in its buffer until shutdown."""
    import sys

    line = f"hkstore on Ray Serve: {what} http://{host}:{port}" + (f"; {tail}" if tail else "")
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()
    return line


def run(store, admin_token, *, host="127.0.0.1", port=8080, address=None, blocking=True, token_source=None, **kw):
    """Start (or join) a Ray cluster, deploy the application on host:port, and (blocking) serve
    until interrupted. address: a Ray cluster ("auto", "ray://..."), else a local one.
    token_source: where the admin token comes from, for the lines it prints."""
    import ray

    serve = _serve()
    if blocking:
        tokens = f"admin token: {token_source}; " if token_source else ""
        announce("starting on", host, port, f"{tokens}tenant tokens: hkstore token issue {store} TENANT "
                                            "(Ray and the replicas take a while to start)")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(application(store, admin_token, **kw), name=APP_NAME, route_prefix="/", blocking=False)
    if not blocking:
        return
    announce("serving on", host, port, "Ctrl-C or SIGTERM stops")
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


def cli_run(store, admin_token, *, host, port, ray_address=None, replicas=2, router="multiplex", autoscale=None,
            token_source=None, **options):
    """`hkstore serve STORE --ray [--replicas N] [--ray-address A] [--router R] [--autoscale MIN:MAX]`."""
    import click

    try:
        scale = tuple(int(x) for x in autoscale.split(":")) if autoscale else None
        if scale is not None and (len(scale) != 2 or not 1 <= scale[0] <= scale[1]):
            raise ValueError
    except ValueError:
        raise click.ClickException(f"--autoscale wants MIN:MAX replicas, got {autoscale!r}") from None
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise click.ClickException("--ray needs Ray Serve: pip install 'hkstore[ray]'") from None
    try:
        run(store, admin_token, host=host, port=port, address=ray_address, replicas=replicas, router=router,
            autoscale=scale, token_source=token_source, **options)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
