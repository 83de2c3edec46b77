"""Manifest files and the CURRENT pointer (FORMAT.md sections 1 and 2).

A commit never changes a file a reader may be using: it writes a whole new manifest and then
swaps CURRENT by rename, so a reader sees either the old store or the new one, and a crash at
any point leaves one of the two.
"""

import json
import os
import re

from formats.errors import CorruptError, FormatError, RollbackError
from formats.durable import fsync_dir, write_durably
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
    """Make `manifest` the live one. It is durable and visible once this returns.

    CURRENT.tmp (naming the new manifest) is made durable before the manifest itself, so a
    writer killed between writing MANIFEST-<g> and the CURRENT rename leaves a manifest one
    generation newer than CURRENT that CURRENT.tmp names: a provably uncommitted one. Any other
    manifest newer than CURRENT means CURRENT was rolled back (see load)."""
    name = manifest_name(manifest["generation"])
    pending = os.path.join(directory, CURRENT + ".tmp")
    with open(pending, "wb") as f:
        f.write(name.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    write_durably(os.path.join(directory, name), encode(manifest))  # its directory fsync covers CURRENT.tmp too
    os.replace(pending, os.path.join(directory, CURRENT))
    fsync_dir(directory)


def current_name(directory):
    """The manifest CURRENT names. CURRENT must be exactly `MANIFEST-<6+ digits>` and one
    newline: anything else (a lost newline included) is damage, never guessed around."""
    path = os.path.join(directory, CURRENT)
    try:
        with open(path, "rb") as f:
            data = f.read(256)
    except FileNotFoundError:
        if os.path.isdir(directory) and any(generation_of(n) is not None for n in os.listdir(directory)):
            raise CorruptError(f"{directory}: CURRENT is missing though manifests are here: run hkstore verify") from None
        raise FormatError(f"{directory}: not an hkstore store (no CURRENT file)") from None
    match = _CURRENT.fullmatch(data)
    if match is None:
        raise CorruptError(f"{directory}: CURRENT is damaged ({data[:40]!r}; expected one line "
                           "'MANIFEST-<number>' ending in a newline): run hkstore verify")
    return match.group(1).decode()


_CURRENT = re.compile(rb"(MANIFEST-[0-9]{6,})\n")
_MANIFEST = re.compile(r"MANIFEST-([0-9]{6,})")


def generation_of(name):
    match = _MANIFEST.fullmatch(name)
    return int(match.group(1)) if match else None


def pending_name(directory):
    """The manifest CURRENT.tmp names (a commit in flight, or one a crash cut off), or None."""
    try:
        with open(os.path.join(directory, CURRENT + ".tmp"), "rb") as f:
            match = _CURRENT.fullmatch(f.read(256))
    except OSError:
        return None
    return match.group(1).decode() if match else None


def newer_manifests(directory, current):
    """Manifests newer than `current` that are not a provably uncommitted one (the next
    generation while CURRENT.tmp names it). Generations only grow, so any of these means CURRENT
    was set back (rolled back, or restored from an older copy)."""
    g = generation_of(current)
    names = os.listdir(directory)
    pending = pending_name(directory)  # after the listing: a manifest listed has its CURRENT.tmp written
    out = []
    for name in names:
        other = generation_of(name)
        if other is not None and other > g and not (other == g + 1 and name == pending):
            out.append(name)
    return sorted(out)


def orphan(directory, current):
    """The uncommitted next manifest a killed writer left (CURRENT.tmp names it), or None."""
    pending = pending_name(directory)
    if pending and generation_of(pending) == generation_of(current) + 1 \
            and os.path.exists(os.path.join(directory, pending)):
        return pending
    return None


def load(directory, allow_rollback=False):
    """The live manifest. Raises RollbackError when a manifest newer than the one CURRENT
    names exists (unless allow_rollback), CorruptError for a damaged or missing manifest."""
    for attempt in range(20):
        name = current_name(directory)
        try:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        newer = [] if allow_rollback else newer_manifests(directory, name)
        if current_name(directory) != name:
            continue  # a commit (and gc of the old manifest) raced with us: read the new one
        if data is None:
            raise CorruptError(f"{directory}: CURRENT names {name}, which is missing")
        if newer:
            raise RollbackError(
                f"{directory}: CURRENT names {name} but newer {', '.join(newer[-3:])} exist(s): CURRENT was "
                "rolled back or restored from an older copy, and the newer commits are not visible. Run "
                "hkstore verify; to read the older state anyway open it read-only with allow_rollback=True")
        manifest = decode(data, name)
        if manifest.get("generation") != generation_of(name):
            raise CorruptError(f"{name}: holds generation {manifest.get('generation')}, not its own")
        return manifest
    raise CorruptError(f"{directory}: CURRENT keeps changing; is a writer committing in a loop?")


def identity(size, digest):
    """A file's identity as a manifest records it (FORMAT.md section 2, File identity)."""
    return {"size": int(size), "xxh64": f"{digest:016x}"}


def identities(manifest):
    """File name -> identity; empty for a manifest written before identities existed."""
    return manifest.get("files", {})


def not_the_file(what, have, want):
    """The error for a file whose identity is not the one the manifest records."""
    return CorruptError(
        f"{what}: not the file the manifest names (it is {have}; the manifest records size {want['size']}, "
        f"xxh64 {want['xxh64']}): another file was put in its place (a misdirected copy or restore?) or it "
        "was damaged; run hkstore verify")


def value_slots(meta) -> int:
    """Vectors a store keeps per key: meta "value_slots" (1: the key's last slot only, what a
    decoder store serves), or all n where it is absent (FORMAT.md section 2)."""
    return int(meta.get("value_slots", meta["n"]))
