"""The hkstore on-disk format (see FORMAT.md).

Readers and writers need NumPy, xxhash (section checksums) and zstandard (PET records). The
lookup hot path has an optional C build (formats/_probe.c, see formats/accel.py); the NumPy code
is the reference and the fallback.
"""

from formats.errors import CorruptError, FormatError

__all__ = ["CorruptError", "FormatError"]
