"""Position tables (FORMAT.md section 4, "Position tables"): one float32 (rows, d) array per
file, raw little-endian, no header; the manifest entry that names the file carries its row
count and XXH64, so a reader needs nothing else to check it.
"""

import os

import numpy as np

from formats.errors import CorruptError
from formats.durable import write_durably
from formats.xxh64 import checksum

DTYPE = np.dtype("<f4")


def write_position(path, table):
    """Write `table` (rows, d) durably; returns the manifest entry fields {rows, xxh64}."""
    table = np.ascontiguousarray(table, dtype=DTYPE)
    if table.ndim != 2 or not np.isfinite(table).all():
        raise ValueError("a position table must be a finite (rows, d) array")
    data = table.tobytes()
    write_durably(path, data)
    return {"rows": int(table.shape[0]), "xxh64": f"{checksum(data):016x}"}


def read_position(file, rows, d, xxh64):
    """The (rows, d) float32 table in `file` (an open binary file), checked against its
    manifest entry. Reads by offset, not from the file's position, so a failed read leaves
    nothing behind that a second read of the same open file would trip on."""
    name = os.path.basename(file.name)
    fd = file.fileno()
    size = os.fstat(fd).st_size
    parts, offset = [], 0
    while offset < size:  # pread may return less than asked for on big files
        part = os.pread(fd, size - offset, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
    data = b"".join(parts)
    if len(data) != rows * d * DTYPE.itemsize:
        raise CorruptError(f"position table {name}: {len(data)} bytes, expected {rows * d * DTYPE.itemsize}")
    if f"{checksum(data):016x}" != xxh64:
        raise CorruptError(f"position table {name}: checksum mismatch")
    return np.frombuffer(data, dtype=DTYPE).reshape(rows, d)
