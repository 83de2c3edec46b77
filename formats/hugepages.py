"""Huge pages for a segment's hot read-only memory.

A lookup reads random cache lines of a big segment: an index slot and a key row per key, then
a value row. Each sits on its own 4 KiB page of the file mapping, so each costs a TLB miss and
a page walk, which on a virtual machine (nested paging) costs more than the miss itself; a
batch's gather of value rows from 4 KiB mappings runs at about 0.8 of the same gather from
huge-page memory. Two ways to 2 MiB pages, tried in this order:

- the file mapping itself (advise, reread): a Linux 6.x kernel with large-folio page cache
  maps a file's 2 MiB folios with one page-table entry each, and reads a mapping advised
  MADV_HUGEPAGE into such folios. A file already cached in small folios (written a moment
  ago, or read at random before the advice) stays small until its pages are evicted and read
  again. No extra memory.
- copies (huge_copy) of the index and keys in anonymous memory advised MADV_HUGEPAGE, where
  the file cannot be: about 20 bytes an entry at n = 3, a small share of the values.
"""

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.12


def available():
    """Whether this kernel backs MADV_HUGEPAGE memory with huge pages (Linux, THP not 'never')."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def advise(mm):
    """Advise a file mapping for huge pages, so the kernel maps the file's 2 MiB page-cache folios
    with one TLB entry each (and reads the file into such folios). Needs THP for files (Linux 6.x
    with large-folio filesystems); elsewhere the advice is refused or has no effect, which only
    costs the speed-up. Returns whether the advice was taken."""
    if len(mm) < HUGE_PAGE or not available():
        return False
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def populate(mm):
    """Map every page of `mm` into this process now, reading what is not cached."""
    try:
        mm.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError):
        np.frombuffer(mm, dtype=np.uint8)[::4096].sum()  # older kernels: touch a byte a page


def pmd_share(mm):
    """The share of `mm`'s bytes this process maps with 2 MiB entries (/proc/self/smaps);
    0.0 where that cannot be read."""
    if not len(mm):
        return 0.0
    try:
        with open("/proc/self/smaps") as f:
            pmd = file_pmd_bytes(f, np.frombuffer(mm, dtype=np.uint8).ctypes.data)
    except (OSError, ValueError):
        return 0.0
    return min(1.0, pmd / len(mm))


def file_pmd_bytes(smaps_lines, address):
    """FilePmdMapped, in bytes, of the mapping that holds `address`, from smaps lines."""
    inside = False
    for line in smaps_lines:
        head = line.split(None, 1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "FilePmdMapped:":
            return int(line.split()[1]) * 1024
    return 0


def reread(mm, path):
    """Evict `path`'s cached pages and read them again through the advised mapping `mm`, so the
    kernel caches them as 2 MiB folios. Only pages no other process maps are evicted; the data
    read back is the same file's (segments are immutable), so readers running meanwhile
    just fault again."""
    try:
        mm.madvise(mmap.MADV_DONTNEED)  # drop this process's 4 KiB mappings; the file is untouched
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    populate(mm)


def huge_copy(array):
    """A read-only copy of `array` (same dtype and shape) starting on a huge-page boundary of
    anonymous memory advised for huge pages. The mapping lives as long as the copy."""
    nbytes = array.nbytes
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mm, dtype=np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE  # THP maps only 2 MiB-aligned ranges
    out = raw[skip:skip + nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    out.flags.writeable = False
    return out
