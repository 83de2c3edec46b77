"""Generation through the PLOT path on the GPU executor: runtime.gen.plot_decode's PlotDecoder with
the upper layers, the KV pool and every sequence's PET on the device
(runtime.exec.gpu_decoder.GpuDecoderExecutor).

    gen = DevicePlotDecoder(snapshot, "root", decoder)          # GpuDecoderExecutor(decoder) inside
    Batcher(gen, kv_budget_bytes=1 << 30).run()                 # runtime.gen.batcher, unchanged

What stays on the host: the windows of each new token, the store lookup (FORMAT.md §4: the
table lives in host memory and on disk), sampling from the logits. What moves to the device:
the looked-up values (once), causal aggregation and the position table, every upper layer with
each sequence's own PET in one mixed-tenant step (BGMV / SGMV for LoRA, the segmented adapter,
BitFit and diff operators), and the keys and values of every running sequence in a
DeviceKVPool preallocated at the batcher's first admission.

A batcher step prefills the requests it admits in one forward (any PET kind: the device path
segments every kind, so nothing is prefilled one request at a time) and decodes the running
ones in another; rows are sorted by tenant before each forward (the executor's plan order) and
each sequence keeps its own logits, so nothing is permuted back.
"""

from __future__ import annotations

import numpy as np
import torch

from formats.backoff import windows as causal_windows
from runtime.gen.kv_pool import Pages
from runtime.gen.plot_decode import PlotDecoder, Sequence
from runtime.plot.window import corpus_windows


class DeviceKVPool(Pages):
    """The upper layers' keys and values of every running sequence on the device (pages of one
    position, as runtime.gen.kv_pool.KVPool)."""

    def __init__(self, executor, positions: int):
        super().__init__(positions)
        self.k, self.v = executor.kv_arrays(positions)

    def adopt(self, seq, slots):
        raise TypeError("the device pool is filled by its own prefill (DevicePlotDecoder.prefill_many)")


class DevicePlotDecoder(PlotDecoder):
    def __init__(self, snapshot, version, decoder, executor=None, **executor_options):
        super().__init__(snapshot, version, decoder)
        if executor is None:
            from runtime.exec.gpu_decoder import GpuDecoderExecutor

            executor = GpuDecoderExecutor(decoder, **executor_options)
        self.executor = executor
        self.window = snapshot.meta["window"]

    def new_pool(self, positions: int) -> DeviceKVPool:
        return DeviceKVPool(self.executor, positions)

    def prefill(self, prompt, pet=None):
        raise TypeError("the device path prefills into its pool: use a Batcher (prefill_many)")

    def _run(self, seqs, wins, lengths, starts, kv_len, pages, pool, plan) -> list[np.ndarray]:
        """One forward of the executor over seqs (in plan order); the served orders."""
        ex = self.executor
        h, orders = ex.inputs(self.snapshot, self.version, wins, lengths, starts)
        logits = ex.forward(h, lengths, kv_len, pages, plan, pool.k, pool.v)
        for s, row in zip(seqs, logits):
            s.logits = torch.from_numpy(row)
        return np.split(orders, np.cumsum(lengths)[:-1])

    def _plan_order(self, seqs: list[Sequence]):
        """(seqs in the executor's plan order (one tenant's rows contiguous), that plan)."""
        plan = self.executor.plan([self.executor.serving_pet(s.pet) for s in seqs])
        return [seqs[j] for j in plan.perm], plan

    def prefill_many(self, prompts, pets, slots, pool) -> list[Sequence]:
        seqs = self._new_sequences(prompts, pets, slots)
        ordered, plan = self._plan_order(seqs)
        wins, lengths = corpus_windows([s.ids for s in ordered], self.n, self.window, self.pad_id)
        B, L = len(ordered), int(lengths.max())
        pages = np.stack([_row(s.slots, L) for s in ordered])
        zeros = np.zeros(B, dtype=np.int64)
        orders = self._run(ordered, wins, lengths, zeros, zeros, pages, pool, plan)
        for s, o in zip(ordered, orders):
            s.kv_len, s.orders = s.prompt_len, o.tolist()
        return seqs

    @torch.no_grad()
    def append(self, seqs, tokens, pool=None) -> None:
        if pool is None:
            raise TypeError("the device path decodes sequences of its pool (a Batcher's)")
        for s, t in zip(seqs, tokens):
            self._check_room(len(s.ids) + 1)
            s.ids.append(int(t))
        ordered, plan = self._plan_order(seqs)
        wins = np.stack([causal_windows(np.asarray(s.ids[-self.n:]), self.n, "causal", self.pad_id)[-1]
                         for s in ordered])
        kv_len = np.array([s.kv_len for s in ordered], dtype=np.int64)
        width = int(kv_len.max()) + 1
        pages = np.stack([_row(s.slots, width) for s in ordered])
        orders = self._run(ordered, wins, np.ones(len(ordered), dtype=np.int64), kv_len, kv_len, pages, pool, plan)
        for s, o in zip(ordered, orders):
            s.kv_len += 1
            s.orders.append(int(o[0]))


def _row(slots: torch.Tensor, width: int) -> np.ndarray:
    """A sequence's first `width` pages (repeating its first page past what it has reserved:
    those entries are masked by the executor's attention)."""
    out = np.full(width, int(slots[0]), dtype=np.int64)
    k = min(width, len(slots))
    out[:k] = slots[:k].numpy()
    return out
