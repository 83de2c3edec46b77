"""Serving code's entry to a decoder store: what runtime.open returns for one.

    rt = runtime.open("decoder-store")                     # a DecoderRuntime
    rt.generate([{"tenant": "acme", "prompt": "the history of", "max_tokens": 32, "temperature": 0.8,
                  "seed": 1}, {"prompt": "a base-model request"}])      # one result dict per request
    for event in rt.stream(requests): ...                 # {"index", "token", "text", "finished", ...}

Every request runs in the runtime's one generation engine (runtime.gen.engine: one thread, a
continuous batch per PLOT version), which hkstore generate and hkstore serve's OpenAI routes
share: calls from several threads decode together. Each request has its own tenant's PET
(loaded once and kept); fields besides tenant, prompt and version (a PLOT version by name;
default the tenant's, else the root) are runtime.gen.sampling.SamplingParams'. A prompt is
text (tokenized with the special tokens the tokenizer adds, a BOS for most) or a list of token
ids (taken as they are). A completion's text is decoded in its prompt's context
(runtime.gen.detok): prompt text + completion text is the text of all the tokens, its leading
space included. A bad request (unknown tenant, an encoder tenant, bad sampling values, a prompt
or max_tokens beyond the context, text that is not valid Unicode, token ids outside the
vocabulary) raises before any request of the call runs: BadRequest, or UnknownTenant.
"""

from __future__ import annotations

import threading

import torch

from runtime.gen.sampling import SamplingParams

FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "logprobs", "ignore_eos")
DEFAULT_KV_BUDGET = 256 << 20


def is_decoder_store_path(path) -> bool:
    import hkstore
    from runtime.model.stored import is_decoder_store

    try:
        with hkstore.open(path) as st:
            return is_decoder_store(st.meta)
    except Exception:  # noqa: BLE001  (not a store: the encoder Runtime reports why)
        return False


class DecoderRuntime:
    def __init__(self, store_path, device: str = "cpu", *, kv_budget_bytes: int = DEFAULT_KV_BUDGET,
                 max_running: int = 64, decoder=None, dtype: str = "auto", pet_cache_bytes: int = 512 << 20,
                 lora_kernel: str = "auto", executor=None, **_ignored):
        """device "cpu" (the reference path) or "cuda" (runtime.gen.device_decode: the upper layers,
        KV pool and PETs on the GPU executor; `executor` hands in one already built). On the CPU,
        dtype is the shared GEMMs' precision, "fp32", "bf16" or "auto" (runtime.gen.row_precision: each
        tenant at the precision its record names, which lm_tenant_create measures; fp32 without one)."""
        import hkstore
        from runtime.model.stored import base_decoder

        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda (runtime.open resolves auto), got {device!r}")
        self.device = device
        if device == "cpu":
            from runtime.gen.row_precision import resolve

            self.precision = resolve(dtype)  # (before the store opens: a bad dtype leaves nothing open)
        self.store = hkstore.open(store_path)
        try:
            self.decoder = decoder if decoder is not None else base_decoder(self.store)
            self.executor = executor
            if device == "cuda" and executor is None:
                from runtime.exec.gpu_decoder import GpuDecoderExecutor

                # (the GPU's own precision: fp32 unless one is asked; auto is the CPU's per-tenant choice)
                self.executor = GpuDecoderExecutor(self.decoder, dtype="fp32" if dtype == "auto" else dtype,
                                                   pet_cache_bytes=pet_cache_bytes,
                                                   lora_kernel=lora_kernel)
        except BaseException:
            self.store.close()
            raise
        self.kv_budget_bytes, self.max_running = kv_budget_bytes, max_running
        self._pets: dict[str, object] = {}
        self._engine = None
        self._engine_lock = threading.Lock()

    def generation_engine(self, queue_limit: int | None = None):
        """The runtime's generation engine (runtime.gen.engine.GenEngine), made at first use;
        queue_limit (sequences submitted and not yet answered; None: no limit) replaces its limit."""
        from runtime.gen.engine import GenEngine

        with self._engine_lock:
            if self._engine is None:
                self._engine = GenEngine(self)
            if queue_limit is not None:
                self._engine.queue_limit = int(queue_limit)
            return self._engine

    def close(self):
        if self._engine is not None:
            self._engine.stop()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def parse(self, snap, request):
        """(version, prompt ids, SamplingParams, PET) of one request, or BadRequest / UnknownTenant
        (what the engine, runtime.gen.engine, checks of every request before any runs)."""
        return self._parse(snap, request)

    def batcher(self, snap, version):
        """A continuous batcher over one PLOT version of snap, with this runtime's KV budget, on
        this runtime's device."""
        from runtime.gen.batcher import Batcher

        if self.device == "cuda":
            from runtime.gen.device_decode import DevicePlotDecoder

            gen = DevicePlotDecoder(snap, version, self.decoder, executor=self.executor)
        else:
            from runtime.gen.plot_decode import PlotDecoder

            gen = PlotDecoder(snap, version, self.decoder, precision=self.precision)
        return Batcher(gen, self.kv_budget_bytes, self.max_running)

    def refresh(self):
        """Serve the store's newest manifest (what hkstore serve calls when a commit lands):
        new tenants become visible; an lm PET already loaded stays as it was."""
        self.store.refresh()

    def stats(self) -> dict:
        """What the server's /metrics reports of this runtime (as Runtime.stats()), with its
        generation engine's sequences, steps and tokens once it has run."""
        out = {"device": self.device, "lm_pets_loaded": len(self._pets)}
        if self._engine is not None:
            out["engine"] = self._engine.stats()
        return out

    def pet(self, tenant):
        """A decoder tenant's lm PET, loaded once and kept (what a Ray worker calls when it takes
        the tenant: runtime/serve/ray_app.py)."""
        from hkstore.errors import UnknownTenant
        from runtime.model.stored import load_lm_pet

        if tenant not in self._pets:
            if tenant not in self.store.snapshot().pets:
                raise UnknownTenant(f"unknown tenant {tenant!r}")
            self._pets[tenant] = load_lm_pet(self.store, tenant, self.decoder)
        return self._pets[tenant]

    def tenants(self) -> list[str]:
        return sorted(t for t in self.store.snapshot().pets)

    def infer(self, requests):
        from runtime.errors import BadRequest

        raise BadRequest("this is a decoder store: it generates text (generate / stream), it does not classify")

    @property
    def meta(self) -> dict:
        return self.store.snapshot().meta

    def embed(self, texts, tenant=None, **_):
        from runtime.errors import BadRequest

        raise BadRequest("this is a decoder store: it generates text (POST /v1/completions), it does not embed")

    def _parse(self, snap, request):
        from hkstore.errors import UnknownTenant
        from runtime.errors import BadRequest
        from runtime.model.stored import load_lm_pet

        if not isinstance(request, dict) or not isinstance(request.get("prompt"), (str, list)):
            raise BadRequest("each request is an object with a 'prompt': a string or a list of token ids")
        unknown = set(request) - {"tenant", "prompt", "version", *FIELDS}
        if unknown:
            raise BadRequest(f"unknown request fields: {', '.join(sorted(unknown))}")
        tenant, pet, version = request.get("tenant"), None, snap.version_names[0]
        if tenant is not None:
            if tenant not in snap.pets:
                raise UnknownTenant(f"unknown tenant {tenant!r}")
            meta = snap.read_pet(tenant).meta
            if meta.get("task") != "lm":
                raise BadRequest(f"tenant {tenant!r} is a {meta.get('task')} tenant: it classifies, it does not generate")
            if tenant not in self._pets:
                self._pets[tenant] = load_lm_pet(self.store, tenant, self.decoder)
            pet, version = self._pets[tenant], meta.get("version", version)
        if request.get("version") is not None:
            version = request["version"]
            if version not in snap.version_names:
                raise BadRequest(f"unknown PLOT version {version!r}: the store holds "
                                 f"{', '.join(snap.version_names)}")
        try:
            params = SamplingParams(**{k: request[k] for k in FIELDS if k in request}).check()
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        prompt = self.prompt_ids(request["prompt"])
        c = self.decoder.config
        if not c.rotary and len(prompt) + params.max_tokens > c.max_len:
            raise BadRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceed the model's "
                             f"context of {c.max_len}")
        return version, prompt, params, pet

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt's token ids: text tokenized, a list of ids checked against the vocabulary;
        BadRequest for anything else."""
        from runtime.errors import BadRequest

        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:  # (the tokenizer would raise a bare TypeError)
                raise BadRequest("the prompt is not valid Unicode text (it holds a lone surrogate)") from None
            return self.decoder.tokenize([prompt], max_len=1 << 30)[0]
        vocab = self.decoder.config.vocab_size
        if not isinstance(prompt, list) or not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise BadRequest(f"a prompt of token ids is a list of integers in [0, {vocab})")
        if not prompt:
            raise BadRequest("an empty prompt: at least one token")
        return list(prompt)

    @torch.no_grad()
    def prompt_logprobs(self, snap, version, prompt: list[int], pet=None, top: int = 0) -> list:
        """Each prompt token's logprob given the tokens before it and its `top` most likely
        alternatives there: [None, (logprob, [(token, logprob), ...]), ...] (nothing comes before
        the first). One pass of the upper layers over the prompt, as a prefill computes its last
        position (what echo with logprobs reports): on the CPU with the prefill's own GEMMs at the
        tenant's precision, so a scored text's logprobs are the ones generating it reported."""
        from runtime.plot.retrieve import retrieve

        h, mask, _ = retrieve(snap, version, [list(prompt)])
        if self.device == "cpu":
            from runtime.gen.batched_prefill import upper_batch
            from runtime.gen.lora_batch import lora_only

            out, rp = upper_batch(self.decoder, h, mask, [pet], None, not lora_only(pet), self.precision)
            logits = self.decoder.logits(out[0], linear=rp.linear)
        else:
            logits = self.decoder.logits(self.decoder.upper(h, mask, pet)[0])
        logprobs = torch.log_softmax(logits.float(), -1)
        out: list = [None]
        for t in range(1, len(prompt)):
            row = logprobs[t - 1]
            alternatives = []
            if top:
                values, ids = row.topk(top)
                alternatives = list(zip(ids.tolist(), values.tolist()))
            out.append((float(row[prompt[t]]), alternatives))
        return out

    def stream(self, requests):
        """Events as tokens are made: {"index", "token", "text" (the completion so far),
        "finished", "finish_reason"}; the last event of each request has finished True.
        Closing the iterator early cancels what is left."""
        for e in self._events(requests):
            yield {"index": e["index"], "token": e["token"], "text": e["text"], "finished": e["finished"],
                   "finish_reason": e["finish_reason"]}

    def generate(self, requests) -> list[dict]:
        """One result per request, in order: ids, text, finish_reason, logprobs, usage."""
        results: list[dict | None] = [None] * len(requests)
        for e in self._events(requests):
            if e["finished"]:
                results[e["index"]] = e["result"]
        return results

    def _events(self, requests):
        """The engine's token events of requests, one submission; its error raised here."""
        from runtime.gen.engine import QueueFull

        if not isinstance(requests, (list, tuple)):
            from runtime.errors import BadRequest

            raise BadRequest("requests is a list of request objects")
        if not requests:
            return
        eng = self.generation_engine()
        h = eng.submit(list(requests))
        if h is None:
            raise QueueFull(f"the generation queue is full ({eng.queue_limit} sequences); retry later")
        finished = False
        try:
            for e in h.events():
                if e["type"] == "error":
                    finished = True
                    raise e["error"]
                if e["type"] == "token":
                    yield e
            finished = True
        finally:
            if not finished:
                eng.cancel(h)
            eng.release(h)
