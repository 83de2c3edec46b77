"""The GPU executor's device PET cache: per (tenant, record, layer) entries, LRU bounded by bytes."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from runtime.exec.plan import tenant_key


class DevicePetCache:
    """Device copies of PET weights: entries (tenant key, record token, layer) -> arrays.

    Layer -1 holds the head (fp32). A layer's fp16 tensors (a full-depth record's, as the host
    cache holds them) stay fp16 on the device too when the executor computes in fp32: its
    stacking casts them (GpuExecutor._stack), so the cache holds half their fp32 bytes.
    Entries of the batch being computed are never evicted (a batch may thus exceed the budget
    for its duration). Host-to-device uploads go through
    a pinned staging buffer, asynchronously on the caller's current stream; the staging
    buffer is appended to ``keep`` so the caller holds it until that stream has passed.
    """

    def __init__(self, executor, max_bytes: int):
        self.ex = executor
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.uploaded_bytes = 0
        self.batch = 0

    def new_batch(self):
        self.batch += 1

    def _key(self, pet, layer):
        return (tenant_key(pet), pet.token, layer)

    def get(self, pet, layer, stream, keep) -> dict:
        """part -> tuple of device arrays (layer >= 0), or {"head": (W, b)} for layer -1."""
        key = self._key(pet, layer)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            entry[2] = self.batch
            return entry[0]
        self.misses += 1
        arrays, nbytes = self._upload(pet, layer, stream, keep)
        self.entries[key] = [arrays, nbytes, self.batch]
        self.bytes += nbytes
        self._evict()
        return arrays

    def _evict(self):
        if self.bytes <= self.max_bytes:
            return
        for key in list(self.entries):
            if self.bytes <= self.max_bytes:
                break
            arrays, nbytes, batch = self.entries[key]
            if batch == self.batch:
                continue  # in use by the current batch
            del self.entries[key]
            self.bytes -= nbytes
            self.evictions += 1

    def _upload(self, pet, layer, stream, keep):
        ex = self.ex
        if layer < 0:
            host = {"head": (pet.head_weight.numpy(), pet.head_bias.numpy())}
            dtype_of = lambda a: np.float32  # noqa: E731 - heads always run in fp32
        else:
            host = {part: tuple(a.numpy() for a in arrays) for part, arrays in pet.parts.items() if part[1] == layer}
            dtype_of = lambda a: np.int32 if a.dtype.kind in "iu" else _float_dtype(a, ex.dtype)  # noqa: E731
        flat_f, flat_i, layout = [], [], []
        off_f = off_i = 0
        for part, arrays in host.items():
            shapes = []
            for a in arrays:
                dt = dtype_of(a)
                if dt == np.int32:
                    flat_i.append(a.astype(np.int32, copy=False).ravel())
                    shapes.append(("i", off_i, a.shape))
                    off_i += a.size
                else:
                    flat_f.append(a.astype(dt, copy=False).ravel())
                    shapes.append(("f", off_f, a.shape, dt))
                    off_f += a.size
            layout.append((part, shapes))
        dev_f = ex.upload(np.concatenate(flat_f) if flat_f else None, stream, keep)
        dev_i = ex.upload(np.concatenate(flat_i) if flat_i else None, stream, keep)
        out, nbytes = {}, 0
        for part, shapes in layout:
            views = []
            for s in shapes:
                base = dev_f if s[0] == "f" else dev_i
                size = int(np.prod(s[2], dtype=np.int64))
                views.append(base[s[1]:s[1] + size].reshape(s[2]))
            out[part] = tuple(views)
        for base in (dev_f, dev_i):
            if base is not None:
                nbytes += base.nbytes
        self.uploaded_bytes += nbytes
        return out, nbytes

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "uploaded_bytes": self.uploaded_bytes}


def _float_dtype(a, compute):
    """A float tensor's device dtype: fp16 stays fp16 (the smaller), others the compute dtype."""
    return np.float16 if a.dtype == np.float16 else compute
