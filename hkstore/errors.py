"""Errors the engine raises for things a user did or can fix. The CLI prints them as one line."""

from formats.errors import CorruptError, FormatError


class StoreError(Exception):
    """A request the store cannot carry out (unknown name, bad argument, wrong state)."""


class StoreLocked(StoreError):
    """Another process holds the store's writer lock."""


class UnknownVersion(StoreError):
    pass


class UnknownTenant(StoreError):
    pass


__all__ = ["CorruptError", "FormatError", "StoreError", "StoreLocked", "UnknownTenant", "UnknownVersion"]
