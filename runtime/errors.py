"""The runtime's request errors: every room may raise them, runtime/__init__.py exports them."""

from hkstore.errors import StoreError


class BadRequest(ValueError):
    """A request that is not {tenant, text | ids}, or holds ids outside the vocabulary."""


class EmptyText(BadRequest):
    """The text (or ids) of a request holds no token."""


class TextTooLong(BadRequest):
    """The request has more tokens than the runtime's max_len."""


class IncompatiblePet(StoreError):
    """The tenant's PET was trained for another base model or a PLOT version this store does
    not hold, or its tensors do not fit the model."""


class Expired(RuntimeError):
    """A queued request whose deadline would pass before its batch could finish."""


class Unavailable(RuntimeError):
    """The worker process serving a request exited before it answered; the request may be sent
    again (a server answers 503 with Retry-After)."""
