"""SP's length-aware buffer: requests binned by length, so a batch carries little padding.

A batch starts from the oldest waiting request (no request waits behind later ones for long)
and fills up with the waiting requests closest to its length, oldest first among equals. FIFO
batching takes the next max_batch requests whatever their lengths; both are here so the
benchmark can measure the padding saved.
"""

from __future__ import annotations


class LengthBuffer:
    def __init__(self, bin_width: int = 8, fifo: bool = False):
        self.bin_width = bin_width
        self.fifo = fifo
        self.items: list = []  # (length, item) in arrival order

    def __len__(self):
        return len(self.items)

    def add(self, length: int, item) -> None:
        self.items.append((length, item))

    def tokens(self) -> int:
        return sum(length for length, _ in self.items)

    def pop(self, max_batch: int) -> list:
        """The next batch's items (at most max_batch), removed from the buffer."""
        if self.fifo or len(self.items) <= max_batch:
            batch, self.items = self.items[:max_batch], self.items[max_batch:]
            return [item for _, item in batch]
        first = self.items[0][0] // self.bin_width
        # the oldest request's bin first, then the nearest bins; arrival order within a bin
        order = sorted(range(len(self.items)), key=lambda i: (abs(self.items[i][0] // self.bin_width - first), i))
        chosen = set(order[:max_batch])
        batch = [self.items[i] for i in sorted(chosen)]
        self.items = [x for i, x in enumerate(self.items) if i not in chosen]
        return [item for _, item in batch]


def length_batches(lengths: list[int], max_batch: int, bin_width: int = 8) -> list[list[int]]:
    """A queue (its requests' lengths, oldest first) cut into batches as the buffer pops them:
    lists of queue indices (the engine pops one batch at a time, runtime.engine)."""
    buffer = LengthBuffer(bin_width)
    for i, n in enumerate(lengths):
        buffer.add(n, i)
    out = []
    while len(buffer):
        out.append(buffer.pop(max_batch))
    return out


def padded_tokens(batches: list[list[int]]) -> tuple[int, int]:
    """(tokens the batches compute, padding included; real tokens) for lists of lengths."""
    return sum(len(b) * max(b) for b in batches), sum(sum(b) for b in batches)
