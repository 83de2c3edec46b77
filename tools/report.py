"""Analyst report of a store: the version tree, what each branch overrides and by how much,
how a corpus is served, and the PET pack.

    r = build_report("STORE", version=None, corpus="medical.txt")   # every number, JSON-able
    index = write_report("STORE", "out/", corpus="medical.txt")     # out/index.html + PNGs

build_report needs numpy and the store only; a corpus also imports runtime.construct.plot (torch) for its
n-gram counting, and n-grams are decoded to text with the `tokenizers` package when the store's
meta["model_path"] names a tokenizer (ids otherwise). write_report draws with tools/plots.py.

Definitions (the page repeats them):
  * shared keys of a branch: its live own keys that some ancestor also holds (hkstore.lookup.
    find_exact along the parent chain: the nearest ancestor holding the key is "the parent's"
    value, the one the branch overrides);
  * cosine distance of a shared key: 1 - cos between the branch's and the parent's value, each
    flattened to n*d numbers (as hkstore.diff does); two zero values are at distance 0, a zero
    and a non-zero one at distance 1;
  * coverage of a corpus at version v: the corpus's windows (runtime.plot.window.corpus_windows of the
    tokenized documents) looked up at v in one batch; shares by serving version and by order;
    "exact" windows are served at their own order (no backoff step);
  * the α curve: the corpus's distinct full windows (runtime.construct.plot.ngram_counts), most frequent
    first; point k is (k / distinct, occurrences of the top k / all occurrences). kept_for[α] is
    the share hkstore.branch.select_by_frequency would keep for alpha = α.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import time

import numpy as np

import hkstore
from formats.backoff import key_order
from formats.xxh64 import hash_keys
from hkstore.maintenance import store_bytes
from hkstore.compact import own_entries, read_entries
from hkstore.lookup import find_exact

SAMPLE = 200_000  # most shared keys per branch whose distances are computed
TOP = 20  # most-changed n-grams listed per branch
HIST_BINS = 40
CHUNK = 8192  # keys per value read while computing distances (bounds memory)
ALPHAS = (10, 25, 50, 75, 90, 95, 99, 100)
THRESHOLDS = (0.001, 0.01, 0.05, 0.1)
CURVE_POINTS = 400
DEFAULT_MAX_LEN = 128

_TOKENIZERS = {}


# -- small helpers ------------------------------------------------------------------------------


def _iso(t):
    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _jsonable(obj):
    """numpy scalars/arrays and tuples to plain JSON types (recursively)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def cosine_distance(a, b):
    """1 - cos between rows of a and b, each row flattened; float64 (m,). Two zero rows are at
    distance 0, a zero and a non-zero row at distance 1."""
    m = len(a)
    a = np.asarray(a, dtype=np.float64).reshape(m, -1)
    b = np.asarray(b, dtype=np.float64).reshape(m, -1)
    na, nb = np.einsum("ij,ij->i", a, a), np.einsum("ij,ij->i", b, b)  # squared norms
    both = (na > 0) & (nb > 0)
    cos = np.where(both, np.einsum("ij,ij->i", a, b) / np.sqrt(np.where(both, na * nb, 1.0)), 0.0)
    out = 1.0 - np.clip(cos, -1.0, 1.0)
    out[(na == 0) & (nb == 0)] = 0.0
    out[(a == b).all(axis=1)] = 0.0  # equal rows are at distance 0 exactly, whatever the rounding
    return out


def summarize(x):
    """count, mean, min, p50, p90, p99, max and the share at or below each threshold."""
    x = np.asarray(x, dtype=np.float64)
    if not len(x):
        return {"count": 0}
    return {"count": int(len(x)), "mean": float(x.mean()), "min": float(x.min()),
            "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": float(x.max()),
            "share_at_most": {f"{t:g}": float((x <= t).mean()) for t in THRESHOLDS}}


def histogram(x, bins=HIST_BINS):
    """Fixed-width bins over [0, max(x)] (cosine distances are >= 0)."""
    x = np.asarray(x, dtype=np.float64)
    hi = float(x.max()) if len(x) else 1.0
    counts, edges = np.histogram(x, bins=bins, range=(0.0, hi if hi > 0 else 1e-9))
    return {"edges": edges.tolist(), "counts": counts.astype(int).tolist()}


# -- tokenizer (torch-free) ---------------------------------------------------------------------


def load_tokenizer(meta):
    """The store's tokenizer (tokenizer.json, else vocab.txt in meta["model_path"]), or None
    when there is none or `tokenizers` is missing. Cached per path."""
    model_dir = meta.get("model_path")
    if not model_dir:
        return None
    if model_dir in _TOKENIZERS:
        return _TOKENIZERS[model_dir]
    tok = None
    try:
        import tokenizers
        from tokenizers.implementations import BertWordPieceTokenizer

        if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        elif os.path.isfile(os.path.join(model_dir, "vocab.txt")):
            settings = os.path.join(model_dir, "tokenizer_config.json")
            lowercase = True
            if os.path.isfile(settings):
                with open(settings) as f:
                    lowercase = json.load(f).get("do_lower_case", True)
            tok = BertWordPieceTokenizer(os.path.join(model_dir, "vocab.txt"), lowercase=lowercase)
        if tok is not None:
            tok.no_padding()
            tok.no_truncation()
    except Exception:  # an unreadable tokenizer only costs the decoded text
        tok = None
    _TOKENIZERS[model_dir] = tok
    return tok


def _tokenizer_file(model_dir):
    for name in ("tokenizer.json", "vocab.txt"):
        if os.path.isfile(os.path.join(model_dir, name)):
            return os.path.join(model_dir, name)
    return None


def decode_key(tokenizer, key, pad_id):
    """{"key": ids, "tokens": [...], "text": "..."}: pad slots shown as "_"."""
    key = [int(k) for k in key]
    tokens = []
    for k in key:
        if k == pad_id:
            tokens.append("_")
        elif tokenizer is not None:
            tokens.append(tokenizer.id_to_token(k) or str(k))
        else:
            tokens.append(str(k))
    return {"key": key, "tokens": tokens, "text": " ".join(tokens)}


def tokenize_corpus(meta, docs, max_len):
    """Token id lists of documents, like runtime.construct.manager.tokenize_corpus (how build and domain
    tokenize): the tokenizer's [CLS] ... [SEP] encoding, each document cut into pieces of at
    most max_len ids so no text is lost to truncation."""
    if max_len < 3:
        raise ValueError(f"max_len={max_len} is too small (at least 3)")
    model_dir = meta.get("model_path")
    tok = load_tokenizer(meta)
    if tok is None:
        raise ValueError(f"the store names no usable tokenizer (meta model_path = {model_dir!r}); "
                         "a corpus cannot be tokenized")
    fingerprint = meta.get("tokenizer_fingerprint")
    if fingerprint:
        from formats.xxh64 import checksum

        with open(_tokenizer_file(model_dir), "rb") as f:
            if f"{checksum(f.read()):016x}" != fingerprint:
                raise ValueError(f"{model_dir}: its tokenizer differs from the store's (fingerprint mismatch)")
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    out = []
    for enc in tok.encode_batch(list(docs)):
        ids = list(enc.ids)
        inner = ids[1:-1] if len(ids) >= 2 and ids[0] == cls and ids[-1] == sep else ids
        step = max_len - 2
        for start in range(0, max(len(inner), 1), step):
            out.append([cls, *inner[start:start + step], sep])
    return out


# -- versions and branches ----------------------------------------------------------------------


def _info_summary(value, limit=12, depth=0):
    """A version's info for display: long lists and maps cut to `limit` items, nesting to 3."""
    if isinstance(value, dict):
        if depth >= 3:
            return f"<{len(value)} items>"
        items = list(value.items())
        out = {str(k): _info_summary(v, limit, depth + 1) for k, v in items[:limit]}
        if len(items) > limit:
            out["..."] = f"{len(items) - limit} more"
        return out
    if isinstance(value, list):
        if depth >= 3:
            return f"<{len(value)} items>"
        out = [_info_summary(v, limit, depth + 1) for v in value[:limit]]
        return out + [f"... {len(value) - limit} more"] if len(value) > limit else out
    return value


def _version_rows(snap):
    children = {}
    for v in snap.versions:
        children.setdefault(v["parent"], []).append(v["name"])
    rows = []
    for vi, v in enumerate(snap.versions):
        keys, _, _, tomb = own_entries(snap, vi)
        # The position table in force (FORMAT.md section 4): the nearest one on the ancestry.
        holder = next((a for a in snap.ancestry(vi) if snap.versions[a].get("position")), None)
        rows.append({
            "index": vi, "name": v["name"], "parent": v["parent"], "depth": len(snap.ancestry(vi)) - 1,
            "children": children.get(v["name"], []), "entries": int((~tomb).sum()), "tombstones": int(tomb.sum()),
            "segments": len(v["segments"]),
            "bytes": int(sum(os.path.getsize(s.path) for s in snap.version_segments(vi))),
            "position_rows": (v.get("position") or {}).get("rows", 0),
            "position_from": None if holder is None else snap.version_names[holder],
            "created": v.get("created"), "created_iso": _iso(v.get("created")), "info": v.get("info") or {},
        })
    return rows


def branch_stats(snap, version, *, sample=SAMPLE, top=TOP, seed=0, tokenizer=None):
    """Overlap of a branch with its parent chain and the cosine distance of the shared keys."""
    vi = snap.version_index(version)
    v = snap.versions[vi]
    meta = snap.meta
    keys, seg, ent, tomb = own_entries(snap, vi)
    live = ~tomb
    keys, seg, ent = keys[live], seg[live], ent[live]
    ancestors = snap.ancestry(vi)[1:]
    chain = [snap.version_segments(a) for a in ancestors]
    if len(keys) and chain:
        pos, pseg, pent = find_exact(chain, keys, hash_keys(keys))
    else:
        pos = np.full(len(keys), -1, dtype=np.int64)
        pseg = pent = pos
    shared_rows = np.flatnonzero(pos >= 0)
    out = {
        "name": v["name"], "index": vi, "parent": v["parent"], "chain": [snap.version_names[a] for a in ancestors],
        "entries": int(len(keys)), "tombstones": int(tomb.sum()), "shared": int(len(shared_rows)),
        "new": int(len(keys) - len(shared_rows)),
        "shared_share": float(len(shared_rows) / len(keys)) if len(keys) else 0.0,
        "shared_by_ancestor": {snap.version_names[a]: int((pos == p).sum()) for p, a in enumerate(ancestors)},
        "by_order": {},
    }
    orders = key_order(keys, meta["window"], meta["pad_id"]) if len(keys) else np.zeros(0, dtype=np.int64)
    for o in sorted(set(orders.tolist()), reverse=True):
        here = orders == o
        out["by_order"][str(int(o))] = {"entries": int(here.sum()), "shared": int((here & (pos >= 0)).sum())}
    rows = shared_rows
    out["sampled"] = bool(len(rows) > sample)
    if out["sampled"]:
        rows = np.sort(np.random.default_rng(seed).choice(rows, size=sample, replace=False))
    out["distance_keys"] = int(len(rows))
    dist = np.zeros(len(rows), dtype=np.float64)
    identical = np.zeros(len(rows), dtype=bool)
    own_segments = snap.version_segments(vi)
    for start in range(0, len(rows), CHUNK):
        r = rows[start:start + CHUNK]
        mine = read_entries(own_segments, keys[r], seg[r], ent[r])
        theirs = np.zeros_like(mine)
        for p in np.unique(pos[r]):
            sub = np.flatnonzero(pos[r] == p)
            theirs[sub] = read_entries(chain[p], keys[r][sub], pseg[r][sub], pent[r][sub])
        dist[start:start + len(r)] = cosine_distance(mine, theirs)
        identical[start:start + len(r)] = (mine == theirs).reshape(len(r), -1).all(axis=1)
    out["identical"] = int(identical.sum())
    out["cosine_distance"] = summarize(dist)
    out["histogram"] = histogram(dist)
    order = np.argsort(-dist, kind="stable")[:top]
    out["most_changed"] = []
    for i in order:
        if dist[i] <= 0:
            break
        row = decode_key(tokenizer, keys[rows[i]], meta["pad_id"])
        row.update(cosine_distance=float(dist[i]), ancestor=snap.version_names[ancestors[pos[rows[i]]]],
                   order=int(orders[rows[i]]))
        out["most_changed"].append(row)
    out["_distances"] = dist  # for the figures; dropped from the JSON
    return out


# -- coverage -------------------------------------------------------------------------------------


def coverage(snap, version, wins):
    """How the windows `wins` (m, n) are served at `version`: one batched lookup."""
    meta = snap.meta
    res = snap.lookup(version, wins)
    m = len(wins)
    ancestry = snap.ancestry(version)
    share = (lambda c: float(c / m) if m else 0.0)
    own_order = key_order(wins, meta["window"], meta["pad_id"]) if m else np.zeros(0, dtype=np.int64)
    by_version = {}
    for a in ancestry:
        c = int((res.version == a).sum())
        by_version[snap.version_names[a]] = {"windows": c, "share": share(c)}
    misses = int((res.order == 0).sum())
    if misses:
        by_version["miss"] = {"windows": misses, "share": share(misses)}
    by_order = {}
    for o in range(meta["n"], -1, -1):
        c = int((res.order == o).sum())
        if c or o > 0:
            by_order[str(o)] = {"windows": c, "share": share(c)}
    steps = own_order - res.order.astype(np.int64)
    by_steps = {}
    for s in sorted(set(steps[res.order > 0].tolist())):
        c = int(((steps == s) & (res.order > 0)).sum())
        by_steps[str(int(s))] = {"windows": c, "share": share(c)}
    by_version_order = {}
    for a in ancestry:
        here = res.version == a
        by_version_order[snap.version_names[a]] = {str(o): int((here & (res.order == o)).sum())
                                                   for o in range(meta["n"], 0, -1)}
    exact = int(((steps == 0) & (res.order > 0)).sum())
    return {"version": snap.version_names[snap.version_index(version)], "windows": m, "by_version": by_version,
            "by_order": by_order, "backoff_steps": by_steps, "by_version_order": by_version_order,
            "exact": exact, "exact_share": share(exact), "misses": misses}


def alpha_curve(counts, points=CURVE_POINTS):
    """The α curve of n-gram counts (see the module doc)."""
    counts = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    k, total = len(counts), int(counts.sum())
    if not k:
        return {"distinct": 0, "occurrences": 0, "points": [], "kept_for": {}}
    cover = np.cumsum(counts)
    if k <= points:
        idx = np.arange(k)
    else:  # log-spaced (the head matters) plus linear, always the last point
        idx = np.unique(np.concatenate([np.geomspace(1, k, points // 2).astype(np.int64) - 1,
                                        np.linspace(0, k - 1, points // 2).astype(np.int64), [k - 1]]))
    kept_for = {}
    for a in ALPHAS:
        need = int(np.searchsorted(cover, a / 100.0 * total - 1e-9, side="left")) + 1
        need = min(need, k)
        kept_for[str(a)] = {"ngrams": need, "share": float(need / k), "covered": float(cover[need - 1] / total)}
    return {"distinct": k, "occurrences": total, "singletons": int((counts == 1).sum()),
            "points": [[0.0, 0.0]] + [[float((i + 1) / k), float(cover[i] / total)] for i in idx],
            "kept_for": kept_for}


def corpus_report(snap, versions, corpus, *, corpus_format=None, max_len=None):
    from runtime.construct.data import read_corpus
    from runtime.construct.plot import ngram_counts
    from runtime.plot.window import corpus_windows

    meta = snap.meta
    docs = read_corpus(corpus, corpus_format)
    if max_len is None:
        infos = [snap.versions[snap.version_index(v)]["info"] for v in versions] + [snap.versions[0]["info"]]
        max_len = next((int(i["max_len"]) for i in infos if isinstance(i.get("max_len"), int)), DEFAULT_MAX_LEN)
    seqs = tokenize_corpus(meta, docs, max_len)
    wins, lengths = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
    vocab = meta.get("vocab_size")
    if vocab and len(wins) and int(wins.max()) >= vocab:
        raise ValueError(f"token id {int(wins.max())} is outside the store's vocabulary of {vocab}")
    _, counts = ngram_counts(seqs, meta["n"], meta["window"], meta["pad_id"])
    return {"corpus": os.path.abspath(corpus), "documents": len(docs), "sequences": len(seqs),
            "tokens": int(lengths.sum()), "windows": int(len(wins)), "max_len": max_len,
            "versions": [coverage(snap, v, wins) for v in versions], "alpha_curve": alpha_curve(counts)}


# -- PETs -------------------------------------------------------------------------------------------


def pet_rows(snap):
    rows = []
    for tenant, loc in sorted(snap.pets.items()):
        row = {"tenant": tenant, "bytes": int(loc["length"]), "file": loc["file"]}
        try:
            rec = snap.read_pet(tenant)
        except (hkstore.FormatError, OSError) as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        m = rec.meta
        row.update(pet_type=m.get("pet_type"), task=m.get("task"), version=m.get("version"),
                   version_exists=m.get("version") in snap.version_names,
                   labels=len(m.get("labels") or []), layers=m.get("layers"),
                   tensor_bytes=int(sum(t.nbytes for t in rec.tensors.values())),
                   parameters=int(sum(t.size for t in rec.tensors.values())),
                   created=m.get("created"), created_iso=_iso(m.get("created")))
        rows.append(row)
    return rows


# -- the report ---------------------------------------------------------------------------------


def _build(store_path, version=None, corpus=None, *, sample=SAMPLE, top=TOP, corpus_format=None, max_len=None,
           seed=0):
    store_path = os.fspath(store_path)
    started = time.perf_counter()
    st = hkstore.open(store_path)
    try:
        snap = st.snapshot()
        if version is not None:
            focus = snap.version_names[snap.version_index(version)]
        else:
            focus = None
        if corpus is not None and not os.path.isfile(corpus):
            raise ValueError(f"{corpus}: no such corpus file")
        meta = snap.meta
        tokenizer = load_tokenizer(meta)
        versions = _version_rows(snap)
        scope = snap.version_names if focus is None else [snap.version_names[i]
                                                          for i in reversed(snap.ancestry(focus))]
        branches = [branch_stats(snap, name, sample=sample, top=top, seed=seed, tokenizer=tokenizer)
                    for name in scope if snap.versions[snap.version_index(name)]["parent"] is not None]
        cov = None
        if corpus is not None:
            cov = corpus_report(snap, snap.version_names if focus is None else [focus], corpus,
                                corpus_format=corpus_format, max_len=max_len)
        segments = {s for v in snap.versions for s in v["segments"]}
        size = store_bytes(store_path, snap.manifest)  # the totals `hkstore info` shows, defined once
        pets = pet_rows(snap)
        notes = []
        for b in branches:
            if b["sampled"]:
                notes.append(f"{b['name']}: cosine distances computed on a random sample of {b['distance_keys']:,} "
                             f"of its {b['shared']:,} shared keys (seed {seed})")
        if tokenizer is None:
            notes.append("no tokenizer found at the store's model_path: n-grams are shown as token ids")
        report = {
            "store": os.path.abspath(store_path), "generated": time.time(), "generated_iso": _iso(time.time()),
            "generation": snap.manifest["generation"], "meta": _named(meta), "focus": focus,
            "totals": {"versions": len(snap.versions), "segments": len(segments), "segment_bytes": size["segments"],
                       "position_bytes": size["positions"], "pet_bytes": size["pets"], "bytes_live": size["live"],
                       "bytes_on_disk": size["on_disk"], "tenants": len(pets)},
            "versions": versions, "branches": branches, "coverage": cov, "pets": pets,
            "sample_limit": sample, "notes": notes,
        }
        report["seconds"] = round(time.perf_counter() - started, 3)
        return report
    finally:
        st.close()


def _named(meta) -> dict:
    """The store's meta with base_model naming the model it was built from (hkstore.model_name,
    as `hkstore info` shows it); the record PETs are checked against, when it differs, beside it."""
    from hkstore.model_name import model_name

    name = model_name(meta)
    if not name or name == meta.get("base_model"):
        return dict(meta)
    return dict(meta, base_model=name, base_model_recorded=meta.get("base_model"))


def _public(report):
    out = dict(report, branches=[{k: v for k, v in b.items() if not k.startswith("_")} for b in report["branches"]])
    return _jsonable(out)


def build_report(store_path, version=None, corpus=None, *, sample=SAMPLE, top=TOP, corpus_format=None,
                 max_len=None, seed=0) -> dict:
    """Every number of the report as a JSON-able dict (see the module doc for definitions).

    version: report that version and its ancestors (branch stats, coverage at it); None: every
    version (coverage at each). corpus: a text / JSON lines / CoNLL file (runtime.construct.data.read_corpus)
    tokenized with the store's tokenizer into pieces of max_len ids (default: the version's or
    root's recorded max_len, else 128). sample: most shared keys per branch whose distances are
    computed (a seeded random sample beyond it; the report says so).
    """
    return _public(_build(store_path, version, corpus, sample=sample, top=top, corpus_format=corpus_format,
                          max_len=max_len, seed=seed))


# -- figures and HTML ---------------------------------------------------------------------------


def _figures(report, out_dir):
    from tools import plots

    figs = {}
    meta = report["meta"]
    nodes = []
    for v in report["versions"]:
        label = f"{v['name']}\n{v['entries']:,} entries\n{plots.nice_bytes(v['bytes'])}"
        nodes.append({"name": v["name"], "parent": v["parent"], "label": label})
    figs["tree"] = plots.tree_plot(nodes, os.path.join(out_dir, "tree.png"), highlight=report["focus"])
    for i, b in enumerate(report["branches"]):
        figs[f"branch{i}_hist"] = plots.histogram_plot(
            b["_distances"], "cosine distance to the parent's value", os.path.join(out_dir, f"branch{i}-hist.png"),
            bins=HIST_BINS, title=f"{b['name']}: {b['distance_keys']:,} shared keys",
            logy=max(b["histogram"]["counts"], default=0) >= 100)
    if report["branches"]:
        figs["distance_cdf"] = plots.cdf_plot(
            {b["name"]: b["_distances"] for b in report["branches"]}, "cosine distance to the parent's value",
            os.path.join(out_dir, "distance-cdf.png"), title="Shared n-grams: how far each branch moves them")
    cov = report["coverage"]
    if cov:
        rows = [c["version"] for c in cov["versions"]]
        names = []
        for c in cov["versions"]:
            names += [k for k in c["by_version"] if k not in names]
        segs = {name: [c["by_version"].get(name, {}).get("share", 0.0) for c in cov["versions"]] for name in names}
        figs["coverage_version"] = plots.stacked_bars(rows, segs, "% of the corpus's windows, by serving version",
                                                      os.path.join(out_dir, "coverage-version.png"),
                                                      title="Which version serves the corpus")
        orders = [str(o) for o in range(meta["n"], -1, -1)]
        segs = {f"order {o}" if o != "0" else "miss": [c["by_order"].get(o, {}).get("share", 0.0)
                                                       for c in cov["versions"]] for o in orders}
        segs = {k: v for k, v in segs.items() if any(v) or k != "miss"}
        figs["coverage_order"] = plots.stacked_bars(rows, segs, "% of the corpus's windows, by served order",
                                                    os.path.join(out_dir, "coverage-order.png"),
                                                    title="Backoff: the order of the key that served each window")
        curve = cov["alpha_curve"]
        if curve["points"]:
            xs, ys = zip(*curve["points"][1:])
            marks = {f"\u2265{a}%: {100 * curve['kept_for'][a]['share']:.2g}% of n-grams":
                     (curve["kept_for"][a]["share"], curve["kept_for"][a]["covered"]) for a in ("50", "90")}
            figs["alpha"] = plots.alpha_plot(xs, ys, os.path.join(out_dir, "alpha.png"), marks=marks,
                                             title=f"α curve: {curve['distinct']:,} distinct n-grams, "
                                                   f"{curve['occurrences']:,} occurrences")
    pets = [p for p in report["pets"] if "error" not in p]
    if pets:
        figs["pets"] = plots.bar_plot([p["tenant"] for p in pets], [p["bytes"] for p in pets],
                                      "bytes in the pack", os.path.join(out_dir, "pets.png"), title="PET sizes",
                                      logy=max(p["bytes"] for p in pets) > 50 * max(1, min(p["bytes"] for p in pets)))
    return {k: os.path.basename(v) for k, v in figs.items()}


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1100px;
color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin-top:22px}
table{border-collapse:collapse;margin:8px 0 14px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f5f8}td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;height:auto;display:block;margin:8px 0;border:1px solid #eee}
.muted{color:#777}.note{background:#fff8e1;border:1px solid #f0d98a;padding:6px 10px;margin:8px 0}
.warn{background:#fdecea;border:1px solid #f5c2c0;padding:6px 10px;margin:8px 0}
code,pre{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace}pre{white-space:pre-wrap;margin:0}
details summary{cursor:pointer;color:#345}
"""

SCRIPT = """
(function () {
  var errors = 0;
  window.addEventListener("error", function () { errors += 1; }, true);
  window.addEventListener("load", function () {
    var imgs = Array.prototype.slice.call(document.images);
    var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); });
    var s = document.getElementById("render-status");
    s.setAttribute("data-images", String(imgs.length));
    s.setAttribute("data-broken", String(broken.length));
    s.setAttribute("data-errors", String(errors));
    s.setAttribute("data-status", broken.length || errors ? "broken" : "ok");
    if (broken.length) {
      s.className = "warn";
      s.textContent = broken.length + " figure(s) did not load: keep the PNG files beside index.html.";
    }
  });
})();
"""


def _e(x):
    return html.escape(str(x), quote=True)


def _num(x):
    if isinstance(x, bool) or x is None:
        return _e("" if x is None else x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.4g}"
    return _e(x)


def _pct(x):
    return f"{100 * x:.1f}%"


def _table(headers, rows, numeric=()):
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"]
    for r in rows:
        cells = []
        for j, c in enumerate(r):
            cls = ' class="n"' if j in numeric else ""
            cells.append(f"<td{cls}>{c}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _img(figs, key, alt):
    return f'<img src="{_e(figs[key])}" alt="{_e(alt)}">' if key in figs else ""


def _position_cell(v):
    if v["position_rows"]:
        return f"own, {v['position_rows']:,} rows"
    return f"from {_e(v['position_from'])}" if v["position_from"] else "none"


def render_html(report, figs):
    """The page (a string): inline CSS and script, images by relative file name only."""
    meta, totals = report["meta"], report["totals"]
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
             f"<title>hkstore report: {_e(os.path.basename(report['store']))}</title><style>{CSS}</style></head><body>"]
    parts.append(f"<h1>hkstore report</h1><div class=\"muted\">{_e(report['store'])} &middot; generation "
                 f"{report['generation']} &middot; generated {_e(report['generated_iso'])}</div>")
    parts.append('<div id="render-status" data-status="pending"></div>')
    for note in report["notes"]:
        parts.append(f'<div class="note">{_e(note)}</div>')
    parts.append("<h2>Store</h2>")
    keys = ["base_model", "base_model_recorded", "d", "n", "window", "lower_layers", "num_layers", "dtype", "pad_id",
            "vocab_size", "model_path"]
    rows = [[_e(k), _num(meta.get(k))] for k in keys if k in meta]
    rows += [[_e(k), _num(v)] for k, v in totals.items()]
    parts.append(_table(["", ""], rows))

    parts.append("<h2>Version tree</h2>")
    if report["focus"]:
        parts.append(f"<p>Focus: <b>{_e(report['focus'])}</b> (highlighted) and its ancestors.</p>")
    parts.append(_img(figs, "tree", "the version tree"))
    rows = []
    for v in report["versions"]:
        info = json.dumps(_jsonable(_info_summary(v["info"])), indent=1, sort_keys=True, default=str)
        corpus = v["info"].get("corpus")
        corpus = ", ".join(os.path.basename(str(c)) for c in corpus) if isinstance(corpus, list) else corpus
        rows.append([_e(v["name"]), _e(v["parent"] or "—"), _num(v["entries"]), _num(v["tombstones"]),
                     _num(v["segments"]), _num(v["bytes"]), _position_cell(v), _e(v["created_iso"] or ""),
                     _e(corpus or ""), f"<details><summary>info</summary><pre>{_e(info)}</pre></details>"])
    parts.append(_table(["version", "parent", "entries", "tombstones", "segments", "bytes", "position table",
                         "created", "corpus", "info"], rows, numeric=(2, 3, 4, 5)))

    parts.append("<h2>Branches: what they override and by how much</h2>")
    if not report["branches"]:
        parts.append("<p class=\"muted\">No branches in scope: the store holds only its root.</p>")
    else:
        parts.append("<p>A branch's <i>shared</i> keys are its own keys that an ancestor also holds; their cosine "
                     "distance is 1 &minus; cos between the branch's value and the nearest ancestor's (each flattened "
                     "to n&times;d numbers). HMI observes that most shared n-grams barely move across domains.</p>")
        parts.append(_img(figs, "distance_cdf", "CDF of cosine distances of shared keys"))
        rows = []
        for b in report["branches"]:
            s = b["cosine_distance"]
            rows.append([_e(b["name"]), _e(" → ".join(b["chain"])), _num(b["entries"]), _num(b["shared"]),
                         _pct(b["shared_share"]), _num(b["new"]), _num(b["identical"]),
                         _num(s.get("p50")), _num(s.get("p90")), _num(s.get("max")),
                         _pct(s["share_at_most"]["0.01"]) if s["count"] else ""])
        parts.append(_table(["branch", "parent chain", "entries", "shared", "shared %", "new", "identical",
                             "p50", "p90", "max", "≤ 0.01"], rows, numeric=tuple(range(2, 11))))
        for i, b in enumerate(report["branches"]):
            parts.append(f"<h3>{_e(b['name'])} <span class=\"muted\">(parent {_e(b['parent'])})</span></h3>")
            anc = ", ".join(f"{_e(k)}: {v:,}" for k, v in b["shared_by_ancestor"].items())
            parts.append(f"<p>{b['entries']:,} live entries ({b['tombstones']:,} tombstoned); {b['shared']:,} "
                         f"shared with the parent chain ({anc}); {b['new']:,} new; {b['identical']:,} of the "
                         f"{b['distance_keys']:,} measured are bit-identical to the parent's.")
            if b["sampled"]:
                parts.append(f" <b>Sampled:</b> distances of {b['distance_keys']:,} random shared keys of "
                             f"{b['shared']:,}.")
            parts.append("</p>")
            s = b["cosine_distance"]
            if s["count"]:
                stat = [[_e(k), _num(s[k])] for k in ("count", "mean", "min", "p50", "p90", "p99", "max")]
                stat += [[f"share ≤ {_e(t)}", _pct(v)] for t, v in s["share_at_most"].items()]
                parts.append(_table(["cosine distance", ""], stat, numeric=(1,)))
                parts.append(_img(figs, f"branch{i}_hist", f"histogram of cosine distances of {b['name']}"))
            if b["most_changed"]:
                rows = [[f"<code>{_e(r['text'])}</code>", f"<code>{_e(r['key'])}</code>", _num(r["order"]),
                         _e(r["ancestor"]), _num(r["cosine_distance"])] for r in b["most_changed"]]
                parts.append("<p>Most-changed shared n-grams:</p>")
                parts.append(_table(["n-gram", "ids", "order", "overrides", "cosine distance"], rows,
                                    numeric=(2, 4)))

    cov = report["coverage"]
    if cov:
        parts.append("<h2>Corpus coverage</h2>")
        parts.append(f"<p>{_e(cov['corpus'])}: {cov['documents']:,} documents, {cov['sequences']:,} sequences "
                     f"(pieces of at most {cov['max_len']} ids), {cov['tokens']:,} tokens = windows. Each version "
                     f"serves every window in one batched lookup; a window backs off to lower orders when no "
                     f"version on its chain holds it.</p>")
        parts.append(_img(figs, "coverage_version", "coverage by serving version"))
        parts.append(_img(figs, "coverage_order", "coverage by served order"))
        # one table: a column per version the corpus was served at, windows (share) per cell
        at = cov["versions"]

        def cell(entry):
            return f"{entry['windows']:,} ({_pct(entry['share'])})" if entry else "—"

        names = []
        for c in at:
            names += [k for k in c["by_version"] if k not in names]
        rows = [[f"served by {_e(name)}"] + [cell(c["by_version"].get(name)) for c in at] for name in names]
        orders = [o for o in map(str, range(meta["n"], -1, -1)) if any(o in c["by_order"] for c in at)]
        rows += [[f"order {o}" if o != "0" else "miss"] + [cell(c["by_order"].get(o)) for c in at] for o in orders]
        rows.append(["at own order (no backoff)"] + [cell({"windows": c["exact"], "share": c["exact_share"]})
                                                     for c in at])
        parts.append(_table(["windows"] + [f"at {c['version']}" for c in at], rows,
                            numeric=tuple(range(1, len(at) + 1))))
        curve = cov["alpha_curve"]
        parts.append("<h3>α curve</h3>")
        parts.append(f"<p>{curve['distinct']:,} distinct n-grams ({curve['singletons']:,} seen once) over "
                     f"{curve['occurrences']:,} occurrences. Keeping the most frequent first, a branch with "
                     f"alpha = α keeps:</p>")
        parts.append(_img(figs, "alpha", "alpha curve"))
        rows = [[f"{a}%", _num(v["ngrams"]), f"{100 * v['share']:.3g}%"] for a, v in curve["kept_for"].items()]
        parts.append(_table(["occurrences covered (α)", "n-grams kept", "share of distinct n-grams"], rows,
                            numeric=(1, 2)))

    parts.append("<h2>PET pack</h2>")
    if not report["pets"]:
        parts.append("<p class=\"muted\">No tenants.</p>")
    else:
        parts.append(_img(figs, "pets", "PET sizes"))
        rows = []
        for p in report["pets"]:
            if "error" in p:
                rows.append([_e(p["tenant"]), f'<span class="warn">{_e(p["error"])}</span>', "", "", _num(p["bytes"]),
                             "", "", ""])
                continue
            version = _e(p["version"]) + ("" if p["version_exists"] else " <b>(missing)</b>")
            rows.append([_e(p["tenant"]), _e(p["pet_type"]), _e(p["task"]), version, _num(p["bytes"]),
                         _num(p["parameters"]), _num(p["labels"]), _e(p["created_iso"] or "")])
        parts.append(_table(["tenant", "type", "task", "trained on version", "bytes", "parameters", "labels",
                             "created"], rows, numeric=(4, 5, 6)))
    parts.append(f"<p class=\"muted\">Numbers: report.json beside this page. Built in {report['seconds']} s.</p>")
    parts.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(parts)


def write_report(store_path, out_dir, version=None, corpus=None, *, sample=SAMPLE, top=TOP, corpus_format=None,
                 max_len=None, seed=0, return_report=False):
    """Write out_dir/index.html (self-contained: inline CSS, PNGs beside it, no network
    resources) and out_dir/report.json; returns the path of index.html (and the report dict
    with return_report=True)."""
    report = _build(store_path, version, corpus, sample=sample, top=top, corpus_format=corpus_format,
                    max_len=max_len, seed=seed)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    figs = _figures(report, out_dir)
    public = _public(report)
    public["figures"] = figs
    index = os.path.join(out_dir, "index.html")
    tmp = index + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_html(public, figs))
    os.replace(tmp, index)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(public, f, indent=1, default=str)
    return (index, public) if return_report else index


__all__ = ["alpha_curve", "branch_stats", "build_report", "cosine_distance", "coverage", "decode_key",
           "load_tokenizer", "render_html", "summarize", "tokenize_corpus", "write_report"]
