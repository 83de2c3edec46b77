"""The upper layers' keys and values of every running sequence in one preallocated pool,
bounded by the batcher's KV budget (a paged pool with pages of one position: no fragmentation,
and a request reserves exactly prompt + max_tokens positions, as the budget counts them).

    pool = KVPool(decoder, positions=budget // bytes_per_token)
    slots = pool.alloc(len(prompt) + max_tokens)     # None while the pool is full
    pool.adopt(seq, slots)                           # the prefill's KVCache moves into the pool
    ... runtime.gen.batched_step.upper_step(decoder, seqs, h, pool)   # one gather per layer
    pool.free(slots)

A decode step attends for every sequence at once: the sequences' pages, (B, longest) indices,
and one pass per layer over each sequence's pages where they lie (runtime/gen/_decode.c, built
with the package); without the extension, the reference: gather the keys and values
(B, kv_heads, longest, head_dim) in one index per layer and one fused attention kernel over
them, positions past a sequence's length masked. Nothing grows or is concatenated per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from formats import accel

# (2: HK_DECODE_API_VERSION in runtime/gen/_decode.c; None: the reference, gather + ATen's attention)
_decode = accel.extension("runtime.gen._decode", 2)


class Pages:
    """The free list of a pool of `positions` pages (one position each): the bookkeeping that
    the host pool and the device pool (runtime.gen.device_decode.DeviceKVPool) share."""

    def __init__(self, positions: int):
        self._free = list(range(positions - 1, -1, -1))  # a stack: the low pages first
        self._positions = positions

    @property
    def positions(self) -> int:
        return self._positions

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        return torch.tensor(taken, dtype=torch.long)

    def free(self, slots: torch.Tensor) -> None:
        self._free.extend(reversed(slots.tolist()))


class KVPool(Pages):
    def __init__(self, decoder, positions: int):
        super().__init__(positions)
        c = decoder.config
        self.first = decoder.lower_layers
        n = c.num_layers - decoder.lower_layers
        # Uninitialized: zeroing touched every page of the worst case (max_running x context: 2 GB
        # for a 124M decoder) up front; the OS commits a page when it is first written, and a
        # step only reads pages its sequences wrote (attend repeats a written page past a length).
        self.k = torch.empty(n, positions, c.kv_heads, c.head_dim)
        self.v = torch.empty(n, positions, c.kv_heads, c.head_dim)

    def adopt(self, seq, slots: torch.Tensor) -> None:
        """Move seq's KVCache (one unpadded sequence: every position real) into its pages."""
        T = seq.cache.length
        for i, k in seq.cache.k.items():
            self.k[i - self.first, slots[:T]] = k[0].transpose(0, 1)
            self.v[i - self.first, slots[:T]] = seq.cache.v[i][0].transpose(0, 1)
        seq.slots, seq.kv_len = slots, T
        seq.cache = None

    def pages(self, seqs) -> torch.Tensor:
        """(B, longest + 1) page indices of each sequence's positions so far and the new one;
        shorter rows repeat their first page (masked by attend)."""
        lengths = torch.tensor([s.kv_len for s in seqs])
        width = int(lengths.max()) + 1
        slots = torch.nn.utils.rnn.pad_sequence([s.slots for s in seqs], batch_first=True)[:, :width]
        past = torch.arange(width)[None, :] > lengths[:, None]
        rows = torch.where(past, slots[:, :1], slots)  # (a sequence reserved at least kv_len + 1 slots)
        self._step = self._step_of(rows, lengths, past)
        return rows

    @staticmethod
    def _step_of(pages, lengths, past) -> tuple:
        """What every layer's attend needs of a step, computed once: (pages, each sequence's new
        page, the pages flat, the mask of the positions each sequence attends to: up to its length,
        the lengths as the kernel reads them)."""
        return (pages, pages[torch.arange(len(lengths)), lengths], pages.flatten(), ~past[:, None, None, :],
                lengths.to(torch.int64).contiguous())

    def attend(self, i: int, seqs, pages: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Layer i: write each sequence's new key and value (B, kv_heads, head_dim) at its next
        page, then attention of q (B, heads, head_dim) over its positions: (B, heads * head_dim)."""
        li, B = i - self.first, len(seqs)
        step = getattr(self, "_step", None)
        if step is None or step[0] is not pages:  # (pages not from this pool's pages())
            lengths = torch.tensor([s.kv_len for s in seqs])
            step = self._step = self._step_of(pages, lengths, torch.arange(pages.shape[1])[None, :] > lengths[:, None])
        _, new, flat, keep, lengths = step
        KV, hd = k.shape[1], k.shape[2]
        if _decode is not None and _fits(pages, q, k, v, self.k):
            out = q.new_empty(B, q.shape[1] * hd)
            # (the pool's layer li is a contiguous (positions, KV, hd) block: its address and the page count say where)
            _decode.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), self.k[li].data_ptr(), self.v[li].data_ptr(),
                           pages.data_ptr(), lengths.data_ptr(), out.data_ptr(), B, q.shape[1], KV, hd, pages.shape[1],
                           self.k.shape[1], 1.0 / math.sqrt(hd), q.stride(0), k.stride(0), v.stride(0))
            return out
        # (index_select: several times faster than advanced indexing here)
        self.k[li, new], self.v[li, new] = k, v
        keys = self.k[li].index_select(0, flat).view(B, -1, KV, hd).transpose(1, 2)  # (B, KV, S, hd)
        values = self.v[li].index_select(0, flat).view(B, -1, KV, hd).transpose(1, 2)
        qg = q.reshape(B, KV, q.shape[1] // KV, hd)  # head h reads K/V head h // (heads / kv_heads)
        # (one fused kernel reading the gathered keys in place: matmuls on the transposed keys
        # copied them, and attention took about 4x the CPU time at a 124M decoder's shapes)
        return F.scaled_dot_product_attention(qg, keys, values, attn_mask=keep).reshape(B, -1)


def _fits(pages, q, k, v, pool) -> bool:
    """Whether the kernel reads these operands as they are: fp32, int64 pages, the pool
    contiguous, and each sequence's q, k and v contiguous (a step's q, k and v are column
    ranges of one GEMM's output: rows apart, each row's heads in order)."""
    return pages.dtype == torch.int64 and pages.is_contiguous() and pool.is_contiguous() and \
        pool.dtype == torch.float32 and \
        all(t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and
            t.stride(0) >= t.shape[1] * t.shape[2] for t in (q, k, v)) and \
        q.shape[0] == k.shape[0] == v.shape[0] == pages.shape[0] and k.shape == v.shape and \
        q.shape[2] == k.shape[2] == pool.shape[3] and k.shape[1] == pool.shape[2] and q.shape[1] % k.shape[1] == 0
