"""Durable file writes: what every writer in formats/ relies on for "acknowledged means on disk"."""

import os


def fsync_dir(path):
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path, data: bytes):
    """Replace `path` with `data` so that a crash leaves the old file or the new one: a
    temporary file, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
