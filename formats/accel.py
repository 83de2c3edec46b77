"""The optional compiled fast path (formats/_probe.c), or None.

hkstore's lookup code has two implementations of the same rule: NumPy (the reference, always
there) and the C extension `formats._probe`, built by `pip install -e .` when a C compiler is
available (setup.py; the build is optional). Callers read `accel.ext` at call time:

    from formats import accel
    if accel.ext is not None: ...C path...
    else: ...NumPy path...

`HKSTORE_NO_ACCEL=1` in the environment forces the NumPy path; `use(False)` does the same from
Python (tests compare both paths in one process).
"""

import contextlib
import importlib
import os
import sys

API_VERSION = 2  # must match HK_API_VERSION in formats/_probe.c: a stale build is ignored

try:
    from formats import _probe as _compiled
except ImportError as e:  # not built, or built for another Python
    _compiled, IMPORT_ERROR = None, f"{type(e).__name__}: {e}"
else:
    IMPORT_ERROR = None
    if getattr(_compiled, "API_VERSION", None) != API_VERSION:
        IMPORT_ERROR = (f"formats/_probe is a stale build (API {getattr(_compiled, 'API_VERSION', None)}, "
                        f"expected {API_VERSION}): rebuild with `pip install -e .`")
        _compiled = None

if _compiled is not None and sys.byteorder != "little":  # the C gather copies little-endian bytes as is
    _compiled, IMPORT_ERROR = None, "big-endian host: the C path assumes native = little-endian"

BUILT = _compiled is not None  # the extension is importable
DISABLED_BY_ENV = os.environ.get("HKSTORE_NO_ACCEL", "").strip() not in ("", "0")
ext = None if DISABLED_BY_ENV else _compiled  # what callers use: the module, or None for NumPy
HAVE_ACCEL = ext is not None


def use(enabled=True):
    """Switch the fast path on or off for this process (on needs it built). Returns the previous
    state; also usable as `with accel.using(False): ...`."""
    global ext, HAVE_ACCEL
    previous = ext is not None
    ext = _compiled if enabled else None
    HAVE_ACCEL = ext is not None
    return previous


@contextlib.contextmanager
def using(enabled):
    previous = use(enabled)
    try:
        yield ext
    finally:
        use(previous)


def describe():
    """One line for reports: whether lookups run on the C path, and why not if they don't."""
    if ext is not None:
        return "C accelerator (formats._probe)"
    if BUILT:
        return "NumPy (accelerator built but disabled: HKSTORE_NO_ACCEL or accel.use(False))"
    return f"NumPy (accelerator not built: {IMPORT_ERROR})"


def extension(name: str, api_version: int):
    """Another optional C extension built with the package (setup.py), e.g.
    "runtime.exec._fused": the module, or None when it is not built, is a stale build (its
    API_VERSION is not api_version) or HKSTORE_NO_ACCEL is set. Its caller keeps a reference
    path for None, as the lookups do for this module's."""
    if DISABLED_BY_ENV:
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return module if getattr(module, "API_VERSION", None) == api_version else None
