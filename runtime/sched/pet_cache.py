"""The host PET cache: ServingPets per tenant, LRU bounded by bytes, each decoded once from the pack."""

from __future__ import annotations

import threading
from collections import OrderedDict


class PetCache:
    """Host LRU of ServingPets keyed by (tenant, token), bounded by bytes; thread-safe.

    ``get(key, token, load)`` returns the cached entry or calls ``load()`` (outside the lock,
    so one slow decode does not stall other tenants) and keeps the result.
    """

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key, token, load):
        with self._lock:
            entry = self._entries.get((key, token))
            if entry is not None:
                self._entries.move_to_end((key, token))
                self.hits += 1
                return entry
            self.misses += 1
        entry = load()
        with self._lock:
            if (key, token) not in self._entries:
                self._entries[(key, token)] = entry
                self._bytes += entry.nbytes
                while self._bytes > self.max_bytes and len(self._entries) > 1:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.nbytes
                    self.evictions += 1
            return self._entries[(key, token)]

    def __len__(self):
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}
