"""Copies of hot read-only arrays into anonymous memory backed by transparent huge pages.

A probe of a big segment reads two random cache lines per key (its index slot, then its key
row), each on its own 4 KiB page of the file mapping: a TLB miss and a page walk each, which on
a virtual machine (nested paging) costs more than the miss itself. Page-cache pages of a file
are mapped 4 KiB at a time unless the kernel happened to cache them as 2 MiB folios, so the
index and keys are copied, once, into memory advised MADV_HUGEPAGE: one TLB entry then covers
2 MiB instead of 4 KiB. The copy costs their size again in memory (about 20 bytes an entry at
n = 3), a small share of the values it serves.
"""

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def available():
    """Whether this kernel backs MADV_HUGEPAGE memory with huge pages (Linux, THP not 'never')."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


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
