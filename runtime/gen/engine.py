"""The one generation engine of a decoder store: every caller's requests in one loop.

    eng = rt.generation_engine()                        # DecoderRuntime's own, its thread started at first use
    h = eng.submit([{"tenant": "acme", "prompt": "the cat", "max_tokens": 8}])   # a Handle (None: queue full)
    for event in h.events(): ...                        # or submit(..., sink=fn): fn(event) on the engine's thread
    eng.cancel(h)                                       # its client went away
    eng.release(h)                                      # its answer is over: its places in the queue free

runtime.open(DECODER_STORE).generate / stream, `hkstore generate` and hkstore serve's OpenAI
routes all submit here, so requests from any of them share one continuous batch (one
runtime.gen.batcher.Batcher per PLOT version, each with its KV pool kept while the store's
snapshot is the newest).

A loop turn (vLLM's EngineCore.step): take what was submitted (parse every sequence of a
submission first, so a bad one refuses the whole submission before any runs) and cancelled,
then each busy batcher steps (schedule: who joins and leaves under the KV budget; execute: one
batched prefill and decode; update: sample, detokenize, stop checks), and its events go to
their handles. Observers (observe(fn)) see each turn's new tokens, time to first token and
inter-token latencies, and the running and waiting sequences: what /metrics reports.

Events of a submission: {"type": "accepted", "prompts": [ids per sequence], "prompt_logprobs":
[per sequence when asked: DecoderRuntime.prompt_logprobs]} once; then per token {"type":
"token", "index", "token", "text" (so far), "finished", "finish_reason", "completion_tokens",
"logprob", "top"}, a sequence's last with finished True and "result" (Batcher.result); or
instead one {"type": "error", "error": exception} (a bad request, a failed step, shutdown).

Requests are DecoderRuntime.parse's, plus: max_tokens None is what is left of the context, at
most REST_CAP (OpenAI's chat default); max_tokens 0 with zero_tokens makes no token (echo
scores the prompt): its one event is finished at once.
"""

from __future__ import annotations

import queue
import threading

REST_CAP = 256


class QueueFull(RuntimeError):
    """The engine holds queue_limit sequences already."""


class Handle:
    """One submission's sequences in the engine: requests[i] is sequence i."""

    __slots__ = ("cancelled", "keys", "prompt_logprobs", "released", "requests", "sink", "zero_tokens", "_events")

    def __init__(self, requests, sink, prompt_logprobs, zero_tokens):
        self._events = None
        if sink is None:
            self._events = queue.SimpleQueue()
            sink = self._events.put
        self.requests, self.sink = requests, sink
        self.prompt_logprobs, self.zero_tokens = prompt_logprobs, zero_tokens
        self.keys, self.cancelled, self.released = [], False, False

    def events(self):
        """The submission's events as they come (submitted without a sink), up to every
        sequence's last or an error."""
        left = len(self.requests)
        while left:
            event = self._events.get()
            yield event
            if event["type"] == "error":
                return
            if event["type"] == "token" and event["finished"]:
                left -= 1


def _stale(batcher, snap) -> bool:
    """An idle batcher over an older snapshot than snap: replaced by one on snap. One over the
    newest stays, with its KV pool (allocating and zeroing a pool per request cost tens of
    milliseconds of time to first token)."""
    return not batcher.busy and batcher.gen.snapshot.manifest.get("generation") != snap.manifest.get("generation")


class GenEngine:
    def __init__(self, rt, queue_limit: int | None = None):
        self.rt, self.queue_limit = rt, queue_limit
        self.cond = threading.Condition()
        self.inbox: list[Handle] = []
        self.cancels: list[Handle] = []
        self.live = 0  # sequences submitted and not released (inbox, waiting, running, being answered)
        self.batchers: dict[str, object] = {}
        self.handles: dict[tuple[str, int], tuple[Handle, int]] = {}  # (version, batcher's id) -> (handle, index)
        self.observers: list = []
        self.stopping = False
        self.thread = None
        self.steps = 0  # batcher steps that decoded at least one sequence
        self.tokens = 0
        self.widest = 0  # the most sequences one step decoded together

    def submit(self, requests: list[dict], sink=None, prompt_logprobs: int | None = None,
               zero_tokens: bool = False) -> Handle | None:
        with self.cond:
            if self.stopping:
                raise RuntimeError("the generation engine is stopped (its runtime was closed)")
            if self.queue_limit is not None and self.live + len(requests) > self.queue_limit:
                return None
            self.live += len(requests)
            h = Handle(list(requests), sink, prompt_logprobs, zero_tokens)
            self.inbox.append(h)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="hkstore-gen", daemon=True)
                self.thread.start()
            self.cond.notify()
            return h

    def cancel(self, h: Handle):
        with self.cond:
            if not h.cancelled:
                h.cancelled = True
                self.cancels.append(h)
                self.cond.notify()

    def release(self, h: Handle):
        """h's answer is over (sent, refused or abandoned): its places in the queue free. A stream
        holds them until its client has read it all or gone away."""
        with self.cond:
            if not h.released:
                h.released = True
                self.live -= len(h.requests)

    def observe(self, fn):
        """fn({"tokens", "ttft", "itl", "running", "waiting"}) after every loop turn, on the
        engine's thread: the turn's new tokens and latencies (seconds), the sequences now."""
        self.observers.append(fn)

    def stats(self) -> dict:
        with self.cond:
            waiting = sum(len(h.requests) for h in self.inbox)
            batchers = list(self.batchers.values())
        return {"running": sum(len(b.running) for b in batchers),
                "waiting": waiting + sum(len(b.waiting) for b in batchers),
                "steps": self.steps, "tokens": self.tokens, "widest_batch": self.widest, "queued": self.live}

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(30)

    # -- the engine's thread ---------------------------------------------------------------------

    def _run(self):
        try:
            while True:
                with self.cond:
                    while not (self.inbox or self.cancels or self.stopping or
                               any(b.busy for b in self.batchers.values())):
                        self.cond.wait()
                    if self.stopping:
                        break
                    inbox, self.inbox = self.inbox, []
                    cancels, self.cancels = self.cancels, []
                self._turn(inbox, cancels)
        finally:
            with self.cond:
                self.stopping = True
                inbox, self.inbox = self.inbox, []
            told = set()
            for h in inbox + [h for h, _ in self.handles.values()]:
                if id(h) not in told:
                    told.add(id(h))
                    h.sink({"type": "error", "error": RuntimeError("the generation engine stopped")})

    def _turn(self, inbox, cancels):
        for h in inbox:
            if not h.cancelled:
                self._admit(h)
        for h in cancels:
            self._drop(h)
        newest = self.rt.store.snapshot()
        tokens, ttft, itl = 0, [], []
        for version, b in list(self.batchers.items()):
            if b.busy:
                tokens += self._step(version, b)
                ttft += b.ttft
                itl += b.itl
                b.ttft.clear()
                b.itl.clear()
            if self.batchers.get(version) is b and _stale(b, newest):
                del self.batchers[version]
        if self.observers:
            s = self.stats()
            report = {"tokens": tokens, "ttft": ttft, "itl": itl, "running": s["running"], "waiting": s["waiting"]}
            for fn in self.observers:
                fn(report)

    def _parse(self, snap, h: Handle) -> list:
        """(version, prompt ids, SamplingParams or None (no token to make), PET) per sequence."""
        from runtime.errors import BadRequest
        from runtime.gen.sampling import SamplingParams

        rt, c = self.rt, self.rt.decoder.config
        ids_of = {}  # the n choices of a prompt share its object: tokenized once
        parsed = []
        for request in h.requests:
            if not isinstance(request, dict) or not isinstance(request.get("prompt"), (str, list)):
                raise BadRequest("each request is an object with a 'prompt': a string or a list of token ids")
            text = request["prompt"]
            if id(text) not in ids_of:
                ids_of[id(text)] = rt.prompt_ids(text)
            prompt = ids_of[id(text)]
            if not c.rotary and len(prompt) >= c.max_len:
                raise BadRequest(f"the prompt is {len(prompt)} tokens, the model's context holds {c.max_len}")
            max_tokens = request.get("max_tokens", SamplingParams.max_tokens)
            if max_tokens is None:
                max_tokens = max(1, min(REST_CAP, c.max_len - len(prompt))) if not c.rotary else REST_CAP
            scoring = h.zero_tokens and max_tokens == 0
            version, prompt, params, pet = rt.parse(snap, dict(request, prompt=prompt,
                                                               max_tokens=1 if scoring else max_tokens))
            parsed.append((version, prompt, None if scoring else params, pet))
        return parsed

    def _admit(self, h: Handle):
        from runtime.errors import BadRequest

        rt = self.rt
        submitted = []
        try:
            snap = rt.store.snapshot()
            parsed = self._parse(snap, h)
            prompt_lps = [None] * len(parsed)
            if h.prompt_logprobs is not None:
                memo = {}
                for i, (version, prompt, _, pet) in enumerate(parsed):
                    key = (version, id(pet), tuple(prompt))
                    if key not in memo:
                        memo[key] = rt.prompt_logprobs(snap, version, prompt, pet, h.prompt_logprobs)
                    prompt_lps[i] = memo[key]
            for i, (version, prompt, params, pet) in enumerate(parsed):
                if params is None:
                    continue
                batcher = self.batchers.get(version)
                if batcher is None or _stale(batcher, snap):
                    batcher = self.batchers[version] = rt.batcher(snap, version)
                try:
                    submitted.append(((version, batcher.submit(prompt, params, pet)), i))
                except ValueError as e:
                    raise BadRequest(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the submission's answer (4xx or 500), the engine goes on
            for (version, rid), _ in submitted:  # (still waiting: none has run)
                self.batchers[version].cancel(rid)
                self.batchers[version].done.pop(rid, None)
            h.sink({"type": "error", "error": e})
            return
        for key, i in submitted:
            h.keys.append(key)
            self.handles[key] = (h, i)
        h.sink({"type": "accepted", "prompts": [p for _, p, _, _ in parsed], "prompt_logprobs": prompt_lps})
        for i, (_, prompt, params, _) in enumerate(parsed):
            if params is None:
                h.sink({"type": "token", "index": i, "token": None, "text": "", "finished": True,
                        "finish_reason": "length", "completion_tokens": 0,
                        "result": {"ids": [], "text": "", "finish_reason": "length", "logprobs": [],
                                   "top_logprobs": [], "prompt_tokens": len(prompt), "completion_tokens": 0}})

    def _drop(self, h: Handle):
        for key in h.keys:
            entry = self.handles.get(key)
            if entry is None or entry[0] is not h:  # finished (batchers' ids recur)
                continue
            del self.handles[key]
            version, rid = key
            b = self.batchers.get(version)
            if b is not None:
                b.cancel(rid)
                b.done.pop(rid, None)  # a waiting one is done at once; a running one at its next step

    def _step(self, version, b) -> int:
        """One step of b; its events to their handles. Returns the tokens it made."""
        try:
            events = b.step()
        except Exception as e:  # noqa: BLE001 - every sequence of the batcher gets the error, the engine goes on
            told = set()
            for key in [k for k in self.handles if k[0] == version]:
                h, _ = self.handles.pop(key)
                if id(h) not in told:
                    told.add(id(h))
                    h.sink({"type": "error", "error": e})
            del self.batchers[version]
            return 0
        decoded = sum(e.token is not None for e in events)
        self.steps += bool(events)
        self.widest = max(self.widest, len(events))  # (one event per sequence the step sampled)
        self.tokens += decoded
        running = {r.id: r for r in b.running}
        for e in events:
            entry = self.handles.get((version, e.id))
            req = running.get(e.id) or b.done.get(e.id)
            if entry is None:  # cancelled
                if e.finished:
                    b.done.pop(e.id, None)
                continue
            h, index = entry
            out = {"type": "token", "index": index, "token": e.token, "text": e.text, "finished": e.finished,
                   "finish_reason": e.finish_reason, "completion_tokens": len(req.ids) if req else 0}
            if e.token is not None and req is not None:
                out["logprob"], out["top"] = req.logprobs[-1], req.top[-1]
            if e.finished:
                out["result"] = b.result(e.id) if e.id in b.done else None
                b.done.pop(e.id, None)
                del self.handles[(version, e.id)]
            h.sink(out)
        return decoded
