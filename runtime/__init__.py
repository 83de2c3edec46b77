"""The lean serving runtime (HMI §6): one shared encoder, thousands of tenants.

    import runtime
    with runtime.open("STORE") as rt:                      # device="auto" | "cpu" | "cuda"
        results = rt.infer([{"tenant": "acme", "text": "Return the sum of a list."},
                            {"tenant": "globex", "ids": [101, 7592, 102]}])
    results = runtime.infer("STORE", requests)             # one-shot

A request is a dict (or a ``Request``) with ``tenant`` and either ``text`` (tokenized with the
store's tokenizer, [CLS] ... [SEP] added) or ``ids`` (token ids exactly as the model sees
them). The upper-layer inputs come from the tenant's PLOT version (runtime.plot.retrieve);
requests of many tenants are batched together and run once through the shared upper layers,
each with its own PET (runtime/exec/cpu.py, runtime/exec/gpu.py, batching and
pipelining in runtime/engine.py). A ``Result`` carries the label (classification) or the
tags (tagging: one per word of a text, one per id of an ids request), the probabilities, the
version that served it and timings in seconds (retrieval, transfer, compute, total). A request's
``policy`` (``fast`` | ``auto`` | ``exact``) picks the level that answers it (runtime.level: the
PLOT, or the tenant's top: its full-depth PET when it has a current one, else lower layers
computed in full context); ``Result.level``, ``.level_name`` (students, plot, exact or full),
``.confidence`` (calibrated) and ``.pruned`` say how it was answered. A tenant with students (runtime.student, Student
Parallelism) may be answered by the first k of them instead of its teacher: per batch, the
engine's pruning policy picks the teacher or k students under the measured load (latency
target ``students_target_s``, 0.5 s); a request's ``students`` pins it (0 the teacher, k the
first k students; at policy fast or auto, not exact); ``Result.students`` says how many answered
(0: the teacher). Under auto the teacher is Tabi's dispatcher; an answer by students is not re-routed.

Errors a caller can fix are raised by ``infer`` before anything runs: ``UnknownTenant``,
``EmptyText``, ``TextTooLong`` (more than ``max_len`` tokens, or more than ``MAX_TEXT_CHARS``
characters: 16,384, the HTTP server's limit, checked before tokenizing, truncate or not),
``BadRequest`` (a malformed request, or a text that is not valid Unicode: a lone surrogate, such
as an undecodable byte Python read with surrogateescape) and ``IncompatiblePet`` (a PET trained
for another base model, or for a PLOT version the store does not hold). Importing this package
needs no torch; ``open`` does.
"""

from __future__ import annotations

from hkstore.errors import StoreError, UnknownTenant
from runtime.errors import BadRequest, EmptyText, Expired, IncompatiblePet, TextTooLong, Unavailable
from runtime.serving import MAX_TEXT_CHARS, Request, Result, Runtime, _cuda_available, _resolve_device  # noqa: F401 - hkstore serve reads _cuda_available

__all__ = [
    "BadRequest", "EmptyText", "Expired", "IncompatiblePet", "MAX_TEXT_CHARS", "Request", "Result", "Runtime", "StoreError", "Unavailable",
    "TextTooLong", "UnknownTenant", "infer", "open", "resolve_precision",
]


def open(store_path, device: str = "auto", *, workers=None, **options) -> Runtime:  # noqa: A001 - the package's verb
    """A Runtime serving the store at store_path; options as Runtime's (max_len, max_batch,
    pet_cache_bytes, pipeline and prefetch (the overlap threads: on by default on a GPU, off on the
    CPU, where they compete with compute for the cores), hot_tier_rows, host_cache_bytes, dtype (CPU: auto, the
    default: each tenant's level at the precision its record names, bf16 where tenant create or levels profile
    measured it loses nothing and the CPU has AVX512_BF16 / AMX-BF16, else fp32; fp32 or bf16: every row so,
    bf16 refused on a CPU without it; int8), lora_kernel,
    students_target_s: the students' pruning policy's latency target, length_buffer: batches of
    similar lengths from what waits, False for first come first served; batching: fifo, length,
    coordinated (PetS's coordinated batching) or tenant (one tenant a batch), overrides length_buffer;
    max_wait_s: how long a batch waits for company, 0 by default).
    A decoder store opens as a runtime.gen.api.DecoderRuntime (generate / stream).
    workers: N (or ``auto``, one per usable core) worker processes, each a Runtime with one torch
    thread (``torch_threads=`` for more), that share a large ``infer`` call: a runtime.pool.Pool,
    the same answers as one Runtime (encoder stores, on the CPU)."""
    from runtime.gen.api import DecoderRuntime, is_decoder_store_path

    if workers is not None:
        from runtime.pool import Pool

        if is_decoder_store_path(store_path):
            raise ValueError("workers: decoder stores are served by one generation engine (see runtime.pool)")
        return Pool(store_path, workers, "cpu" if device == "auto" else device, **options)
    if is_decoder_store_path(store_path):
        return DecoderRuntime(store_path, _resolve_device(device), **options)
    return Runtime(store_path, device, **options)


def resolve_precision(precision: str) -> str:
    """fp32 or bf16 for a requested precision (fp32, bf16, auto) on this CPU; bf16 where the CPU
    lacks native bf16 raises a ValueError that says so (runtime.exec.precision)."""
    from runtime.exec.precision import resolve

    return resolve(precision)


def infer(store_path, requests, device: str = "auto", **options) -> list:
    """One-shot: open the store, serve requests, close."""
    with open(store_path, device, **options) as rt:
        return rt.infer(requests)
