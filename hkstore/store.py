"""The store: a directory of immutable segments and pack files tied together by a manifest.

Readers work on a Snapshot (one manifest and the files it names); a writer holds the store's
flock and publishes each change as a new manifest generation. See formats/FORMAT.md.

The manifest records each segment's and pack's identity (FORMAT.md section 2, File identity):
a file in another file's slot is refused where it would be read, never served.
"""

import copy
import fcntl
import mmap
import os
import re
import threading
import time

import numpy as np

from formats import manifest as mf
from formats import pack
from formats.errors import CorruptError, FormatError
from formats.position import read_position, write_position
from formats.durable import fsync_dir
from formats.segment import DTYPES, Segment, write_segment
from hkstore import lookup as lk
from hkstore.errors import StoreError, StoreLocked, UnknownTenant, UnknownVersion

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PACK_ROLL_BYTES = 256 << 20  # start a new pack file past this size, so gc can rewrite in pieces
# Records this big are read as mappings (PackFile.read). Each is a mapping while a host cache
# holds its tensors: at this size a 4 GiB cache holds at most 16k, under Linux's default 65,530.
MAP_MIN = 256 << 10


# A record's kind says which manifest map names it (FORMAT.md section 5): a tenant's PET, its
# students record, or its full-depth PET.
MAPS = {"pet": "pets", "students": "students", "full": "full"}
KIND_NAMES = {"pet": "PET", "students": "students", "full": "full-depth PET"}
FOUND = {"pet": "", "students": "students ", "full": "full-depth PET "}


def record_kind(meta):
    """"students" (meta pet_type "students"), "full" (meta level "full") or "pet"; a tombstone's
    kind says what it removes."""
    if meta.get("pet_type") == "students":
        return "students"
    return "full" if meta.get("level") == "full" else "pet"


def check_name(kind, name):
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise StoreError(f"invalid {kind} name {name!r}: use 1-64 letters, digits, '.', '_' or '-', not starting with a symbol")
    return name


class Snapshot:
    """An immutable view of the store as one manifest describes it."""

    def __init__(self, path, manifest, segments, positions, packs=None):
        self.path = path
        self.manifest = manifest
        self.meta = manifest["meta"]
        self.versions = manifest["versions"]
        self.version_names = [v["name"] for v in self.versions]
        self._index = {name: i for i, name in enumerate(self.version_names)}
        self._segments = segments  # file name -> Segment, shared across snapshots
        self._positions = positions  # file name -> PositionFile, shared likewise
        self._packs = packs  # file name -> PackFile (held open: gc cannot take a pack from us)

    def version_index(self, version):
        if isinstance(version, (int, np.integer)) and 0 <= version < len(self.versions):
            return int(version)
        if version not in self._index:
            raise UnknownVersion(f"unknown version {version!r} (known: {', '.join(self.version_names)})")
        return self._index[version]

    def ancestry(self, version):
        """Version indices from `version` up to the root."""
        out, v = [], self.version_index(version)
        while v is not None:
            out.append(v)
            parent = self.versions[v]["parent"]
            v = None if parent is None else self._index[parent]
        return out

    def position(self, version):
        """The position table (rows, d) float32 that `version`'s aggregation adds (FORMAT.md
        section 4): the nearest one on its ancestry, None if no version there has one."""
        for v in self.ancestry(version):
            entry = self.versions[v].get("position")
            if entry:
                return self._positions[entry["file"]].table()
        return None

    def version_segments(self, version):
        return [self._segments[name] for name in self.versions[self.version_index(version)]["segments"]]

    def lookup(self, version, windows):
        return lk.lookup(self, version, windows)

    @property
    def pets(self):
        return self.manifest["pets"]

    @property
    def students(self):
        """tenant -> location of its students record (FORMAT.md section 5); older stores: none."""
        return self.manifest.get("students", {})

    @property
    def full(self):
        """tenant -> location of its full-depth PET record (FORMAT.md section 5); older stores: none."""
        return self.manifest.get("full", {})

    def read_students(self, tenant):
        if tenant not in self.students:
            raise UnknownTenant(f"tenant {tenant!r} has no students")
        return self._read_record(tenant, self.students[tenant], "students")

    def read_full(self, tenant):
        if tenant not in self.full:
            raise UnknownTenant(f"tenant {tenant!r} has no full-depth PET")
        return self._read_record(tenant, self.full[tenant], "full")

    def read_pet(self, tenant):
        if tenant not in self.manifest["pets"]:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return self._read_record(tenant, self.manifest["pets"][tenant], "pet")

    def _read_record(self, tenant, loc, kind):
        name = loc["file"]
        packfile = (self._packs or {}).get(name)
        if packfile is None:
            try:
                packfile = PackFile(os.path.join(self.path, "packs", name))
            except FileNotFoundError:
                raise CorruptError(f"pack {name} of tenant {tenant!r} is missing") from None
        want = mf.identities(self.manifest).get(name)
        if want is not None:
            packfile.check(want)
        data = packfile.read(loc["offset"], loc["length"])
        where = f"pack {name}: the record at byte {loc['offset']}"
        if len(data) != loc["length"]:
            raise CorruptError(f"{where} (tenant {tenant!r}) is truncated")
        try:  # the buffer is this read's own: its tensors are views into it, not copies
            record = pack.decode_record(data, 0, loc["length"], copy=False)
        except FormatError as e:  # a file the manifest names as a pack: bytes that are no record are damage
            raise CorruptError(f"{where} (tenant {tenant!r}): {e}") from None
        # Identities cover what the manifest recorded them for; the record's own tenant and kind
        # are checked on every read, so another tenant's PET is never served as this one's.
        if record.tenant != tenant or record.tombstone or record_kind(record.meta) != kind:
            what = "a tombstone" if record.tombstone else \
                f"tenant {record.tenant!r}'s {FOUND[record_kind(record.meta)]}record"
            raise CorruptError(f"{where} is {what}, not tenant {tenant!r}'s {KIND_NAMES[kind]} record: a pack file in "
                               "another's place? run hkstore verify")
        return record


class PackFile:
    """A pack file named by a manifest, opened when the manifest is installed and held open
    while any snapshot names it: gc may unlink it, the records stay readable (like segments)."""

    def __init__(self, path):
        self.path = path
        self.name = os.path.basename(path)
        self._file = open(path, "rb")
        # record boundary -> identity of the records before it, for each size checked so far: a
        # manifest that covers more of the (growing) newest pack costs a walk of the new records only
        self._walked = {0: 0}
        self._lock = threading.Lock()

    def check(self, want):
        """CorruptError unless the file's first want["size"] bytes are the records whose identity
        the manifest records (FORMAT.md section 2, File identity). Reads 128 bytes a record, once."""
        size = want["size"]
        with self._lock:
            have = self._walked.get(size)
            if have is None:
                start = max(b for b in self._walked if b < size)
                try:
                    have = pack.walk_chain(self._file, start, size, self._walked[start])
                except CorruptError as e:
                    have = f"not whole records up to byte {size}: {e}"
                    raise mf.not_the_file(f"pack {self.name}", have, want) from None
                self._walked[size] = have
        if f"{have:016x}" != want["xxh64"]:
            raise mf.not_the_file(f"pack {self.name}", f"records up to byte {size} with xxh64 {have:016x}", want)

    def read(self, offset, length):
        """The length bytes at offset (fewer past the end of the file) as a writable uint8 array
        private to the caller, so a record's tensors can be views into it instead of copies. A
        big record is a private (copy-on-write) mapping of the file: its pages are the page
        cache's own, mapped 64 KiB a fault, where a new buffer costs a fault and a zeroed page
        every 4 KiB before the read copies into it (most of a tenant's first use, measured)."""
        fd = self._file.fileno()
        if length >= MAP_MIN and offset % mmap.ALLOCATIONGRANULARITY == 0 and offset + length <= os.fstat(fd).st_size:
            return np.frombuffer(mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                                           offset=offset), np.uint8)
        buf = np.empty(length, dtype=np.uint8)
        return buf[:os.preadv(fd, [buf], offset)]

    def __del__(self):
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()


class _NotTheFile:
    """Stands in for a segment whose identity is not the one the manifest records: any use
    raises CorruptError, so none of its bytes is served, while lookups that never reach it
    (other versions) go on."""

    def __init__(self, path, error):
        self.path, self.name, self._error = path, os.path.basename(path), str(error)

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise CorruptError(self._error)


class _Missing(Exception):
    """A file the manifest names is not there (gc racing with a refresh, or a damaged store)."""


class PositionFile:
    """A position table named by a manifest. The file is opened when the manifest is installed
    (so gc cannot take it from an older snapshot) and read and checked on first use. A table
    that fails its check (or was missing at install) is read again on the next use: the file
    may have been put right meanwhile, and each error then says what is wrong now."""

    def __init__(self, path, entry, d, missing=False):
        self.path, self.entry, self.d = path, entry, d
        self.name = os.path.basename(path)
        self._file = None if missing else open(path, "rb")
        self._table = None
        self._lock = threading.Lock()

    def table(self):
        with self._lock:
            if self._table is None:
                try:
                    if self._file is None:
                        self._file = open(self.path, "rb")
                    self._table = read_position(self._file, self.entry["rows"], self.d, self.entry["xxh64"])
                except FileNotFoundError:
                    raise CorruptError(f"position table {self.name} is missing") from None
                except OSError as e:
                    raise CorruptError(f"position table {self.name}: unreadable ({e.strerror or e})") from None
                finally:
                    if self._file is not None:  # read whole or failed: either way never read from again
                        self._file.close()
                        self._file = None
            return self._table


class Store:
    """Open with hkstore.open() or hkstore.create()."""

    def __init__(self, path, writable=False, allow_rollback=False):
        self.path = os.fspath(path)
        self.writable = writable
        if writable and allow_rollback:
            raise StoreError("allow_rollback is for read-only opens: a writer must never commit over newer manifests")
        self.allow_rollback = allow_rollback
        self._lock_fd = None
        self._segments = {}
        self._positions = {}
        self._packs = {}
        self._mutex = threading.RLock()
        if writable:
            self._take_lock()
        try:
            if writable:
                self._drop_orphan()
            self.refresh()
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------

    def _take_lock(self):
        fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(f"{self.path}: another writer holds the store lock; try again when it is done") from None
        self._lock_fd = fd

    def _drop_orphan(self):
        """Remove the uncommitted manifest a killed writer left (FORMAT.md section 1), so that
        only a rolled-back CURRENT can leave a manifest newer than the live one."""
        current = mf.current_name(self.path)
        name = mf.orphan(self.path, current)
        if name is not None:
            os.remove(os.path.join(self.path, name))
            os.remove(os.path.join(self.path, mf.CURRENT + ".tmp"))
            fsync_dir(self.path)

    def close(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def refresh(self):
        """Move to the newest committed manifest. Retries if gc removes a file under us; a file
        that stays missing while CURRENT does not move is damage: the store opens all the same,
        and only what reads that file raises CorruptError (the lookups of the versions whose
        ancestry names the segment or position table, the tenants whose record is in the pack)."""
        for attempt in range(20):
            manifest = mf.load(self.path, allow_rollback=self.allow_rollback)
            try:
                self._install(manifest)
                return self._snapshot
            except _Missing:
                pass
            if mf.current_name(self.path) == mf.manifest_name(manifest["generation"]):
                break  # not a race with a commit: the live manifest names a file that is gone
        self._install(manifest, tolerate=True)
        return self._snapshot

    def scrub(self, deep=False):
        """Check that the segments being served are still the files this process checked:
        one whose file changed since it was opened (inode, size or mtime: rewritten in place,
        or replaced) is opened afresh, so its header is checked against the identity the
        manifest records again and its rows on their next return. deep=True reopens every
        segment, so every row is checked again on its next return (warm() checks them all
        now). Cheap without deep: a stat a segment. Returns the names of the segments reopened."""
        with self._mutex:
            old = dict(self._segments)
            if deep:
                self._segments = {}
            self._install(self._manifest, tolerate=True)
            return sorted(name for name, seg in old.items() if self._segments.get(name) is not seg)

    def _install(self, manifest, tolerate=False):
        try:
            self._install_files(manifest, tolerate)
        except FileNotFoundError as e:
            where = os.path.relpath(e.filename, self.path) if e.filename else "a file"
            raise _Missing(f"{where} is missing") from None

    def _open_segment(self, name, meta):
        """The named segment, reusing this process's open copy while its file is unchanged."""
        seg = self._segments.get(name)
        if seg is None or seg.changed():
            seg = Segment(os.path.join(self.path, "segments", name))
        if (seg.n, seg.slots, seg.d) != (meta["n"], mf.value_slots(meta), meta["d"]):
            raise CorruptError(f"segment {name}: shape (n={seg.n}, slots={seg.slots}, d={seg.d}) does not "
                               "match the store")
        return seg

    def _install_files(self, manifest, tolerate=False):
        """Open what `manifest` names. A segment that cannot be used (damaged header, wrong
        shape, another file's identity; with `tolerate`, missing) and a position table or pack
        missing with `tolerate` are stood in for: only what reads them fails."""
        with self._mutex:
            names = {s for v in manifest["versions"] for s in v["segments"]}
            files = mf.identities(manifest)
            segments, opened = {}, {}
            for name in names:
                path = os.path.join(self.path, "segments", name)
                try:
                    seg = self._open_segment(name, manifest["meta"])
                except FileNotFoundError:
                    if not tolerate:
                        raise
                    segments[name] = _NotTheFile(path, CorruptError(
                        f"segment {name} is missing, which the live manifest names: run hkstore verify"))
                    continue
                except OSError as e:
                    segments[name] = _NotTheFile(path, CorruptError(f"segment {name}: unreadable ({e.strerror or e})"))
                    continue
                except FormatError as e:
                    segments[name] = _NotTheFile(path, CorruptError(str(e)))
                    continue
                want = files.get(name)
                if want is not None and seg.identity() != want:  # the header Segment() read and checked
                    have = f"size {seg.size}, xxh64 {seg.digest:016x}"
                    segments[name] = _NotTheFile(seg.path, mf.not_the_file(f"segment {name}", have, want))
                    continue
                segments[name] = opened[name] = seg
            positions = {}
            for v in manifest["versions"]:
                entry = v.get("position")
                if entry and entry["file"] not in positions:
                    path = os.path.join(self.path, "positions", entry["file"])
                    have = self._positions.get(entry["file"])
                    if have is None:
                        try:
                            have = PositionFile(path, entry, manifest["meta"]["d"])
                        except FileNotFoundError:
                            if not tolerate:
                                raise
                            have = PositionFile(path, entry, manifest["meta"]["d"], missing=True)
                    positions[entry["file"]] = have
            packs = {}
            live = [loc for kind in MAPS.values() for loc in manifest.get(kind, {}).values()]
            for name in set(manifest["packs"]) | {loc["file"] for loc in live}:
                try:
                    packs[name] = self._packs.get(name) or PackFile(os.path.join(self.path, "packs", name))
                except FileNotFoundError:
                    if not tolerate:
                        raise  # left out: a read of its records reports the pack missing
            self._segments = opened  # a refused file is opened afresh next time (it may have been put right)
            self._positions = positions
            self._packs = packs
            self._manifest = manifest
            self._snapshot = Snapshot(self.path, manifest, segments, positions, packs)

    def snapshot(self):
        """The current consistent view; it stays valid while writers commit and compact."""
        return self._snapshot

    @property
    def meta(self):
        return self._snapshot.meta

    @property
    def versions(self):
        return self._snapshot.versions

    def lookup(self, version, windows):
        return self._snapshot.lookup(version, windows)

    def warm(self, background=False):
        """Map and check every value row of the current snapshot's segments now (Segment.warm),
        so lookups skip the first-return check and page faults, and put each big segment in huge
        pages (its file mapping, or where the kernel cannot, copies of its index and keys: about
        20 bytes an entry more memory); returns the rows that failed.
        A segment in another file's slot is skipped: lookups that reach it raise anyway.
        background=True runs it in a daemon thread (the C path releases the GIL, so lookups go
        on meanwhile, checking the rows they reach first themselves) and returns the thread."""
        if background:
            t = threading.Thread(target=self.warm, name="hkstore-warm", daemon=True)
            t.start()
            return t
        seen, failed = set(), 0
        snap = self._snapshot
        for v in range(len(snap.version_names)):
            for seg in snap.version_segments(v):
                if id(seg) not in seen and not isinstance(seg, _NotTheFile):
                    seen.add(id(seg))
                    failed += seg.warm()
        return failed

    # -- writing ---------------------------------------------------------------------------

    def _require_writable(self):
        if not self.writable:
            raise StoreError("this store was opened read-only; open it with writable=True")

    def _commit(self, change):
        """Apply `change` to a copy of the manifest and publish it as the next generation."""
        self._require_writable()
        with self._mutex:
            new = copy.deepcopy(self._manifest)
            result = change(new)
            self._record_identities(new)
            new["generation"] += 1
            mf.commit(self.path, new)
            # Committed: whatever is missing or damaged (and was before) fails only its readers.
            self._install(new, tolerate=True)
            return result

    def _record_identities(self, m):
        """Give every segment and pack `m` names its identity (FORMAT.md section 2, File identity)
        and drop those of files it no longer names. Identities already recorded are kept (the
        manifest, not the file, says what belongs in a slot); a file without one (written by
        this commit, or left by a writer from before identities) gets it from the file as it is."""
        known = mf.identities(m)
        files = {}
        for name in sorted({s for v in m["versions"] for s in v["segments"]}):
            if name in known:
                files[name] = known[name]
                continue
            try:
                seg = self._segments.get(name) or Segment(os.path.join(self.path, "segments", name))
                files[name] = seg.identity()
            except (FormatError, OSError):
                pass  # damaged or missing: nothing to vouch for (verify reports it)
        for i, name in enumerate(m["packs"]):
            newest = i == len(m["packs"]) - 1
            have = known.get(name)
            # Only the newest pack grows (an older writer may have appended past its identity);
            # an older pack's identity stands whatever its file now holds.
            if have is not None and not (newest and have["size"] < m["pack_end"]):
                files[name] = have
                continue
            try:
                end = m["pack_end"] if newest else os.path.getsize(os.path.join(self.path, "packs", name))
                files[name] = mf.identity(end, self._pack_identity(name, have, end))
            except (FormatError, OSError):
                pass
        m["files"] = files

    def _pack_identity(self, name, have, end):
        """The identity of a pack's first `end` bytes, walking only what `have` does not cover."""
        start, value = (have["size"], int(have["xxh64"], 16)) if have and have["size"] <= end else (0, 0)
        return pack.walk_chain(os.path.join(self.path, "packs", name), start, end, value)

    def _new_file(self, manifest, suffix):
        number = manifest["next_file"]
        manifest["next_file"] += 1
        return f"{number:06d}{suffix}"

    def _version(self, manifest, name, write=False):
        for v in manifest["versions"]:
            if v["name"] == name:
                if write and v.get("sealed"):
                    raise StoreError(f"version {name!r} is sealed: its answers can no longer change "
                                     "(create a branch under it instead)")
                return v
        raise UnknownVersion(f"unknown version {name!r}")

    def seal(self, version):
        """Make `version` take no further entries, tombstones or position table (FORMAT.md
        section 2). Irreversible. Compaction may then drop a child's entries that equal what a
        sealed ancestry serves, as those answers can no longer change."""
        self._snapshot.version_index(version)
        self._commit(lambda m: self._version(m, version).__setitem__("sealed", True))

    def _check_keys_values(self, keys, values):
        """Check keys (count, n) and values (count, n, d); returns the values as the store keeps
        them: a store with value_slots 1 keeps each key's last slot (also taken as (count, 1, d))."""
        meta = self.meta
        keys = np.asarray(keys)
        if keys.ndim != 2 or keys.shape[1] != meta["n"]:
            raise StoreError(f"keys must have shape (count, {meta['n']}), got {keys.shape}")
        if len(keys) and (keys.min() < 0 or keys.max() >= 2**32):
            raise StoreError("token ids must fit in uint32")
        if values is None:
            return None
        values = np.asarray(values)
        slots = mf.value_slots(meta)
        if values.shape == (len(keys), meta["n"], meta["d"]):
            return values[:, meta["n"] - slots:]
        if values.shape != (len(keys), slots, meta["d"]):
            raise StoreError(f"values must have shape ({len(keys)}, {meta['n']}, {meta['d']}), got {values.shape}")
        return values

    def add_segment(self, version, keys, values, *, tombstone=None):
        """Write one immutable segment of entries and attach it to `version` (newest)."""
        self._require_writable()
        values = self._check_keys_values(keys, values)
        self._snapshot.version_index(version)

        def change(m):
            v = self._version(m, version, write=True)
            name = self._new_file(m, ".seg")
            write_segment(os.path.join(self.path, "segments", name), keys, values,
                          tombstone=tombstone, dtype=m["meta"]["dtype"])
            v["segments"].append(name)
            return name

        return self._commit(change)

    def delete(self, version, keys):
        """Tombstone `keys` in `version`: lookups fall through to the parent for them."""
        keys = np.asarray(keys, dtype=np.uint32)
        self._check_keys_values(keys, None)
        if self._snapshot.versions[self._snapshot.version_index(version)]["parent"] is None:
            raise StoreError("entries of the root cannot be deleted: it is what every lookup falls back to")
        keys = np.unique(keys, axis=0)
        values = np.zeros((len(keys), mf.value_slots(self.meta), self.meta["d"]), dtype=np.float16)
        return self.add_segment(version, keys, values, tombstone=np.ones(len(keys), dtype=bool))

    def create_version(self, name, parent, info=None, keys=None, values=None):
        """A new branch under `parent`, holding (keys, values) if given, in one commit: a
        crash never leaves a visible branch without its entries."""
        check_name("version", name)
        if name in self._snapshot.version_names:
            raise StoreError(f"version {name!r} already exists")
        self._snapshot.version_index(parent)
        if keys is not None:
            values = self._check_keys_values(keys, values)

        def change(m):
            segments = []
            if keys is not None and len(keys):
                segments.append(self._new_file(m, ".seg"))
                write_segment(os.path.join(self.path, "segments", segments[0]), keys, values, dtype=m["meta"]["dtype"])
            m["versions"].append({"name": name, "parent": parent, "segments": segments,
                                  "created": time.time(), "info": info or {}})

        self._commit(change)

    def set_version_info(self, name, **info):
        self._snapshot.version_index(name)
        self._commit(lambda m: self._version(m, name)["info"].update(info))

    def set_position(self, version, table):
        """Give `version` its own position table (rows, d), or with None drop it so the
        version inherits its parent's again; one commit either way."""
        self._require_writable()
        self._snapshot.version_index(version)
        if table is not None:
            table = np.asarray(table, dtype=np.float32)
            if table.ndim != 2 or table.shape[1] != self.meta["d"] or not len(table):
                raise StoreError(f"a position table must have shape (rows, {self.meta['d']}), got {table.shape}")
            if not np.isfinite(table).all():
                raise StoreError("a position table must be finite")

        def change(m):
            v = self._version(m, version, write=True)
            if table is None:
                v.pop("position", None)
                return None
            name = self._new_file(m, ".pos")
            directory = os.path.join(self.path, "positions")
            if not os.path.isdir(directory):
                os.makedirs(directory, exist_ok=True)
                fsync_dir(self.path)
            v["position"] = {"file": name, **write_position(os.path.join(directory, name), table)}
            return name

        return self._commit(change)

    def replace_segments(self, version, old, new_name):
        """Swap a version's segments `old` for `new_name` (or none) in one commit: compaction's publish step."""

        def change(m):
            v = self._version(m, version)
            if v["segments"] != old:
                raise StoreError(f"version {version!r} changed during compaction; run it again")
            v["segments"] = [new_name] if new_name else []

        self._commit(change)

    def reserve_file(self, suffix):
        """A fresh file name (committed, so it is never reused) for a file written before its manifest."""
        return self._commit(lambda m: self._new_file(m, suffix))

    # -- PET pack --------------------------------------------------------------------------

    def _append_pets(self, records, fresh=False):
        """Append records to the active pack (rolling to a new one past PACK_ROLL_BYTES, or
        at once with `fresh`: gc moving the active pack's live records out of it); returns their
        locations and a manifest change that places them."""
        m = self._manifest
        active = m["packs"][-1] if m["packs"] else None
        end, new_files, locations = m["pack_end"], [], []
        grown = {}  # pack -> identity of its records, extended record by record as they are appended
        written = set()
        if active is not None:
            # A writer killed mid-append leaves a torn tail past the committed end: cut it off
            # now, before this pack may be rolled past and become immutable (verify walks it).
            path = os.path.join(self.path, "packs", active)
            try:
                if os.path.getsize(path) > end:
                    os.truncate(path, end)
                grown[active] = self._pack_identity(active, mf.identities(m).get(active), end)
            except (CorruptError, FileNotFoundError):
                active = None  # damaged or missing: start a new pack rather than vouch for it
        if fresh:
            active = None
        for record in records or ([None] if fresh else []):
            if active is None or end >= PACK_ROLL_BYTES:
                active = self.reserve_file(".pack")
                new_files.append(active)
                open(os.path.join(self.path, "packs", active), "ab").close()
                fsync_dir(os.path.join(self.path, "packs"))
                end = 0
                grown[active] = 0
            if record is None:
                break  # `fresh` with nothing to move: the new, empty pack becomes the active one
            path = os.path.join(self.path, "packs", active)
            # A writer killed mid-append leaves a torn tail past the committed end: cut it off.
            if os.path.getsize(path) > end:
                os.truncate(path, end)
            data = pack.encode_record(record)
            offset, length = pack.append_encoded(path, data, sync=False)
            written.add(path)
            end = offset + length
            grown[active] = pack.chain(grown[active], pack.header_digest(data))
            locations.append({"file": active, "offset": offset, "length": length})
        for path in written:  # one fsync a pack for the whole batch, before any manifest names a record
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        ends = {loc["file"]: loc["offset"] + loc["length"] for loc in locations}

        def place(m2):
            m2["packs"] += new_files
            m2["pack_end"] = end
            m2.setdefault("files", {}).update({name: mf.identity(ends[name], grown[name]) for name in ends})

        return locations, place

    def put_pets(self, records, fresh_pack=False):
        """Store, replace or (tombstone records) delete tenants' PETs, students and full-depth
        PETs in one commit, in order; durable once this returns. One commit for many records
        keeps bulk loads fast. A students or full-depth record needs its tenant's PET (stored
        before it, or earlier in `records`): UnknownTenant otherwise, and nothing is written.
        fresh_pack: write into a new pack file, never the active one (gc rewriting it)."""
        self._require_writable()
        records = list(records)
        tenants = set(self._manifest["pets"])
        for record in records:
            check_name("tenant", record.tenant)
            kind = record_kind(record.meta)
            if kind == "pet":
                (tenants.discard if record.tombstone else tenants.add)(record.tenant)
            elif not record.tombstone and record.tenant not in tenants:
                raise UnknownTenant(f"unknown tenant {record.tenant!r}: a {KIND_NAMES[kind]} record is stored "
                                    "beside the tenant's PET")
        locations, place = self._append_pets(records, fresh=fresh_pack)

        def change(m):
            place(m)
            for record, loc in zip(records, locations):
                _place_record(m, record, loc)

        self._commit(change)

    def put_pet(self, record):
        """Store (or replace) a tenant's PET record; durable once this returns."""
        self.put_pets([record])

    def get_pet(self, tenant):
        return self._snapshot.read_pet(tenant)

    def delete_pet(self, tenant):
        self._require_writable()
        if tenant not in self._manifest["pets"]:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        self.put_pets([pack.PetRecord(tenant=tenant, meta={"deleted": time.time()}, tensors={}, tombstone=True)])

    def pets(self):
        return dict(self._snapshot.pets)

    def put_students(self, record):
        """Store (or replace) a tenant's students record (meta pet_type "students"); the tenant
        must have a PET (the teacher the students were distilled from)."""
        if record.meta.get("pet_type") != "students":
            raise StoreError("a students record has meta pet_type 'students'")
        if record.tenant not in self._manifest["pets"]:
            raise UnknownTenant(f"unknown tenant {record.tenant!r}")
        self.put_pets([record])

    def get_students(self, tenant):
        return self._snapshot.read_students(tenant)

    def delete_students(self, tenant):
        self._require_writable()
        if tenant not in self._manifest.get("students", {}):
            raise UnknownTenant(f"tenant {tenant!r} has no students")
        self.put_pets([pack.PetRecord(tenant=tenant, meta={"deleted": time.time(), "pet_type": "students"},
                                      tensors={}, tombstone=True)])

    def put_full(self, record):
        """Store (or replace) a tenant's full-depth PET (meta level "full", FORMAT.md section 5);
        the tenant must have a PET, the one whose `created` the record's `pet_created` names."""
        if record.tombstone or record_kind(record.meta) != "full":
            raise StoreError("a full-depth PET record has meta level 'full' and is no tombstone "
                             "(delete_full removes one)")
        if record.tenant not in self._manifest["pets"]:
            raise UnknownTenant(f"unknown tenant {record.tenant!r}: a full-depth PET is stored beside the tenant's PET")
        self.put_pets([record])

    def get_full(self, tenant):
        return self._snapshot.read_full(tenant)

    def delete_full(self, tenant):
        """Remove only the tenant's full-depth PET: its PET and students stay."""
        self._require_writable()
        if tenant not in self._manifest.get("full", {}):
            raise UnknownTenant(f"tenant {tenant!r} has no full-depth PET")
        self.put_pets([pack.PetRecord(tenant=tenant, meta={"deleted": time.time(), "level": "full"},
                                      tensors={}, tombstone=True)])

    def fulls(self):
        return dict(self._snapshot.full)


def _place_record(m, record, loc):
    """Name `record` (at `loc`) in manifest `m`'s map for its kind, or for a tombstone drop what
    it removes: a students or full-depth tombstone that record only, any other the tenant whole."""
    kind = record_kind(record.meta)
    maps = {k: m.setdefault(name, {}) for k, name in MAPS.items()}
    if not record.tombstone:
        maps[kind][record.tenant] = loc
    else:
        for k in (MAPS if kind == "pet" else [kind]):
            maps[k].pop(record.tenant, None)
    for name in ("students", "full"):
        if not m[name]:
            del m[name]  # manifests without them stay as older writers wrote them

def model_meta(model_dir):
    """Store metadata read from a Hugging Face BERT-format directory (no torch needed)."""
    import json

    from formats.xxh64 import checksum

    config_path = os.path.join(model_dir, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{model_dir}: no config.json (expected a Hugging Face BERT-format directory)") from None
    except ValueError as e:
        raise StoreError(f"{config_path}: not valid JSON ({e})") from None
    for name in ("tokenizer.json", "vocab.txt"):
        tok = os.path.join(model_dir, name)
        if os.path.exists(tok):
            with open(tok, "rb") as f:
                fingerprint = f"{checksum(f.read()):016x}"
            break
    else:
        raise StoreError(f"{model_dir}: no tokenizer.json or vocab.txt")
    return {
        "base_model": config.get("_name_or_path") or os.path.basename(os.path.abspath(model_dir)),
        "d": int(config["hidden_size"]),
        "vocab_size": int(config["vocab_size"]),
        "pad_id": int(config.get("pad_token_id", 0)),
        "num_layers": int(config["num_hidden_layers"]),
        "tokenizer_fingerprint": fingerprint,
    }


def create(path, *, d, vocab_size, n=3, window="centered", lower_layers=3, dtype="fp16", pad_id=0,
           base_model="unknown", tokenizer_fingerprint="", model_path=None, num_layers=None, root="root",
           architecture="encoder", value_slots=None):
    """Create an empty store whose root version holds nothing yet; returns it open for writing.
    architecture: "encoder" (averaged windows) or "decoder" (causal windows, hGPT). value_slots:
    vectors kept per key, n (every slot; an encoder store's only choice) or 1 (the key's last
    slot, all a decoder serves: a decoder store's default; n gives the layout of decoder stores
    made before format 2)."""
    path = os.fspath(path)
    if dtype not in DTYPES:
        raise StoreError(f"unknown value dtype {dtype!r} (expected fp16 or int8)")
    if window not in ("centered", "causal"):
        raise StoreError(f"unknown window kind {window!r} (expected centered or causal)")
    if not 2 <= n <= 5:
        raise StoreError(f"n must be between 2 and 5, got {n}")
    if architecture not in ("encoder", "decoder"):
        raise StoreError(f"unknown architecture {architecture!r} (expected encoder or decoder)")
    if architecture == "decoder" and window != "causal":
        raise StoreError("a decoder store needs causal windows (a token cannot see the tokens after it)")
    if os.path.exists(os.path.join(path, mf.CURRENT)):
        raise StoreError(f"{path}: a store already exists here")
    check_name("version", root)
    for sub in ("", "segments", "packs", "positions"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)
    meta = {"base_model": base_model, "tokenizer_fingerprint": tokenizer_fingerprint, "d": int(d), "n": int(n),
            "window": window, "lower_layers": int(lower_layers), "dtype": dtype, "pad_id": int(pad_id),
            "vocab_size": int(vocab_size), "model_path": model_path, "num_layers": num_layers,
            "architecture": architecture}
    slots = (1 if architecture == "decoder" else n) if value_slots is None else int(value_slots)
    if slots not in (1, n) or (slots == 1 and architecture != "decoder"):
        raise StoreError(f"value_slots must be {n}" + (" or 1" if architecture == "decoder" else "") + f", got {slots}")
    if slots != n:
        meta["value_slots"] = slots
    manifest = {"format": mf.FORMAT_VERSION, "generation": 1, "next_file": 1, "meta": meta,
                "versions": [{"name": root, "parent": None, "segments": [], "created": time.time(), "info": {}}],
                "pets": {}, "packs": [], "pack_end": 0, "files": {}}
    fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.exists(os.path.join(path, mf.CURRENT)):
            raise StoreError(f"{path}: a store already exists here")
        mf.commit(path, manifest)
    except BlockingIOError:
        raise StoreLocked(f"{path}: another writer is creating this store") from None
    finally:
        os.close(fd)
    return Store(path, writable=True)


def open_store(path, writable=False, allow_rollback=False):
    """Open a store. allow_rollback=True (read-only) reads what CURRENT names even when newer
    manifests exist (a rolled-back CURRENT, FORMAT.md section 1); otherwise that is a RollbackError."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise StoreError(f"{path}: is a file, not a store directory" if os.path.exists(path)
                         else f"{path}: no such store directory")
    try:
        return Store(path, writable=writable, allow_rollback=allow_rollback)
    except FormatError as e:
        if isinstance(e, CorruptError):
            raise
        raise StoreError(str(e)) from None
