"""verify (is every byte what the manifest says?) and gc (delete what no manifest names)."""

import os

import numpy as np

from formats import manifest as mf
from formats import pack
from formats.backoff import left
from formats.errors import CorruptError, FormatError, RollbackError
from formats.position import read_position
from formats.segment import Segment
from hkstore.store import MAPS, record_kind, open_store

REWRITE_BATCH_BYTES = 64 << 20  # live records gc copies per commit


def live_records(manifest):
    """(kind, tenant, location) of every record the manifest names: each tenant's PET, students
    and full-depth PET (FORMAT.md section 5), by kind, then tenant."""
    return [(kind, tenant, loc) for kind, name in MAPS.items() for tenant, loc in sorted(manifest.get(name, {}).items())]


def store_bytes(path, manifest) -> dict:
    """A store's byte totals, defined once (`hkstore info`, `verify` and `tree` agree on them):
    ``live`` is what the manifest references (segment files, position tables, live PET
    records; a healthy store's verify checks exactly these bytes); ``on_disk`` counts whole
    pack files instead of live records (dead records stay until gc rewrites the pack)."""
    segments = {s for v in manifest["versions"] for s in v["segments"]}
    positions = {v["position"]["file"] for v in manifest["versions"] if v.get("position")}
    out = {"segments": sum(os.path.getsize(os.path.join(path, "segments", s)) for s in segments),
           "positions": sum(os.path.getsize(os.path.join(path, "positions", p)) for p in positions),
           "pets": sum(loc["length"] for _, _, loc in live_records(manifest)),
           "packs": sum(os.path.getsize(os.path.join(path, "packs", p)) for p in manifest["packs"])}
    out["live"] = out["segments"] + out["positions"] + out["pets"]
    out["on_disk"] = out["segments"] + out["positions"] + out["packs"]
    return out


def verify(path):
    """Check CURRENT (and that no newer manifest exists: a rolled-back CURRENT), the manifest,
    every segment and position table, and every pack record, live or dead, and every byte of
    each pack, and that each segment and pack is the file the manifest records (its identity).
    Returns a report dict whose `problems` list is empty for a healthy store; `unrecorded` lists
    the files whose identity the manifest does not record yet (written before identities
    existed: the next commit records them)."""
    problems, checked = [], {"segments": 0, "entries": 0, "positions": 0, "pets": 0, "pack_records": 0,
                             "bytes": 0}
    try:
        manifest = mf.load(path)
    except RollbackError as e:
        problems.append(f"rollback: {e}")
        try:  # check what CURRENT names as well, so the report says whether that state is intact
            manifest = mf.load(path, allow_rollback=True)
        except (FormatError, OSError, ValueError) as e2:
            return {"ok": False, "problems": problems + [f"manifest: {e2}"], "checked": checked, "unrecorded": []}
    except (FormatError, OSError, ValueError) as e:
        return {"ok": False, "problems": [f"manifest: {e}"], "checked": checked, "unrecorded": []}
    meta = manifest["meta"]
    files = mf.identities(manifest)
    named = {s for v in manifest["versions"] for s in v["segments"]} | set(manifest["packs"])
    unrecorded = sorted(named - set(files))
    names = [v["name"] for v in manifest["versions"]]
    for v in manifest["versions"]:
        if v["parent"] is None and v is not manifest["versions"][0]:
            problems.append(f"version {v['name']}: a second root")
        if v["parent"] is not None and v["parent"] not in names[:names.index(v["name"])]:
            problems.append(f"version {v['name']}: parent {v['parent']!r} is not an earlier version")
        for name in v["segments"]:
            try:
                seg = Segment(os.path.join(path, "segments", name))
                want = files.get(name)
                if want is not None and seg.identity() != want:
                    raise mf.not_the_file(f"segment {name}", f"size {seg.size}, xxh64 {seg.digest:016x}", want)
                seg.verify()
                if (seg.n, seg.slots, seg.d) != (meta["n"], mf.value_slots(meta), meta["d"]):
                    raise CorruptError(f"segment {name}: shape does not match the store")
                for start in range(0, seg.count, 1 << 16):
                    seg.check_rows(np.arange(start, min(start + (1 << 16), seg.count)))
                checked["segments"] += 1
                checked["entries"] += seg.count
                checked["bytes"] += os.path.getsize(seg.path)
            except (FormatError, OSError) as e:
                problems.append(f"version {v['name']}: {e}")
        if v.get("position"):
            entry = v["position"]
            try:
                with open(os.path.join(path, "positions", entry["file"]), "rb") as f:
                    read_position(f, entry["rows"], meta["d"], entry["xxh64"])
                checked["positions"] += 1
                checked["bytes"] += os.path.getsize(os.path.join(path, "positions", entry["file"]))
            except (FormatError, OSError) as e:
                problems.append(f"version {v['name']}: {e}")
    for kind, tenant, loc in live_records(manifest):
        try:
            with open(os.path.join(path, "packs", loc["file"]), "rb") as f:
                data = os.pread(f.fileno(), loc["length"], loc["offset"])
            record = pack.decode_record(data, 0, len(data))
            if record.tenant != tenant or record.tombstone or record_kind(record.meta) != kind:
                what = {"pet": "live", "students": "students", "full": "full-depth PET"}[kind]
                raise CorruptError(f"record at {loc['file']}:{loc['offset']} is not tenant {tenant!r}'s {what} record")
            checked["pets"] += 1
            checked["bytes"] += loc["length"]
        except (FormatError, OSError) as e:
            problems.append(f"tenant {tenant}: {e}")
    problems += _walk_packs(path, manifest, checked)
    if not any(p.startswith("rollback") for p in problems):
        problems += _root_coverage(path, manifest)
    return {"ok": not problems, "problems": problems, "checked": checked, "unrecorded": unrecorded}


def _walk_packs(path, manifest, checked):
    """Every record of every pack, dead ones included, and nothing after the last record. The
    newest pack is walked up to the manifest's `pack_end`: bytes past it are an uncommitted
    tail a killed writer left, which the next append cuts off."""
    problems = []
    for i, name in enumerate(manifest["packs"]):
        full = os.path.join(path, "packs", name)
        limit = manifest.get("pack_end") if i == len(manifest["packs"]) - 1 else None
        try:
            size = os.path.getsize(full)
            want = mf.identities(manifest).get(name)
            if want is not None:
                try:
                    value = pack.walk_chain(full, 0, want["size"])
                    have = None if f"{value:016x}" == want["xxh64"] else \
                        f"records up to byte {want['size']} with xxh64 {value:016x}"
                except CorruptError as e:
                    have = f"not whole records up to byte {want['size']}: {e}"
                if have is not None:
                    problems.append(str(mf.not_the_file(f"pack {name}", have, want)))
            if limit is not None and size < limit:
                problems.append(f"pack {name}: {size} bytes, the manifest says {limit} are committed (truncated)")
            for offset, length, record in pack.scan(full, limit):
                if isinstance(record, FormatError):
                    problems.append(f"pack {name}: {record}")
                else:
                    checked["pack_records"] += 1
        except OSError as e:
            problems.append(f"pack {name}: {e}")
    return problems


def _root_coverage(path, manifest):
    """The root must serve a uni-gram for every id, or some lookup could miss."""
    meta, root = manifest["meta"], manifest["versions"][0]
    if not root["segments"] or not meta.get("vocab_size"):
        return []
    try:
        store = open_store(path)
    except (FormatError, OSError) as e:
        return [f"store: {e}"]
    n, vocab, pad = meta["n"], meta["vocab_size"], meta["pad_id"]
    unigrams = np.full((vocab, n), pad, dtype=np.uint32)
    unigrams[:, left(n, meta["window"])] = np.arange(vocab)
    try:
        result = store.lookup(0, unigrams)
    except FormatError as e:
        return [f"root: {e}"]
    missing = int((result.order == 0).sum())
    return [f"root: {missing} of {vocab} vocabulary ids have no uni-gram entry"] if missing else []


def garbage(path):
    """Files in the store directory that the live manifest does not name."""
    manifest = mf.load(path)
    live_segments = {s for v in manifest["versions"] for s in v["segments"]}
    live_packs = set(manifest["packs"])
    live_positions = {v["position"]["file"] for v in manifest["versions"] if v.get("position")}
    current = mf.current_name(path)
    generation = mf.generation_of(current)
    out = []
    for name in os.listdir(path):
        other = mf.generation_of(name)
        if other is not None and other > generation:
            continue  # never: only a rolled-back CURRENT leaves newer manifests, and they hold the newer commits
        if (name.startswith("MANIFEST-") and name != current) or name.endswith(".tmp"):
            out.append(name)
    for sub, live in (("segments", live_segments), ("packs", live_packs), ("positions", live_positions)):
        if not os.path.isdir(os.path.join(path, sub)):
            continue
        for name in os.listdir(os.path.join(path, sub)):
            if name not in live:
                out.append(os.path.join(sub, name))
    return sorted(out)


def gc(store, dry_run=False):
    """Delete unreferenced files, then rewrite pack files that are mostly dead records.

    Readers that still hold an old snapshot keep working: their segments stay memory-mapped
    and their packs and position tables open (the kernel frees a deleted file only when its
    last map or descriptor goes away). Manifests newer than the live one are never deleted.
    """
    removed, freed = [], 0
    rewritten = [] if dry_run else _rewrite_packs(store)
    for name in garbage(store.path):
        full = os.path.join(store.path, name)
        freed += os.path.getsize(full)
        removed.append(name)
        if not dry_run:
            os.remove(full)
    return {"removed": removed, "bytes_freed": freed, "packs_rewritten": rewritten}


def _rewrite_packs(store, live_fraction=0.5):
    """Copy the live records of packs that are less than half live into a fresh pack."""
    manifest = store.snapshot().manifest
    sizes = {p: os.path.getsize(os.path.join(store.path, "packs", p)) for p in manifest["packs"][:-1]}
    live = {p: 0 for p in sizes}
    records = live_records(manifest)
    for _, _, loc in records:
        if loc["file"] in live:
            live[loc["file"]] += loc["length"]
    victims = [p for p in sizes if live[p] < live_fraction * sizes[p]]
    if not victims:
        return []
    read = {"pet": store.get_pet, "students": store.get_students, "full": store.get_full}
    batch, held = [], 0
    # In live_records' order, PETs first: a students or full-depth record needs its tenant's PET.
    # Commits of up to REWRITE_BATCH_BYTES each: few commits, and memory stays bounded.
    for kind, tenant, loc in records:
        if loc["file"] in victims:
            batch.append(read[kind](tenant))
            held += loc["length"]
            if held >= REWRITE_BATCH_BYTES:
                store.put_pets(batch)
                batch, held = [], 0
    if batch:
        store.put_pets(batch)
    store._commit(lambda m: m.__setitem__("packs", [p for p in m["packs"] if p not in victims]))
    return victims
