"""The errors a reader raises. Each carries one line a user can act on."""


class FormatError(Exception):
    """The bytes are not what the spec says (wrong magic, unknown version, bad shape)."""


class CorruptError(FormatError):
    """A checksum or length does not match: the file was damaged after it was written."""


class RollbackError(CorruptError):
    """CURRENT names an older manifest than one that exists: newer commits would vanish."""
