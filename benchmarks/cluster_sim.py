"""Cluster scheduling simulator (issue 20): Punica §5 vs Ray Serve's multiplexed routing vs round
robin among serving replicas, driven by the runtime's measured per-batch cost model.

    python -m benchmarks.cluster_sim --out figures/cluster_sim            # tables (cluster_sim.md) + PNGs
    python -m benchmarks.cluster_sim --quick --out /tmp/sim                # 1 and 8 replicas, seconds

The model. R replicas, each the runtime behind `hkstore serve`'s dispatcher: a FIFO queue, batches
of up to --max-batch texts formed when full or when the oldest has waited --max-wait-ms, one
batch at a time, costing  a + b*n + c*s  ms for n texts of s distinct tenants (benchmarks/cluster_cost.py
fits a, b, c on this machine; --cost FILE) plus --pet-load-ms (measured too) for each tenant of
the batch whose PET the replica's cache does not hold. A replica's PET cache holds --cache
tenants (LRU; the GPU's device PET cache, or a small host cache). A replica has room while it
holds fewer than --room requests (queued + running: Ray's max_ongoing_requests); a request no
replica has room for waits in the router, first come first served.

Routing policies:
  round_robin   the next replica in turn that has room (tenant-blind);
  ray           Ray Serve's multiplexed default: replicas holding the tenant's PET; if none has
                room, those holding the fewest PETs; then all; power of two choices on queue
                length among the candidates with room;
  punica        Punica §5 (runtime.serve.routing.punica_order): the busiest replica holding the
                tenant with room; else the busiest with room whose working set (tenants used in
                the last --window-ms) has space; else the least busy. A replica whose queue holds
                more distinct tenants than its cache migrates the requests of the extra tenants
                back to the router (Punica's migration when a GPU's working set no longer fits).

Workloads (Punica's): Distinct (every request a new tenant), Uniform (--tenants-per-replica x R
tenants, equally popular), Skewed (the same tenants, Zipf --zipf), Identical (one tenant).
Poisson arrivals at --load x R x a replica's full-batch capacity; --requests-per-replica requests.

Reported per (replicas, workload, policy): throughput, p50 / p99 latency, PET cache hit rate (a
request is a hit when its replica holds its PET when its batch starts), active replicas (those
that ran a batch in the second half of the run: consolidation leaves the others idle, free to
scale down), migrations; and the replicas each policy needs for a fixed load at a p99 target.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import os
import random
import time

from runtime.serve.routing import punica_order

POLICIES = ("round_robin", "ray", "punica")
WORKLOADS = ("distinct", "uniform", "skewed", "identical")
DEFAULT_COST = {"a_ms": 10.0, "b_ms": 3.0, "c_ms": 1.0, "pet_load_ms": 2.0, "model": "assumed"}


# -- workloads -------------------------------------------------------------------------------------------


def tenant_stream(kind, n, tenants, rng, zipf=1.5):
    if kind == "distinct":
        return list(range(n))
    if kind == "identical":
        return [0] * n
    if kind == "uniform":
        return [rng.randrange(tenants) for _ in range(n)]
    if kind == "skewed":
        weights = [1.0 / (i + 1) ** zipf for i in range(tenants)]
        total = sum(weights)
        cum, acc = [], 0.0
        for w in weights:
            acc += w / total
            cum.append(acc)
        import bisect

        return [min(bisect.bisect_left(cum, rng.random()), tenants - 1) for _ in range(n)]
    raise ValueError(kind)


# -- the simulation --------------------------------------------------------------------------------------


class Replica:
    __slots__ = (
        "busy_ms",
        "busy_until",
        "cache",
        "held",
        "i",
        "last_batch",
        "queue",
        "recent",
        "recent_count",
        "running",
        "wake",
    )

    def __init__(self, i):
        self.i = i
        self.queue = collections.deque()  # (arrival time, tenant, request id)
        self.running = 0
        self.cache = collections.OrderedDict()  # tenant -> None, LRU order
        self.recent = collections.deque()  # (time, tenant) of batches, for the working set
        self.recent_count = collections.Counter()
        self.busy_until = None
        self.wake = None
        self.last_batch = -1.0
        self.busy_ms = 0.0

    @property
    def load(self):
        return len(self.queue) + self.running


class Sim:
    def __init__(self, replicas, policy, cost, *, max_batch=32, max_wait_ms=5.0, room=32, cache=256,
                 window_ms=1000.0, seed=0):
        self.R, self.policy, self.cost = replicas, policy, cost
        self.B, self.W, self.room, self.C, self.window = max_batch, max_wait_ms, room, cache, window_ms
        self.rng = random.Random(seed)
        self.reps = [Replica(i) for i in range(replicas)]
        self.holders = collections.defaultdict(set)  # tenant -> replicas whose cache holds it
        self.by_load = [set() for _ in range(room + 1)]  # load -> replicas (load <= room)
        self.by_load[0] = set(range(replicas))
        self.by_cached = collections.defaultdict(set, {0: set(range(replicas))})  # cached PETs -> replicas
        self.ncached = collections.Counter({0: replicas})  # cached PETs -> how many replicas
        self.rr = 0
        self.pending = collections.deque()  # requests no replica had room for
        self.events = []
        self.seq = 0
        self.done = {}
        self.hits = self.misses = self.migrations = 0

    # bookkeeping

    def _push(self, t, kind, r):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, r))

    def _set_load(self, rep, before):
        after = rep.load
        if before <= self.room:
            self.by_load[before].discard(rep.i)
        if after <= self.room:
            self.by_load[after].add(rep.i)

    def _working_set(self, rep, now):
        while rep.recent and rep.recent[0][0] < now - self.window:
            _, t = rep.recent.popleft()
            rep.recent_count[t] -= 1
            if rep.recent_count[t] == 0:
                del rep.recent_count[t]
        return len(rep.recent_count)

    # routing

    def _has_room(self, rep):
        return rep.load < self.room

    def choose(self, tenant, now, exclude=None):
        reps = self.reps
        if self.policy == "round_robin":
            for k in range(self.R):
                rep = reps[(self.rr + k) % self.R]
                if self._has_room(rep):
                    self.rr = (self.rr + k + 1) % self.R
                    return rep
            return None
        if self.policy == "ray":
            held = self.holders.get(tenant)
            if held:
                got = self._with_room(held)
                if got:
                    return self._two_choices(got)
            fewest = min(self.ncached)
            group = self.by_cached[fewest]
            got = self._with_room(group) if len(group) < self.R else self._random_with_room()
            if not got:
                got = self._random_with_room() or self._sample_free(8)
            return self._two_choices(got) if got else None
        # punica: warm (busiest with room), then fitting (busiest with room and working-set space),
        # then the rest least busy first. Exact punica_order for small clusters, the same order
        # read off the load buckets for large ones.
        held = self.holders.get(tenant, ())
        if exclude is not None:
            held = set(held) - {exclude}
        if self.R <= 16:
            order = punica_order([r for r in reps if r.i != exclude], tenant, load=lambda r: r.load,
                                 room=self._has_room, holds=lambda r, t: r.i in held,
                                 fits=lambda r: self._working_set(r, now) < self.C)
            return order[0] if order and self._has_room(order[0]) else None
        if held:
            if len(held) <= 16:
                warm = [reps[i] for i in held if self._has_room(reps[i])]
                if warm:
                    return max(warm, key=lambda r: r.load)
            else:
                for load in range(self.room - 1, -1, -1):
                    both = self.by_load[load] & held
                    if both:
                        return reps[next(iter(both))]
        for load in range(self.room - 1, -1, -1):
            for i in self.by_load[load]:
                if i != exclude and self._working_set(reps[i], now) < self.C:
                    return reps[i]
        for load in range(self.room):
            for i in self.by_load[load]:
                if i != exclude:
                    return reps[i]
        return None

    def _with_room(self, ids, k=8):
        """Up to k of the replicas `ids` with room (a random sample when there are many)."""
        ids = list(ids)
        if len(ids) > k:
            ids = self.rng.sample(ids, k)
        return [i for i in ids if self.reps[i].load < self.room]

    def _random_with_room(self, tries=8):
        out = []
        for _ in range(tries):
            i = self.rng.randrange(self.R)
            if self.reps[i].load < self.room and i not in out:
                out.append(i)
                if len(out) == 2:
                    break
        return out

    def _sample_free(self, k):
        out = []
        for load in range(self.room):
            for i in self.by_load[load]:
                out.append(i)
                if len(out) >= k:
                    return out
        return out

    def _two_choices(self, ids):
        if len(ids) == 1:
            return self.reps[ids[0]]
        a, b = self.rng.sample(ids, 2)
        ra, rb = self.reps[a], self.reps[b]
        return ra if ra.load <= rb.load else rb

    # events

    def offer(self, req, now):
        rep = self.choose(req[1], now)
        if rep is None:
            self.pending.append(req)
            return
        before = rep.load
        rep.queue.append(req)
        self._set_load(rep, before)
        self._maybe_start(rep, now)

    def _maybe_start(self, rep, now):
        if rep.busy_until is not None or not rep.queue:
            return
        t = rep.queue[0][0] + self.W
        if len(rep.queue) < self.B and now < t:
            if rep.wake != t:
                rep.wake = t
                self._push(t, "wake", rep.i)
            return
        self._start(rep, now)

    def _start(self, rep, now):
        if self.policy == "punica":
            self._migrate(rep, now)
        before = rep.load
        batch = [rep.queue.popleft() for _ in range(min(self.B, len(rep.queue)))]
        tenants = {t for _, t, _ in batch}
        missing = [t for t in tenants if t not in rep.cache]
        for _, t, _ in batch:
            if t in rep.cache:
                self.hits += 1
            else:
                self.misses += 1
        for t in tenants:
            self._touch(rep, t)
        c = self.cost
        ms = c["a_ms"] + c["b_ms"] * len(batch) + c["c_ms"] * len(tenants) + c["pet_load_ms"] * len(missing)
        rep.running = len(batch)
        rep.busy_until = now + ms
        rep.busy_ms += ms
        rep.last_batch = now
        rep.recent.extend((now, t) for t in tenants)
        rep.recent_count.update(tenants)
        self._set_load(rep, before)
        self._push(now + ms, "done", rep.i)
        self._batch = getattr(self, "_batch", {})
        self._batch[rep.i] = batch

    def _touch(self, rep, t):
        if t in rep.cache:
            rep.cache.move_to_end(t)
            return
        self.ncached[len(rep.cache)] -= 1
        self.by_cached[len(rep.cache)].discard(rep.i)
        if self.ncached[len(rep.cache)] == 0:
            del self.ncached[len(rep.cache)]
        if len(rep.cache) >= self.C:
            old, _ = rep.cache.popitem(last=False)
            self.holders[old].discard(rep.i)
            if not self.holders[old]:
                del self.holders[old]
        rep.cache[t] = None
        self.holders[t].add(rep.i)
        self.ncached[len(rep.cache)] += 1
        self.by_cached[len(rep.cache)].add(rep.i)

    def _migrate(self, rep, now):
        """Punica's migration: the queued requests of tenants past the cache's capacity move to
        another replica (Punica's order, this one excluded); those no other can take stay."""
        counts = collections.Counter(t for _, t, _ in rep.queue)
        if len(counts) <= self.C or self.R == 1:
            return
        keep = {t for t, _ in counts.most_common(self.C)}
        before = rep.load
        moved = [q for q in rep.queue if q[1] not in keep]
        rep.queue = collections.deque(q for q in rep.queue if q[1] in keep)
        for q in moved:
            target = self.choose(q[1], now, exclude=rep.i)
            if target is None:
                rep.queue.append(q)
                continue
            b = target.load
            target.queue.append(q)
            self._set_load(target, b)
            if target.busy_until is None:
                target.wake = now
                self._push(now, "wake", target.i)
            self.migrations += 1
        self._set_load(rep, before)

    def run(self, arrivals):
        """arrivals: [(time ms, tenant)], sorted. Returns the metrics."""
        t_first = arrivals[0][0] if arrivals else 0.0
        k = 0
        n = len(arrivals)
        lat = []
        t_end = t_first
        t_last = arrivals[-1][0] if arrivals else 0.0
        t_from = t_first + 0.25 * (t_last - t_first)  # steady state: past the first quarter
        served = 0
        while k < n or self.events:
            if k < n and (not self.events or arrivals[k][0] <= self.events[0][0]):
                now, tenant = arrivals[k]
                self.offer((now, tenant, k), now)
                k += 1
                continue
            now, _, kind, i = heapq.heappop(self.events)
            rep = self.reps[i]
            if kind == "wake":
                if rep.wake == now:
                    rep.wake = None
                    self._maybe_start(rep, now)
                continue
            batch = self._batch.pop(i)
            before = rep.load
            rep.running = 0
            rep.busy_until = None
            self._set_load(rep, before)
            for arr, _, _ in batch:
                lat.append(now - arr)
            if t_from <= now <= t_last:
                served += len(batch)
            t_end = now
            while self.pending:
                nxt = self.choose(self.pending[0][1], now)
                if nxt is None:
                    break
                req = self.pending.popleft()
                b2 = nxt.load
                nxt.queue.append(req)
                self._set_load(nxt, b2)
                self._maybe_start(nxt, now)
            self._maybe_start(rep, now)
        lat.sort()
        half = t_first + (t_end - t_first) / 2
        # sustained throughput: answers per second from the first quarter of the arrivals to the last
        return {"requests": len(lat), "throughput": served / max((t_last - t_from) / 1000.0, 1e-9),
                "p50_ms": _pct(lat, 0.50), "p99_ms": _pct(lat, 0.99),
                "hit_rate": self.hits / max(self.hits + self.misses, 1),
                "active": sum(1 for r in self.reps if r.last_batch >= half),
                "migrations": self.migrations,
                "utilization": sum(r.busy_ms for r in self.reps) / (self.R * max(t_end - t_first, 1e-9))}


def _pct(xs, q):
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)]


def capacity_per_replica(cost, max_batch):
    """Requests/s of one replica running full batches of distinct, cached tenants."""
    c = cost
    return 1000.0 * max_batch / (c["a_ms"] + (c["b_ms"] + c["c_ms"]) * max_batch)


def arrivals_for(rate_per_s, n, tenants, rng):
    t, out = 0.0, []
    for tenant in tenants[:n]:
        t += rng.expovariate(rate_per_s) * 1000.0
        out.append((t, tenant))
    return out


def simulate(replicas, workload, policy, cost, args, rate=None, seed=0, n=None):
    rng = random.Random(seed)
    n = n or args.requests_per_replica * replicas
    population = max(1, args.tenants_per_replica * replicas)
    tenants = tenant_stream(workload, n, population, rng, args.zipf)
    if rate is None:
        rate = args.load * replicas * capacity_per_replica(cost, args.max_batch)
    arr = arrivals_for(rate, n, tenants, random.Random(seed + 1))
    sim = Sim(replicas, policy, cost, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, room=args.room,
              cache=args.cache, window_ms=args.window_ms, seed=seed)
    out = sim.run(arr)
    out.update(replicas=replicas, workload=workload, policy=policy, offered=rate)
    return out


def replicas_needed(workload, policy, cost, args, rate, lo, hi, slo_ms, n):
    """Smallest replica count in [lo, hi] that keeps up with `rate` req/s (sustained throughput at
    least 97% of it) with p99 <= slo_ms, over the same n requests whatever the count (binary
    search; None: not even hi)."""

    def ok(r):
        out = simulate(r, workload, policy, cost, args, rate=rate, n=n)
        return out["p99_ms"] <= slo_ms and out["throughput"] >= 0.97 * rate

    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# -- report ----------------------------------------------------------------------------------------------


def table(rows):
    head = ("| replicas | workload | policy | throughput req/s | p50 ms | p99 ms | PET hit rate | active replicas "
            "| migrations |\n| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    lines = [f"| {r['replicas']} | {r['workload']} | {r['policy']} | {r['throughput']:,.0f} | {r['p50_ms']:.0f} | "
             f"{r['p99_ms']:,.0f} | {r['hit_rate']:.3f} | {r['active']} | {r['migrations']:,} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def draw(rows, out_dir, sizes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    for metric, label, log in (("p99_ms", "p99 latency (ms)", True), ("hit_rate", "PET cache hit rate", False),
                               ("active", "active replicas / replicas", False),
                               ("throughput", "throughput / replica (req/s)", False)):
        fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), sharey=metric != "p99_ms",
                                 squeeze=False)
        axes = axes[0]
        for ax, w in zip(axes, workloads):
            for p in policies:
                pts = [r for r in rows if r["workload"] == w and r["policy"] == p]
                xs = [r["replicas"] for r in pts]
                if metric == "active":
                    ys = [r["active"] / r["replicas"] for r in pts]
                elif metric == "throughput":
                    ys = [r["throughput"] / r["replicas"] for r in pts]
                else:
                    ys = [r[metric] for r in pts]
                ax.plot(xs, ys, marker="o", label=p)
            if len(sizes) > 1:
                ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(s) for s in sizes])
            ax.set_title(w)
            ax.set_xlabel("replicas")
        axes[0].set_ylabel(label)
        axes[-1].legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"cluster_{metric.replace('_ms', '')}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for cluster_sim.md, cluster_sim.json and the PNGs")
    p.add_argument("--cost", default=None, help="cost model JSON from benchmarks/cluster_cost.py "
                   "(default: figures/cluster_cost.json if present)")
    p.add_argument("--replicas", default="1,8,64,512")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--load", type=float, default=0.7, help="offered load / the replicas' full-batch capacity")
    p.add_argument("--requests-per-replica", type=int, default=300)
    p.add_argument("--tenants-per-replica", type=int, default=128)
    p.add_argument("--zipf", type=float, default=1.5)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--room", type=int, default=None, help="requests a replica holds at most (default: --max-batch)")
    p.add_argument("--cache", type=int, default=256, help="PETs a replica's cache holds")
    p.add_argument("--window-ms", type=float, default=1000.0)
    p.add_argument("--slo-ms", type=float, default=500.0, help="p99 target for replicas needed")
    p.add_argument("--needed-at", type=int, default=64,
                   help="replicas needed: the load that many replicas get at --load, searched in [1, 2x]")
    p.add_argument("--pet-load-ms", type=float, default=None,
                   help="override the cost model's PET load (e.g. a GPU's host-to-device upload)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.requests_per_replica = "1,8", 150
    if a.room is None:
        a.room = a.max_batch
    cost_path = a.cost or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "figures",
                                       "cluster_cost.json")
    cost = dict(DEFAULT_COST)
    if os.path.exists(cost_path):
        with open(cost_path) as f:
            cost.update(json.load(f))
    if a.pet_load_ms is not None:
        cost["pet_load_ms"] = a.pet_load_ms
        cost["model"] = f"{cost.get('model', '?')}, PET load set to {a.pet_load_ms:g} ms"
    os.makedirs(a.out, exist_ok=True)
    sizes = [int(x) for x in a.replicas.split(",")]
    t0 = time.perf_counter()
    rows = []
    for R in sizes:
        for w in a.workloads.split(","):
            for pol in a.policies.split(","):
                rows.append(simulate(R, w, pol, cost, a))
                print(f"[{time.perf_counter() - t0:6.1f}s] R={R} {w} {pol}: {rows[-1]['throughput']:.0f} req/s "
                      f"p99 {rows[-1]['p99_ms']:.0f} ms hit {rows[-1]['hit_rate']:.3f} active {rows[-1]['active']}",
                      flush=True)
    needed = []
    if not a.quick and a.needed_at:
        rate = a.load * a.needed_at * capacity_per_replica(cost, a.max_batch)
        for w in a.workloads.split(","):
            row = {"workload": w}
            for pol in a.policies.split(","):
                row[pol] = replicas_needed(w, pol, cost, a, rate, 1, 2 * a.needed_at, a.slo_ms,
                                           2 * a.requests_per_replica * a.needed_at)
            needed.append(row)
            print(f"[{time.perf_counter() - t0:6.1f}s] needed {row}", flush=True)
    pngs = draw(rows, a.out, sizes)
    cap = capacity_per_replica(cost, a.max_batch)
    md = [f"Cost model ({cost.get('model', '?')}): batch ms = {cost['a_ms']:.2f} + {cost['b_ms']:.3f} n + "
          f"{cost['c_ms']:.3f} s, + {cost['pet_load_ms']:.2f} ms per PET not in the replica's cache; one replica's "
          f"full-batch capacity {cap:,.0f} req/s. Offered load {a.load:g} x replicas x capacity, Poisson; "
          f"{a.requests_per_replica} requests per replica; max batch {a.max_batch}, max wait {a.max_wait_ms:g} ms, "
          f"room {a.room} requests, cache {a.cache} PETs per replica, {a.tenants_per_replica} tenants per replica "
          f"(Uniform, Skewed: Zipf {a.zipf:g}).", "", table(rows)]
    if needed:
        md += [f"Replicas needed for {a.load * a.needed_at * cap:,.0f} req/s (what {a.needed_at} replicas get at "
               f"load {a.load:g}) keeping up (sustained throughput >= 97% of it) with p99 <= {a.slo_ms:g} ms:", "",
               "| workload | " + " | ".join(a.policies.split(",")) + " |",
               "| --- |" + " ---: |" * len(a.policies.split(","))]
        for row in needed:
            md.append(f"| {row['workload']} | " + " | ".join(
                "> %d" % (2 * a.needed_at) if row[pol] is None else str(row[pol]) for pol in a.policies.split(","))
                + " |")
        md.append("")
    md.append(f"Simulated in {time.perf_counter() - t0:.0f} s. Figures: " + ", ".join(os.path.basename(x) for x in pngs))
    with open(os.path.join(a.out, "cluster_sim.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "cluster_sim.json"), "w") as f:
        json.dump({"cost": cost, "rows": rows, "needed": needed, "args": vars(a)}, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
