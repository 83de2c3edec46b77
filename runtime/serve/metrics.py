"""The HTTP server's Prometheus metrics (its own registry, plus the runtime's counters)."""

import math
import re

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TENANT_LABELS = 20  # tenants with a label of their own in per-tenant series; the rest are "other"


class TenantLabels:
    """Bounded label values for per-tenant series: the first `limit` tenants seen keep their
    name for the server's life, every later one is "other" (Prometheus series stay <= limit + 1)."""

    def __init__(self, limit=TENANT_LABELS):
        self.limit, self.named = int(limit), set()

    def __call__(self, tenant) -> str:
        tenant = str(tenant or "")
        if tenant in self.named:
            return tenant
        if tenant and tenant != "other" and len(self.named) < self.limit:
            self.named.add(tenant)
            return tenant
        return "other"


class Metrics:
    def __init__(self, service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.service = service
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.queue_depth = Gauge("hkstore_queue_depth", "Texts waiting in the input queue", registry=r)
        self.queue_limit = Gauge("hkstore_queue_limit", "Texts the input queue holds at most", registry=r)
        self.inflight = Gauge("hkstore_inflight_batches", "Batches the runtime is computing", registry=r)
        self.batch_size = Histogram("hkstore_batch_size", "Texts per batch handed to the runtime",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("hkstore_batch_seconds", "Runtime time per batch", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.queue_wait = Histogram("hkstore_queue_wait_seconds", "Time a text waits before its batch starts",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("hkstore_request_latency_seconds", "Infer request latency in the server (all outcomes)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("hkstore_infer_requests", "Infer requests by HTTP status and tenant (the first "
                                f"{TENANT_LABELS} tenants seen by name, the rest 'other')", ["code", "tenant"],
                                registry=r)
        self.tenant_label = TenantLabels()
        self.texts = Counter("hkstore_infer_texts", "Texts answered", registry=r)
        self.embeddings = Counter("hkstore_embeddings_requests", "Embeddings requests by HTTP status and model "
                                  f"(base, a tenant: the first {TENANT_LABELS} tenants seen by name, the rest and "
                                  "requests refused before their model was read 'other')", ["code", "model"],
                                  registry=r)
        self.embedded = Counter("hkstore_embeddings_inputs", "Inputs embedded", registry=r)
        self.embeddings_latency = Histogram("hkstore_embeddings_latency_seconds", "Embeddings request latency in the "
                                            "server (all outcomes)", buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("hkstore_rejected", "Infer requests rejected", ["reason"], registry=r)
        self.swaps = Counter("hkstore_dedicated_swaps", "Full-model swaps (dedicated mode)", registry=r)
        self.damaged = Counter("hkstore_store_damaged", "Requests (or refreshes) that met a damaged store: answered 503",
                               ["where"], registry=r)
        self.degraded = Gauge("hkstore_store_degraded", "1 while /healthz reports the store damaged", registry=r)
        self.tokens_damaged = Gauge("hkstore_tokens_damaged", "1 while STORE/tokens.json is damaged (tenant tokens "
                                    "refused, the admin token works)", registry=r)
        self.tokens_damaged.set_function(lambda: float(service.tokens.problem() is not None))
        r.register(_RuntimeCollector(service))

    def count_request(self, tenant, status):
        """One infer request answered with `status`, whatever answered it (the route, the body
        validation, the authentication gate)."""
        rt = getattr(self.service, "rt", None)
        known = rt is not None and tenant in rt.store.snapshot().pets  # made-up names never get a series
        self.requests.labels(str(int(status)), self.tenant_label(tenant) if known else "other").inc()


    def count_embeddings(self, model, status):
        """One embeddings request answered with `status`; model: "base", a tenant or "other"."""
        rt = getattr(self.service, "rt", None)
        if model != "base":
            known = rt is not None and model in rt.store.snapshot().pets
            model = self.tenant_label(model) if known else "other"
        self.embeddings.labels(str(int(status)), model).inc()


def _flatten(prefix, obj, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}_{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out[re.sub(r"[^a-zA-Z0-9_]", "_", prefix).lower()] = float(obj)
    return out


class _RuntimeCollector:
    """Read at scrape time: the runtime's counters, the store's size, the jobs."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        svc = self.service
        rt = svc.rt
        if rt is None:
            return
        stats = svc.runtime_stats()
        flat = _flatten("", stats, {})
        info = GaugeMetricFamily("hkstore_runtime_info", "The runtime serving this server", labels=["device", "mode"])
        info.add_metric([str(stats.get("device", "")), svc.mode], 1.0)
        yield info
        caches = {"host": stats.get("host_pet_cache") or {}, "device": stats.get("device_pet_cache") or {}}
        for key in ("hits", "misses", "evictions"):
            c = CounterMetricFamily(f"hkstore_pet_cache_{key}", f"PET cache {key} (host: decoded PETs; device: GPU)",
                                    labels=["cache"])
            for name, pc in caches.items():
                if key in pc:
                    c.add_metric([name], float(pc[key]))
            yield c
        for key in ("entries", "bytes"):
            g = GaugeMetricFamily(f"hkstore_pet_cache_{key}", f"PET cache {key}", labels=["cache"])
            for name, pc in caches.items():
                if key in pc:
                    g.add_metric([name], float(pc[key]))
            yield g
        hot = stats.get("hot_tier") or {}  # the GPU executor's PLOT hot tier
        for key in ("hits", "misses", "rebuilds"):
            if key in hot:
                yield CounterMetricFamily(f"hkstore_plot_hot_tier_{key}", f"PLOT hot tier {key} (windows)",
                                          value=float(hot[key]))
        for key in ("rows", "capacity", "bytes", "hit_rate"):
            if key in hot:
                yield GaugeMetricFamily(f"hkstore_plot_hot_tier_{key}", f"PLOT hot tier {key}", value=float(hot[key]))
        g = GaugeMetricFamily("hkstore_runtime_stat", "Numeric fields of Runtime.stats()", labels=["name"])
        for name, value in flat.items():
            g.add_metric([name], value)
        yield g
        snap = rt.store.snapshot()
        yield GaugeMetricFamily("hkstore_tenants", "Tenants in the served snapshot", value=len(snap.pets))
        yield GaugeMetricFamily("hkstore_versions", "PLOT versions in the served snapshot", value=len(snap.versions))
        jobs = GaugeMetricFamily("hkstore_jobs", "Manage jobs not finished, by state", labels=["state"])
        for state, n in svc.jobs.counts().items():
            jobs.add_metric([state], n)
        yield jobs
        fin = CounterMetricFamily("hkstore_jobs_finished", "Manage jobs finished by this server", labels=["state"])
        for state in ("done", "failed"):
            fin.add_metric([state], svc.jobs.finished.get(state, 0))
        yield fin
