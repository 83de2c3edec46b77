"""Per-tenant API tokens: ``<tenant>~<secret>``, shown once at creation; STORE/tokens.json keeps
only a salted SHA-256 of each (runtime/serve/app.py checks them)."""

import hashlib
import hmac
import os
import secrets
import threading

from hkstore.store import NAME
from hkstore.files import atomic_write_json, read_json

TOKEN_SEP = "~"


def valid_name(name) -> bool:
    """check_name's rule, whole string (``$`` alone would let a trailing newline through)."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None

# -- tokens -------------------------------------------------------------------------------------


def new_tenant_token(tenant: str) -> str:
    return f"{tenant}{TOKEN_SEP}{secrets.token_urlsafe(32)}"


def hash_token(token: str, salt: bytes | None = None) -> dict:
    salt = salt if salt is not None else secrets.token_bytes(16)
    return {"scheme": "sha256-salted", "salt": salt.hex(),
            "hash": hashlib.sha256(salt + token.encode()).hexdigest()}


def token_matches(token: str, entry: dict) -> bool:
    try:
        salt = bytes.fromhex(entry["salt"])
    except (KeyError, ValueError, TypeError):
        return False
    return hmac.compare_digest(hash_token(token, salt)["hash"], str(entry.get("hash", "")))


class TokenStore:
    """STORE/tokens.json: tenant -> salted hash of its API token. Re-read when the file changes."""

    def __init__(self, store_path):
        self.path = os.path.join(store_path, "tokens.json")
        self._lock = threading.Lock()
        self._stamp = None
        self._tenants = {}

    def _load(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._tenants = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            data = read_json(self.path)
            self._tenants, self._stamp = dict(data.get("tenants", {})), stamp

    def tenants(self) -> dict:
        with self._lock:
            self._load()
            return self._tenants

    def verify(self, token: str):
        """The tenant whose token this is, or None."""
        tenant, sep, _ = token.partition(TOKEN_SEP)
        if not sep or not valid_name(tenant):
            return None
        entry = self.tenants().get(tenant)
        return tenant if entry and token_matches(token, entry) else None

    def _write(self, change):
        with self._lock:
            self._load()
            tenants = dict(self._tenants)
            change(tenants)
            atomic_write_json(self.path, {"format": 1, "tenants": tenants}, mode=0o600)
            self._stamp = None
            self._load()

    def set(self, tenant, entry):
        self._write(lambda t: t.__setitem__(tenant, entry))

    def remove(self, tenant):
        self._write(lambda t: t.pop(tenant, None))



# -- issue and revoke (`hkstore token issue/revoke STORE TENANT`) -------------------------------


def issue(store_path, tenant: str) -> dict:
    """A new API token for a tenant of the store (replacing any it had: the old one stops
    working); returns {tenant, token, file}. The token is shown only here."""
    import time

    import hkstore

    with hkstore.open(store_path) as store:
        if tenant not in store.snapshot().pets:
            raise hkstore.UnknownTenant(f"unknown tenant {tenant!r}")
    token = new_tenant_token(tenant)
    tokens = TokenStore(store_path)
    tokens.set(tenant, dict(hash_token(token), created=time.time(), issued_by="cli"))
    return {"tenant": tenant, "token": token, "file": tokens.path}


def revoke(store_path, tenant: str) -> dict:
    """Drop a tenant's API token (requests with it get 401); {tenant, revoked: whether it had one}."""
    import hkstore

    hkstore.open(store_path).close()  # a store, or a one-line StoreError
    tokens = TokenStore(store_path)
    had = tenant in tokens.tenants()
    if had:
        tokens.remove(tenant)
    return {"tenant": tenant, "revoked": had, "file": tokens.path}
