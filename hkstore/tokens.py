"""Per-tenant API tokens: ``<tenant>~<secret>``, shown once at creation; STORE/tokens.json keeps
only a salted SHA-256 of each (runtime/serve/app.py checks them).

Every writer (``hkstore token issue/revoke``, the server's tenant jobs, in any process) holds
STORE/tokens.lock (flock) across its read-modify-write, so concurrent updates are never lost;
the write itself is atomic (temporary file, fsync, rename). A reader re-reads the file when it
changed, so a revoked token is refused as soon as ``revoke`` returns. A damaged file refuses
every tenant token (the admin token is not in it) and says why (``TokenStore.damage``); writers
refuse to build on it."""

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time

from hkstore.errors import StoreError
from hkstore.store import NAME
from hkstore.files import atomic_write_json

TOKEN_SEP = "~"
FORMAT = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A file whose mtime is this close to when it was read may be replaced within the same
# timestamp tick by a file of the same size (and a recycled inode): its content is compared
# until it is older than this.
_RACY_NS = 2_000_000_000


class TokenFileDamaged(StoreError):
    """STORE/tokens.json cannot be read as a token file."""


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


def entry_problem(entry):
    """Why a tokens.json entry cannot verify anything, or None."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, not an object"
    salt, digest = entry.get("salt"), entry.get("hash")
    if not isinstance(salt, str) or not isinstance(digest, str):
        return "salt or hash missing or not a string"
    try:
        if not bytes.fromhex(salt):
            return "empty salt"
    except ValueError:
        return "salt is not hex"
    if not _HEX64.fullmatch(digest):
        return "hash is not 64 hex digits"
    return None


def token_matches(token: str, entry) -> bool:
    if entry_problem(entry) is not None:
        return False
    return hmac.compare_digest(hash_token(token, bytes.fromhex(entry["salt"]))["hash"], entry["hash"])


def parse_tokens(data: bytes):
    """(tenants, problem) of a tokens.json's bytes: tenants maps every well-formed entry; problem
    says what is damaged (None: nothing). Any bytes at all give an answer, never an exception."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        return {}, f"not valid JSON ({str(e).splitlines()[0][:120]})"
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict):
        return {}, "no 'tenants' object"
    if doc.get("format", FORMAT) != FORMAT:
        return {}, f"unknown format {str(doc.get('format'))[:40]!r}"
    tenants, bad = {}, []
    for name, entry in doc["tenants"].items():
        problem = "invalid tenant name" if not valid_name(name) else entry_problem(entry)
        if problem is None:
            tenants[name] = entry
        else:
            bad.append(f"{name[:64]!r}: {problem}")
    if bad:
        return tenants, f"{len(bad)} damaged entr{'y' if len(bad) == 1 else 'ies'} ({'; '.join(bad[:3])})"
    return tenants, None


@contextlib.contextmanager
def _file_lock(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or when the process dies
        yield
    finally:
        os.close(fd)


class TokenStore:
    """STORE/tokens.json: tenant -> salted hash of its API token. Re-read when the file changes."""

    def __init__(self, store_path):
        self.path = os.path.join(store_path, "tokens.json")
        self.lock_path = os.path.join(store_path, "tokens.lock")
        self._lock = threading.Lock()
        self._stamp = None
        self._racy = False
        self._digest = None
        self._tenants = {}
        self.damage = None  # why the file cannot be used (every tenant token then fails), or None

    def _load(self):
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._stamp, self._digest, self._tenants, self.damage = None, None, {}, None
            return
        except OSError as e:
            self._set(None, None, {}, f"unreadable ({e.strerror or e})")
            return
        try:
            st = os.fstat(fd)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if stamp == self._stamp and not self._racy:
                return
            data = b""
            while chunk := os.read(fd, 1 << 20):
                data += chunk
        except OSError as e:
            self._set(None, None, {}, f"unreadable ({e.strerror or e})")
            return
        finally:
            os.close(fd)
        self._racy = time.time_ns() - st.st_mtime_ns < _RACY_NS
        digest = hashlib.sha256(data).digest()
        if digest != self._digest:
            tenants, problem = parse_tokens(data)
            self._set(stamp, digest, tenants, problem)
        self._stamp = stamp

    def _set(self, stamp, digest, tenants, problem):
        if problem is not None and problem != self.damage:
            import logging

            logging.getLogger("hkstore.tokens").error(
                "%s is damaged: %s; the tenant tokens it holds are refused until it is repaired or the tokens "
                "are issued again (hkstore token issue)", self.path, problem)
        self._stamp, self._digest, self._tenants, self.damage = stamp, digest, tenants, problem

    def tenants(self) -> dict:
        with self._lock:
            self._load()
            return self._tenants

    def problem(self):
        """Why tokens.json is damaged (read now), or None."""
        with self._lock:
            self._load()
            return self.damage

    def verify(self, token: str):
        """The tenant whose token this is, or None."""
        if not isinstance(token, str):
            return None
        tenant, sep, _ = token.partition(TOKEN_SEP)
        if not sep or not valid_name(tenant):
            return None
        entry = self.tenants().get(tenant)
        return tenant if entry is not None and token_matches(token, entry) else None

    def _write(self, change):
        with self._lock, _file_lock(self.lock_path):
            # The file as it is now, not as this process last saw it: another process may have
            # written it since.
            try:
                with open(self.path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                data = None
            except OSError as e:
                raise TokenFileDamaged(f"{self.path} is unreadable ({e.strerror or e})") from None
            tenants = {}
            if data is not None:
                try:
                    doc = json.loads(data.decode("utf-8"))
                except (ValueError, RecursionError):
                    doc = None
                if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict) \
                        or doc.get("format", FORMAT) != FORMAT:
                    raise TokenFileDamaged(
                        f"{self.path} is damaged ({parse_tokens(data)[1]}): repair it, or move it aside and "
                        "issue every tenant's token again (hkstore token issue)")
                tenants = doc["tenants"]  # damaged entries of other tenants are kept as they are
            if change(tenants) is False:
                return
            atomic_write_json(self.path, {"format": FORMAT, "tenants": tenants}, mode=0o600)
            self._stamp = None
            self._load()

    def set(self, tenant, entry):
        def put(tenants):
            tenants[tenant] = entry

        self._write(put)

    def remove(self, tenant):
        """Drop tenant's entry; whether it had one (read under the lock)."""
        had = []

        def drop(tenants):
            had.append(tenants.pop(tenant, None) is not None)
            return had[0]  # nothing to write when it had none

        self._write(drop)
        return had[0]



# -- issue and revoke (`hkstore token issue/revoke STORE TENANT`) -------------------------------


def issue(store_path, tenant: str) -> dict:
    """A new API token for a tenant of the store (replacing any it had: the old one stops
    working); returns {tenant, token, file}. The token is shown only here."""
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
    had = tokens.remove(tenant)
    return {"tenant": tenant, "revoked": had, "file": tokens.path}
