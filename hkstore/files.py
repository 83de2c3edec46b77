"""Small files written so that a crash leaves the old bytes or the new, never a mix (the
server's job records and token file; the store itself has its own commit protocol)."""

import contextlib
import json
import os
import threading

from formats.durable import fsync_dir


def atomic_write(path, data: bytes, mode: int = 0o644):
    """Write a file so that readers see the old or the new bytes, never a mix: a temporary
    file, fsync, rename over `path`, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path, obj, mode: int = 0o644):
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str).encode(), mode)


def read_json(path):
    with open(path, "rb") as f:
        return json.loads(f.read())
