"""The encoder runtime: a store opened for serving (``runtime.open``), its requests and results.

``Runtime`` validates and tokenizes requests, loads the tenants' PETs (host cache; a tenant's
current full-depth PET too, the top of its cascade), asks the tenant's records which policy,
students and top serve each request (runtime.engine.Ask) and hands them to the engine
(runtime.engine: one queue, one loop), whose answers become ``Result``s.
See the package doc for the request and result fields.
"""

from __future__ import annotations

import math
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from hkstore.errors import StoreError, UnknownTenant
from runtime.errors import BadRequest, EmptyText, IncompatiblePet, TextTooLong

DEFAULT_PET_CACHE_BYTES = 512 << 20  # device PET cache (GPU)
DEFAULT_HOST_CACHE_BYTES = 4 << 30  # host PET cache: 10K adapter/LoRA tenants of MiniLM fit
DEFAULT_HOT_TIER_ROWS = 65536  # GPU PLOT hot tier: (window, version) rows kept on the device
# Characters per text, checked before tokenizing: the HTTP server's cap, so a text is refused
# alike from Python, the shell and HTTP (truncate or not), and a megabyte of text costs no
# tokenizer pass. max_len (tokens) stays the real bound below it.
MAX_TEXT_CHARS = 16_384
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Request:
    tenant: str
    text: str | None = None
    ids: list | None = None
    truncate: bool | None = None  # cut to max_len tokens instead of TextTooLong (None: the runtime's default)
    policy: str | None = None  # fast | auto | exact (runtime.level.serve; None: auto once profiled, else fast)
    students: int | None = None  # 0: the teacher; k: the first k students; None: the pruning policy's choice
    level: str | None = None  # pins a level: plot, exact (full-context lower layers) or full; None: the policy's


@dataclass
class Result:
    tenant: str
    task: str  # classification | tagging
    labels: list  # the tenant's label names, in probability order
    label: str | None  # classification: the most probable label
    tags: list | None  # tagging: one label per word (text) or per id (ids request)
    tokens: list | None  # tagging: the words / tokens the tags belong to
    probabilities: list  # classification: per label; tagging: per word/token, per label
    version: str  # the PLOT version that served the request
    timings: dict  # seconds: retrieval, transfer, compute (of its batch), total (submit to result)
    batch_size: int = 0  # requests in the batch that computed it
    logits: np.ndarray = field(default=None, repr=False)  # raw head output: (labels,) or (tokens, labels)
    truncated: int = 0  # tokens cut off the end of the request (truncate), 0 when none
    level: int = 1  # which level answered: 1 the PLOT (hPLM), 2 the tenant's top (runtime.level)
    confidence: float | None = None  # calibrated confidence (runtime.level.dispatch.confidence)
    pruned: int = 0  # words level 2 did not see (Tabi word pruning); their tags are level 1's
    students: int = 0  # how many students answered (runtime.student); 0: the teacher
    level_name: str = "plot"  # the level by name: students, plot, exact (full-context lower layers) or full


PINS = {"plot": "plot", "exact": "context", "full": "full"}  # a request's level pin -> its rows' input source


def _cuda_available() -> bool:
    from runtime.exec.gpu import cuda_available

    return cuda_available()


def _resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a device asked for: auto picks the GPU when CuPy sees one."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if device == "cuda" and not _cuda_available():
        raise StoreError("device='cuda' needs CuPy and a CUDA GPU (pip install 'hkstore[gpu]')")
    return device


class Runtime:
    """A store opened for serving; see the package doc. Use ``runtime.open``."""

    def __init__(self, store_path, device: str = "auto", *, max_len: int = 128, max_batch: int = 64,
                 pet_cache_bytes: int = DEFAULT_PET_CACHE_BYTES, pipeline: bool | None = None,
                 prefetch: bool | None = None,
                 hot_tier_rows: int = DEFAULT_HOT_TIER_ROWS, host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
                 dtype: str = "auto", lora_kernel: str = "auto", encoder=None, truncate: bool = False,
                 students_target_s: float = 0.5, length_buffer: bool = True, batching: str | None = None,
                 max_wait_s: float = 0.0):
        import hkstore

        device = _resolve_device(device)
        # The overlap threads pay where retrieval (host) and compute (device) run on different
        # hardware; on the CPU they compete with compute for the same cores: synchronized served
        # 130.0 requests/s against pipelined 103.6 on two cores (BENCHMARKS, HMI analogues).
        pipeline = device == "cuda" if pipeline is None else bool(pipeline)
        prefetch = device == "cuda" if prefetch is None else bool(prefetch)
        if max_len < 1 or max_batch < 1:
            raise ValueError(f"max_len and max_batch must be positive, got {max_len} and {max_batch}")
        self.device, self.max_len, self.max_batch = device, int(max_len), int(max_batch)
        self.truncate = bool(truncate)
        # SP's length-aware buffer cuts what waits into batches of similar lengths (FIFO: 39% of a
        # mixed burst's token slots are padding, the buffer 14%; BENCHMARKS, Student Parallelism)
        batching = batching or ("length" if length_buffer else "fifo")
        self.store = hkstore.open(store_path)
        try:
            self._setup(device, encoder, pet_cache_bytes, pipeline, prefetch, hot_tier_rows, host_cache_bytes,
                        dtype, lora_kernel, students_target_s, batching, max_wait_s)
        except BaseException:
            self.store.close()
            raise
        self._warming = self._warm()

    def _warm(self):
        """Store.warm() on a background thread when the store's segments fit in a quarter of
        the machine's memory: a fresh Zipf stream of lookups runs at 0.39 of an in-memory take
        before it and 0.80 after (BENCHMARKS, store lookups); a bigger store would push out
        what serving needs and is left to fault its rows in as they are asked for."""
        folder = os.path.join(self.store.path, "segments")
        size = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file()) if os.path.isdir(folder) else 0
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return self.store.warm(background=True) if size and 4 * size <= memory else None

    def _setup(self, device, encoder, pet_cache_bytes, pipeline, prefetch, hot_tier_rows, host_cache_bytes, dtype,
               lora_kernel, students_target_s, batching, max_wait_s):
        from runtime.engine import Engine
        from runtime.exec.context import ContextInputs
        from runtime.model import stored
        from runtime.model.stored import check_encoder
        from runtime.sched.pet_cache import PetCache
        from runtime.student.serve import StudentServing

        meta = self.store.meta
        if encoder is None:
            encoder = stored.base_encoder(self.store)
        else:
            check_encoder(meta, encoder)
        # a text past the model's positions is too long whatever max_len says (422, not a failed lookup)
        self.max_len = min(self.max_len, encoder.config.max_len)
        self.encoder = encoder
        self.meta = meta
        # level 2's inputs (full-context lower layers) are a source of the executor's batches
        context = ContextInputs(self.store, encoder)
        self._context = context  # its full-context encoders per version also serve exact embeddings
        if device == "cuda":
            from runtime.exec.gpu import GpuExecutor

            # auto: the GPU's own default (fp32); a tenant's recorded precision is the CPU's
            self.executor = GpuExecutor(encoder, dtype="fp32" if dtype == "auto" else dtype,
                                        pet_cache_bytes=pet_cache_bytes, prefetch=prefetch,
                                        hot_tier_rows=hot_tier_rows, max_batch=self.max_batch, max_len=self.max_len,
                                        lora_kernel=lora_kernel, context=context)
        else:
            # int8: the shared GEMMs quantized (runtime.exec.int8); bf16: every row in bf16; auto: each row at
            # the precision its PET records, where the CPU has bf16 (runtime.exec.precision)
            if dtype not in ("fp32", "int8", "bf16", "auto"):
                raise ValueError(f"the CPU executor computes in fp32, bf16 or auto (or dtype='int8' for the shared GEMMs), "
                                 f"not {dtype!r}")
            from runtime.exec.cpu import CpuExecutor

            self.executor = CpuExecutor(encoder, lora_kernel=lora_kernel, prefetch=prefetch, int8=dtype == "int8",
                                        precision=dtype if dtype in ("bf16", "auto") else "fp32",
                                        context=context)
        self.pets = PetCache(host_cache_bytes)
        self._refresh_lock = threading.Lock()
        # tenants with students: the engine routes a batch to the teacher or k students under the load
        self.students = StudentServing(encoder.config.d, students_target_s)
        self.engine = Engine(self.executor, self.store.snapshot, max_batch=self.max_batch, pipeline=pipeline,
                             batching=batching, students=self.students, max_wait_s=max_wait_s)
        tok = encoder.tokenizer
        self._cls, self._sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")

    # -- lifecycle -------------------------------------------------------------------------

    def close(self):
        warming = getattr(self, "_warming", None)
        if warming is not None:
            warming.join(30)  # its C pass reads the segments' mappings: they must outlive it
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        close = getattr(self.executor, "close", None) if hasattr(self, "executor") else None
        if close:
            close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def refresh(self):
        """Serve the store's newest manifest (new or updated tenants, new versions)."""
        with self._refresh_lock:
            self.store.refresh()
            if self._warming is None or not self._warming.is_alive():
                self._warming = self._warm()  # the segments committed since

    @property
    def tenants(self) -> list:
        return sorted(self.store.snapshot().pets)

    def stats(self) -> dict:
        out = {"device": self.device, "batches": self.engine.batches, "requests": self.engine.items,
               "host_pet_cache": self.pets.stats()}
        extra = getattr(self.executor, "stats", None)
        if extra:
            out.update(extra())
        return out

    # -- requests --------------------------------------------------------------------------

    def pet(self, tenant):
        """The tenant's ServingPet (decoded once, then from the host cache)."""
        snap = self.store.snapshot()
        if not isinstance(tenant, str):
            raise BadRequest(f"tenant must be a string, got {type(tenant).__name__}")
        if tenant not in snap.pets:
            self.refresh()  # created after this runtime opened?
            snap = self.store.snapshot()
            if tenant not in snap.pets:
                raise UnknownTenant(f"unknown tenant {tenant!r}")
        loc = snap.pets[tenant]
        token = (loc["file"], loc["offset"])
        pet = self.pets.get(tenant, token, lambda: self._load_pet(snap, tenant, token))
        if pet.version not in snap.version_names:
            raise IncompatiblePet(f"tenant {tenant!r} was trained on PLOT version {pet.version!r}, "
                                  "which this store no longer holds")
        return pet

    def full(self, tenant, pet):
        """The tenant's current full-depth ServingPet (its top), None when it has none or a stale
        one (trained with an earlier PET than `pet`, the tenant's ServingPet: not served). Cached
        with the PETs, under a key no tenant's PET has ('/' is not in tenant names)."""
        snap = self.store.snapshot()
        loc = snap.full.get(tenant)
        if loc is None:
            return None
        token = (loc["file"], loc["offset"])
        full = self.pets.get(f"{tenant}/full", token, lambda: self._load_full(snap, tenant, token))
        return full if full.meta.get("pet_created") == pet.meta.get("created") else None

    def _load_full(self, snap, tenant, token):
        from runtime.model.pet import load_pet, pet_meta

        record = snap.read_full(tenant)
        meta = record.meta
        self._check_base(tenant, meta, "full-depth PET")
        try:  # its fp16 tensors stay fp16 in the host cache (half a tenant's bytes): the executor computes in fp32
            pet = load_pet(self.encoder, record.tensors, pet_meta(meta), half=True)
        except ValueError as e:
            raise IncompatiblePet(f"tenant {tenant!r}'s full-depth PET does not fit the model: {e}") from None
        pet.meta.update(version=meta.get("version"), tenant=tenant, created=meta.get("created"),
                        pet_created=meta.get("pet_created"))
        return self.executor.load_pet(pet, key=f"{tenant}/full", token=token)

    def _check_base(self, tenant, meta, what):
        base = self.meta.get("base_model")
        if meta.get("base_model") != base:
            raise IncompatiblePet(f"tenant {tenant!r}'s {what} was trained for base model {meta.get('base_model')!r}, "
                                  f"this store serves {base!r}")

    def _load_pet(self, snap, tenant, token):
        from runtime.model.pet import load_pet, pet_meta

        record = snap.read_pet(tenant)
        meta = record.meta
        self._check_base(tenant, meta, "PET")
        version = meta.get("version")
        if version not in snap.version_names:
            raise IncompatiblePet(f"tenant {tenant!r} was trained on PLOT version {version!r}, "
                                  "which this store does not hold")
        try:
            pet = load_pet(self.encoder, record.tensors, pet_meta(meta), half=True)
        except ValueError as e:
            raise IncompatiblePet(f"tenant {tenant!r}'s PET does not fit the model: {e}") from None
        from runtime.level.serve import calibration, current

        pet.meta.update(version=version, tenant=tenant, levels=current(meta), calibration=calibration(meta),
                        created=meta.get("created"))
        return self.executor.load_pet(pet, key=tenant, token=token)

    def _normalize(self, requests, max_len=None, words_needed=True) -> list:
        """(tenant, ids, words or None, text) per request, validated (see the package doc);
        max_len: the token limit (default the runtime's); words_needed: a text whose tokenizer
        keeps no word (only [CLS] [SEP]) is EmptyText (infer answers per word; an embedding
        still exists)."""
        max_len = self.max_len if max_len is None else int(max_len)
        if isinstance(requests, (dict, Request)):
            raise BadRequest("infer takes a list of requests")
        parsed, texts = [], []
        for r in requests:
            if isinstance(r, Request):
                tenant, text, ids, cut, policy, students = r.tenant, r.text, r.ids, r.truncate, r.policy, r.students
                level = r.level
            elif isinstance(r, dict):
                unknown = set(r) - {"tenant", "text", "ids", "truncate", "policy", "students", "level"}
                if unknown:
                    raise BadRequest(f"unknown request fields {sorted(unknown)}; expected tenant, text or ids, "
                                     "truncate, policy, students and level")
                tenant, text, ids, cut = r.get("tenant"), r.get("text"), r.get("ids"), r.get("truncate")
                policy, students, level = r.get("policy"), r.get("students"), r.get("level")
            else:
                raise BadRequest(f"a request is a dict or runtime.Request, got {type(r).__name__}")
            if tenant is None:
                raise BadRequest("a request needs a tenant")
            if not isinstance(tenant, str):
                raise BadRequest(f"tenant must be a string, got {type(tenant).__name__}")
            if (text is None) == (ids is None):
                raise BadRequest("a request needs exactly one of text and ids")
            if policy is not None and policy not in ("fast", "auto", "exact"):
                raise BadRequest(f"policy must be fast, auto or exact, got {policy!r}")
            if students is not None and (not isinstance(students, (int, np.integer)) or isinstance(students, bool)
                                         or students < 0):
                raise BadRequest(f"students must be a whole number >= 0 (0: the teacher), got {students!r}")
            if level is not None:
                if not isinstance(level, str) or level not in PINS:
                    raise BadRequest(f"level must be one of {', '.join(PINS)}, got {level!r}")
                if policy is not None or students:
                    raise BadRequest("a request pins a level or asks for a policy or students, not both")
            if text is not None:
                if not isinstance(text, str):
                    raise BadRequest(f"text must be a string, got {type(text).__name__}")
                if len(text) > MAX_TEXT_CHARS:
                    raise TextTooLong(f"tenant {tenant!r}: the text has {len(text):,} characters, more than "
                                      f"{MAX_TEXT_CHARS:,} (the limit per text, as the HTTP server's; truncate "
                                      "cuts tokens, not characters: shorten the text)")
                bad = unicode_problem(text)
                if bad:
                    raise BadRequest(f"tenant {tenant!r}: the text is not valid Unicode ({bad})")
                if not text.strip():
                    raise EmptyText(f"tenant {tenant!r}: the text is empty")
                texts.append(len(parsed))
            parsed.append([tenant, ids, None, text, self.truncate if cut is None else bool(cut), 0, (policy, level),
                           None if students is None else int(students)])
        if texts:
            encodings = self.encoder.tokenizer.encode_batch([parsed[j][3] for j in texts])
            for j, e in zip(texts, encodings):
                parsed[j][1] = list(e.ids)
                parsed[j][2] = _words(parsed[j][3], e)
        vocab = self.encoder.config.vocab_size
        for p in parsed:
            tenant, ids, words, text, cut, _, _, _ = p
            if text is None:
                try:
                    arr = np.asarray(ids)
                except Exception:  # ragged or odd objects
                    arr = np.asarray([None])
                if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                    raise BadRequest(f"tenant {tenant!r}: ids must be a list of integers")
                if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                    raise BadRequest(f"tenant {tenant!r}: token ids must lie in [0, {vocab})")
                p[1] = ids = arr.astype(np.int64).tolist()
            if not len(ids) or (words_needed and words is not None and not words):
                raise EmptyText(f"tenant {tenant!r}: the request holds no token")
            if len(ids) > max_len:
                if not cut:
                    raise TextTooLong(f"tenant {tenant!r}: {len(ids)} tokens, more than max_len={max_len} "
                                      "(truncate cuts it instead)")
                p[5] = len(ids) - max_len
                if text is None:
                    p[1] = ids[:max_len]
                else:  # keep [SEP] last, and the words that start before the cut
                    p[1] = ids[:max_len - 1] + ids[-1:]
                    p[2] = [w for w in words if w[0] < max_len - 1]
        return parsed

    def infer(self, requests) -> list:
        """Results of requests (see the package doc), in request order. Thread-safe. A
        request's ``policy`` picks the level (runtime.level.serve): ``fast`` the PLOT level,
        ``exact`` the tenant's top (its current full-depth PET, else full-context lower layers),
        ``auto`` Tabi's dispatcher (the default once the tenant is profiled against its top,
        runtime.level.profile)."""
        parsed, asks = self._asks(requests)
        return [self._result(p, ask.pet, a) for p, ask, a in zip(parsed, asks, self.engine.serve(asks))]

    def submit(self, requests, deadline: float = math.inf) -> list:
        """Queue requests on the engine; one Future per request (a Result). The request errors
        raise here, before anything is queued. A cancelled future leaves the queue; one whose
        batch could not finish by `deadline` (time.perf_counter) fails with ``Expired``."""
        parsed, asks = self._asks(requests)
        out = []
        for p, ask, inner in zip(parsed, asks, self.engine.submit(asks, deadline)):
            outer: Future = Future()
            inner.add_done_callback(lambda f, p=p, pet=ask.pet, outer=outer:
                                    _settle(outer, f, lambda a: self._result(p, pet, a)))
            outer.add_done_callback(lambda f, inner=inner: f.cancelled() and inner.cancel())
            out.append(outer)
        return out

    def _asks(self, requests):
        """The parsed requests and their engine asks: policy, students and PET per request."""
        from runtime.engine import Ask
        from runtime.level.serve import follow, policy_of

        parsed = self._normalize(list(requests) if not isinstance(requests, (dict, Request)) else requests)
        pets, fulls = {}, {}
        for tenant, *_ in parsed:
            if tenant not in pets:
                pets[tenant] = self.pet(tenant)
                fulls[tenant] = self.full(tenant, pets[tenant])
        snap = self.store.snapshot()
        asks = []
        for tenant, ids, words, _, _, _, (asked, level), students in parsed:
            pet, full = pets[tenant], fulls[tenant]
            positions = self._positions(pet, ids, words)
            if level is not None:
                self._check_pin(snap, tenant, level, full)
                asks.append(Ask(tenant, [int(t) for t in ids], positions, pet, "fast", full=full, pin=PINS[level]))
                continue
            policy, chosen = policy_of(pet, asked, full)
            mine = self.students.ask(snap, tenant, pet.meta, students, policy)
            if policy == "auto":  # a students-first policy needs the students it was profiled on
                chosen = follow(chosen, mine)
                policy = "auto" if chosen else "fast"
            asks.append(Ask(tenant, [int(t) for t in ids], positions, pet, policy, chosen, mine, full))
        return parsed, asks

    @staticmethod
    def _check_pin(snap, tenant, level, full):
        """A pin to the full-depth level of a tenant without a current one is the caller's
        mistake (BadRequest), never another level served in its place."""
        if level != "full" or full is not None:
            return
        if tenant in snap.full:
            raise BadRequest(f"tenant {tenant!r}'s full-depth level is stale: it was trained for an earlier PET "
                             "(hkstore tenant update retrains it)")
        raise BadRequest(f"tenant {tenant!r} has no full-depth level (hkstore tenant create --levels plot,full)")

    @staticmethod
    def _positions(pet, ids, words):
        """The token positions a tagging request reports: a word's first sub-token, or every id."""
        if pet.task == "classification":
            return None
        return list(range(len(ids))) if words is None else [first for first, _ in words]

    def generate(self, requests):
        """Encoder stores do not generate text: a BadRequest (decoder stores: runtime.gen.api)."""
        raise BadRequest("this is an encoder store: it classifies and tags (infer), it does not generate text")

    stream = generate

    @property
    def embed_max_len(self) -> int:
        """Tokens per input of the base model's exact embeddings: the model's own limit
        (sentence-transformers' max_seq_length when the model directory has one, 256 for
        all-MiniLM-L6-v2; else its position table), not max_len, which bounds the PLOT's
        requests: the base model's embedding is the model's, whatever the server's PLOT limits."""
        if getattr(self, "_embed_max_len", None) is None:
            self._embed_max_len = _sentence_max_len(self.meta.get("model_path"), self.encoder.config.max_len)
        return self._embed_max_len

    def embed(self, texts, tenant=None, *, truncate=None, normalize=True, policy=None):
        """Sentence embeddings: (vectors (n, d) float32, token counts). Each input is a text
        (tokenized, [CLS] ... [SEP] added) or a list of token ids (as the model sees them,
        special tokens included). The last hidden state, mean-pooled over the input's tokens
        (the attention mask) and L2-normalized: what sentence-transformers computes for
        all-MiniLM-L6-v2.

        policy "exact": the whole encoder. The base model's (tenant None) own embedding,
        exactly; a tenant's from its top, as infer's policy exact: its current full-depth PET
        in every layer of the base model when it has one, else the full-context lower layers
        its PLOT version stands for and its PET in the upper layers. policy "fast": the lower layers'
        output from the PLOT (the root's for the base model, the tenant's version for a tenant),
        HMI's approximation: cheap, and close only where the PLOT covers the text. Default:
        exact for the base model, fast for a tenant (what its infer serves). The base model's
        exact embeddings take up to ``embed_max_len`` tokens, everything else ``max_len``
        (truncate cuts longer inputs as sentence-transformers does, else TextTooLong). A
        tenant's head is not used. Computed on the CPU, outside the batching scheduler."""
        import torch

        from runtime.model.pet import load_pet, pet_meta
        from runtime.plot.retrieve import retrieve

        if policy not in (None, "fast", "exact"):
            raise BadRequest(f"policy must be fast or exact, got {policy!r}")
        exact = policy == "exact" if policy is not None else tenant is None
        if isinstance(texts, str):
            texts = [texts]
        requests = []
        for t in texts:
            if isinstance(t, str):
                requests.append({"tenant": tenant or "base", "text": t, "truncate": truncate})
            elif isinstance(t, (list, tuple, np.ndarray)):
                requests.append({"tenant": tenant or "base", "ids": list(t), "truncate": truncate})
            else:
                raise BadRequest(f"an input is a text or a list of token ids, got {type(t).__name__}")
        limit = self.embed_max_len if exact and tenant is None else self.max_len
        parsed = self._normalize(requests, max_len=limit, words_needed=False)
        snap = self.store.snapshot()
        pet, version, full = None, snap.version_names[0], None
        if tenant is not None:
            serving = self.pet(tenant)  # UnknownTenant / IncompatiblePet, as infer
            record = snap.read_pet(tenant)
            pet, version = load_pet(self.encoder, record.tensors, pet_meta(record.meta)), record.meta["version"]
            if exact and self.full(tenant, serving) is not None:  # current, never a stale one
                record = snap.read_full(tenant)
                full = load_pet(self.encoder, record.tensors, pet_meta(record.meta))
        seqs = [p[1] for p in parsed]
        lower = (self.encoder if tenant is None or full else self._context.lower(version)) if exact else None
        out = np.empty((len(seqs), self.encoder.config.d), dtype=np.float32)
        order = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))  # similar lengths pad little
        with torch.no_grad():
            for start in range(0, len(order), _EMBED_BATCH):
                rows = order[start:start + _EMBED_BATCH]
                batch = [seqs[j] for j in rows]
                if full is not None:
                    ids, mask = lower.pad(batch)
                    hidden = self.encoder.full(self.encoder.embed(ids), mask, full)
                elif exact:
                    ids, mask = lower.pad(batch)
                    hidden = self.encoder.upper(lower.lower(ids, mask), mask, pet)
                else:
                    inputs, mask, _ = retrieve(snap, version, batch)
                    hidden = self.encoder.upper(inputs, mask, pet)
                m = mask[..., None].to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                out[rows] = pooled.numpy()
        return out, [len(s) for s in seqs]

    def _result(self, parsed, pet, a):
        """A Result from a runtime.level.serve.Answer (probabilities calibrated, per word)."""
        tenant, ids, words, _, _, truncated, _, _ = parsed
        labels = list(pet.labels)
        probs = a.probs
        if pet.task == "classification":
            label, tags, tokens = labels[int(probs.argmax())], None, None
        else:
            if words is None:  # ids request: a tag per id
                tokens = [self.encoder.tokenizer.id_to_token(int(t)) for t in ids]
            else:
                tokens = [w for _, w in words]
            label = None
            tags = [labels[int(row.argmax())] for row in probs]
        return Result(tenant=tenant, task=pet.task, labels=labels, label=label, tags=tags, tokens=tokens,
                      probabilities=probs.tolist(), version=pet.version, timings=a.timings, batch_size=a.batch_size,
                      logits=a.logits, truncated=truncated, level=a.level, confidence=a.confidence, pruned=a.pruned,
                      students=a.students, level_name=a.level_name)


def _settle(outer: Future, inner: Future, convert):
    """outer takes inner's outcome, converted (a Result from an Answer)."""
    if outer.done():
        return
    if inner.cancelled():
        outer.cancel()
        return
    exc = inner.exception()
    try:
        outer.set_result(convert(inner.result())) if exc is None else outer.set_exception(exc)
    except BaseException as e:  # noqa: BLE001 - the caller's to see
        if not outer.done():
            outer.set_exception(e)


def unicode_problem(text: str) -> str | None:
    """Why a str cannot be encoded as UTF-8 (the tokenizer's input), None when it can: a lone
    surrogate, which is how Python carries an undecodable byte (surrogateescape: U+DC80..U+DCFF
    stand for the bytes 0x80..0xFF) or a broken JSON escape such as "\\ud800"."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    cp = ord(m.group())
    byte = f", the undecodable byte 0x{cp - 0xDC00:02x}" if 0xDC80 <= cp <= 0xDCFF else ""
    return f"lone surrogate U+{cp:04X}{byte} at character {m.start()}"


def _words(text, encoding) -> list:
    """(first sub-token position, word text) per word of a tokenized text."""
    out, previous = [], None
    for j, (w, (start, end)) in enumerate(zip(encoding.word_ids, encoding.offsets)):
        if w is None:
            continue
        if w != previous:
            out.append([j, start, end])
        else:
            out[-1][2] = end
        previous = w
    return [(j, text[a:b]) for j, a, b in out]


_EMBED_BATCH = 32  # inputs per forward pass of embed: bounds the attention scores' memory at 256 tokens


def _sentence_max_len(model_path, position_rows) -> int:
    """sentence-transformers' max_seq_length of the model directory (its sentence_bert_config.json),
    else the position table's rows."""
    import json
    import os

    if not model_path:
        from runtime.model.stored import default_model_path

        try:
            model_path = default_model_path()
        except ImportError:
            return int(position_rows)
    try:
        with open(os.path.join(model_path, "sentence_bert_config.json")) as f:
            limit = int(json.load(f)["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(position_rows)
    return max(2, min(limit, int(position_rows)))
