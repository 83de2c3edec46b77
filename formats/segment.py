"""PLOT segment files (FORMAT.md section 3): write once, then memory-map and probe.

A segment is immutable. Opening one reads its 256-byte header and nothing else; the index and
keys are checked the first time a process probes it, and each value row the first time it is
returned, so damage is always an error and never a silent answer, without an O(size) open.
The header's own checksum covers every section's checksum, so it doubles as the file's identity
(FORMAT.md section 2): the manifest records it, and one header read tells whether the file in a
segment's slot is the one the manifest means.
"""

import mmap
import os
import struct
import threading

import numpy as np
import xxhash

from formats import accel, hugepages
from formats.durable import fsync_dir
from formats.errors import CorruptError, FormatError
from formats.manifest import identity
from formats.xxh64 import checksum, hash_keys, xxh64_rows

MAGIC = b"HKSEG\x00\x00\x01"
FORMAT_VERSION = 1  # values hold all n slots of a key
FORMAT_LAST_SLOT = 2  # values hold only each key's last slot (decoder stores: FORMAT.md section 3)
HEADER_SIZE = 256
ALIGN = 64
DTYPES = {"fp16": 1, "int8": 2}
SECTIONS = ("index", "keys", "flags", "rowsums", "values", "scales")
TOMBSTONE = 1

_HEAD = struct.Struct("<8sIIIIQQQ")  # magic, format, n, d, dtype, count, capacity, max_probe
_SECTION = struct.Struct("<QQQ")  # offset, length, xxh64
_SLOTS = struct.Struct("<I")  # format 2: value slots per entry (1), right after the section table
_SLOTS_AT = _HEAD.size + 6 * _SECTION.size


def _capacity(count):
    cap = 8
    while cap < 2 * count:
        cap *= 2
    return cap


def build_index(hashes, capacity):
    """Place every entry at the first free slot at or after its home slot (linear probing).

    All unplaced entries move in lock step: each round, entries whose slot is free claim it
    (one winner per slot), the rest step forward. An entry only ever steps over occupied
    slots, which is the invariant a linear-probing lookup relies on.
    """
    mask = capacity - 1
    slots = np.zeros(capacity, dtype=np.uint32)
    home = (hashes & np.uint64(mask)).astype(np.int64)
    pos = home.copy()
    pending = np.arange(len(hashes), dtype=np.int64)
    while len(pending):
        p = pos[pending]
        free = slots[p] == 0
        taken_slots, first = np.unique(p[free], return_index=True)
        winners = pending[free][first]
        slots[taken_slots] = (winners + 1).astype(np.uint32)
        placed = np.zeros(len(hashes), dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        pos[pending] = (pos[pending] + 1) & mask
    max_probe = int(((pos - home) & mask).max()) if len(hashes) else 0
    return slots, max_probe


def quantize_int8(values, chunk=65536):
    """Symmetric int8 with one float32 scale per vector (per (entry, slot) row of width d).

    Works in chunks so that peak memory stays near the int8 output, not 3 float32 copies."""
    values = np.asarray(values)
    q = np.empty(values.shape, dtype=np.int8)
    scales = np.empty(values.shape[:-1], dtype=np.float32)
    for start in range(0, len(values), chunk):
        v = values[start:start + chunk].astype(np.float32)
        s = np.abs(v).max(axis=-1) / 127.0
        q[start:start + chunk] = np.clip(np.rint(v / np.where(s > 0, s, 1.0)[..., None]), -127, 127)
        scales[start:start + chunk] = s
    return q, scales


def _row_sums(key_hashes, values, scales):
    count = len(values)
    rows = lambda a: a.reshape(count, int(np.prod(a.shape[1:]))).view(np.uint8)  # noqa: E731 - count may be 0
    sums = xxh64_rows(rows(values), key_hashes)
    if scales is not None:
        sums = xxh64_rows(rows(scales), sums)
    return sums


def write_segment(path, keys, values, *, tombstone=None, dtype="fp16"):
    """Write a segment to `path` atomically (temp file, fsync, rename, fsync directory).

    keys: (count, n) ids, unique; values: (count, n, d), or (count, 1, d) for a segment that
    keeps only each key's last slot (format 2); tombstone: optional (count,) bools.
    """
    if dtype not in DTYPES:
        raise FormatError(f"unknown value dtype {dtype!r} (expected fp16 or int8)")
    keys = np.ascontiguousarray(keys, dtype="<u4")
    values = np.asarray(values)
    if keys.ndim != 2 or values.ndim != 3 or values.shape[0] != keys.shape[0] or values.shape[1] not in (
            keys.shape[1], 1):
        raise FormatError(f"keys {keys.shape} and values {values.shape} do not match (count, n) and (count, n or 1, d)")
    count, n = keys.shape
    slots, d = values.shape[1], values.shape[2]
    if count and len(np.unique(keys.view(np.dtype((np.void, 4 * n))).ravel())) != count:
        raise FormatError("a segment's keys must be unique")
    flags = np.zeros(count, dtype=np.uint8)
    if tombstone is not None:
        flags[np.asarray(tombstone, dtype=bool)] = TOMBSTONE
    if dtype == "fp16":
        stored, scales = np.ascontiguousarray(values, dtype="<f2"), None
    else:
        stored, scales = quantize_int8(values)
    hashes = hash_keys(keys)
    capacity = _capacity(count)
    index, max_probe = build_index(hashes, capacity)
    rowsums = _row_sums(hashes, stored, scales).astype("<u8")
    blobs = {
        "index": index.astype("<u4"), "keys": keys, "flags": flags, "rowsums": rowsums,
        "values": stored, "scales": scales if scales is not None else np.zeros(0, "<f4"),
    }
    table, offset = [], HEADER_SIZE
    for name in SECTIONS:
        raw = memoryview(np.ascontiguousarray(blobs[name]).reshape(-1).view(np.uint8))
        table.append((offset, len(raw), checksum(raw), raw))
        offset += -(-len(raw) // ALIGN) * ALIGN
    header = bytearray(HEADER_SIZE)
    fmt = FORMAT_VERSION if slots == n else FORMAT_LAST_SLOT  # n == 1 is not a store's (n >= 2)
    _HEAD.pack_into(header, 0, MAGIC, fmt, n, d, DTYPES[dtype], count, capacity, max_probe)
    for i, (off, length, digest, _) in enumerate(table):
        _SECTION.pack_into(header, _HEAD.size + i * _SECTION.size, off, length, digest)
    if fmt == FORMAT_LAST_SLOT:
        _SLOTS.pack_into(header, _SLOTS_AT, slots)
    struct.pack_into("<Q", header, HEADER_SIZE - 8, checksum(bytes(header[:HEADER_SIZE - 8])))
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        for off, length, _, raw in table:
            f.seek(off)
            f.write(raw)
        f.truncate(table[-1][0] + table[-1][1])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class Segment:
    """A memory-mapped segment. Thread-safe for reads."""

    def __init__(self, path):
        self.path = str(path)
        name = os.path.basename(self.path)
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            self._stat = (st.st_ino, st.st_size, st.st_mtime_ns)
            if size < HEADER_SIZE:
                raise CorruptError(f"segment {name}: truncated ({size} bytes, header needs {HEADER_SIZE})")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = self._mm[:HEADER_SIZE]
        magic, fmt, self.n, self.d, dtype, self.count, self.capacity, self.max_probe = _HEAD.unpack_from(header)
        if magic != MAGIC:
            # A file the manifest names as a segment: a wrong magic is damage, like a bad checksum.
            raise CorruptError(f"segment {name}: not an hkstore segment (bad magic)")
        self.size = size
        self.digest = struct.unpack_from("<Q", header, HEADER_SIZE - 8)[0]
        if self.digest != checksum(header[:HEADER_SIZE - 8]):
            raise CorruptError(f"segment {name}: header checksum mismatch")
        if fmt not in (FORMAT_VERSION, FORMAT_LAST_SLOT):
            raise FormatError(f"segment {name}: format version {fmt} is not supported (this reader knows "
                              f"{FORMAT_VERSION} and {FORMAT_LAST_SLOT})")
        # slots: vectors kept per entry, the key's last ones (n, or 1 in format 2)
        self.slots = self.n if fmt == FORMAT_VERSION else _SLOTS.unpack_from(header, _SLOTS_AT)[0]
        if fmt == FORMAT_LAST_SLOT and self.slots != 1:
            raise CorruptError(f"segment {name}: format 2 keeps 1 slot per entry, the header says {self.slots}")
        self.dtype = {v: k for k, v in DTYPES.items()}.get(dtype)
        if self.dtype is None:
            raise FormatError(f"segment {name}: unknown value dtype code {dtype}")
        self.sections = {}
        for i, sec in enumerate(SECTIONS):
            self.sections[sec] = _SECTION.unpack_from(header, _HEAD.size + i * _SECTION.size)
        end = max(off + length for off, length, _ in self.sections.values())
        if size < end:
            raise CorruptError(f"segment {name}: truncated ({size} bytes, sections need {end})")
        if size > end:
            raise CorruptError(f"segment {name}: {size - end} unexpected bytes after the last section")
        n, d, count, slots = self.n, self.d, self.count, self.slots
        self.index = self._array("index", "<u4", (self.capacity,))
        self.keys = self._array("keys", "<u4", (count, n))
        self.flags = self._array("flags", "u1", (count,))
        self.rowsums = self._array("rowsums", "<u8", (count,))
        self.values = self._array("values", "<f2" if self.dtype == "fp16" else "i1", (count, slots, d))
        self.scales = self._array("scales", "<f4", (count, slots)) if self.dtype == "int8" else None
        self._checked = False
        self._huge = False  # warm() has put this segment in huge pages
        self._all_rows_ok = False  # warm() checked every value row
        self._row_ok = None
        self._lock = threading.Lock()

    @property
    def name(self):
        return os.path.basename(self.path)

    def changed(self):
        """Whether the file at this segment's path is no longer the one it opened (another
        inode, size or mtime): a segment is immutable, so a change is a rewrite in place or a
        replacement, whose rows this process's first-use checks no longer cover. A file gone
        (gc) is no change: the mapping holds the bytes that were checked."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_ino, st.st_size, st.st_mtime_ns) != self._stat

    def identity(self):
        """{size, xxh64} as the manifest records it (FORMAT.md section 2, File identity)."""
        return identity(self.size, self.digest)

    def _array(self, section, dtype, shape):
        off, length, _ = self.sections[section]
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if length != expected:
            raise CorruptError(f"segment {self.name}: section {section} is {length} bytes, expected {expected}")
        return np.frombuffer(self._mm, dtype=dtype, count=int(np.prod(shape)), offset=off).reshape(shape)

    def _section_bytes(self, section):
        off, length, _ = self.sections[section]
        return memoryview(self._mm)[off:off + length]

    def check_section(self, section):
        off, length, digest = self.sections[section]
        if checksum(self._section_bytes(section)) != digest:
            raise CorruptError(f"segment {self.name}: section {section} checksum mismatch")

    def verify(self):
        """Check every section checksum and the index structure; raise CorruptError on damage."""
        for section in SECTIONS:
            self.check_section(section)
        live = self.index[self.index != 0].astype(np.int64) - 1
        if len(live) != self.count or (self.count and (live.max() >= self.count or len(np.unique(live)) != self.count)):
            raise CorruptError(f"segment {self.name}: index does not name every entry exactly once")
        if self.count and (self.probe(np.asarray(self.keys)) != np.arange(self.count)).any():
            raise CorruptError(f"segment {self.name}: an entry cannot be found through the index")
        # The bytes between sections must be zero (FORMAT.md section 3): every byte is checked.
        start = HEADER_SIZE
        for off, length, _ in sorted(self.sections.values()):
            if off > start and any(self._mm[start:off]):
                raise CorruptError(f"segment {self.name}: nonzero padding in bytes {start}..{off}")
            start = max(start, off + length)

    def _check_once(self):
        # Index, keys, flags and rowsums are small (about 28 bytes an entry): check them in full
        # on first use. Rowsums too, although no lookup returns them: a value row is checked only
        # against its rowsum, so checking the rowsums against the header ties every byte a lookup
        # serves to the header, and the header to the identity the manifest records.
        if not self._checked:
            with self._lock:
                if not self._checked:
                    self.check_section("index")
                    self.check_section("keys")
                    self.check_section("flags")
                    self.check_section("rowsums")
                    self._row_ok = np.zeros(self.count, dtype=bool)
                    self.has_tombstones = bool((self.flags & TOMBSTONE).any())
                    self._checked = True

    def probe(self, keys, hashes=None):
        """Entry number of each key, or -1. keys: (m, n) uint32; hashes: their key hashes (m,)
        uint64, computed here when None."""
        self._check_once()
        keys = np.asarray(keys, dtype=np.uint32)
        m = len(keys)
        ext = accel.ext
        if (ext is not None and m and self.count and keys.ndim == 2 and keys.shape[1] == self.n
                and self.capacity > 0 and not self.capacity & (self.capacity - 1)):
            # formats/_probe.c: hash, probe and compare in one loop, without the GIL.
            keys = np.ascontiguousarray(keys)
            result = np.empty(m, dtype=np.int64)
            compute = hashes is None
            hashes = np.empty(m, dtype=np.uint64) if compute else np.ascontiguousarray(hashes, dtype=np.uint64)
            try:
                ext.probe(self.index, self.keys, self.n, self.max_probe, keys, result, hashes, compute)
            except ext.CorruptIndex as e:
                raise CorruptError(f"segment {self.name}: index names entry {e.args[1]}, past its {e.args[2]} entries") from None
            return result
        result = np.full(m, -1, dtype=np.int64)
        if m == 0 or self.count == 0:
            return result
        if hashes is None:
            hashes = hash_keys(keys)
        mask = self.capacity - 1
        slot = (hashes & np.uint64(mask)).astype(np.int64)
        active = np.arange(m)
        for _ in range(self.max_probe + 1):
            entry = self.index[slot[active]].astype(np.int64) - 1
            occupied = entry >= 0
            active, entry = active[occupied], entry[occupied]
            if not len(active):
                break
            hit = (self.keys[entry] == keys[active]).all(axis=1)
            result[active[hit]] = entry[hit]
            active = active[~hit]
            slot[active] = (slot[active] + 1) & mask
        return result

    def tombstoned(self, entries):
        self._check_once()
        if not self.has_tombstones:
            return np.zeros(len(entries), dtype=bool)
        return (self.flags[entries] & TOMBSTONE) != 0

    def read_values(self, entries, key_hashes, out=None, out_rows=None):
        """Value rows of the given entries (m, slots, d), each checked on first return: float16
        for fp16 segments, float32 (dequantized) for int8 ones, whose float16 conversion
        would cost more than the gather. With `out` ((M, slots, d) of that dtype) the rows go to
        out[out_rows] (out_rows None: out is (m, slots, d) and takes them all) and out is returned."""
        ext = accel.ext
        if ext is not None:
            self._check_once()
            entries = np.ascontiguousarray(entries, dtype=np.int64)
            key_hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
            if out is None:
                out = np.empty((len(entries), self.slots, self.d),
                               dtype=np.float16 if self.scales is None else np.float32)
            if out_rows is not None:
                out_rows = np.ascontiguousarray(out_rows, dtype=np.int64)
            # One pass: first-return rows are checked against their rowsums, then copied
            # (int8: dequantized); rows are prefetched ahead. Once warm() has checked every row,
            # the gather skips the row_ok test and the rowsum prefetch: two random reads a row.
            rowsums, row_ok, hashes = (None,) * 3 if self._all_rows_ok else (self.rowsums, self._row_ok, key_hashes)
            bad = ext.gather(self.values, self.count, self.slots, entries, out, out_rows, self.scales, rowsums, row_ok,
                             hashes)
            if bad >= 0:
                raise CorruptError(f"segment {self.name}: value row {entries[bad]} fails its checksum")
            return out
        self._check_rows(entries, key_hashes)
        # mode="clip" skips NumPy's defensive copy; entries are valid because probe made them.
        rows = np.take(self.values, entries, axis=0, mode="clip")
        if self.scales is not None:
            rows = rows.astype(np.float32)
            rows *= np.take(self.scales, entries, axis=0, mode="clip")[..., None]
        if out is None:
            return rows
        if out_rows is None:
            out[...] = rows
        else:
            out[out_rows] = rows
        return out

    def warm(self, chunk=1 << 15):
        """Do now what lookups would do on each row's first return: map the value pages into
        this process (no page fault later) and check every row against its rowsum. Lookups then
        run at their steady rate from the first batch, instead of paying a fault and an XXH64
        of the row for every row they return for the first time (most rows of a Zipf tail).
        Costs one pass over the values section (about 0.5 s of one core per 2.3 GB); the C path
        releases the GIL, so a thread can run it beside lookups. A damaged row is left
        unchecked, so a lookup that returns it still raises; returns how many rows failed.
        A big segment is also put in huge pages (formats/hugepages.py): its file mapping where
        the kernel can (read again if it was cached in small pages), otherwise copies of its
        index and keys; lookups' random reads then take no page walks."""
        self._check_once()
        self._huge_pages()
        ext = accel.ext
        failed = 0
        for s in range(0, self.count, chunk):
            e = min(self.count, s + chunk)
            scales = self.scales[s:e] if self.scales is not None else None
            if ext is not None:
                failed += ext.verify_rows(self.values[s:e], self.keys[s:e], self.n, self.rowsums[s:e],
                                          self._row_ok[s:e], scales, True)
                continue
            todo = np.flatnonzero(~self._row_ok[s:e]) + s
            if not len(todo):
                continue
            sums = _row_sums(hash_keys(self.keys[todo]), self.values[todo], self.scales[todo] if scales is not None else None)
            good = sums == self.rowsums[todo]
            self._row_ok[todo[good]] = True
            failed += int((~good).sum())
        self._all_rows_ok = not failed and bool(self._row_ok.all())
        return failed

    def _huge_pages(self):
        # Below a huge page a segment is a few pages, which the TLB keeps anyway.
        with self._lock:
            if self._huge or self.size < hugepages.HUGE_PAGE or not hugepages.available():
                return
            self._huge = True
            # Advised here, not at open: only a store meant to stay in memory is warmed, and on a
            # store bigger than memory a fault in an advised mapping reads 2 MiB, not a page.
            if hugepages.advise(self._mm):
                hugepages.populate(self._mm)
                if hugepages.pmd_share(self._mm) < 0.5:
                    hugepages.reread(self._mm, self.path)
                if hugepages.pmd_share(self._mm) >= 0.5:
                    return
            self.keys = hugepages.huge_copy(self.keys)
            self.index = hugepages.huge_copy(self.index)

    def check_rows(self, entries):
        """Check the given entries' value rows against their rowsums (verify walks them all)."""
        self._check_rows(entries, hash_keys(self.keys[entries]))

    def _check_rows(self, entries, key_hashes):
        self._check_once()
        ext = accel.ext
        if ext is not None:
            entries = np.ascontiguousarray(entries, dtype=np.int64)
            bad = ext.gather(self.values, self.count, self.slots, entries, None, None, self.scales, self.rowsums,
                             self._row_ok, np.ascontiguousarray(key_hashes, dtype=np.uint64))
            if bad >= 0:
                raise CorruptError(f"segment {self.name}: value row {entries[bad]} fails its checksum")
            return
        fresh = np.flatnonzero(~self._row_ok[entries])
        if not len(fresh):
            return
        # The C hash over each row's bytes beats the vectorized one here: rows are long.
        values = memoryview(self._mm)[self.sections["values"][0]:][:self.sections["values"][1]]
        scales = self.scales is not None and memoryview(self._mm)[self.sections["scales"][0]:][:self.sections["scales"][1]]
        vbytes, sbytes = self.slots * self.d * self.values.itemsize, self.slots * 4
        for e, h in zip(entries[fresh].tolist(), key_hashes[fresh].tolist()):
            digest = xxhash.xxh64_intdigest(values[e * vbytes:(e + 1) * vbytes], h)
            if scales:
                digest = xxhash.xxh64_intdigest(scales[e * sbytes:(e + 1) * sbytes], digest)
            if digest != self.rowsums[e]:
                raise CorruptError(f"segment {self.name}: value row {e} fails its checksum")
        self._row_ok[entries[fresh]] = True

    def close(self):
        # Views into the map may still be alive in callers; let the GC unmap it.
        self._mm = None
