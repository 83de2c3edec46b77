"""Torch thread counts for the executors' helper threads (retrieval, PET stacking, prefetch).

Torch's OpenMP thread counts are per thread: helper threads run single-threaded so they never
start thread teams that fight the compute thread's for the cores.
"""

from __future__ import annotations

import torch


def _per_thread_torch_threads() -> bool:
    """True when torch.set_num_threads only affects the calling thread (the OpenMP backend)."""
    try:
        return "parallel backend: OpenMP" in torch.__config__.parallel_info()
    except Exception:  # an unexpected build: assume a global setting
        return False


PER_THREAD = _per_thread_torch_threads()


def helper_thread_setup():
    """Run at the start of a helper thread (retrieval, PET stacking): one torch thread, so the
    helpers' small tensor ops never start OpenMP teams that fight the compute thread's for the
    cores. Without per-thread settings (non-OpenMP builds) nothing is changed."""
    if PER_THREAD:
        torch.set_num_threads(1)
