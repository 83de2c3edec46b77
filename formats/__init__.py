"""The hkstore on-disk format (see FORMAT.md). NumPy plus the xxhash checksum library only."""

from formats.errors import CorruptError, FormatError

__all__ = ["CorruptError", "FormatError"]
