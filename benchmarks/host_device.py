"""The GPU executor's code run on the host: NumPy stands in for CuPy and runtime.exec.ops_cpu for
runtime.exec.ops_gpu (streams and events become no-ops, "device" arrays are NumPy arrays).

What it is for: checking the executor's own logic (permutation, stacking, the device PET
cache, the PLOT hot tier's keys, probe, gather and rebuilds) without a GPU, and measuring
what does not depend on one, such as the hot tier's hit rate (benchmarks/bench_hot_tier.py).
Nothing here is fast; it is not a serving path.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from runtime.exec import ops_cpu
from runtime.exec.gpu import GpuExecutor


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Device:
    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def host_cupy():
    """The part of CuPy's namespace the GPU executor uses, on NumPy."""
    cuda = types.SimpleNamespace(
        Stream=_Stream, Event=_Event, Device=_Device, alloc_pinned_memory=lambda n: bytearray(n),
        get_elapsed_time=lambda a, b: 0.0,
        runtime=types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1))
    return types.SimpleNamespace(
        cuda=cuda, asarray=np.asarray, empty=np.empty, zeros=np.zeros, ascontiguousarray=np.ascontiguousarray,
        asnumpy=np.asarray, matmul=np.matmul, stack=np.stack, concatenate=np.concatenate, where=np.where, exp=np.exp,
        tanh=np.tanh)  # (the decoder executor's tanh GELU)


def _tensor(a):
    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


class HostOps:
    """runtime.exec.ops_gpu's interface over runtime.exec.ops_cpu on NumPy arrays (in place stays in place)."""

    def __getattr__(self, name):
        fn = getattr(ops_cpu, name)

        def call(*args, **kwargs):
            out = fn(*[_tensor(a) for a in args], **{k: _tensor(v) for k, v in kwargs.items()})
            return out.numpy() if isinstance(out, torch.Tensor) else out

        return call


class HostGpuExecutor(GpuExecutor):
    """runtime.exec.gpu.GpuExecutor on host_cupy() and HostOps()."""

    def __init__(self, encoder, **kwargs):
        super().__init__(encoder, _cupy=host_cupy(), _ops=HostOps(), **kwargs)

    def copy_h2d(self, dst, src, stream):
        dst[...] = src.reshape(dst.shape)
