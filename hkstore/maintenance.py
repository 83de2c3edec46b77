"""verify (is every byte what the manifest says?) and gc (delete what no manifest names)."""

import contextlib
import fcntl
import json
import os
import re
import time

import numpy as np

from formats import manifest as mf
from formats import pack, xxh64
from formats.backoff import left
from formats.errors import CorruptError, FormatError, RollbackError
from formats.position import read_position
from formats.segment import Segment
from hkstore.store import MAPS, record_kind, open_store

REWRITE_BATCH_BYTES = 64 << 20  # live records gc copies per commit
MODELS = "models"  # STORE/models/: the weights construction saves beside the store (runtime.model.stored)


def live_records(manifest):
    """(kind, tenant, location) of every record the manifest names: each tenant's PET, students
    and full-depth PET (FORMAT.md section 5), by kind, then tenant."""
    return [(kind, tenant, loc) for kind, name in MAPS.items() for tenant, loc in sorted(manifest.get(name, {}).items())]


def model_files(manifest) -> dict:
    """models/ file -> the XXH64 (hex) its version's info records for it: the weights
    construction saved (info entries {"file": "models/...", "xxh64": ...}: lower_weights,
    context_weights)."""
    out = {}
    for v in manifest["versions"]:
        for entry in (v.get("info") or {}).values():
            if isinstance(entry, dict) and isinstance(entry.get("file"), str) and \
                    entry["file"].startswith(MODELS + "/") and isinstance(entry.get("xxh64"), str):
                out[entry["file"]] = entry["xxh64"]
    return out


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # missing: verify reports it; a total counts what is there


def store_bytes(path, manifest) -> dict:
    """A store's byte totals, defined once (`hkstore info`, `verify`, `tree` and the report
    agree on them): ``live`` is what the manifest references (segment files, position tables,
    live PET records, the model weights versions name; a healthy store's verify checks exactly
    these bytes); ``on_disk`` counts whole pack files instead of live records (dead records
    stay until gc rewrites the pack) and every file under models/."""
    segments = {s for v in manifest["versions"] for s in v["segments"]}
    positions = {v["position"]["file"] for v in manifest["versions"] if v.get("position")}
    models_dir = os.path.join(path, MODELS)
    out = {"segments": sum(_size(os.path.join(path, "segments", s)) for s in segments),
           "positions": sum(_size(os.path.join(path, "positions", p)) for p in positions),
           "pets": sum(loc["length"] for _, _, loc in live_records(manifest)),
           "packs": sum(_size(os.path.join(path, "packs", p)) for p in manifest["packs"]),
           "models": sum(_size(os.path.join(path, f)) for f in model_files(manifest)),
           "models_on_disk": sum(_size(os.path.join(models_dir, f)) for f in
                                 (os.listdir(models_dir) if os.path.isdir(models_dir) else []))}
    out["live"] = out["segments"] + out["positions"] + out["pets"] + out["models"]
    out["on_disk"] = out["segments"] + out["positions"] + out["packs"] + out["models_on_disk"]
    return out


SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_safetensors(path):
    """CorruptError unless `path` is a whole safetensors file: an 8-byte header length, a JSON
    header naming each tensor's dtype, shape and byte range, and the ranges tiling the data
    exactly to the end of the file."""
    name = os.path.relpath(path, os.path.dirname(os.path.dirname(path)))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptError(f"{name}: truncated ({size} bytes), not a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CorruptError(f"{name}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise CorruptError(f"{name}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CorruptError(f"{name}: the safetensors header is not a JSON object")
    ranges = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            width = SAFETENSORS_DTYPES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
        except (KeyError, TypeError, ValueError):
            raise CorruptError(f"{name}: tensor {tensor[:64]!r} has no valid dtype, shape and data_offsets") from None
        if end - begin != count * width or begin < 0:
            raise CorruptError(f"{name}: tensor {tensor[:64]!r} spans bytes {begin}..{end}, its shape needs {count * width}")
        ranges.append((begin, end))
    at = 0
    for begin, end in sorted(ranges):
        if begin != at:
            raise CorruptError(f"{name}: tensor data has a gap or overlap at byte {at} of the data")
        at = end
    if 8 + n + at != size:
        raise CorruptError(f"{name}: {size} bytes, the header accounts for {8 + n + at}")


def _verify_models(path, manifest, checked):
    """Every model file a version names against its recorded XXH64, and every safetensors file
    under models/ for its structure."""
    problems = []
    named = model_files(manifest)
    directory = os.path.join(path, MODELS)
    present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    for rel, want in sorted(named.items()):
        full = os.path.join(path, rel)
        try:
            with open(full, "rb") as f:
                digest = xxh64.checksum(f.read())
            if f"{digest:016x}" != want:
                raise CorruptError(f"{rel}: checksum mismatch (the weights file is damaged: construction "
                                   "recorded another XXH64)")
            check_safetensors(full)
            checked["models"] += 1
            checked["bytes"] += os.path.getsize(full)
        except FileNotFoundError:
            problems.append(f"{rel}: missing (a version's info names it)")
        except (FormatError, OSError) as e:
            problems.append(str(e))
    for name in present:
        rel = f"{MODELS}/{name}"
        if rel in named or not name.endswith(".safetensors"):
            continue
        try:
            check_safetensors(os.path.join(directory, name))
        except (FormatError, OSError) as e:
            problems.append(str(e))
    return problems


def _verify_tokens(path):
    """tokens.json, if there is one: a token file whose every entry can verify a token."""
    from hkstore.tokens import parse_tokens

    full = os.path.join(path, "tokens.json")
    try:
        with open(full, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []  # no tenant has a token yet
    except OSError as e:
        return [f"tokens.json: unreadable ({e.strerror or e})"]
    _, problem = parse_tokens(data)
    return [] if problem is None else [f"tokens.json: {problem} (tenant tokens in it are refused; repair it, or "
                                       "move it aside and issue the tokens again: hkstore token issue)"]


def verify(path):
    """Check CURRENT (and that no newer manifest exists: a rolled-back CURRENT), the manifest,
    every segment and position table, and every pack record, live or dead, and every byte of
    each pack, and that each segment and pack is the file the manifest records (its identity).
    Returns a report dict whose `problems` list is empty for a healthy store; `unrecorded` lists
    the files whose identity the manifest does not record yet (written before identities
    existed: the next commit records them)."""
    problems, checked = [], {"segments": 0, "entries": 0, "positions": 0, "pets": 0, "pack_records": 0,
                             "models": 0, "bytes": 0}
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
    problems += _verify_models(path, manifest, checked)
    problems += _verify_tokens(path)
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


TEMP_NAME = re.compile(r"\.tmp(?:\.(\d+)\.(\d+))?$")  # "x.tmp" and atomic_write's "x.tmp.<pid>.<thread>"
STALE_TEMP_SECONDS = 600  # an atomic write of a small file takes milliseconds: older is a killed writer's


def _stale_temporary(full, name):
    """Whether `name` is a temporary file of an atomic write whose writer is gone: its process
    no longer runs (the pid in its name), or it is older than any write takes."""
    match = TEMP_NAME.search(name)
    if match is None:
        return False
    try:
        if time.time() - os.path.getmtime(full) > STALE_TEMP_SECONDS:
            return True
    except OSError:
        return False
    if match.group(1) is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


TOKEN_LOCK = "tokens.lock"  # held by every writer of tokens.json across its read-modify-write (hkstore.tokens)


@contextlib.contextmanager
def _token_writers_idle(path):
    """Yields whether no writer of tokens.json is at work (None: no lock file, so no writer that
    takes it has run here), holding its lock meanwhile so none starts: a temporary file of that
    write is stale exactly when its lock is free."""
    try:
        fd = os.open(os.path.join(path, TOKEN_LOCK), os.O_RDWR)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _is_token_temporary(name):
    return name.startswith("tokens.json.tmp")


def garbage(path):
    """Files in the store directory that the live manifest does not name, and temporary files
    that killed writers left (the manifest's own, and stale ones of atomic writes: tokens.json's,
    a model's weights)."""
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
        elif TEMP_NAME.search(name):
            idle = None
            if _is_token_temporary(name):
                with _token_writers_idle(path) as idle:
                    pass
            if idle or (idle is None and _stale_temporary(os.path.join(path, name), name)):
                out.append(name)
    for sub, live in (("segments", live_segments), ("packs", live_packs), ("positions", live_positions)):
        if not os.path.isdir(os.path.join(path, sub)):
            continue
        for name in os.listdir(os.path.join(path, sub)):
            if name not in live:
                out.append(os.path.join(sub, name))
    models = os.path.join(path, MODELS)
    if os.path.isdir(models):
        out += [os.path.join(MODELS, n) for n in os.listdir(models) if _stale_temporary(os.path.join(models, n), n)]
    return sorted(out)


def pack_plan(path, manifest, live_fraction=0.5):
    """Which packs gc rewrites and how many bytes that frees. A pack is rewritten when it holds
    a dead record of something deleted (a record a later tombstone removes, or of a tenant and
    kind the manifest no longer names: deleted means gone from disk), or when less than
    `live_fraction` of it is live. The newest pack is no exception; gc moves its live records
    to a fresh pack. Reads each record's header and directory, never a payload."""
    packs = manifest["packs"]
    files = mf.identities(manifest)
    records = live_records(manifest)
    live_at = {(loc["file"], loc["offset"]) for _, _, loc in records}
    named = {(tenant, kind) for kind, tenant, _ in records}
    live_bytes = {}
    for _, _, loc in records:
        live_bytes[loc["file"]] = live_bytes.get(loc["file"], 0) + loc["length"]
    stats = {}
    pending = {}  # (tenant, kind) -> [(pack, length)] of dead records no tombstone has removed yet
    for i, name in enumerate(packs):
        full = os.path.join(path, "packs", name)
        try:
            size = os.path.getsize(full)
        except OSError:
            continue  # missing: nothing to rewrite (verify reports it)
        stats[name] = {"size": size, "live": live_bytes.get(name, 0), "erased": 0}
        end = manifest.get("pack_end", size) if i == len(packs) - 1 else files.get(name, {}).get("size", size)
        try:
            for offset, length, tenant, meta, tombstone in pack.directories(full, min(end, size)):
                kind = record_kind(meta)
                if tombstone:
                    for k in (MAPS if kind == "pet" else [kind]):
                        for where, n in pending.pop((tenant, k), []):
                            stats[where]["erased"] += n
                elif (name, offset) not in live_at:
                    pending.setdefault((tenant, kind), []).append((name, length))
        except FormatError:
            pass  # damage: what was read counts; the rest of the pack is left to verify
    for key, dead in pending.items():
        if key not in named:  # removed by a tombstone an earlier gc dropped
            for where, n in dead:
                stats[where]["erased"] += n
    rewrite = [p for p, st in stats.items() if st["size"] and (st["erased"] or st["live"] < live_fraction * st["size"])]
    return {"rewrite": rewrite, "bytes_freed": sum(stats[p]["size"] - stats[p]["live"] for p in rewrite),
            "packs": stats}


def reclaimable(path):
    """What gc would free now, in bytes: the files no manifest names and the dead part of the
    packs it would rewrite (`hkstore info` shows it; a dry run of gc says the same)."""
    plan = pack_plan(path, mf.load(path))
    return plan["bytes_freed"] + sum(os.path.getsize(os.path.join(path, name)) for name in garbage(path))


def _total_bytes(path):
    return sum(_size(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def gc(store, dry_run=False):
    """Rewrite pack files that hold deleted or mostly dead records (pack_plan), then delete
    unreferenced files. `bytes_freed` is what the store's files shrank by (a dry run: what a
    run would free now, reclaimable(); a run that rewrites packs also replaces the manifest,
    whose size may differ by a few bytes a record moved).

    Readers that still hold an old snapshot keep working: their segments stay memory-mapped
    and their packs and position tables open (the kernel frees a deleted file only when its
    last map or descriptor goes away). Manifests newer than the live one are never deleted.
    """
    plan = pack_plan(store.path, store.snapshot().manifest)
    removed, freed = [], 0
    before = None if dry_run else _total_bytes(store.path)
    if dry_run:
        rewritten = plan["rewrite"]
        freed = plan["bytes_freed"]
    else:
        rewritten = _rewrite_packs(store, plan["rewrite"])
    for name in garbage(store.path):
        full = os.path.join(store.path, name)
        with _token_writers_idle(store.path) if _is_token_temporary(name) else contextlib.nullcontext(True) as idle:
            if idle is False or not os.path.exists(full):
                continue  # a token writer started meanwhile (its temporary may be this one)
            freed += os.path.getsize(full)
            removed.append(name)
            if not dry_run:
                os.remove(full)
    if not dry_run:
        freed = before - _total_bytes(store.path)
    return {"removed": removed, "bytes_freed": freed, "packs_rewritten": rewritten}


def _rewrite_packs(store, victims):
    """Copy the live records of `victims` into the active pack, or a fresh one where the active
    pack is a victim itself, then drop the victims from the manifest (gc deletes their files).
    Returns the victims."""
    if not victims:
        return []
    manifest = store.snapshot().manifest
    fresh = bool(manifest["packs"]) and manifest["packs"][-1] in victims
    records = live_records(manifest)
    read = {"pet": store.get_pet, "students": store.get_students, "full": store.get_full}
    batch, held = [], 0
    # In live_records' order, PETs first: a students or full-depth record needs its tenant's PET.
    # Commits of up to REWRITE_BATCH_BYTES each: few commits, and memory stays bounded.
    for kind, tenant, loc in records:
        if loc["file"] in victims:
            batch.append(read[kind](tenant))
            held += loc["length"]
            if held >= REWRITE_BATCH_BYTES:
                store.put_pets(batch, fresh_pack=fresh)
                batch, held, fresh = [], 0, False
    if batch or fresh:
        store.put_pets(batch, fresh_pack=fresh)
    store._commit(lambda m: m.__setitem__("packs", [p for p in m["packs"] if p not in victims]))
    return victims
