"""Build a CUDA kernel source with g++ against cuda_emu.h and launch its kernels via ctypes.

:class:`EmuModule` takes the complete text of one kernel module (``kernel_sources()[name]``,
unchanged), parses its ``extern "C" __global__`` signatures, writes a translation unit
(``#include "cuda_emu.h"``, the source, one launch trampoline per kernel) and builds it into a
shared library, cached under ``$HKSTORE_EMU_CACHE`` (default ``~/.cache/hkstore/emu``) in a
directory named by a hash of the source, the header, this file's generator and the flags.

:class:`EmuFunction` launches one kernel: ``fn(grid, block, args)`` as CuPy's RawKernel. Every
launch is checked before it runs:

* the arguments against the kernel's C signature: count; pointer parameters take a
  C-contiguous NumPy array (the CuPy stand-in's device arrays are NumPy arrays) of the
  pointee's dtype (``unsigned short`` also takes float16: the kernels' raw fp16 bits);
  scalar parameters take a NumPy scalar of exactly the parameter's type (``np.int32`` for
  ``int``, ``np.int64`` for ``long long``, ``np.float32`` for ``float``), never a Python
  number whose C type would be a guess;
* CUDA's limits: grid x <= 2^31 - 1, y and z <= 65535, every extent >= 1; block x, y <= 1024,
  z <= 64, x*y*z <= 1024 and <= the kernel's ``__launch_bounds__``; static ``__shared__``
  bytes <= 48 KiB (counted over the whole module: an upper bound per kernel); no dynamic
  shared memory (no source declares ``extern __shared__``).

Memory: every pointer argument is copied into a staging buffer (arguments whose memory
overlaps share one, so aliasing such as in-place ``y = x`` behaves as on the device) with
guard zones of poison bytes (0xFF) on both sides; after the kernel the guards must be intact
(an out-of-bounds write fails the launch), the buffers of const arguments must be unchanged,
and the others are copied back.  Out-of-bounds reads see poison (NaN as floats, -1 as ints).
With ``HKSTORE_EMU_SANITIZE=1`` the library is built with ``-fsanitize=address,undefined``
and the staging buffers get no guard zones, so AddressSanitizer's redzones sit right at
every argument's ends and any out-of-bounds read or write is reported; the process must
then have libasan preloaded (see kernels/NOTES.md).

Block order: forward (default), reverse or random with a seed - from ``block_order()``, or
the environment variable ``HKSTORE_EMU_BLOCK_ORDER`` (``forward``, ``reverse``,
``random`` or ``random:SEED``).  The order also picks the thread schedule inside a block
(round robin; warp by warp with lanes reversed; warp by warp in random order: see
cuda_emu.h).  Race-free kernels whose blocks write disjoint outputs give identical results
in every order.

Launches are serialised (one lock per process), as kernels of one device stream would be.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

__all__ = [
    "EmuError",
    "EmuFunction",
    "EmuModule",
    "KernelSignature",
    "Param",
    "block_order",
    "compiler",
    "compiler_missing_reason",
    "parse_kernels",
    "sanitize_enabled",
]

HEADER = "cuda_emu.h"
GUARD = 256                  # guard bytes (poison) before and after each staged argument
POISON = 0xFF
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
MAX_STATIC_SHARED = 48 << 10
_GENERATOR_VERSION = "1"      # bump when the generated translation unit changes

_BASE_FLAGS = ("-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off", "-fno-strict-aliasing",
               "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0", "-Wno-unknown-pragmas", "-Wno-attributes")
_FAST_FLAGS = ("-O2",)
_SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined")

# C base types the kernels use -> NumPy dtype.
_C_TYPES = {
    "float": np.float32, "double": np.float64,
    "char": np.int8, "signed char": np.int8, "unsigned char": np.uint8,
    "short": np.int16, "unsigned short": np.uint16,
    "int": np.int32, "unsigned int": np.uint32, "unsigned": np.uint32,
    "long": np.int64, "unsigned long": np.uint64,
    "long long": np.int64, "unsigned long long": np.uint64,
    "bool": np.bool_,
}
_CTYPES = {
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
    np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.bool_): ctypes.c_bool,
}
_ORDERS = {"forward": 0, "reverse": 1, "random": 2}

_launch_lock = threading.RLock()
_order_state = threading.local()
_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class EmuError(RuntimeError):
    """A launch the emulation refused or a kernel that misbehaved (the message says which)."""


# -- configuration ------------------------------------------------------------------------------


def sanitize_enabled() -> bool:
    return os.environ.get("HKSTORE_EMU_SANITIZE", "") not in ("", "0")


def compiler() -> str | None:
    """The C++ compiler used (``$CXX`` or g++), or None when there is none."""
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def compiler_missing_reason() -> str | None:
    """Why the emulation cannot run here (no compiler, no _Float16, no libasan loaded in a
    sanitizer run), or None when it can."""
    cxx = compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) found: the CUDA emulation needs g++ >= 12"
    if not _probe_float16(cxx):
        return f"{cxx} has no _Float16 (g++ >= 12 needed)"
    if shutil.which("nm") is None:
        return "nm (binutils) not found: needed to locate the kernels' __shared__ variables"
    if sanitize_enabled() and not _asan_loaded():
        return ("HKSTORE_EMU_SANITIZE=1 needs libasan loaded first: "
                'LD_PRELOAD="$(g++ -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 python -m pytest ...')
    return None


_float16_probe: dict[str, bool] = {}


def _probe_float16(cxx: str) -> bool:
    if cxx not in _float16_probe:
        with tempfile.TemporaryDirectory() as d:
            src = Path(d, "p.cpp")
            src.write_text("int main() { _Float16 h = (_Float16)1.5f; return (float)h == 1.5f ? 0 : 1; }\n")
            r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, check=False)
            _float16_probe[cxx] = r.returncode == 0
    return _float16_probe[cxx]


def _asan_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def cache_dir() -> Path:
    """$HKSTORE_EMU_CACHE, else ~/.cache/hkstore/emu, else (no usable home) a per-user temp dir."""
    root = os.environ.get("HKSTORE_EMU_CACHE")
    if root:
        return Path(root)
    try:
        home = Path.home() / ".cache" / "hkstore" / "emu"
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except (OSError, RuntimeError):
        pass
    return Path(tempfile.gettempdir()) / f"hkstore-emu-{os.getuid()}"


@contextlib.contextmanager
def block_order(order: str, seed: int = 0):
    """Run the launches of this thread's block in `order` (forward, reverse, random)."""
    if order not in _ORDERS:
        raise ValueError(f"block order must be one of {sorted(_ORDERS)}, got {order!r}")
    prev = getattr(_order_state, "value", None)
    _order_state.value = (order, int(seed))
    try:
        yield
    finally:
        _order_state.value = prev


def _current_order() -> tuple[int, int]:
    value = getattr(_order_state, "value", None)
    if value is None:
        env = os.environ.get("HKSTORE_EMU_BLOCK_ORDER", "forward")
        name, _, seed = env.partition(":")
        if name not in _ORDERS:
            raise EmuError(f"HKSTORE_EMU_BLOCK_ORDER={env!r}: use forward, reverse, random or random:SEED")
        value = (name, int(seed or 0))
    return _ORDERS[value[0]], value[1]


# -- signatures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str             # the declared type, verbatim (e.g. "const int* __restrict__")
    pointer: bool
    const: bool            # pointee is const (pointer parameters)
    dtype: np.dtype        # pointee (pointer) or value (scalar) dtype


@dataclass(frozen=True)
class KernelSignature:
    name: str
    params: tuple[Param, ...]
    launch_bounds: str | None   # the expression, evaluated by the compiler


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _balanced(text: str, i: int) -> tuple[str, int]:
    """The text inside the parentheses opening at text[i], and the index after the closing one."""
    if text[i] != "(":
        raise ValueError("expected '('")
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
    raise ValueError("unbalanced parentheses")


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return [s.strip() for s in out]


def _typedefs(text: str) -> dict[str, str]:
    return {m.group(2): " ".join(m.group(1).split()) for m in re.finditer(r"\btypedef\s+([^;{}]+?)\s+(\w+)\s*;", text)}


def _param(decl: str, typedefs: dict[str, str], kernel: str) -> Param:
    m = re.fullmatch(r"(.*?)(\w+)\s*", decl, flags=re.DOTALL)
    if not m or not m.group(1).strip():
        raise EmuError(f"{kernel}: cannot parse parameter {decl!r}")
    ctype, name = " ".join(m.group(1).split()), m.group(2)
    stars = ctype.count("*")
    if stars > 1 or "[" in ctype or "&" in ctype:
        raise EmuError(f"{kernel}: parameter {decl!r}: only scalars and single pointers are supported")
    words = [w for w in ctype.replace("*", " * ").split() if w not in ("__restrict__", "restrict", "volatile")]
    pointer = "*" in words
    if pointer:
        k = words.index("*")
        if any(w not in ("const",) for w in words[k + 1 :]):
            raise EmuError(f"{kernel}: parameter {decl!r}: unexpected qualifiers after '*'")
        words = words[:k]
    const = "const" in words
    base = " ".join(w for w in words if w != "const")
    seen = set()
    while base in typedefs and base not in seen:
        seen.add(base)
        inner = [w for w in typedefs[base].split() if w != "const"]
        base = " ".join(inner)
    base = base.replace("signed int", "int") if base == "signed int" else base
    if base == "void":
        raise EmuError(f"{kernel}: parameter {decl!r}: void pointers are not supported")
    if base not in _C_TYPES:
        raise EmuError(f"{kernel}: parameter {decl!r}: unsupported type {base!r}")
    return Param(name, ctype, pointer, const if pointer else False, np.dtype(_C_TYPES[base]))


def parse_kernels(source: str) -> list[KernelSignature]:
    """The ``extern "C" __global__ void`` kernels of a CUDA source, in order."""
    text = _strip_comments(source)
    typedefs = _typedefs(text)
    out = []
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\b', text):
        i = m.end()
        bounds = None
        rest = text[i:]
        lb = re.match(r"\s*__launch_bounds__\s*", rest)
        if lb:
            j = i + lb.end()
            inner, j = _balanced(text, j)
            bounds = _split_top(inner)[0]
            i = j
        nm = re.match(r"\s*(\w+)\s*", text[i:])
        if not nm:
            raise EmuError(f"cannot parse the kernel declaration at {text[m.start():m.start() + 80]!r}")
        name = nm.group(1)
        inner, _ = _balanced(text, i + nm.end())
        params = tuple(_param(p, typedefs, name) for p in _split_top(inner) if p and p != "void")
        out.append(KernelSignature(name, params, bounds))
    return out


# -- build -----------------------------------------------------------------------------------------


def _header_path() -> Path:
    return Path(str(resources.files(__package__).joinpath(HEADER)))


def _translation_unit(sigs: list[KernelSignature]) -> str:
    lines = [f'#include "{HEADER}"', '#include "kernel.cu"', "", "namespace {"]
    for k, sig in enumerate(sigs):
        lines.append(f"void hkemu_body_{k}(void** a) {{")
        for i, p in enumerate(sig.params):
            lines.append(f"    using P{i} = {p.ctype};")
            lines.append(f"    static_assert(sizeof(P{i}) == {8 if p.pointer else p.dtype.itemsize}, "
                         f'"{sig.name}: parameter {p.name} has an unexpected size");')
        call = ", ".join(f"*static_cast<P{i}*>(a[{i}])" for i in range(len(sig.params)))
        lines.append(f"    {sig.name}({call});")
        lines.append("}")
    lines.append("}  // namespace")
    lines.append("")
    lines.append("#define HKEMU_EXPORT extern \"C\" __attribute__((visibility(\"default\")))")
    bodies = ", ".join(f"hkemu_body_{k}" for k in range(len(sigs)))
    lines.append(f"static void (*const hkemu_bodies[])(void**) = {{{bodies}}};")
    lines.append(f"HKEMU_EXPORT const int hkemu_kernel_count = {len(sigs)};")
    bounds = ", ".join(f"(int)({s.launch_bounds})" if s.launch_bounds else "0" for s in sigs)
    lines.append(f"HKEMU_EXPORT const int hkemu_launch_bounds[] = {{{bounds}}};")
    lines.append("HKEMU_EXPORT void hkemu_set_shared(hk_emu::SharedVar* v, int n) "
                 "{ hk_emu::g_shared = v; hk_emu::g_shared_count = n; }")
    lines.append("HKEMU_EXPORT int hkemu_launch(int k, const unsigned* grid, const unsigned* block, void** args,")
    lines.append("                              int order, unsigned long long seed, char* err, int errlen) {")
    lines.append(f"    if (k < 0 || k >= {len(sigs)}) {{ snprintf(err, errlen, \"no kernel %d\", k); return 1; }}")
    lines.append("    return hk_emu::launch(hkemu_bodies[k], args, grid, block, order, seed, err, errlen);")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _flags(sanitize: bool, extra: tuple[str, ...]) -> tuple[str, ...]:
    return _BASE_FLAGS + (_SANITIZE_FLAGS if sanitize else _FAST_FLAGS) + tuple(extra)


_build_lock = threading.Lock()
_libraries: dict[str, tuple] = {}   # path -> what _load returns; libraries stay loaded


def _build(source: str, sigs: list[KernelSignature], sanitize: bool, extra_flags: tuple[str, ...]) -> Path:
    cxx = compiler()
    reason = compiler_missing_reason()
    if reason:
        raise EmuError(reason)
    header = _header_path().read_bytes()
    unit = _translation_unit(sigs)
    flags = _flags(sanitize, extra_flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (source.encode(), header, unit.encode(), "\0".join(flags).encode(), "".join(version).encode(),
                 _GENERATOR_VERSION.encode()):
        key.update(hashlib.sha256(part).digest())
    digest = key.hexdigest()[:32]
    out_dir = cache_dir() / digest
    lib = out_dir / "module.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
    try:
        (tmp / HEADER).write_bytes(header)
        (tmp / "kernel.cu").write_text(source, encoding="utf-8")
        (tmp / "unit.cpp").write_text(unit, encoding="utf-8")
        cmd = [cxx, *flags, "-I", str(tmp), "-x", "c++", str(tmp / "unit.cpp"), "-o", str(tmp / "module.so")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise EmuError(f"g++ failed to build the emulated module ({' '.join(cmd)}):\n{r.stderr[-6000:]}")
        for name in (HEADER, "kernel.cu", "unit.cpp"):   # kept next to the library for debugging
            os.replace(tmp / name, out_dir / name)
        (tmp / "shared.txt").write_text(_shared_symbols(tmp / "module.so"))
        os.replace(tmp / "shared.txt", out_dir / "shared.txt")
        os.replace(tmp / "module.so", lib)              # atomic: concurrent builders agree
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


def _shared_symbols(lib: Path) -> str:
    """Lines "offset size name" of the library's function-local statics (the __shared__
    variables: CUDA device code can have no other), and one line "anchor offset" for
    hkemu_kernel_count, from which the load address follows."""
    nm = shutil.which("nm")
    if nm is None:
        raise EmuError("nm (binutils) not found: needed to locate the __shared__ variables")
    r = subprocess.run([nm, "-S", "--defined-only", str(lib)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EmuError(f"nm failed on {lib}: {r.stderr}")
    out, anchor = [], None
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "bBdDuV" and parts[3].startswith("_ZZ"):
            out.append(f"{int(parts[0], 16)} {int(parts[1], 16)} {parts[3]}")
        elif len(parts) >= 3 and parts[-1] == "hkemu_kernel_count":
            anchor = int(parts[0], 16)
    if anchor is None:
        raise EmuError(f"no hkemu_kernel_count symbol in {lib}")
    return "\n".join([f"anchor {anchor}", *out]) + "\n"


def _guard_pattern(zone: int) -> bytes:
    """Guard zone `zone`'s bytes: NaN as fp32 and fp16, negative as ints, and different for
    every zone, so that a kernel copying another argument's guard (an out-of-bounds read)
    into this one (an out-of-bounds write) still changes it."""
    return bytes([POISON, POISON, 0x80 | (zone % 128), POISON]) * (GUARD // 4)


class _SharedVar(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("n", ctypes.c_ulonglong)]


def _load(path: Path, kernels: int) -> tuple:
    """(library, shared-variable table, their names, their bytes, launch bounds) of a build."""
    lib = ctypes.CDLL(str(path))
    lib.hkemu_launch.restype = ctypes.c_int
    lib.hkemu_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong,
                                 ctypes.c_char_p, ctypes.c_int]
    lib.hkemu_set_shared.restype = None
    lib.hkemu_set_shared.argtypes = [ctypes.c_void_p, ctypes.c_int]
    count = ctypes.c_int.in_dll(lib, "hkemu_kernel_count").value
    if count != kernels:
        raise EmuError("the built library does not match the parsed signatures")
    bounds = list((ctypes.c_int * count).in_dll(lib, "hkemu_launch_bounds"))
    lines = (path.parent / "shared.txt").read_text().split("\n")
    anchor = int(lines[0].split()[1])
    base = ctypes.addressof(ctypes.c_int.in_dll(lib, "hkemu_kernel_count")) - anchor
    shared = [(int(a), int(n), name) for a, n, name in (ln.split() for ln in lines[1:] if ln.strip())]
    table = (_SharedVar * max(len(shared), 1))(*[_SharedVar(base + a, n) for a, n, _ in shared])
    lib.hkemu_set_shared(ctypes.addressof(table), len(shared))
    return lib, table, [name for _, _, name in shared], sum(n for _, n, _ in shared), bounds


# -- modules and launches -------------------------------------------------------------------------


class EmuModule:
    """One kernel source built for the emulation; ``get_function(name)`` as CuPy's RawModule."""

    def __init__(self, code: str, *, sanitize: bool | None = None, extra_flags: tuple[str, ...] = ()):
        self.code = code
        self.sanitize = sanitize_enabled() if sanitize is None else bool(sanitize)
        self.signatures = parse_kernels(code)
        if not self.signatures:
            raise EmuError('no extern "C" __global__ kernel in the source')
        names = [s.name for s in self.signatures]
        if len(set(names)) != len(names):
            raise EmuError(f"duplicate kernel names: {names}")
        with _build_lock:
            path = _build(code, self.signatures, self.sanitize, tuple(extra_flags))
            loaded = _libraries.get(str(path))
            if loaded is None:
                loaded = _libraries[str(path)] = _load(path, len(self.signatures))
        self.path = path
        self._lib, self._shared_table, self.shared_variables, self.static_shared_bytes, bounds = loaded
        self.launch_bounds = {s.name: (int(bounds[k]) or None) for k, s in enumerate(self.signatures)}
        self._functions = {s.name: EmuFunction(self, k, s) for k, s in enumerate(self.signatures)}

    def get_function(self, name: str) -> EmuFunction:
        try:
            return self._functions[name]
        except KeyError:
            raise EmuError(f"no kernel {name!r} in this module; have {sorted(self._functions)}") from None


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value,)
    if not isinstance(value, tuple) or not 1 <= len(value) <= 3:
        raise EmuError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    out = []
    for v in value:
        if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
            raise EmuError(f"{what} {value!r}: {v!r} is not an int")
        out.append(int(v))
    return tuple(out + [1] * (3 - len(out)))


class EmuFunction:
    """One kernel of an :class:`EmuModule`: ``fn(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, module: EmuModule, index: int, sig: KernelSignature):
        self.module = module
        self.index = index
        self.signature = sig
        self.name = sig.name
        self.launches = 0

    def _check_config(self, grid, block, shared_mem) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        g, b = _dims(grid, "grid"), _dims(block, "block")
        name = self.name
        if min(g) < 1 or min(b) < 1:
            raise EmuError(f"{name}: grid {g} / block {b}: every extent must be >= 1 (invalid configuration)")
        if g[0] > MAX_GRID_X or g[1] > MAX_GRID_YZ or g[2] > MAX_GRID_YZ:
            raise EmuError(f"{name}: grid {g} exceeds CUDA's limits ({MAX_GRID_X}, {MAX_GRID_YZ}, {MAX_GRID_YZ})")
        if any(v > m for v, m in zip(b, MAX_BLOCK)):
            raise EmuError(f"{name}: block {b} exceeds CUDA's per-dimension limits {MAX_BLOCK}")
        threads = b[0] * b[1] * b[2]
        if threads > MAX_THREADS:
            raise EmuError(f"{name}: block {b} has {threads} threads > {MAX_THREADS}")
        bound = self.module.launch_bounds[name]
        if bound is not None and threads > bound:
            raise EmuError(f"{name}: block {b} has {threads} threads > __launch_bounds__({bound})")
        if not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
            raise EmuError(f"{name}: shared_mem must be an int >= 0")
        if shared_mem:
            raise EmuError(f"{name}: dynamic shared memory ({shared_mem} bytes) requested, but the kernel "
                           "declares no extern __shared__ array (not emulated)")
        if self.module.static_shared_bytes > MAX_STATIC_SHARED:
            raise EmuError(f"{name}: {self.module.static_shared_bytes} bytes of static __shared__ memory "
                           f"> {MAX_STATIC_SHARED}")
        return g, b

    def _check_args(self, args) -> list:
        params = self.signature.params
        if not isinstance(args, (tuple, list)):
            raise EmuError(f"{self.name}: args must be a tuple")
        if len(args) != len(params):
            raise EmuError(f"{self.name}: {len(args)} arguments for {len(params)} parameters")
        for p, a in zip(params, args):
            where = f"{self.name}: parameter {p.ctype} {p.name}"
            if p.pointer:
                if not isinstance(a, np.ndarray):
                    raise EmuError(f"{where} needs a device array, got {type(a).__name__}")
                ok = a.dtype == p.dtype or (p.dtype == np.uint16 and a.dtype == np.float16)
                if not ok:
                    raise EmuError(f"{where} needs {p.dtype} data, got a {a.dtype} array")
                if not a.flags.c_contiguous:
                    raise EmuError(f"{where}: the array is not C-contiguous")
                if not p.const and not a.flags.writeable:
                    raise EmuError(f"{where}: the array is read-only")
            else:
                if isinstance(a, np.ndarray) or not isinstance(a, np.generic):
                    raise EmuError(f"{where} needs a NumPy scalar of dtype {p.dtype} "
                                   f"(np.{p.dtype.name}(...)), got {type(a).__name__} {a!r}")
                if a.dtype != p.dtype:
                    raise EmuError(f"{where} needs a {p.dtype} scalar, got {a.dtype}")
        return list(args)

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
        g, b = self._check_config(grid, block, shared_mem)
        args = self._check_args(args)
        params = self.signature.params
        guard = 0 if self.module.sanitize else GUARD
        # Alias groups: arguments whose memory overlaps share one staging buffer.
        spans = []
        for i, (p, a) in enumerate(zip(params, args)):
            if p.pointer:
                start = a.__array_interface__["data"][0]
                spans.append((start, start + a.nbytes, i))
        spans.sort()
        groups: list[list] = []       # [start, end, [arg indices]]
        for start, end, i in spans:
            if groups and start < groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], end)
                groups[-1][2].append(i)
            else:
                groups.append([start, end, [i]])
        values: list = [None] * len(args)
        staged = []
        try:
            for start, end, members in groups:
                size = end - start
                total = size + 2 * guard
                buf = _libc.malloc(max(total, 1))
                if not buf:
                    raise MemoryError("staging buffer")
                zone = 2 * len(staged)
                staged.append((buf, start, size, members))
                if guard:
                    ctypes.memmove(buf, _guard_pattern(zone), guard)
                    ctypes.memmove(buf + guard + size, _guard_pattern(zone + 1), guard)
                if size:
                    ctypes.memmove(buf + guard, start, size)
                for i in members:
                    ptr = args[i].__array_interface__["data"][0]
                    values[i] = ctypes.c_void_p(buf + guard + (ptr - start))
            for i, (p, a) in enumerate(zip(params, args)):
                if not p.pointer:
                    values[i] = _CTYPES[p.dtype](a.item())
            argv = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
            gv = (ctypes.c_uint * 3)(*g)
            bv = (ctypes.c_uint * 3)(*b)
            err = ctypes.create_string_buffer(1024)
            with _launch_lock:
                order, seed = _current_order()
                self.launches += 1
                launch_seed = (seed * 0x9E3779B1 + self.launches) & (2**64 - 1)
                rc = self.module._lib.hkemu_launch(self.index, gv, bv, argv, order, launch_seed, err, len(err))
            if rc:
                raise EmuError(f"{self.name} grid {g} block {b}: {err.value.decode(errors='replace')}")
            problems = []
            for zone, (buf, start, size, members) in enumerate(staged):
                names = ", ".join(params[i].name for i in members)
                if guard:
                    before = ctypes.string_at(buf, guard)
                    after = ctypes.string_at(buf + guard + size, guard)
                    bad_before = sum(1 for a, b in zip(before, _guard_pattern(2 * zone)) if a != b)
                    bad_after = sum(1 for a, b in zip(after, _guard_pattern(2 * zone + 1)) if a != b)
                    if bad_before or bad_after:
                        problems.append(f"out-of-bounds write around argument(s) {names}: "
                                        f"{bad_before} byte(s) before, {bad_after} byte(s) after")
                if (all(params[i].const for i in members) and size
                        and ctypes.string_at(buf + guard, size) != ctypes.string_at(start, size)):
                    problems.append(f"the kernel wrote through const argument(s) {names}")
            if problems:
                raise EmuError(f"{self.name} grid {g} block {b}: " + "; ".join(problems))
            for buf, start, size, members in staged:
                if size and not all(params[i].const for i in members):
                    ctypes.memmove(start, buf + guard, size)
        finally:
            for buf, *_ in staged:
                _libc.free(buf)
