"""Routing policies among serving replicas, as pure functions (no Ray): the Ray Serve request
router (runtime/serve/ray_router.py) and the cluster simulator (benchmarks/cluster_sim.py) share them."""


def punica_order(replicas, tenant, load, room, holds, fits):
    """Replicas in Punica's order of preference (§5 of Punica, as routing among replicas):

    1. replicas that hold the tenant's PET and have room, busiest first;
    2. replicas with room whose working set has space for one more PET, busiest first;
    3. every other replica, least busy first (the tenant migrates to where it now fits).

    Busiest-first consolidates load on few replicas, so whole ones go idle (scale-down).
    load(r) -> queue length; room(r) -> it can take a request; holds(r, tenant); fits(r) -> its
    working set has space."""
    warm, fit, rest = [], [], []
    for r in replicas:
        if tenant and holds(r, tenant) and room(r):
            warm.append(r)
        elif room(r) and fits(r):
            fit.append(r)
        else:
            rest.append(r)
    warm.sort(key=load, reverse=True)
    fit.sort(key=load, reverse=True)
    rest.sort(key=load)
    return warm + fit + rest
