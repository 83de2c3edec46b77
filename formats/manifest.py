"""Manifest files and the CURRENT pointer (FORMAT.md sections 1 and 2).

A commit never changes a file a reader may be using: it writes a whole new manifest and then
swaps CURRENT by rename, so a reader sees either the old store or the new one, and a crash at
any point leaves one of the two.
"""

import json
import os

from formats.errors import CorruptError, FormatError
from formats.durable import write_durably
from formats.xxh64 import checksum

FORMAT_VERSION = 1
CURRENT = "CURRENT"


def manifest_name(generation):
    return f"MANIFEST-{generation:06d}"


def encode(manifest):
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    return body + b"\n#xxh64:%016x\n" % checksum(body)


def decode(data, name="manifest"):
    body, sep, trailer = data.rpartition(b"\n#xxh64:")
    if not sep or len(trailer.strip()) != 16:
        raise CorruptError(f"{name}: missing checksum line (truncated?)")
    try:
        digest = int(trailer.strip(), 16)
    except ValueError:
        raise CorruptError(f"{name}: unreadable checksum line") from None
    if checksum(body) != digest:
        raise CorruptError(f"{name}: checksum mismatch")
    manifest = json.loads(body)
    if manifest.get("format") != FORMAT_VERSION:
        raise FormatError(f"{name}: format version {manifest.get('format')} is not supported")
    return manifest


def commit(directory, manifest):
    """Make `manifest` the live one. It is durable and visible once this returns."""
    name = manifest_name(manifest["generation"])
    write_durably(os.path.join(directory, name), encode(manifest))
    write_durably(os.path.join(directory, CURRENT), name.encode() + b"\n")


def current_name(directory):
    path = os.path.join(directory, CURRENT)
    try:
        with open(path, "rb") as f:
            name = f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        raise FormatError(f"{directory}: not an hkstore store (no CURRENT file)") from None
    if not name.startswith("MANIFEST-") or "/" in name:
        raise CorruptError(f"{directory}: CURRENT does not name a manifest")
    return name


def load(directory):
    """The live manifest."""
    name = current_name(directory)
    try:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptError(f"{directory}: CURRENT names {name}, which is missing") from None
    return decode(data, name)
