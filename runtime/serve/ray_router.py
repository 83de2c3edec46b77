"""Punica's cluster scheduling (§5) as a Ray Serve request router among TenantWorker replicas.

Punica sends a new request to the busiest GPU that still has room, so load consolidates on few
GPUs and whole ones free up for scale-down, and it migrates requests off a GPU whose working set
no longer fits. Here a replica's "room" is its queue (ongoing requests below
``max_ongoing_requests``, the batch it can take) and its working set is the tenants whose PETs
it holds (Ray's multiplexed model ids, at most ``max_models``). Order of preference:

1. replicas that hold the tenant's PET and have room, busiest first;
2. replicas with room whose working set still has space for one more PET, busiest first;
3. every other replica, least busy first: the tenant migrates to where its PET now fits.

The order is returned as singleton ranks, so Serve tries them one by one and skips a replica
that turns out full. The pure ordering, ``runtime.serve.routing.punica_order``, is what benchmarks/cluster_sim.py simulates.
"""

from ray.serve.request_router import FIFOMixin, MultiplexMixin, RequestRouter

from runtime.serve.routing import punica_order


class PunicaRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Busiest replica with room; tenants migrate when a working set is full (module doc)."""

    def initialize_state(self, max_models=4096, **kwargs):
        self.max_models = int(max_models)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        tenant = ""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
            tenant = pending_request.metadata.multiplexed_model_id or ""
        if not candidate_replicas:
            return []
        holders = self._multiplexed_model_id_to_replica_ids.get(tenant, set()) if tenant else set()
        cache = self._replica_queue_len_cache
        max_models = getattr(self, "max_models", 4096)

        def load(r):
            q = cache.get(r.replica_id)
            return 0 if q is None else q

        order = punica_order(
            candidate_replicas, tenant, load,
            room=lambda r: load(r) < r.max_ongoing_requests,
            holds=lambda r, t: r.replica_id in holders,
            fits=lambda r: len(r.multiplexed_model_ids) < max_models)
        return [[r] for r in order]
