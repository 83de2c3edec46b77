"""A small stand-in for CuPy: NumPy-backed "device" arrays and RawModule on the kernel emulation.

It covers what runtime.exec.ops_gpu, runtime.exec.gpu (with device_cache and hot_tier) and
tests/test_ops_gpu.py use of CuPy - ``asarray``, ``empty`` (poisoned), ``zeros``, ``ones``,
``full``, ``asnumpy``, ``ascontiguousarray``, ``copyto``, ``matmul``, ``stack``,
``concatenate``, ``where``, ``exp``, ``tanh``, ``ndarray``, ``RawModule``, and ``cuda``: ``Stream``,
``Event``, ``Device``, ``alloc_pinned_memory``, ``get_elapsed_time``,
``runtime.getDevice``/``getDeviceCount`` - and no more.

It is never installed as ``cupy`` (nothing is put in ``sys.modules``): tests hand it over
explicitly (``ops_gpu.use_cupy(cupy_standin)``, ``GpuExecutor(_cupy=cupy_standin)``), so
``runtime.open(device="auto")`` cannot mistake it for a GPU.

Semantics kept from CuPy, so that the code under test is held to them:

* device arrays are :class:`ndarray` (a NumPy subclass); host NumPy arrays are not device
  arrays, and mixing a host array into a device element-wise operation raises TypeError
  (as CuPy does); NumPy scalars are fine;
* ``empty`` returns memory filled with 0xFF bytes (NaN for floats), never zeros, so code that
  reads what it did not write shows it;
* ``RawModule(code=...)`` builds the source with the emulation (runtime.exec.emu.module); its
  kernels take device arrays only.

Streams and events exist for the API: work runs synchronously, in call order.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np

from runtime.exec.emu.module import EmuModule

POISON_BYTE = 0xFF


class _DeviceMemory:
    """``a.data`` of a device array: the async host -> device copy the executor uses."""

    def __init__(self, array: ndarray):
        self._array = array

    @property
    def ptr(self) -> int:
        return self._array.__array_interface__["data"][0]

    def copy_from_host_async(self, src, nbytes: int, stream=None) -> None:
        nbytes = int(nbytes)
        if nbytes > self._array.nbytes:
            raise ValueError(f"copy of {nbytes} bytes into a device array of {self._array.nbytes}")
        if not self._array.flags.c_contiguous:
            raise ValueError("copy into a non-contiguous device array")
        address = src.value if isinstance(src, ctypes.c_void_p) else int(src)
        ctypes.memmove(self.ptr, address, nbytes)

    def copy_from_host(self, src, nbytes: int) -> None:
        self.copy_from_host_async(src, nbytes)


def _host(a):
    return a.view(np.ndarray) if isinstance(a, ndarray) else a


def _device(a):
    if isinstance(a, np.ndarray) and not isinstance(a, ndarray):
        return a.view(ndarray)
    if isinstance(a, np.generic):          # 0-d results stay arrays, as in CuPy
        return np.asarray(a).view(ndarray)
    return a


def _reject_host(values, what: str) -> None:
    for v in values:
        if isinstance(v, np.ndarray) and not isinstance(v, ndarray):
            raise TypeError(f"{what}: a host numpy.ndarray mixed with device arrays "
                            "(CuPy refuses implicit host->device conversion; use cupy.asarray)")
        if isinstance(v, (list, tuple)):
            _reject_host(v, what)


class ndarray(np.ndarray):
    """A "device" array: NumPy memory, CuPy's rules (see the module doc)."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _reject_host(inputs, f"{ufunc.__name__}")
        args = [_host(i) for i in inputs]
        if out is not None:
            _reject_host(out, f"{ufunc.__name__} out=")
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if isinstance(result, tuple):
            return tuple(_device(r) for r in result)
        return _device(result)

    @property
    def data(self):
        return _DeviceMemory(self)

    def get(self, stream=None) -> np.ndarray:
        return np.array(self.view(np.ndarray), copy=True)

    def __repr__(self) -> str:
        return "device " + repr(self.view(np.ndarray))


# -- array creation and conversion ------------------------------------------------------------


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if isinstance(a, ndarray):
        return a.astype(dtype)
    host = np.array(a, dtype=dtype, copy=True, order=order or "K")
    return host.view(ndarray)


array = asarray


def asnumpy(a, stream=None) -> np.ndarray:
    if isinstance(a, ndarray):
        return np.array(a.view(np.ndarray), copy=True)
    return np.asarray(a)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    if a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a.view(np.ndarray)).view(ndarray)


def empty(shape, dtype=np.float32, order="C"):
    out = np.empty(shape, dtype=dtype, order=order)
    out.view(np.uint8).fill(POISON_BYTE) if out.size else None
    return out.view(ndarray)


def zeros(shape, dtype=np.float32, order="C"):
    return np.zeros(shape, dtype=dtype, order=order).view(ndarray)


def ones(shape, dtype=np.float32, order="C"):
    return np.ones(shape, dtype=dtype, order=order).view(ndarray)


def full(shape, fill_value, dtype=None, order="C"):
    return np.full(shape, fill_value, dtype=dtype, order=order).view(ndarray)


def empty_like(a, dtype=None):
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None):
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def copyto(dst, src, casting="same_kind", where=True):
    if not isinstance(dst, ndarray):
        raise TypeError("copyto: dst must be a device array")
    _reject_host([src], "copyto")
    np.copyto(dst.view(np.ndarray), _host(src), casting=casting)


def _checked(fn, name):
    def call(*args, **kwargs):
        _reject_host(args, name)
        return _device(fn(*[_host(a) if not isinstance(a, (list, tuple)) else [_host(x) for x in a] for a in args],
                          **kwargs))

    call.__name__ = name
    return call


matmul = _checked(np.matmul, "matmul")
where = _checked(np.where, "where")
exp = _checked(np.exp, "exp")
tanh = _checked(np.tanh, "tanh")
stack = _checked(np.stack, "stack")
concatenate = _checked(np.concatenate, "concatenate")


# -- kernels ------------------------------------------------------------------------------------


class RawKernel:
    def __init__(self, function):
        self._function = function
        self.name = function.name

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None):
        for a in args:
            if isinstance(a, np.ndarray) and not isinstance(a, ndarray):
                raise TypeError(f"{self.name}: a host numpy.ndarray passed to a kernel (needs a device array)")
        self._function(grid, block, args, shared_mem=shared_mem, stream=stream)


class RawModule:
    """CuPy's RawModule(code=...) on the emulation: the source is built with g++ (cached)."""

    def __init__(self, code: str | None = None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None or path is not None:
            raise NotImplementedError("the CuPy stand-in builds RawModule(code=...) only")
        self.code = code
        self.options = tuple(options)
        self._module = EmuModule(code)

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self._module.get_function(name))


# -- streams, events, devices -------------------------------------------------------------------


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        self.non_blocking = non_blocking

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        return self

    def wait_event(self, event) -> None:
        if not isinstance(event, Event):
            raise TypeError("wait_event needs an Event")

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.disable_timing = disable_timing
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    if start.disable_timing or end.disable_timing:
        raise RuntimeError("cudaErrorInvalidResourceHandle: an event without timing")
    return 0.0


class Device:
    def __init__(self, device=None):
        device = 0 if device is None else int(device)
        if device != 0:
            raise RuntimeError(f"cudaErrorInvalidDevice: the stand-in has one device (0), not {device}")
        self.id = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        return self

    def synchronize(self) -> None:
        pass


def alloc_pinned_memory(nbytes: int):
    return bytearray(max(int(nbytes), 0))


cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=Device, alloc_pinned_memory=alloc_pinned_memory,
    get_elapsed_time=get_elapsed_time,
    runtime=types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1),
)

# Marks the module for code that must tell it from the real CuPy.
IS_STANDIN = True
