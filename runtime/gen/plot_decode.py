"""Generation through the PLOT path (hGPT, HMI §3.2): the lower layers never run at serving time.

    gen = PlotDecoder(store.snapshot(), "root", decoder)
    seq = gen.prefill(prompt_ids)                  # one lookup for the prompt's windows
    while not done:
        token = gen.step([seq])[0]                 # greedy; the new token's window is looked up next

Prefill: runtime.plot.retrieve gives the prompt's upper-layer inputs (each token's causal window,
its last slot, plus the position table); the upper layers run once over the prompt, keeping
their keys and values in the sequence's own KVCache. Decode step: each sequence's newest token
gets its window [x(t-n+1) .. x(t)] (left-padded near the start), ONE lookup serves every
sequence of the step, and the upper layers run on one position per sequence against its cache.
The lower layers keep no cache: a window's value does not depend on anything before it.

Sequences of a step share the lookup; their upper layers run one after another, each with its
own cache and PET. runtime.gen.batcher schedules many requests over it (continuous batching);
generate() is one request through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.gen.lora_batch import lora_only
from runtime.model.decoder import KVCache
from runtime.model.stored import is_decoder_store
from runtime.plot.retrieve import retrieve


@dataclass
class Sequence:
    ids: list[int]  # prompt + generated so far
    prompt_len: int
    pet: object = None
    cache: KVCache = field(default_factory=KVCache)
    logits: torch.Tensor | None = None  # (vocab,) next-token logits after the last step
    orders: list[int] = field(default_factory=list)  # served order of each token's window
    slots: torch.Tensor | None = None  # its pages of a runtime.gen.kv_pool.KVPool (then cache is None)
    kv_len: int = 0  # positions held in those pages

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len:]


class PlotDecoder:
    def __init__(self, snapshot, version, decoder, precision: str = "fp32"):
        """precision: the shared GEMMs' in the batched prefill and decode step, "fp32", "bf16" or
        "auto" (runtime.gen.row_precision; the one-sequence path of prefill / greedy stays fp32)."""
        from runtime.gen.row_precision import resolve

        meta = snapshot.meta
        if not is_decoder_store(meta):
            raise ValueError("generation needs a decoder store (this one serves an encoder)")
        self.snapshot, self.version, self.decoder = snapshot, version, decoder
        self.precision = resolve(precision)
        self.n, self.pad_id = meta["n"], meta["pad_id"]
        self.position = snapshot.position(version)

    def _check_room(self, length: int) -> None:
        c = self.decoder.config
        if not c.rotary and length > c.max_len:
            raise ValueError(f"the sequence would be {length} tokens, beyond the model's context of {c.max_len}")

    @torch.no_grad()
    def prefill(self, prompt: list[int], pet=None) -> Sequence:
        """A new sequence with the prompt run through lookups + the upper layers."""
        if not prompt:
            raise ValueError("an empty prompt: at least one token (most tokenizers add a BOS)")
        self._check_room(len(prompt))
        seq = Sequence(list(prompt), len(prompt), pet)
        h, mask, served = retrieve(self.snapshot, self.version, [seq.ids])
        out = self.decoder.upper(h, mask, pet, kv_cache=seq.cache)
        seq.logits = self.decoder.logits(out[0, -1])
        seq.orders = served.order[0, :len(prompt)].tolist()
        return seq

    prefills_any_pet = True  # runtime.gen.batcher: prefill_many takes every PET kind

    def prefill_many(self, prompts: list[list[int]], pets: list, slots: list, pool) -> list[Sequence]:
        """New sequences for several prompts at once: one lookup for all, then one upper-layer
        pass for the prompts with pure-LoRA PETs or none (per-row LoRA) and one per other PET
        shared by its prompts (runtime.gen.batched_prefill); keys and values in their pages of pool."""
        from runtime.gen.batched_prefill import prefill_batch

        seqs = self._new_sequences(prompts, pets, slots)
        h, mask, served = retrieve(self.snapshot, self.version, [s.ids for s in seqs])
        groups: dict = {}  # None: the per-row LoRA pass; id(pet): the rows sharing that PET
        for b, s in enumerate(seqs):
            groups.setdefault(None if lora_only(s.pet) else id(s.pet), []).append(b)
        for key, rows in groups.items():
            T = int(mask[rows].sum(1).max())
            logits = prefill_batch(self.decoder, h[rows, :T], mask[rows, :T], [seqs[b] for b in rows], pool,
                                   shared_pet=key is not None, precision=self.precision)
            for j, b in enumerate(rows):
                seqs[b].logits = logits[j]
        for b, s in enumerate(seqs):
            s.orders = served.order[b, :s.prompt_len].tolist()
        return seqs

    def _new_sequences(self, prompts, pets, slots) -> list[Sequence]:
        """Pooled sequences for prompts (each checked: not empty, within the context)."""
        for p in prompts:
            if not p:
                raise ValueError("an empty prompt: at least one token (most tokenizers add a BOS)")
            self._check_room(len(p))
        return [Sequence(list(p), len(p), pet, cache=None, slots=sl) for p, pet, sl in zip(prompts, pets, slots)]

    def _step_inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """Upper-layer inputs (B, d) of each sequence's newest token: one lookup for all."""
        n = self.n
        keys = np.full((len(seqs), n), self.pad_id, dtype=np.uint32)  # the newest causal window: the last n
        for b, s in enumerate(seqs):                                       # ids, left-padded (formats.backoff)
            tail = s.ids[-n:]
            keys[b, n - len(tail):] = tail
        result = self.snapshot.lookup(self.version, keys)
        h = torch.from_numpy(np.asarray(result.values, dtype=np.float32)[:, -1].copy())
        for b, s in enumerate(seqs):
            s.orders.append(int(result.order[b]))
        if self.position is not None:
            at = np.array([len(s.ids) - 1 for s in seqs])
            rows = np.flatnonzero(at < len(self.position))
            if len(rows):
                h[torch.from_numpy(rows)] += torch.from_numpy(np.asarray(self.position[at[rows]], dtype=np.float32))
        return h

    @torch.no_grad()
    def append(self, seqs: list[Sequence], tokens: list[int], pool=None) -> None:
        """Add one token to each sequence: look up its window, run the upper layers one position
        (against pool's pages when the sequences live in a KVPool: runtime.gen.batcher's)."""
        for s, t in zip(seqs, tokens):
            self._check_room(len(s.ids) + 1)
            s.ids.append(int(t))
        h = self._step_inputs(seqs)
        if len(seqs) > 1 or pool is not None:  # one GEMM per PET group for all sequences (runtime.gen.batched_step)
            from runtime.gen.batched_step import upper_step

            for s, logits in zip(seqs, upper_step(self.decoder, seqs, h, pool, self.precision)):
                s.logits = logits
            return
        for b, s in enumerate(seqs):
            out = self.decoder.upper(h[b][None, None], pet=s.pet, kv_cache=s.cache)
            s.logits = self.decoder.logits(out[0, -1])

    def step(self, seqs: list[Sequence]) -> list[int]:
        """One greedy decode step for every sequence: the argmax of its logits is appended."""
        tokens = [int(s.logits.argmax()) for s in seqs]
        self.append(seqs, tokens)
        return tokens

    def generate(self, prompt: list[int], params=None, pet=None) -> dict:
        """One completion (runtime.gen.sampling's rule): ids and text of the new tokens (an end
        of sequence token or a stop sequence ends it and is left out), finish_reason "stop" or
        "length", each token's logprob (and top alternatives when params.logprobs), token counts.
        ValueError when prompt + max_tokens exceed the context."""
        from runtime.gen.batcher import Batcher

        batcher = Batcher(self, kv_budget_bytes=1 << 62, max_running=1)
        rid = batcher.submit(prompt, params, pet)
        batcher.run()
        return batcher.result(rid)

    def greedy(self, prompt: list[int], max_new_tokens: int, pet=None, stop: int | None = None) -> list[int]:
        """The greedy continuation of one prompt through the PLOT path (new ids only). The last
        token is chosen from the final logits without being looked up (nothing follows it)."""
        seq = self.prefill(prompt, pet)
        out = []
        for k in range(max_new_tokens):
            token = int(seq.logits.argmax())
            out.append(token)
            if token == stop or k == max_new_tokens - 1:
                break
            self.append([seq], [token])
        return out
