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

A forward's logits stay on the device (runtime.exec.gpu_decoder.DeviceLogits): a greedy row
takes its argmax and log-probability from there (greedy_choices, what the batcher asks first),
and a sequence's ``logits`` come to the host, the whole step's at once, only when read.
"""

from __future__ import annotations

import numpy as np
import torch

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


class DeviceSequence(Sequence):
    """A Sequence whose logits are row `row` of a forward's DeviceLogits until read (then on the host)."""

    step = None  # runtime.exec.gpu_decoder.DeviceLogits holding its latest logits, or None
    row = 0

    @property
    def logits(self) -> torch.Tensor | None:
        if self._logits is None and self.step is not None:
            self._logits = torch.from_numpy(self.step.host()[self.row])
        return self._logits

    @logits.setter
    def logits(self, value) -> None:
        self._logits, self.step = value, None

    def attach(self, step, row: int) -> None:
        self._logits, self.step, self.row = None, step, row


class DevicePlotDecoder(PlotDecoder):
    def __init__(self, snapshot, version, decoder, executor=None, **executor_options):
        super().__init__(snapshot, version, decoder)
        if executor is None:
            from runtime.exec.gpu_decoder import GpuDecoderExecutor

            executor = GpuDecoderExecutor(decoder, **executor_options)
        self.executor = executor
        self.window = snapshot.meta["window"]
        self._table = (None, None, None)  # (ids of a decode step's sequences, their page table, them)

    def new_pool(self, positions: int) -> DeviceKVPool:
        return DeviceKVPool(self.executor, positions)

    def prefill(self, prompt, pet=None):
        raise TypeError("the device path prefills into its pool: use a Batcher (prefill_many)")

    def _run(self, seqs, wins, lengths, starts, kv_len, pages, pool, plan) -> list[np.ndarray]:
        """One forward of the executor over seqs (in plan order); the served orders."""
        ex = self.executor
        h, orders = ex.inputs(self.snapshot, self.version, wins, lengths, starts)
        step = ex.forward(h, lengths, kv_len, pages, plan, pool.k, pool.v, host=False)
        for j, s in enumerate(seqs):
            s.attach(step, j)
        return np.split(orders, np.cumsum(lengths)[:-1])

    def greedy_choices(self, seqs) -> list | None:
        """(argmax, its log-probability) of each sequence's latest logits, from the device (no
        logits copied back); None when some sequence's logits are not a forward's of this path."""
        if not all(isinstance(s, DeviceSequence) and s.step is not None for s in seqs):
            return None
        return [(int(s.step.argmax[s.row]), float(s.step.logprob[s.row])) for s in seqs]

    def _pages(self, ordered, width: int) -> np.ndarray:
        """(B, width) pages of the ordered sequences (each _row's), from a table made once while
        the step's sequences stay the same ones in the same order (their slots never change)."""
        key = tuple(map(id, ordered))
        if self._table[0] != key:  # the sequences are held with the table: their ids stay theirs
            size = max(len(s.slots) for s in ordered)
            self._table = (key, np.stack([_row(s.slots, size) for s in ordered]), list(ordered))
        table = self._table[1]
        if width > table.shape[1]:  # (past every reservation: masked entries, each row's first page)
            table = np.concatenate([table, np.repeat(table[:, :1], width - table.shape[1], 1)], 1)
        return table[:, :width]

    def _new_sequences(self, prompts, pets, slots) -> list[DeviceSequence]:
        return [DeviceSequence(s.ids, s.prompt_len, s.pet, cache=None, slots=s.slots)
                for s in super()._new_sequences(prompts, pets, slots)]

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
        wins = np.full((len(ordered), self.n), self.pad_id, dtype=np.uint32)  # the newest causal window:
        for b, s in enumerate(ordered):                                        # the last n ids, left-padded
            tail = s.ids[-self.n:]
            wins[b, self.n - len(tail):] = tail
        kv_len = np.array([s.kv_len for s in ordered], dtype=np.int64)
        pages = self._pages(ordered, int(kv_len.max()) + 1)
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
