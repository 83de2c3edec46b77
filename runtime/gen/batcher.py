"""Continuous batching of completions over one PlotDecoder (Orca / Punica style, CPU reference).

    b = Batcher(PlotDecoder(snapshot, "root", decoder), kv_budget_bytes=64 << 20, max_running=32)
    rid = b.submit(prompt_ids, SamplingParams(max_tokens=32), pet=tenant_pet)
    while b.busy:
        for event in b.step():                  # Event(id, token, text, finished, finish_reason)
            ...
    b.result(rid)                               # what PlotDecoder.generate returns

A step is schedule → execute → update (vLLM's EngineCore.step): schedule decides, as data (a
Schedule), which waiting requests join under the KV budget, which running ones decode and which
leave cancelled; execute runs it (the joining prompts' prefill in one pass, one lookup and one
batched upper-layer step for every decoding sequence's latest token, each with its own PET);
update samples every running sequence's next token, detokenizes it in context, checks stops,
makes the step's events and frees the finished sequences' KV pages. A token chosen in one step
runs through the model at the next, so a sequence that ends or is cancelled costs no step.

KV memory: a request reserves the upper layers' keys and values for prompt + max_tokens
positions when admitted (2 x kv_heads x head_dim x 4 bytes x upper layers per position), so a
running sequence never runs out; requests wait (first come, first served) while the budget is
full, and one that could never fit is refused at submit with a one-line ValueError. The
positions live in one pool preallocated at the first admission (runtime.gen.kv_pool: the
budget's positions, at most max_running full contexts), so a decode step attends for every
sequence in one batched op and nothing is allocated per step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from runtime.gen.detok import IncrementalText
from runtime.gen.lora_batch import lora_only
from runtime.gen.sampling import GREEDY_BELOW, Chooser, SamplingParams, find_stop, greedy


@dataclass
class Event:
    id: int
    token: int | None  # None when the sequence ended without a new token (EOS, cancel)
    text: str  # the completion's text so far, decoded in the prompt's context (runtime.gen.detok)
    finished: bool
    finish_reason: str | None  # "stop", "length" or "cancelled" once finished


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    pet: object
    reserve: int
    chooser: Chooser | None = None
    seq: object = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list = field(default_factory=list)
    text: str = ""
    detok: IncrementalText | None = None
    finish: str | None = None
    submitted: float = 0.0
    last_token: float | None = None  # when its latest token was chosen
    pending: int | None = None  # its latest token, chosen and not yet run through the model


@dataclass
class Schedule:
    """One step's decision (what the executor runs and who leaves), made before anything runs."""

    admitted: list = field(default_factory=list)  # (request, its KV pages): prefilled this step
    decode: list = field(default_factory=list)  # running requests whose pending token runs this step
    cancelled: list = field(default_factory=list)  # running requests that leave without running


class Batcher:
    def __init__(self, gen, kv_budget_bytes: int, max_running: int = 64):
        c = gen.decoder.config
        self.gen = gen
        self.bytes_per_token = 2 * c.kv_heads * c.head_dim * 4 * (c.num_layers - gen.decoder.lower_layers)
        self.budget = int(kv_budget_bytes)
        self.max_running = max_running
        self.reserved = 0
        self.pool = None  # runtime.gen.kv_pool.KVPool, made at the first admission
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.done: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.ttft: list[float] = []  # seconds from submit to the first token, per request
        self.itl: list[float] = []  # seconds between consecutive tokens of a request
        self.tokens = 0
        self.started = time.perf_counter()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, prompt: list[int], params: SamplingParams | None = None, pet=None) -> int:
        params = (params or SamplingParams()).check()
        c = self.gen.decoder.config
        if not prompt:
            raise ValueError("an empty prompt: at least one token (most tokenizers add a BOS)")
        if not c.rotary and len(prompt) + params.max_tokens > c.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceed the model's "
                             f"context of {c.max_len}")
        need = (len(prompt) + params.max_tokens) * self.bytes_per_token
        if need > self.budget:
            raise ValueError(f"the request needs {need} bytes of KV cache, more than the whole budget of {self.budget}")
        if len(prompt) + params.max_tokens > self.max_running * c.max_len:  # (a rotary model, past its context)
            raise ValueError(f"prompt + max_tokens ({len(prompt) + params.max_tokens} positions) exceed the KV pool "
                             f"of {self.max_running} x {c.max_len} positions")
        req = _Request(next(self._ids), list(prompt), params, pet, need, submitted=time.perf_counter(),
                       detok=IncrementalText(self.gen.decoder.decode, prompt))
        self.waiting.append(req)
        return req.id

    def cancel(self, rid: int) -> bool:
        """End a waiting or running request now (its client went away); False if unknown or done."""
        for req in list(self.waiting):
            if req.id == rid:
                self.waiting.remove(req)
                req.finish = "cancelled"
                self.done[rid] = req
                return True
        for req in self.running:
            if req.id == rid:
                req.finish = "cancelled"
                return True
        return False

    def result(self, rid: int) -> dict:
        r = self.done[rid]
        return {"ids": r.ids, "text": r.text, "finish_reason": r.finish, "logprobs": r.logprobs,
                "top_logprobs": r.top, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.ids)}

    def step(self) -> list[Event]:
        """Schedule, execute, update: returns this step's events."""
        plan = self.schedule()
        self.execute(plan)
        return self.update(plan)

    def schedule(self) -> Schedule:
        """Admit waiting requests, first come first served, while the KV budget, max_running and
        the pool allow (each reserves prompt + max_tokens positions now); every running request
        either decodes its pending token or, cancelled, leaves."""
        plan = Schedule()
        if self.pool is None and self.waiting:
            from runtime.gen.kv_pool import KVPool

            c = self.gen.decoder.config
            positions = min(self.budget // self.bytes_per_token, self.max_running * c.max_len)
            new_pool = getattr(self.gen, "new_pool", None)  # the device path's pool lives on the device
            self.pool = new_pool(positions) if new_pool else KVPool(self.gen.decoder, positions)
        for req in self.running:
            if req.finish == "cancelled":
                plan.cancelled.append(req)
            elif req.pending is not None:
                plan.decode.append(req)
        while self.waiting and len(self.running) + len(plan.admitted) < self.max_running and \
                self.reserved + self.waiting[0].reserve <= self.budget:
            req = self.waiting[0]
            slots = self.pool.alloc(len(req.prompt) + req.params.max_tokens)
            if slots is None:  # (the pool holds at most max_running contexts) it frees as sequences end
                break
            self.waiting.popleft()
            self.reserved += req.reserve
            req.chooser = Chooser(req.params)
            plan.admitted.append((req, slots))
        return plan

    def execute(self, plan: Schedule) -> None:
        """Run the plan: the admitted prompts' prefill, then one decode step for the pending
        tokens; every sequence that ran has its next-token logits (seq.logits)."""
        admitted = plan.admitted
        if admitted:
            if hasattr(self.gen, "prefill_many") and (getattr(self.gen, "prefills_any_pet", False) or
                                                      all(lora_only(r.pet) for r, _ in admitted)):  # (FullGen: LoRA)
                seqs = self.gen.prefill_many([r.prompt for r, _ in admitted], [r.pet for r, _ in admitted],
                                             [s for _, s in admitted], self.pool)
            else:  # other PETs: one prompt at a time, its cache then moved into the pool
                seqs = [self.gen.prefill(r.prompt, r.pet) for r, _ in admitted]
                for seq, (_, slots) in zip(seqs, admitted):
                    self.pool.adopt(seq, slots)
            for seq, (req, _) in zip(seqs, admitted):
                req.seq = seq
                self.running.append(req)
        if plan.decode:
            self.gen.append([r.seq for r in plan.decode], [r.pending for r in plan.decode], self.pool)
            for req in plan.decode:
                req.pending = None

    def update(self, plan: Schedule) -> list[Event]:
        """Choose every running sequence's next token (greedy rows of a generator with
        greedy_choices from it; the other greedy rows without top log-probs: runtime.gen.sampling.greedy
        for all at once; the rest: one log-softmax for all),
        detokenize it, check EOS, max_tokens and stop sequences; retire the finished and the
        cancelled, freeing their KV pages."""
        events = [Event(r.id, None, r.text, True, r.finish) for r in plan.cancelled]
        live = [r for r in self.running if r.finish is None]
        eos = self.gen.decoder.config.eos_id
        chosen = self._greedy_on_device(live)
        rest = [b for b in range(len(live)) if b not in chosen]  # rows whose logits come to the host
        if rest:
            logits = _stacked([live[b].seq.logits for b in rest]).float()
            plain = [j for j, b in enumerate(rest) if _plain_greedy(live[b].params)]
            if plain:
                part = logits if len(plain) == len(rest) else logits[torch.tensor(plain, device=logits.device)]
                for j, token, logprob in zip(plain, *greedy(part)):
                    chosen[rest[j]] = (token, logprob, [])
            others = [j for j in range(len(rest)) if rest[j] not in chosen]
            if others:
                logprobs = torch.log_softmax(logits, -1)
                for j in others:
                    chosen[rest[j]] = live[rest[j]].chooser(logits[j], logprobs[j])
        for b, req in enumerate(live):
            token, logprob, top = chosen[b]
            if token == eos and not req.params.ignore_eos:
                self._extend(req, req.detok.flush())
                req.finish = "stop"
                events.append(Event(req.id, None, req.text, True, req.finish))
                continue
            now = time.perf_counter()
            (self.ttft if req.last_token is None else self.itl).append(now - (req.last_token or req.submitted))
            req.last_token = now
            self.tokens += 1
            req.ids.append(token)
            req.logprobs.append(logprob)
            req.top.append(top)
            last = len(req.ids) == req.params.max_tokens
            if not self._extend(req, req.detok.add(token) + (req.detok.flush() if last else "")) and last:
                req.finish = "length"
            if req.finish is None:
                req.pending = token
            events.append(Event(req.id, token, req.text, req.finish is not None, req.finish))
        ended = [r for r in self.running if r.finish is not None]
        if ended:
            self.running = [r for r in self.running if r.finish is None]
        for req in ended:
            self.reserved -= req.reserve
            self.pool.free(req.seq.slots)
            req.seq = None
            self.done[req.id] = req
        return events

    def _greedy_on_device(self, live) -> dict:
        """{index in live: (token, logprob, [])} of the greedy rows without top log-probs, when
        the generator gives their argmax and its log-probability itself (the device path: no
        logits copied back for them); what Chooser returns for such a row."""
        choose = getattr(self.gen, "greedy_choices", None)
        rows = [b for b, r in enumerate(live) if _plain_greedy(r.params)]
        picks = choose([live[b].seq for b in rows]) if choose is not None and rows else None
        return {} if picks is None else {b: (token, logprob, []) for b, (token, logprob) in zip(rows, picks)}

    @staticmethod
    def _extend(req: _Request, delta: str) -> bool:
        """Add delta to req's text; True when a stop sequence now occurs (the text ends before it)."""
        if not delta:
            return False
        # a stop sequence not in the text before must overlap delta: search from there
        start = max(0, len(req.text) - max(map(len, req.params.stop), default=1) + 1)
        req.text += delta
        if req.params.stop and (at := find_stop(req.text, req.params.stop, start)) >= 0:
            req.text, req.finish = req.text[:at], "stop"
            return True
        return False

    def metrics(self) -> dict:
        """Running and waiting sequences, tokens made, tokens/s since the batcher began, and
        time to first token and inter-token latency percentiles (seconds)."""
        import numpy as np

        def pct(xs):
            return {f"p{q}": round(float(np.percentile(xs, q)), 6) for q in (50, 90, 99)} if xs else {}

        elapsed = time.perf_counter() - self.started
        return {"running": len(self.running), "waiting": len(self.waiting), "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / elapsed, 2) if elapsed > 0 else None,
                "kv_reserved_bytes": self.reserved, "kv_budget_bytes": self.budget,
                "time_to_first_token_s": pct(self.ttft), "inter_token_latency_s": pct(self.itl)}

    def run(self) -> None:
        while self.busy:
            self.step()


def _plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's next token is its logits' argmax with no top alternatives reported."""
    return params.temperature < GREEDY_BELOW and not params.logprobs


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(rows), without the copy when they are the rows of one tensor in order (a
    decode step's logits: a 50k vocabulary's copy was a step's largest non-GEMM op after attention)."""
    whole = rows[0]._base
    if whole is not None and whole.dim() == 2 and whole.shape[0] == len(rows) and whole.is_contiguous():
        step = whole.stride(0) * whole.element_size()
        if all(r._base is whole and r.data_ptr() == whole.data_ptr() + j * step for j, r in enumerate(rows)):
            return whole
    return torch.stack(rows)
