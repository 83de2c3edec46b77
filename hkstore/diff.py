"""diff: what changed between two versions (of one store or of two stores)."""

import numpy as np

from formats.xxh64 import hash_keys
from hkstore.compact import own_entries, read_entries, void_keys
from hkstore.lookup import find_exact

COMPARES = ("own entries: the keys each version holds itself, not what it inherits; a key only one "
            "of them holds is classified by what the other serves for it through its ancestors")


def _served_by(snap, version, keys):
    """Per key, the index of `version`'s nearest ancestor (not itself) holding it exactly; -1 if none."""
    ancestors = snap.ancestry(snap.version_index(version))[1:]
    if not len(keys) or not ancestors:
        return np.full(len(keys), -1, dtype=np.int64)
    pos, _, _ = find_exact([snap.version_segments(a) for a in ancestors], keys, hash_keys(keys))
    return np.where(pos >= 0, np.asarray(ancestors + [-1])[pos], -1)


def _distances(a, b):
    width = int(np.prod(a.shape[1:]))
    a = a.reshape(len(a), width).astype(np.float64)
    b = b.reshape(len(b), width).astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosine = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1), 1.0)
    return 1.0 - cosine, np.linalg.norm(a - b, axis=1)


def _stats(x):
    if not len(x):
        return None
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p95": float(np.percentile(x, 95)),
            "max": float(x.max())}


def diff_versions(snap_a, version_a, snap_b, version_b, tolerance=0.0, sample=5):
    """What `version_b` holds itself compared with what `version_a` holds itself (COMPARES):

    - keys both hold: changed (vectors further apart than `tolerance` max-abs, with cosine and
      L2 distance statistics) or unchanged;
    - keys only b holds: ``overridden`` where a serves the key through its ancestors (b now
      answers it itself), else ``added``;
    - keys only a holds: ``inherited`` where b serves the key through its ancestors (b answers
      it from an ancestor, so nothing is lost), else ``removed``.
    """
    ka, sa, ea, ta = own_entries(snap_a, version_a)
    kb, sb, eb, tb = own_entries(snap_b, version_b)
    ka, sa, ea = ka[~ta], sa[~ta], ea[~ta]
    kb, sb, eb = kb[~tb], sb[~tb], eb[~tb]
    va, vb = void_keys(ka), void_keys(kb)
    _, ia, ib = np.intersect1d(va, vb, return_indices=True)
    only_b = np.setdiff1d(np.arange(len(kb)), ib)
    only_a = np.setdiff1d(np.arange(len(ka)), ia)
    a_from = _served_by(snap_a, version_a, kb[only_b])
    b_serves = _served_by(snap_b, version_b, ka[only_a]) >= 0
    # A key b holds that a serves from b itself (b is a's ancestor) is shared, not overridden.
    b_itself = snap_b.version_index(version_b) if snap_a.path == snap_b.path else -2
    added, overridden = only_b[a_from < 0], only_b[(a_from >= 0) & (a_from != b_itself)]
    removed = only_a[~b_serves]
    inherited = np.concatenate([only_a[b_serves], only_b[a_from == b_itself]])
    values_a = read_entries(snap_a.version_segments(version_a), ka[ia], sa[ia], ea[ia])
    values_b = read_entries(snap_b.version_segments(version_b), kb[ib], sb[ib], eb[ib])
    if len(ia):
        changed = np.abs(values_a - values_b).max(axis=(1, 2)) > tolerance
    else:
        changed = np.zeros(0, dtype=bool)
    cos, l2 = _distances(values_a[changed], values_b[changed])
    worst = np.argsort(-cos)[:sample]
    return {
        "a": str(version_a), "b": str(version_b), "compares": COMPARES,
        "entries_a": len(ka), "entries_b": len(kb),
        "added": len(added), "overridden": len(overridden), "removed": len(removed),
        "inherited": len(inherited),
        "changed": int(changed.sum()), "unchanged": int((~changed).sum()),
        "cosine_distance": _stats(cos), "l2_distance": _stats(l2),
        "most_changed": [{"key": kb[ib][changed][i].tolist(), "cosine_distance": float(cos[i])} for i in worst],
        "added_sample": [kb[i].tolist() for i in added[:sample]],
        "removed_sample": [ka[i].tolist() for i in removed[:sample]],
    }


def diff_positions(snap_a, version_a, snap_b, version_b):
    """The position tables in force at each version (FORMAT.md section 4): their rows and the
    largest absolute difference (rows one lacks count as zeros, as in aggregation)."""
    pa, pb = snap_a.position(version_a), snap_b.position(version_b)
    rows = max(0 if pa is None else len(pa), 0 if pb is None else len(pb))
    full = [np.zeros((rows, snap_a.meta["d"]), np.float32) for _ in range(2)]
    for out, p in zip(full, (pa, pb)):
        if p is not None:
            out[:len(p)] = p
    return {"rows_a": None if pa is None else len(pa), "rows_b": None if pb is None else len(pb),
            "max_abs_difference": float(np.abs(full[0] - full[1]).max()) if rows else 0.0}


def _same_record(a, b):
    if a.meta != b.meta or set(a.tensors) != set(b.tensors):
        return False
    return all(a.tensors[k].dtype == b.tensors[k].dtype and np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def diff_pets(snap_a, snap_b):
    ta, tb = set(snap_a.pets), set(snap_b.pets)
    both = sorted(ta & tb)
    changed = [t for t in both if not _same_record(snap_a.read_pet(t), snap_b.read_pet(t))]
    out = {"added": sorted(tb - ta), "removed": sorted(ta - tb), "changed": changed,
           "unchanged": len(both) - len(changed)}
    for kind in ("students", "full"):  # tenants' students and full-depth records (FORMAT.md section 5), alike
        sa, sb = set(getattr(snap_a, kind)), set(getattr(snap_b, kind))
        if sa or sb:
            read_a, read_b = getattr(snap_a, f"read_{kind}"), getattr(snap_b, f"read_{kind}")
            same = sorted(sa & sb)
            moved = [t for t in same if not _same_record(read_a(t), read_b(t))]
            out[kind] = {"added": sorted(sb - sa), "removed": sorted(sa - sb), "changed": moved,
                         "unchanged": len(same) - len(moved)}
    return out


def diff(snap_a, version_a, snap_b, version_b, tolerance=0.0):
    out = {"plot": diff_versions(snap_a, version_a, snap_b, version_b, tolerance),
           "position": diff_positions(snap_a, version_a, snap_b, version_b)}
    if snap_a.path != snap_b.path:
        out["pets"] = diff_pets(snap_a, snap_b)
    return out
