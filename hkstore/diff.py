"""diff: what changed between two versions (of one store or of two stores)."""

import numpy as np

from hkstore.compact import own_entries, read_entries, void_keys


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
    """Keys `version_b` holds and `version_a` does not (added), the reverse (removed), and keys
    both hold with vectors further apart than `tolerance` max-abs (changed), with cosine and L2
    distance statistics. Only each version's own entries count, not what it inherits."""
    ka, sa, ea, ta = own_entries(snap_a, version_a)
    kb, sb, eb, tb = own_entries(snap_b, version_b)
    ka, sa, ea = ka[~ta], sa[~ta], ea[~ta]
    kb, sb, eb = kb[~tb], sb[~tb], eb[~tb]
    va, vb = void_keys(ka), void_keys(kb)
    _, ia, ib = np.intersect1d(va, vb, return_indices=True)
    added = np.setdiff1d(np.arange(len(kb)), ib)
    removed = np.setdiff1d(np.arange(len(ka)), ia)
    values_a = read_entries(snap_a.version_segments(version_a), ka[ia], sa[ia], ea[ia])
    values_b = read_entries(snap_b.version_segments(version_b), kb[ib], sb[ib], eb[ib])
    if len(ia):
        changed = np.abs(values_a - values_b).max(axis=(1, 2)) > tolerance
    else:
        changed = np.zeros(0, dtype=bool)
    cos, l2 = _distances(values_a[changed], values_b[changed])
    worst = np.argsort(-cos)[:sample]
    return {
        "a": str(version_a), "b": str(version_b),
        "entries_a": int(len(ka)), "entries_b": int(len(kb)),
        "added": int(len(added)), "removed": int(len(removed)),
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
    return {"added": sorted(tb - ta), "removed": sorted(ta - tb), "changed": changed,
            "unchanged": len(both) - len(changed)}


def diff(snap_a, version_a, snap_b, version_b, tolerance=0.0):
    out = {"plot": diff_versions(snap_a, version_a, snap_b, version_b, tolerance),
           "position": diff_positions(snap_a, version_a, snap_b, version_b)}
    if snap_a.path != snap_b.path:
        out["pets"] = diff_pets(snap_a, snap_b)
    return out
