"""PET pack records (FORMAT.md section 5): one tenant's task knowledge per record.

A record is a 128-byte header, a JSON directory and the tensor payload, padded to a PAGE so a
record can be mapped, copied or skipped without touching its neighbours. Readers verify every
checksum before they return data: a damaged record raises, it never decodes to wrong tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import xxhash
import zstandard

from formats.durable import fsync_dir
from formats.errors import CorruptError, FormatError

PAGE = 4096
ALIGN = 64
MAGIC = b"HKPET\x00\x00\x01"
FORMAT = 1
FLAG_TOMBSTONE = 1
FLAG_ZSTD = 2

# magic, format, flags, record_length, dir_length, payload_offset, payload_length, raw_length,
# dir_xxh64, payload_xxh64, 48 reserved zero bytes, header_xxh64 (of the 120 bytes before it).
_HEADER = struct.Struct("<8sIIQQQQQQQ48xQ")
HEADER_SIZE = _HEADER.size
_HASHED = HEADER_SIZE - 8

# On-disk dtype name -> little-endian NumPy dtype. NumPy has no bfloat16, so bfloat16 tensors
# live in memory as uint16 arrays of the raw bits; uint16 is therefore not a dtype of its own.
DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

# Compression rule, chosen from benchmarks/bench_pack.py: trained float weights barely compress
# (their mantissas are noise), so zstd only pays for index-heavy or sparse payloads.
ZSTD_LEVEL = 3
ZSTD_MAX_RATIO = 0.9


@dataclass(frozen=True)
class PetRecord:
    tenant: str
    meta: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    tombstone: bool = False


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _disk_dtype(name: str, array: np.ndarray) -> tuple[str, np.dtype]:
    if array.dtype.kind == "u" and array.dtype.itemsize == 2:
        return "bfloat16", DTYPES["bfloat16"]
    dtype_name = array.dtype.name
    # An ml_dtypes bfloat16 array would be cast by value, not copied bit for bit: refuse it
    # (pass array.view(np.uint16) instead).
    if dtype_name not in DTYPES or dtype_name == "bfloat16":
        raise ValueError(f"tensor {name!r}: dtype {array.dtype} is not storable in a PET pack")
    return dtype_name, DTYPES[dtype_name]


def _pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[bytes, dict]:
    """The raw payload (tensors in order, each at a multiple of ALIGN) and its directory."""
    entries, chunks, end = {}, [], 0
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor name {name!r} is not a string")
        array = np.asarray(tensor)
        dtype_name, dtype = _disk_dtype(name, array)
        data = np.ascontiguousarray(array, dtype=dtype).tobytes()
        offset = _align(end, ALIGN)
        chunks += [bytes(offset - end), data]
        entries[name] = {"dtype": dtype_name, "shape": list(array.shape),
                         "offset": offset, "length": len(data)}
        end = offset + len(data)
    return b"".join(chunks), entries


def _maybe_compress(raw: bytes) -> tuple[bytes, bool]:
    if not raw:
        return raw, False
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    if len(packed) <= ZSTD_MAX_RATIO * len(raw):
        return packed, True
    return raw, False


def encode_record(record: PetRecord) -> bytes:
    """The record's bytes; the length is a multiple of PAGE."""
    if not isinstance(record.tenant, str) or not isinstance(record.meta, dict):
        raise ValueError("a PET record needs a str tenant and a dict meta")
    if record.tombstone and record.tensors:
        raise ValueError(f"tenant {record.tenant!r}: a tombstone carries no tensors")
    raw, entries = _pack_tensors(record.tensors)
    stored, compressed = _maybe_compress(raw)
    directory = json.dumps({"tenant": record.tenant, "meta": record.meta, "tensors": entries},
                           separators=(",", ":"), allow_nan=False).encode()
    payload_offset = _align(HEADER_SIZE + len(directory), ALIGN)
    record_length = _align(payload_offset + len(stored), PAGE)
    flags = (FLAG_TOMBSTONE if record.tombstone else 0) | (FLAG_ZSTD if compressed else 0)
    out = bytearray(record_length)
    _HEADER.pack_into(out, 0, MAGIC, FORMAT, flags, record_length, len(directory),
                      payload_offset, len(stored), len(raw),
                      xxhash.xxh64_intdigest(directory), xxhash.xxh64_intdigest(stored), 0)
    struct.pack_into("<Q", out, _HASHED, xxhash.xxh64_intdigest(out[:_HASHED]))
    out[HEADER_SIZE:HEADER_SIZE + len(directory)] = directory
    out[payload_offset:payload_offset + len(stored)] = stored
    return bytes(out)


@dataclass(frozen=True)
class _Header:
    flags: int
    record_length: int
    dir_length: int
    payload_offset: int
    payload_length: int
    raw_length: int
    dir_hash: int
    payload_hash: int


def _read_header(mv: memoryview) -> _Header:
    """Parse and check the header at the start of mv. Errors carry no location; callers add it."""
    if len(mv) < HEADER_SIZE:
        raise CorruptError(f"truncated: {len(mv)} bytes where the {HEADER_SIZE}-byte header should be")
    magic, fmt, *fields, header_hash = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, not a PET record")
    if xxhash.xxh64_intdigest(mv[:_HASHED]) != header_hash:
        raise CorruptError("header checksum mismatch")
    if fmt != FORMAT:
        raise FormatError(f"format version {fmt} is not supported (this reader knows {FORMAT})")
    header = _Header(*fields)
    if header.flags & ~(FLAG_TOMBSTONE | FLAG_ZSTD):
        raise FormatError(f"unknown flags {header.flags:#x}")
    # Every length is determined by the others: a record has exactly one valid encoding.
    consistent = (
        header.payload_offset == _align(HEADER_SIZE + header.dir_length, ALIGN)
        and header.record_length == _align(header.payload_offset + header.payload_length, PAGE)
        and (header.flags & FLAG_ZSTD or header.raw_length == header.payload_length)
    )
    if not consistent:
        raise FormatError("header lengths are inconsistent")
    return header


def _verify(mv: memoryview, header: _Header) -> None:
    """Check both checksums and that every byte outside them is zero padding."""
    dir_end = HEADER_SIZE + header.dir_length
    payload_end = header.payload_offset + header.payload_length
    if xxhash.xxh64_intdigest(mv[HEADER_SIZE:dir_end]) != header.dir_hash:
        raise CorruptError("directory checksum mismatch")
    if xxhash.xxh64_intdigest(mv[header.payload_offset:payload_end]) != header.payload_hash:
        raise CorruptError("payload checksum mismatch")
    for start, end in ((dir_end, header.payload_offset), (payload_end, header.record_length)):
        if bytes(mv[start:end]) != bytes(end - start):
            raise CorruptError(f"nonzero padding in bytes {start}..{end} of the record")


def _parse_directory(mv: memoryview, header: _Header) -> dict:
    try:
        directory = json.loads(bytes(mv[HEADER_SIZE:HEADER_SIZE + header.dir_length]))
    except ValueError as err:
        raise FormatError(f"directory is not UTF-8 JSON ({err})") from None
    if not (isinstance(directory, dict) and isinstance(directory.get("tenant"), str)
            and isinstance(directory.get("meta"), dict)
            and isinstance(directory.get("tensors"), dict)):
        raise FormatError("directory lacks tenant, meta or tensors")
    if header.flags & FLAG_TOMBSTONE and directory["tensors"]:
        raise FormatError("a tombstone lists tensors")
    return directory


def _tensor_view(raw: memoryview, name: str, entry: dict) -> np.ndarray:
    """A view of one tensor inside the raw payload, after checking its directory entry."""
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        offset, length = entry["offset"], entry["length"]
        # Plain loops and math.prod (exact on ints at any size): a record holds dozens of
        # tensors, checked on a tenant's first use
        valid = type(offset) is int and type(length) is int and offset % ALIGN == 0
        for n in shape:
            valid = valid and type(n) is int and n >= 0
        valid = valid and length == math.prod(shape) * dtype.itemsize and 0 <= offset and offset + length <= len(raw)
    except (KeyError, TypeError):
        valid = False
    if not valid:
        raise FormatError(f"tensor {name!r}: bad directory entry {entry!r}")
    return np.ndarray(shape, dtype, raw, offset)


def _raw_payload(mv: memoryview, header: _Header) -> memoryview:
    stored = mv[header.payload_offset:header.payload_offset + header.payload_length]
    if not header.flags & FLAG_ZSTD:
        return stored
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.raw_length)
    except zstandard.ZstdError as err:
        raise CorruptError(f"zstd payload does not decompress ({err})") from None
    if len(raw) != header.raw_length:
        raise CorruptError(f"zstd payload decompressed to {len(raw)} bytes, "
                           f"header says {header.raw_length}")
    return memoryview(bytearray(raw))  # writable, as an uncompressed record's views into a caller's buffer are


def _parse(buf, offset: int, length: int | None) -> tuple[dict, dict[str, np.ndarray], bool]:
    """(directory, tensor views, tombstone) of the verified record at offset."""
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    mv = memoryview(buf).cast("B")[offset:]
    if length is not None:
        if len(mv) < length:
            raise CorruptError(f"truncated: {len(mv)} of {length} bytes present")
        mv = mv[:length]
    header = _read_header(mv)
    if length is not None and header.record_length != length:
        raise CorruptError(f"header says {header.record_length} bytes, expected {length}")
    if len(mv) < header.record_length:
        raise CorruptError(f"truncated: {len(mv)} of {header.record_length} bytes present")
    mv = mv[:header.record_length]
    _verify(mv, header)
    directory = _parse_directory(mv, header)
    raw = _raw_payload(mv, header)
    views = {name: _tensor_view(raw, name, entry) for name, entry in directory["tensors"].items()}
    return directory, views, bool(header.flags & FLAG_TOMBSTONE)


def _located(offset: int, err: FormatError) -> FormatError:
    return type(err)(f"PET record at offset {offset}: {err}")


def _record(buf, offset: int, length: int | None, copy: bool = True) -> PetRecord:
    directory, views, tombstone = _parse(buf, offset, length)
    tensors = {name: view.copy() for name, view in views.items()} if copy else views
    return PetRecord(directory["tenant"], directory["meta"], tensors, tombstone)


def decode_record(buf, offset: int = 0, length: int | None = None, copy: bool = True) -> PetRecord:
    """The verified record at buf[offset:]; tensors are copies, so buf may be closed afterwards.

    copy=False: tensors are views into buf (writable only if buf is; zstd records: into a new
    buffer they share), for a buffer the caller owns and hands over. Each view pins all of it.
    length, when given (a manifest's byte range), must equal the record's own length.
    Raises CorruptError for damage (checksum, truncation), FormatError for anything else.
    """
    try:
        return _record(buf, offset, length, copy)
    except FormatError as err:
        error = _located(offset, err)
    # Raised outside the handler so the error drags along no frame holding a view of buf:
    # a caller's `with mmap` must still be able to close the map while the error propagates.
    raise error


def record_tensor_views(buf, offset: int, length: int) -> dict[str, np.ndarray]:
    """The record's tensors as views into buf (writable only if buf is), after full verification.

    Uncompressed records are not copied (the views pin buf: drop them before closing an mmap);
    zstd records are decompressed into a new buffer the views share.
    """
    try:
        return _parse(buf, offset, length)[1]
    except FormatError as err:
        error = _located(offset, err)
    raise error  # outside the handler, as in decode_record


def append_record(path, record: PetRecord) -> tuple[int, int]:
    """Append the record durably and return its (offset, length) in the file."""
    return append_encoded(path, encode_record(record))


def append_encoded(path, data: bytes, sync: bool = True) -> tuple[int, int]:
    """append_record for a record already encoded (a writer that needs its header_digest).

    A torn earlier append can leave the file off a page boundary; padding it first keeps every
    record page-aligned, which is what lets scan() resync after damage. sync=False leaves the
    fsync to the caller (one for many records), who must make it before a manifest names them.
    """
    created = not os.path.exists(path)
    with open(path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        if offset % PAGE:
            f.write(bytes(PAGE - offset % PAGE))
            offset = _align(offset, PAGE)
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    if created:
        # The new file's directory entry must be durable before a manifest names the file.
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return offset, len(data)


# -- a pack's identity (FORMAT.md section 2, File identity) ------------------------------------------


def header_digest(data, offset: int = 0) -> int:
    """The checksum a record's header ends with, as stored. It covers the header, and through
    dir_xxh64 and payload_xxh64 every byte of the record."""
    return struct.unpack_from("<Q", data, offset + _HASHED)[0]


def chain(value: int, digest: int) -> int:
    """Extend a pack's identity by one record: XXH64 of the record's header digest, seeded with
    the identity of the records before it. Appending extends it without rereading the file."""
    return xxhash.xxh64_intdigest(struct.pack("<Q", digest), value)


_WALK = struct.Struct("<8s8xQ")  # a header's magic and record_length, all a walk needs besides the digest


def walk_chain(file, start: int, end: int, value: int = 0) -> int:
    """Extend `value` (the identity of the records before `start`) over the records in bytes
    [start, end) of a pack: a path or an open file. Reads 128 bytes a record and trusts nothing
    else of it (a read checks the record it returns in full). CorruptError if the bytes are not
    whole records ending exactly at `end`."""
    if not hasattr(file, "fileno"):
        with open(file, "rb") as f:
            return walk_chain(f, start, end, value)
    fd, pread, xxh64 = file.fileno(), os.pread, xxhash.xxh64_intdigest
    offset = start
    while offset < end:  # a loop per record: keep it lean, big packs hold thousands
        head = pread(fd, HEADER_SIZE, offset)
        if len(head) < HEADER_SIZE:
            raise CorruptError(f"no record at byte {offset}")
        magic, length = _WALK.unpack_from(head)
        if magic != MAGIC:
            raise CorruptError(f"no record at byte {offset}")
        if length <= 0 or length % PAGE or offset + length > end:
            raise CorruptError(f"the record at byte {offset} ({length} bytes) does not end at a record "
                               f"boundary by byte {end}")
        value = xxh64(head[_HASHED:], value)  # = chain(value, header_digest(head)): the digest's own bytes
        offset += length
    return value


def directories(file, end: int) -> Iterator[tuple[int, int, str, dict, bool]]:
    """(offset, length, tenant, meta, tombstone) of each record in bytes [0, end) of a pack (a
    path or an open file), from its header and directory alone: what gc needs to tell whose
    bytes a dead record holds, without reading payloads. Header and directory are checked;
    CorruptError (or FormatError) at the first record that is not whole."""
    if not hasattr(file, "fileno"):
        with open(file, "rb") as f:
            yield from directories(f, end)
        return
    fd = file.fileno()
    offset = 0
    while offset < end:
        try:
            header = _read_header(memoryview(os.pread(fd, HEADER_SIZE, offset)))
            if offset + header.record_length > end:
                raise CorruptError(f"the record ({header.record_length} bytes) runs past byte {end}")
            mv = memoryview(os.pread(fd, HEADER_SIZE + header.dir_length, offset))
            if len(mv) < HEADER_SIZE + header.dir_length:
                raise CorruptError("truncated directory")
            if xxhash.xxh64_intdigest(mv[HEADER_SIZE:]) != header.dir_hash:
                raise CorruptError("directory checksum mismatch")
            directory = _parse_directory(mv, header)
        except FormatError as err:
            raise _located(offset, err) from None
        yield offset, header.record_length, directory["tenant"], directory["meta"], bool(header.flags & FLAG_TOMBSTONE)
        offset += header.record_length


def _next_record_page(fd: int, offset: int, size: int) -> int:
    """The first page after offset that starts with the record magic, or size if none does."""
    page = _align(offset + 1, PAGE)
    while page < size and os.pread(fd, len(MAGIC), page) != MAGIC:
        page += PAGE
    return min(page, size)


def scan(path, end: int | None = None) -> Iterator[tuple[int, int | None, PetRecord | FormatError]]:
    """Walk every record of a pack file from offset 0, for verify and diagnostics.

    Yields (offset, length, record) for good records and (offset, length or None, error) for a
    damaged one (length is None when even the header is unreadable); the error is a
    CorruptError for damage, a FormatError for bytes that are no v1 record. After an error
    the scan resyncs at the next page that starts with the record magic, so a damaged or
    torn record hides no later record. Records are read with pread: no mapping outlives it.
    With `end`, only the first `end` bytes are walked (a pack's committed part).
    """
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size if end is None else min(end, os.fstat(fd).st_size)
        offset = 0
        while offset < size:
            length = None
            try:
                length = _read_header(memoryview(os.pread(fd, HEADER_SIZE, offset))).record_length
                # A short read (torn tail) is reported as truncation by _record.
                record = _record(os.pread(fd, min(length, size - offset), offset), 0, length)
            except FormatError as err:
                yield offset, length, _located(offset, err)
                offset = _next_record_page(fd, offset, size)
                continue
            yield offset, length, record
            offset += length
