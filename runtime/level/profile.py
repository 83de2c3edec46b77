"""Profiling (Tabi §5): calibrate each level and choose a tenant's policy on held-out data by
re-using saved level outputs, then record it with the tenant.

Level 2 is the tenant's top (runtime.level.serve): its current full-depth PET (``full`` rows)
when it has one, else the full-context lower layers (``context`` rows); costs are relative to
it, and the record says which top it was profiled against (``profile.top``, and for full the
full-depth PET's ``full_created``), since a record measured on another top is not followed.

``collect`` runs the held-out queries once per level through the engine, as rows it routes
itself (level 1 with its attention and coverage; level 2 on the full text and on the text
pruned at each alpha), and
keeps the logits and the measured seconds. Everything after that is arithmetic on the saved
outputs, as in Tabi: ``calibrate`` fits the temperatures (runtime.model.calibrate), and
``choose`` scores every candidate (c, k, alpha, w, gate) by its *expected* metric and cost:
a query is re-routed with Eq. 4's probability p, so its expected scoring counts (correct for
classification; true positives, predicted and gold entities for tagging) are
(1 - p) * level 1's + p * the ensemble's, summed over queries before the metric is taken
(entity F1 is not a mean over queries, its counts are sums). Cost: the measured seconds of
each level, shared over queries in proportion to their tokens (level 2 on a pruned text:
its kept tokens); a query below the coverage gate costs the lookup plus level 2 (a gate
above 1, every query to level 2, needs no lookup).

Level 1 is one of two (``policy.level1``): the PLOT row (``plot``) or, for a tenant with
complete, current students, its first k students at their best k (``students``: no coverage
gate, since they read no coverage, and no word pruning, since they report no attention: gate
and alpha 0; their answers at T = 1, as they are served). ``collect`` runs the students' level
too when it is given them, and ``choose`` scores both cascades' candidates alike, each at its
measured cost: the students-first cascade is chosen when it meets the target cheaper. Its
record keeps the best PLOT-first policy beside it (``policy.plot``), which serving follows
while the students it was profiled on are not servable (runtime.level.serve.follow).

The chosen candidate is the cheapest whose expected metric is within ``target`` of level 2's
(else the most accurate), and, with an ``assurance``, that also stays within it in that share
of bootstrap resamples of the queries (a few hundred queries are a noisy sample). With an
assurance the bar a candidate's expected metric must clear is also tightened for the
selection itself (``selection_bar``): the cheapest of thousands of candidates within target
on dev is the luckiest, so the rule is replayed on each resample and its pick scored on the
queries that resample left out. ``save`` writes the tenant's levels record into its PET meta
(FORMAT.md §5, key ``levels``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.exec.rows import Row
from runtime.level import dispatch, ensemble
from runtime.level.prune import prune, word_spans
from runtime.model import calibrate as cal

# profile_tenant's default share of dev resamples the chosen policy must hold its target in
# (choose): the usual one-sided 90%. On the six tasks' test splits it cut the (task, target)
# cases that missed their target from 7 to 3 of 18, at +0.03 of level 2's cost (BENCHMARKS,
# Tabi)
ASSURANCE = 0.9
GRID = {"c": [0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.01], "k": [10.0, 30.0, 100.0, 1000.0],
        "alpha": [0.0, 0.25, 0.5, 0.75], "w": [0.0, 0.25, 0.5], "gate": [0.0, 0.1, 0.2, 0.3, 0.4, 1.01]}


@dataclass
class Saved:
    """Level outputs of held-out queries (logits at the reported positions)."""

    task: str
    tokens: np.ndarray  # (N,) tokens per query
    coverage: np.ndarray  # (N,) share of windows at full order
    logits1: list
    logits2: dict  # alpha -> per query logits at the reported positions level 2 saw
    seen: dict  # alpha -> per query indices (into the reported positions) level 2 saw
    kept_tokens: dict  # alpha -> (N,) tokens level 2 ran on
    seconds: dict = field(default_factory=dict)  # level1, retrieval, level2 (full text), students
    students: list | None = None  # the students' level: per query its logits at the reported positions
    group: dict | None = None  # and which: {"k": students, "created": the group's created}


def _timed(engine, rows):
    t0 = time.perf_counter()
    outs = engine.run(rows)
    return outs, time.perf_counter() - t0


def top_row(pet, full, ids) -> Row:
    """Level 2's row on ids: the full-depth PET `full` (a ServingPet), else full context with pet."""
    return Row(ids, full, pet.version, "full") if full is not None else Row(ids, pet, pet.version, "context")


def collect(engine, pet, queries, alphas=GRID["alpha"], n: int = 3, batch: int = 32, full=None,
            students=None) -> Saved:
    """Saved level outputs of queries: (ids, positions) each; positions as serve.answer takes
    them (None for classification). Chunk by chunk of `batch` queries: level 1, the students'
    level when `students` is (group, k) (the tenant's runtime.model.student.Group and how many
    answer), then level 2 (the top: `full`, the tenant's full-depth ServingPet, else exact) at
    each alpha, so that the levels' seconds are measured interleaved (a shared machine's load
    changes within a run)."""
    alphas = sorted(set(alphas) | {0.0})
    saved = Saved(pet.task, np.array([len(ids) for ids, _ in queries]), np.zeros(len(queries)), [],
                  {a: [] for a in alphas}, {a: [] for a in alphas}, {a: [] for a in alphas},
                  {"level1": 0.0, "retrieval": 0.0, **{f"level2@{a}": 0.0 for a in alphas}})
    if students is not None:
        group, k = students
        saved.students, saved.group = [], {"k": int(k), "created": group.meta.get("created")}
        saved.seconds["students"] = 0.0
    for start in range(0, len(queries), batch):
        chunk = queries[start:start + batch]
        outs, s1 = _timed(engine, [Row(list(ids), pet, pet.version, "plot", attention=True) for ids, _ in chunk])
        saved.seconds["level1"] += s1
        saved.seconds["retrieval"] += sum(o.timings.get("retrieval", 0.0) / max(o.batch_size, 1) for o in outs)
        for j, (o, (_, pos)) in enumerate(zip(outs, chunk)):
            logits = np.asarray(o.logits, dtype=np.float32)
            saved.logits1.append(logits if pos is None else logits[pos])
            saved.coverage[start + j] = dispatch.coverage(o.served[1], n)
        if students is not None:
            outs_s, ss = _timed(engine, [Row(list(ids), pet, group.meta["version"], "students", group=group, k=k)
                                         for ids, _ in chunk])
            saved.seconds["students"] += ss
            for o, (_, pos) in zip(outs_s, chunk):
                logits = np.asarray(o.logits, dtype=np.float32)
                saved.students.append(logits if pos is None else logits[pos])
        for alpha in alphas:
            kept_all = []
            for (ids, pos), o in zip(chunk, outs):
                firsts = None if pos is None or (len(pos) == len(ids) and pos[0] == 0) else pos
                kept_all.append(prune(o.received, word_spans(firsts, len(ids)), alpha)[0])
            runs = [top_row(pet, full, [ids[j] for j in kept]) for (ids, _), kept in zip(chunk, kept_all)]
            outs2, s2 = _timed(engine, runs)
            saved.seconds[f"level2@{alpha}"] += s2
            saved.kept_tokens[alpha] += [len(k) for k in kept_all]
            for o, kept, (_, pos) in zip(outs2, kept_all, chunk):
                logits = np.asarray(o.logits, dtype=np.float32)
                if pos is None:
                    saved.logits2[alpha].append(logits)
                    saved.seen[alpha].append(None)
                    continue
                where = np.searchsorted(kept, pos)
                seen = [j for j, p in enumerate(pos) if where[j] < len(kept) and kept[where[j]] == p]
                saved.logits2[alpha].append(logits[where[seen]])
                saved.seen[alpha].append(seen)
    saved.kept_tokens = {a: np.array(v) for a, v in saved.kept_tokens.items()}
    saved.seconds["level2"] = saved.seconds["level2@0.0"]
    return saved


def calibrate(saved: Saved, targets) -> dict:
    """Temperatures of both levels fitted on saved outputs, with ECE before and after.
    targets: per query the label index (classification) or the index per reported position
    (tagging; -1 positions are left out)."""
    out = {"temperature": {}, "ece": {}}
    for level, logits in (("1", saved.logits1), ("2", saved.logits2[0.0])):
        z, y = cal.samples(logits, targets)
        T = cal.fit_temperature(z, y)
        out["temperature"][level] = T
        out["ece"][level] = {"before": cal.reliability(cal.softmax(z), y)["ece"],
                             "after": cal.reliability(cal.softmax(z, T), y)["ece"]}
    return out


def _probs(saved, temps, alpha, w, p1=None):
    """Per query the answer probabilities of a re-routed query at (alpha, w); p1: level 1's
    calibrated probabilities (default: the PLOT level's)."""
    if p1 is None:
        p1 = [cal.softmax(z, temps["1"]) for z in saved.logits1]
    out = []
    for q, z2 in enumerate(saved.logits2[alpha]):
        p2 = cal.softmax(z2, temps["2"])
        if saved.task == "classification":
            out.append(ensemble.combine(p1[q], p2, w))
        else:
            out.append(ensemble.tagging(p1[q], p2, saved.seen[alpha][q], w))
    return out


@dataclass
class _Level2:
    """What every candidate shares: level 2 on the full text and the costs per query."""

    st2: np.ndarray  # (N, counts) level 2's scoring counts per query
    per_tok: dict  # seconds per token of each measured level
    tok: np.ndarray  # (N,) tokens per query
    ref_cost: float  # level 2 alone on every query


def choose(saved: Saved, temps: dict, stats, metric, target: float, grid: dict = GRID, assurance: float = 0.0,
           resamples: int = 200, seed: int = 0) -> dict:
    """Evaluate every candidate of grid on saved outputs; stats(probs, q) -> counts vector of
    query q, metric(summed counts) -> score. Returns {"chosen", "candidates", "level1",
    "level2", "students", "plot", "met"} (candidates: dicts with level1 (plot or students), c,
    k, alpha, w, gate, metric, cost (relative to level 2 alone), reroute (expected share), and
    for students-first ones students (k); "students": the students' level alone, None when not
    measured; "plot": the best PLOT-first candidate, the fallback of a students-first choice).
    assurance > 0: the chosen candidate must also be within target of level 2 in that share of
    `resamples` bootstrap resamples of the queries (held, below); 0 takes the cheapest within
    target on the queries as they are."""
    N = len(saved.logits1)
    tok = saved.tokens.astype(np.float64)
    per_tok = {k: v / tok.sum() for k, v in saved.seconds.items()}
    st2 = np.array([stats(p, q) for q, p in enumerate(_probs(saved, temps, 0.0, 0.0))])
    base = _Level2(st2, per_tok, tok, float((per_tok["level2"] * tok).sum()))
    m2 = metric(st2.sum(0))
    cands, how = [], []  # how: each candidate's (gated, p, st1, ste), from which its per-query rows
    p1 = [cal.softmax(z, temps["1"]) for z in saved.logits1]
    st1 = _plot_candidates(saved, temps, stats, metric, grid, p1, base, cands, how)
    alone = None
    if saved.students is not None:
        alone = _students_candidates(saved, temps, stats, metric, grid, base, cands, how)
    draws = np.random.default_rng(seed).multinomial(N, np.full(N, 1 / N), size=resamples).astype(np.float64) \
        if assurance else None
    rows = np.stack([_expected_rows(gated, p, st1, st2, ste) for gated, p, st1, ste in how])
    level2 = np.all(rows == st2[None], axis=(1, 2))  # candidates that answer every query as level 2
    bar = selection_bar(rows, np.array([x["cost"] for x in cands]), st2, metric, target, draws) if assurance \
        else target

    def pick(allowed):
        return _pick(cands, rows, level2, allowed, m2, target, st2, metric, draws, assurance, bar)

    chosen, met = pick(range(len(cands)))
    plot = chosen if cands[chosen]["level1"] == "plot" else pick([j for j, x in enumerate(cands)
                                                                   if x["level1"] == "plot"])[0]
    return {"chosen": cands[chosen], "candidates": cands,
            "level1": {"metric": metric(st1.sum(0)), "cost": float((per_tok["level1"] * tok).sum() / base.ref_cost)},
            "level2": {"metric": m2, "cost": 1.0}, "students": alone, "plot": cands[plot], "met": met,
            "bar": bar}


BAR_STEP = 0.005  # how far selection_bar tightens the bar at a time: half a point
BAR_FLOOR = -0.05  # below it (5 points above level 2 on dev) only level 2 itself is trusted


def selection_bar(rows, costs, st2, metric, target, draws) -> float:
    """How far below level 2 a candidate's dev metric may be for the rule to keep its target on
    queries it did not see: the cheapest candidate within `target` of level 2 on a few hundred
    queries is, among thousands, the one whose luck was best, and it does worse on new ones.
    Each resample of `draws` replays the rule on its queries (the cheapest candidate within the
    bar, level 2 itself always allowed) and scores the pick on the queries the resample left out
    (out of bag); the bar is the loosest of target, target - BAR_STEP, ... down to BAR_FLOOR at
    which the picks' mean out-of-bag shortfall from level 2 is within target, else -inf (level
    2 alone). rows: (candidates, N, counts) per-query expected counts, costs (candidates,);
    metric must take counts with further axes (runtime.level.queries.Queries.metric)."""
    out = (draws == 0).astype(np.float64)
    seen = np.isfinite(metric(np.moveaxis(out @ st2, -1, 0)))  # resamples that left some query out
    if not seen.any():
        return target
    draws, out = draws[seen], out[seen]
    C, N, S = rows.shape
    flat = rows.transpose(1, 0, 2).reshape(N, C * S)

    def scores(weights):  # (resamples, candidates) metric, (resamples,) level 2's
        sums = (weights @ flat).reshape(len(weights), C, S)
        return metric(np.moveaxis(sums, -1, 0)), metric(np.moveaxis(weights @ st2, -1, 0))

    (inside, inside2), (left, left2) = scores(draws), scores(out)
    level2 = np.all(rows == st2[None], axis=(1, 2))  # candidates that are level 2 on every query
    pick = np.arange(len(draws))
    bar = target
    while bar >= BAR_FLOOR - 1e-12:
        allowed = (inside >= inside2[:, None] - bar) | level2[None]
        cheapest = np.where(allowed, costs[None], np.inf).min(axis=1)  # level 2 is allowed: finite
        # as _pick: the cheapest allowed, the most accurate (here) among equally cheap ones
        first = np.argmax(np.where(allowed & (costs[None] == cheapest[:, None]), inside, -np.inf), axis=1)
        shortfall = left2 - left[pick, first]
        if np.mean(shortfall) <= target + 1e-12:
            return float(round(bar, 6))
        bar -= BAR_STEP
    return float("-inf")


def _pick(cands, rows, level2, allowed, m2, target, st2, metric, draws, assurance, bar) -> tuple:
    """(index of the chosen one among the allowed candidates, whether it met the target): the
    cheapest within `bar` (the target, or selection_bar's when assured; a candidate that is
    level 2 on every query, level2[j], always within) and held within target in `assurance` of
    the resamples `draws` (rows[j]: candidate j's per-query counts), else the most accurate."""
    allowed = list(allowed)
    ok = sorted((j for j in allowed if cands[j]["metric"] >= m2 - bar or level2[j]),
                key=lambda j: (cands[j]["cost"], -cands[j]["metric"]))
    if assurance and ok:
        def holds(j):
            return held(draws, rows[j], st2, metric, target) >= assurance

        ok = [next((j for j in ok if holds(j)), ok[-1])]  # level 2 itself (a gate above 1) always holds
    if ok:
        return ok[0], True
    return max(allowed, key=lambda j: cands[j]["metric"]), False


def _plot_candidates(saved, temps, stats, metric, grid, p1, base, cands, how) -> np.ndarray:
    """The PLOT-first candidates of grid, appended to cands (and how); returns level 1's counts."""
    st1 = np.array([stats(p, q) for q, p in enumerate(p1)], dtype=np.float64)
    conf = np.array([dispatch.confidence(p, saved.task) for p in p1])
    per_tok, tok = base.per_tok, base.tok
    c1, lookup, full2 = per_tok["level1"] * tok, per_tok["retrieval"] * tok, per_tok["level2"] * tok
    ens = {(a, w): np.array([stats(p, q) for q, p in enumerate(_probs(saved, temps, a, w, p1))])
           for a in grid["alpha"] for w in grid["w"] if a in saved.logits2}
    for g, c, k in itertools.product(grid["gate"], grid["c"], grid["k"]):
        gated = saved.coverage < g
        p = np.where(gated, 0.0, dispatch.reroute_probability(conf, c, k))
        probe = lookup[gated].sum() if g <= 1 else 0.0  # a gate above 1 needs no lookup (serve.answer)
        base_cost = probe + full2[gated].sum() + c1[~gated].sum()
        for (a, w), ste in ens.items():
            rows = _expected_rows(gated, p, st1, base.st2, ste)
            cost = base_cost + (p[~gated] * per_tok["level2"] * saved.kept_tokens[a][~gated]).sum()
            cands.append({"level1": "plot", "c": c, "k": k, "alpha": a, "w": w, "gate": g,
                          "metric": float(metric(rows.sum(0))), "cost": float(cost / base.ref_cost),
                          "reroute": float((p.sum() + gated.sum()) / len(p))})
            how.append((gated, p, st1, ste))
    return st1


def _students_candidates(saved, temps, stats, metric, grid, base, cands, how) -> dict:
    """The students-first candidates of grid (gate and alpha 0: students read no coverage and
    report no attention), appended to cands (and how); returns the students' level alone."""
    ps = [cal.softmax(z, 1.0) for z in saved.students]  # served at T = 1 (runtime.level.serve.single)
    sts = np.array([stats(p, q) for q, p in enumerate(ps)], dtype=np.float64)
    conf = np.array([dispatch.confidence(p, saved.task) for p in ps])
    cs, full2 = base.per_tok["students"] * base.tok, base.per_tok["level2"] * base.tok
    none = np.zeros(len(ps), dtype=bool)
    ens = {w: np.array([stats(p, q) for q, p in enumerate(_probs(saved, temps, 0.0, w, ps))]) for w in grid["w"]}
    for c, k in itertools.product(grid["c"], grid["k"]):
        p = dispatch.reroute_probability(conf, c, k)
        for w, ste in ens.items():
            rows = _expected_rows(none, p, sts, base.st2, ste)
            cands.append({"level1": "students", "students": saved.group["k"], "c": c, "k": k, "alpha": 0.0, "w": w,
                          "gate": 0.0, "metric": float(metric(rows.sum(0))),
                          "cost": float((cs.sum() + (p * full2).sum()) / base.ref_cost),
                          "reroute": float(p.sum() / len(p))})
            how.append((none, p, sts, ste))
    return {"metric": float(metric(sts.sum(0))), "cost": float(cs.sum() / base.ref_cost), **saved.group}


def _expected_rows(gated, p, st1, st2, ste):
    """Per query the expected scoring counts of a candidate: level 2's for gated queries, else
    level 1's re-routed with probability p to the ensemble's (ste)."""
    return np.where(gated[:, None], st2, (1 - p[:, None]) * st1 + p[:, None] * ste)


def held(draws, rows, rows2, metric, target) -> float:
    """The share of resamples (draws: (B, N) counts of each query) in which the candidate with
    per-query counts rows stays within target of level 2 (rows2) on the same resample."""
    a, b = draws @ rows, draws @ rows2
    return float(np.mean([metric(x) >= metric(y) - target for x, y in zip(a, b)]))


def record(temps: dict, ece: dict, chosen: dict, result: dict, target: float, examples: int,
           assurance: float = 0.0, full=None) -> dict:
    """The levels record a tenant's PET meta keeps (FORMAT.md §5); full: the full-depth
    ServingPet level 2 was (None: exact)."""
    top = {"top": "exact"} if full is None else {"top": "full", "full_created": full.meta.get("created")}
    alone = result.get("students")
    return {"levels": [1, 2], "temperature": temps, "ece": ece, "policy": policy(chosen, result),
            "profile": {**top, "target": target, "assurance": assurance, "expected_metric": chosen["metric"],
                        "expected_cost": chosen["cost"],
                        "expected_reroute": chosen["reroute"], "level1_metric": result["level1"]["metric"],
                        "level2_metric": result["level2"]["metric"], "level1_cost": result["level1"]["cost"],
                        **({"students_metric": alone["metric"], "students_cost": alone["cost"]} if alone else {}),
                        "met": result["met"], "bar": _bar_json(result.get("bar", target)), "examples": examples,
                        "profiled": time.time()}}


def _bar_json(bar: float):
    """selection_bar's bar as a record keeps it, in points: None when only level 2 was trusted."""
    return None if not np.isfinite(bar) else round(100 * bar, 3)


def bar_words(bar, top: str) -> str:
    """A record's bar (points; None: level 2 alone) in words, `top` naming level 2."""
    if bar is None:
        return f"none cleared it ({top} alone: dev cannot tell a cheaper policy from luck)"
    return f"{abs(bar):g} points {'below' if bar >= 0 else 'above'} {top}"


def policy(chosen: dict, result: dict) -> dict:
    """The record's policy (FORMAT.md §5) of a chosen candidate: a students-first one names its
    students (how many, and the group's created) and keeps the best PLOT-first one as its fallback."""
    out = {k: chosen.get(k, "plot" if k == "level1" else None) for k in ("level1", "c", "k", "alpha", "w", "gate")}
    if out["level1"] == "students":
        fallback = result.get("plot") or {}
        out.update(students=int(chosen["students"]), students_created=(result.get("students") or {}).get("created"),
                   plot=policy(fallback, {}) if fallback else None)
    return out


def save(store_path, tenant: str, levels: dict) -> None:
    """Write a tenant's levels record into its PET meta (the record is rewritten whole)."""
    import hkstore
    from formats.pack import PetRecord

    with hkstore.open(store_path, writable=True) as store:
        old = store.get_pet(tenant)
        meta = dict(old.meta, levels=dict(levels, pet_created=old.meta.get("created")))
        store.put_pet(PetRecord(tenant=tenant, meta=meta, tensors=old.tensors))


def profile_tenant(rt, store_path, tenant: str, dev_path, calibration_path=None, target: float = 0.005,
                   alphas=GRID["alpha"], batch: int = 32, assurance: float = ASSURANCE) -> dict:
    """Tabi §4.1 and §5 for one tenant of an open runtime (runtime.open(store_path)), level 2
    its top (the current full-depth PET, else exact): the levels'
    temperatures fitted on calibration_path (labelled text the PET did not train on; default:
    the ones fitted at tenant create / update when the PET has them and the top is exact, the
    level they were fitted on, else dev_path), the policy
    chosen on dev_path for `target` (the metric as a fraction: 0.005 is half a point below level
    2) and held in `assurance` of dev's resamples (choose), level 1 the PLOT or, when the tenant
    has complete, current students, their best k if that cascade is cheaper, the record saved in
    the tenant's PET meta. Returns the record."""
    from runtime.level.queries import read_queries

    pet = rt.pet(tenant)
    full = rt.full(tenant, pet)
    if pet.task not in ("classification", "tagging"):
        raise ValueError(f"tenant {tenant!r} is a {pet.task} tenant: levels serve classification and tagging")
    max_len = (rt.store.snapshot().read_pet(tenant).meta.get("train") or {}).get("max_len", rt.max_len)
    dev = read_queries(dev_path, pet.task, rt.encoder, pet.labels, max_len)
    calib = read_queries(calibration_path, pet.task, rt.encoder, pet.labels, max_len) if calibration_path else dev
    if not len(dev) or not len(calib):
        raise ValueError("profiling needs at least one labelled example")
    n = rt.meta["n"]
    from runtime.level.serve import calibration

    fitted = None if calibration_path or full is not None else calibration(rt.store.snapshot().read_pet(tenant).meta)
    if fitted:  # fitted at tenant create / update on held-out training examples (Tabi's way)
        temps = {"temperature": fitted["temperature"], "ece": fitted["ece"]}
    else:
        saved_c = collect(rt.engine, pet, calib.pairs(), alphas=[0.0], n=n, batch=batch, full=full)
        temps = calibrate(saved_c, calib.targets)
    saved_d = collect(rt.engine, pet, dev.pairs(), alphas=list(alphas), n=n, batch=batch, full=full,
                      students=_students(rt, tenant, pet))
    result = choose(saved_d, temps["temperature"], dev.stats, dev.metric, target, dict(GRID, alpha=list(alphas)),
                    assurance=assurance)
    levels = record(temps["temperature"], temps["ece"], result["chosen"], result, target, len(dev), assurance, full)
    save(store_path, tenant, levels)
    rt.refresh()
    return levels


def check_precision(store_path, tenant: str, dev_path, target: float | None = None) -> dict:
    """Each current level's precision measured again on the dev file and rewritten
    (runtime.construct.manager.tenant_precision; target None: its default), each with its words
    as `hkstore tenant info` says them."""
    from runtime.construct import precision
    from runtime.construct.manager import tenant_precision

    levels = tenant_precision(store_path, tenant, dev_path, target)
    return {name: dict(level, words=precision.words(level["precision"], level["precision_check"]))
            for name, level in levels.items()}


def _students(rt, tenant: str, pet):
    """(group, k) of the tenant's servable students (complete and current) at their best k, the
    students-first level 1 profiling measures; None when it has none."""
    group, _ = rt.students.group(rt.store.snapshot(), tenant, pet.meta)
    if group is None:
        return None
    return group, int(group.meta.get("best_k") or group.size)
