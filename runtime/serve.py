"""The HTTP front end (HMI §4): a dispatcher for infer requests and durable manage jobs.

    app = runtime.serve.create_app("STORE", admin_token="...")   # a FastAPI app; run it with uvicorn
    hkstore serve STORE [--host 127.0.0.1] [--port 8080] [--admin-token-file F]

**Infer.** ``POST /v1/tenants/{tenant}/infer`` with ``{"text": ...}`` or ``{"texts": [...]}``
answers ``{"tenant", "results": [...]}``, one result per text: the label (classification) or
the tags per word (tagging), with probabilities. The dispatcher appends each text to the open
batch until it holds ``max_batch`` texts or its first text has waited ``max_wait_ms``, then
hands the batch, mixed across tenants, to ``runtime.Runtime.infer`` in a worker thread and
routes each result back to its caller. A request that would push the queue past
``queue_limit`` texts is answered 429 with Retry-After; one that is not answered within
``request_timeout_s`` gets 504 (its texts leave the queue if not yet started; under overload,
texts that could no longer finish in time are answered 504 when their batch forms, rather than
computed for nobody).

**Manage** (HMI §4.1 a-e) are durable jobs, admin only; each POST answers 202 with a job id:

    POST   /v1/domains                  create a domain: corpus upload, further pre-training, branch
    POST   /v1/domains/{name}/update    update a domain into a new sibling version
    POST   /v1/tenants                  create a tenant: labeled data upload, PET fine-tuning
                                        (the answer holds the tenant's API token, shown once)
    POST   /v1/tenants/{tenant}/update  continue a tenant's fine-tuning
    DELETE /v1/tenants/{tenant}         delete a tenant
    GET    /v1/jobs/{id}, /v1/jobs      state (queued, running, done, failed) and progress

A job is STORE/jobs/<id>.json (written atomically: temporary file, fsync, rename, fsync of the
directory) with its uploads in STORE/jobs/<id>/. One runner thread takes the jobs in creation
order and hands each to a worker process (``python -m runtime.serve --job-worker``: started
ahead of time, so torch is imported when the job comes; it runs up to 20 jobs one after the
other, then a fresh one takes over) that calls runtime.manager; the store's writer lock
serializes it with any other writer, and serving goes on meanwhile. When a job commits, the runtime refreshes its snapshot, so the new tenant or
version becomes visible at once and atomically. A server that restarts finds every job that
was running: a job whose change reached the store is finished, one that did not is queued
again (at most 3 attempts, then failed), so no job is silently lost. One server per store runs
jobs (STORE/jobs/LOCK); a second one serves and answers 503 to manage requests.

**Security.** Manage operations need the admin token (``Authorization: Bearer``). Each tenant
gets its own token at creation, ``<tenant>~<secret>``; STORE/tokens.json keeps only a salted
SHA-256 of it. A tenant token reaches only its own tenant (403 otherwise); the admin token
reaches every tenant. Names follow hkstore.store.check_name.

**Observability.** ``/healthz``; ``/metrics`` in the Prometheus text format: queue depth,
batch sizes, latencies, rejections, jobs, PET cache hits and any counters the runtime reports
(``Runtime.stats()``: the GPU executor's PLOT hot tier among them).

**Dedicated baseline.** ``mode="dedicated"`` emulates one full model per tenant (HMI's
baseline): batches hold one tenant only, one runs at a time, and a tenant whose model is not
among the ``dedicated_resident`` most recent ones first copies a full model's weights (the
swap); every batch also runs the lower layers (no PLOT) before the upper ones.
"""

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional, Union

import click
from fastapi import Depends, FastAPI, Path, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from formats.segment import fsync_dir
import hkstore
from hkstore.errors import StoreError, UnknownTenant
from hkstore.store import NAME, check_name

log = logging.getLogger("hkstore.serve")

NAME_PATTERN = NAME.pattern  # hkstore.store.check_name's rule, as an OpenAPI pattern
JOB_ID = re.compile(r"^[0-9a-f]{16}$")
MAX_TEXT_CHARS = 16_384  # per text; the runtime's max_len (tokens) is the real bound
MAX_TEXTS = 64  # texts per infer request
MAX_DOCUMENTS = 100_000
MAX_DOCUMENT_CHARS = 100_000
MAX_EXAMPLES = 100_000
MAX_INFER_BODY = 1 << 20  # bytes
MAX_UPLOAD_BODY = 64 << 20
MAX_ATTEMPTS = 3  # runs of a job interrupted by crashes before it is marked failed
WORKER_JOBS = 20  # jobs one worker process runs before a fresh one takes over
LOCK_WAIT_S = 120.0  # how long a job waits for another writer's store lock
TOKEN_SEP = "~"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# -- files --------------------------------------------------------------------------------------


def atomic_write(path, data: bytes, mode: int = 0o644):
    """Write a file so that readers see the old or the new bytes, never a mix: a temporary
    file, fsync, rename over `path`, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path, obj, mode: int = 0o644):
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str).encode(), mode)


def read_json(path):
    with open(path, "rb") as f:
        return json.loads(f.read())


def _valid_name(name) -> bool:
    """check_name's rule, whole string (``$`` alone would let a trailing newline through)."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None


# -- tokens -------------------------------------------------------------------------------------


def new_tenant_token(tenant: str) -> str:
    return f"{tenant}{TOKEN_SEP}{secrets.token_urlsafe(32)}"


def hash_token(token: str, salt: bytes | None = None) -> dict:
    salt = salt if salt is not None else secrets.token_bytes(16)
    return {"scheme": "sha256-salted", "salt": salt.hex(),
            "hash": hashlib.sha256(salt + token.encode()).hexdigest()}


def token_matches(token: str, entry: dict) -> bool:
    try:
        salt = bytes.fromhex(entry["salt"])
    except (KeyError, ValueError, TypeError):
        return False
    return hmac.compare_digest(hash_token(token, salt)["hash"], str(entry.get("hash", "")))


class TokenStore:
    """STORE/tokens.json: tenant -> salted hash of its API token. Re-read when the file changes."""

    def __init__(self, store_path):
        self.path = os.path.join(store_path, "tokens.json")
        self._lock = threading.Lock()
        self._stamp = None
        self._tenants = {}

    def _load(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._tenants = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            data = read_json(self.path)
            self._tenants, self._stamp = dict(data.get("tenants", {})), stamp

    def tenants(self) -> dict:
        with self._lock:
            self._load()
            return self._tenants

    def verify(self, token: str):
        """The tenant whose token this is, or None."""
        tenant, sep, _ = token.partition(TOKEN_SEP)
        if not sep or not _valid_name(tenant):
            return None
        entry = self.tenants().get(tenant)
        return tenant if entry and token_matches(token, entry) else None

    def _write(self, change):
        with self._lock:
            self._load()
            tenants = dict(self._tenants)
            change(tenants)
            atomic_write_json(self.path, {"format": 1, "tenants": tenants}, mode=0o600)
            self._stamp = None
            self._load()

    def set(self, tenant, entry):
        self._write(lambda t: t.__setitem__(tenant, entry))

    def remove(self, tenant):
        self._write(lambda t: t.pop(tenant, None))


# -- request and response bodies ------------------------------------------------------------------

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, min_length=1, max_length=64)]
Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
Document = Annotated[str, StringConstraints(min_length=1, max_length=MAX_DOCUMENT_CHARS)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Word = Annotated[str, StringConstraints(min_length=1, max_length=100)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InferBody(Strict):
    """Exactly one of text and texts."""

    text: Optional[Text] = None
    texts: Optional[Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)]] = None

    @model_validator(mode="after")
    def _one(self):
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of 'text' and 'texts'")
        for j, t in enumerate(self.all_texts()):
            if not t.strip():
                raise ValueError(f"text {j} is blank")
        return self

    def all_texts(self) -> list:
        return [self.text] if self.text is not None else list(self.texts)


class InferResult(BaseModel):
    task: str
    version: str
    labels: list[str]
    label: Optional[str] = None
    tags: Optional[list[str]] = None
    tokens: Optional[list[str]] = None
    probabilities: list
    batch_size: int
    timings_ms: dict


class InferResponse(BaseModel):
    tenant: str
    results: list[InferResult]


class DomainCreateBody(Strict):
    name: Name
    parent: Name = "root"
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    alpha: Annotated[float, Field(ge=0, le=100)] = 50
    mlm_steps: Annotated[int, Field(ge=0, le=100_000)] = 100
    lr: Annotated[float, Field(gt=0, le=1)] = 5e-5
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_len: Annotated[int, Field(ge=8, le=512)] = 128
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0


class DomainUpdateBody(Strict):
    new_name: Name
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    alpha: Optional[Annotated[float, Field(ge=0, le=100)]] = None
    mlm_steps: Annotated[int, Field(ge=0, le=100_000)] = 100
    lr: Annotated[float, Field(gt=0, le=1)] = 5e-5
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_len: Optional[Annotated[int, Field(ge=8, le=512)]] = None
    include_old: bool = True
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0


class ClassificationExample(Strict):
    text: Text
    label: Label


def _one_word(values, what):
    for v in values:
        if len(v.split()) != 1 or len(v.splitlines()) != 1:
            raise ValueError(f"{what} must not hold whitespace or line breaks: {v!r}")
    return values


class TaggingExample(Strict):
    tokens: Annotated[list[Word], Field(min_length=1, max_length=512)]
    tags: Annotated[list[Word], Field(min_length=1, max_length=512)]

    @field_validator("tokens", "tags")
    @classmethod
    def _words(cls, v, info):
        return _one_word(v, info.field_name)

    @model_validator(mode="after")
    def _aligned(self):
        if len(self.tokens) != len(self.tags):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.tags)} tags")
        return self


Examples = Annotated[list[Union[ClassificationExample, TaggingExample]], Field(min_length=1, max_length=MAX_EXAMPLES)]


def _check_examples(task, examples):
    want = ClassificationExample if task == "classification" else TaggingExample
    for j, e in enumerate(examples or ()):
        if not isinstance(e, want):
            raise ValueError(f"examples[{j}]: a {task} example is "
                             + ("{text, label}" if task == "classification" else "{tokens, tags}"))


class TenantCreateBody(Strict):
    tenant: Name
    version: Name = "root"
    task: Literal["classification", "tagging"] = "classification"
    examples: Examples
    pet_type: Literal["adapter", "lora", "bitfit", "diff", "mask", "head"] = "adapter"
    epochs: Annotated[int, Field(ge=1, le=1000)] = 3
    max_examples: Optional[Annotated[int, Field(ge=1, le=MAX_EXAMPLES)]] = None
    lr: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_len: Annotated[int, Field(ge=8, le=512)] = 128
    bottleneck: Annotated[int, Field(ge=1, le=1024)] = 64
    rank: Annotated[int, Field(ge=1, le=256)] = 8
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0

    @model_validator(mode="after")
    def _task(self):
        _check_examples(self.task, self.examples)
        return self


class TenantUpdateBody(Strict):
    examples: Optional[Examples] = None
    version: Optional[Name] = None
    epochs: Annotated[int, Field(ge=1, le=1000)] = 1
    max_examples: Optional[Annotated[int, Field(ge=1, le=MAX_EXAMPLES)]] = None
    lr: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_len: Optional[Annotated[int, Field(ge=8, le=512)]] = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0

    @model_validator(mode="after")
    def _kinds(self):
        if self.examples:
            kinds = {type(e) for e in self.examples}
            if len(kinds) > 1:
                raise ValueError("examples mix {text, label} and {tokens, tags}")
        return self


class JobView(BaseModel):
    id: str
    kind: str
    state: Literal["queued", "running", "done", "failed"]
    created: float
    started: Optional[float] = None
    finished: Optional[float] = None
    attempts: int
    params: dict
    progress: dict
    result: Optional[dict] = None
    error: Optional[str] = None


class JobAccepted(BaseModel):
    job: JobView


class TenantJobAccepted(BaseModel):
    job: JobView
    token: str = Field(description="the tenant's API token; shown only here, valid once the job is done")


class JobList(BaseModel):
    jobs: list[JobView]


class Health(BaseModel):
    status: str
    device: str
    mode: str
    tenants: int
    versions: int
    queue_depth: int
    jobs: dict
    jobs_enabled: bool


# -- jobs -----------------------------------------------------------------------------------------

JOB_KINDS = ("domain_create", "domain_update", "tenant_create", "tenant_update", "tenant_rm")


def _store_state(store_path, kind, params):
    """What a job's commit changes, as the store holds it now (to tell whether a job that was
    interrupted got as far as its commit)."""
    with hkstore.open(store_path) as st:
        snap = st.snapshot()
        if kind.startswith("tenant"):
            loc = snap.pets.get(params["tenant"])
            return dict(loc) if loc else None
        name = params["name"] if kind == "domain_create" else params["new_name"]
        if name not in snap.version_names:
            return None
        v = snap.versions[snap.version_index(name)]
        kept = int(v["info"].get("ngrams_kept", 0) or 0)
        return {"version": name, "complete": bool(v["segments"]) or kept == 0}


def _committed(kind, before, now):
    """True: the change is in the store; False: it is not; "partial": it half is."""
    if kind == "tenant_rm":
        return now is None
    if kind in ("tenant_create", "tenant_update"):
        return now is not None and now != before
    if now is None:
        return False
    return True if now["complete"] else "partial"


def _public_params(params):
    return {k: v for k, v in params.items() if not k.startswith("_")}


class Jobs:
    """Durable manage jobs: files under STORE/jobs, one runner thread, one child per job."""

    def __init__(self, store_path, *, on_commit=None, tokens=None, threads=1, python=None):
        self.store_path = os.path.abspath(store_path)
        self.dir = os.path.join(self.store_path, "jobs")
        self.on_commit = on_commit or (lambda job: None)
        self.tokens = tokens
        self.threads = int(threads)
        self.python = python or sys.executable
        self.enabled = False
        self._lock = threading.RLock()
        self._queue = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._active = {}  # id -> job (queued or running), in creation order
        self._thread = None
        self._lock_fd = None
        self._worker = None  # the worker process: reads job ids on its stdin, one at a time
        self._worker_jobs = 0  # jobs handed to it
        self.finished = collections.Counter()

    # -- files --

    def path(self, job_id):
        return os.path.join(self.dir, f"{job_id}.json")

    def job_dir(self, job_id):
        return os.path.join(self.dir, job_id)

    def _save(self, job):
        atomic_write_json(self.path(job["id"]), job)

    def load(self, job_id):
        if not JOB_ID.match(job_id or ""):
            return None
        try:
            return read_json(self.path(job_id))
        except FileNotFoundError:
            return None

    def view(self, job) -> dict:
        progress = dict(job.get("progress") or {})
        if job["state"] == "running":
            with contextlib.suppress(FileNotFoundError, ValueError):
                progress.update(read_json(os.path.join(self.job_dir(job["id"]), "progress.json")))
        return {"id": job["id"], "kind": job["kind"], "state": job["state"], "created": job["created"],
                "started": job.get("started"), "finished": job.get("finished"), "attempts": job.get("attempts", 0),
                "params": _public_params(job["params"]), "progress": progress, "result": job.get("result"),
                "error": job.get("error")}

    def list(self, limit=50, state=None):
        out = []
        try:
            names = [n for n in os.listdir(self.dir) if n.endswith(".json") and JOB_ID.match(n[:-5])]
        except FileNotFoundError:
            return []
        for n in names:
            with contextlib.suppress(FileNotFoundError, ValueError):
                job = read_json(os.path.join(self.dir, n))
                if state is None or job["state"] == state:
                    out.append(job)
        out.sort(key=lambda j: (j["created"], j["id"]), reverse=True)
        return out[:limit]

    # -- lifecycle --

    def start(self):
        import fcntl

        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            log.warning("%s: another server runs this store's jobs; manage requests answer 503", self.store_path)
            return False
        self._lock_fd = fd
        self.enabled = True
        self._recover()
        self._thread = threading.Thread(target=self._loop, name="hkstore-jobs", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout=10.0):
        self._stop.set()
        self._wake.set()
        worker = self._worker
        if worker is not None and worker.poll() is None:
            worker.terminate()  # a running job stays "running": the next start resumes it
        if self._thread is not None:
            self._thread.join(timeout)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _recover(self):
        """Jobs a previous server left queued or running go back into the queue (running ones
        through _settle, which finishes them if their change reached the store)."""
        jobs = sorted(self.list(limit=1 << 30), key=lambda j: (j["created"], j["id"]))
        for job in jobs:
            if job["state"] == "queued":
                self._enqueue(job)
            elif job["state"] == "running":
                pid = job.get("pid")
                if pid and _is_job_process(pid, self.store_path):
                    job["_adopt"] = pid  # a worker that outlived its server: wait for it
                self._active[job["id"]] = job
                self._queue.append(job["id"])
        self._wake.set()

    # -- submission --

    def submit(self, kind, params, uploads, extra=None) -> dict:
        """Write the uploads, then the job file (durable once this returns); queue it."""
        if not self.enabled:
            raise JobsUnavailable("this server does not run jobs: another server on this store does")
        job_id = secrets.token_hex(8)
        d = self.job_dir(job_id)
        os.makedirs(d)
        for name, data in uploads.items():
            atomic_write(os.path.join(d, name), data)
        params = dict(params)
        for name in uploads:
            params[name.split(".")[0] + "_path"] = os.path.join(d, name)
        job = {"format": 1, "id": job_id, "kind": kind, "state": "queued", "created": time.time(), "params": params,
               "attempts": 0, "progress": {}, "result": None, "error": None, **(extra or {})}
        self._save(job)
        with self._lock:
            self._enqueue(job)
        self._wake.set()
        return job

    def _enqueue(self, job):
        self._active[job["id"]] = job
        self._queue.append(job["id"])

    def pending(self) -> list:
        with self._lock:
            return list(self._active.values())

    def counts(self) -> dict:
        c = collections.Counter(j["state"] for j in self.pending())
        return {"queued": c.get("queued", 0), "running": c.get("running", 0)}

    # -- the runner --

    def _spawn(self):
        """A worker that imports what jobs need, then runs the job ids it reads on stdin."""
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        with open(os.path.join(self.dir, "worker.log"), "ab") as log_file:  # until it has a job's log.txt
            self._worker = subprocess.Popen(
                [self.python, "-m", "runtime.serve", "--job-worker", self.store_path, "-", str(os.getpid()),
                 str(self.threads)], stdin=subprocess.PIPE, stdout=log_file, stderr=log_file, env=env, cwd=root)
        self._worker_jobs = 0
        return self._worker

    def _retire(self):
        """Let the worker finish (EOF on its stdin) and forget it."""
        worker, self._worker = self._worker, None
        if worker is not None:
            with contextlib.suppress(OSError):
                worker.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(10)
            if worker.poll() is None:
                worker.kill()
                worker.wait(5)

    def _hand(self, job_id):
        """The worker (alive, a fresh one if needed) that now runs job_id."""
        for _ in range(2):
            if self._worker is None or self._worker.poll() is not None or self._worker_jobs >= WORKER_JOBS:
                self._retire()
                self._spawn()
            try:
                self._worker.stdin.write(f"{job_id}\n".encode())
                self._worker.stdin.flush()
                self._worker_jobs += 1
                return self._worker
            except OSError:  # it died meanwhile: once more with a fresh one
                self._retire()
        raise RuntimeError("could not start a job worker")

    def _loop(self):
        # Spawned here: the kernel kills a worker when the thread that forked it exits (PDEATHSIG).
        self._spawn()
        while not self._stop.is_set():
            with self._lock:
                job_id = self._queue.popleft() if self._queue else None
            if job_id is None:
                if self._worker is None or self._worker.poll() is not None:
                    self._spawn()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._run(self._active[job_id])
            except Exception as e:  # noqa: BLE001 - a runner bug must not stop the runner
                log.exception("job %s: runner error", job_id)
                job = self._active.get(job_id)
                if job is not None and not self._stop.is_set():
                    self._fail(job, f"internal error while running the job: {e}")
        self._retire()

    def _run(self, job):
        if "_adopt" in job:
            pid = job.pop("_adopt")
            while _is_job_process(pid, self.store_path) and not self._stop.is_set():
                time.sleep(0.2)
            if self._stop.is_set():
                return
            self._settle(job, None)
            return
        if job["state"] == "running":  # interrupted by a crash of the previous server
            self._settle(job, None)
            return
        d = self.job_dir(job["id"])
        result = os.path.join(d, "result.json")
        for name in ("result.json", "progress.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
        job.update(state="running", started=time.time(), attempts=job.get("attempts", 0) + 1,
                   before=_store_state(self.store_path, job["kind"], job["params"]), pid=None)
        job["progress"] = {"stage": "starting"}
        self._save(job)
        worker = self._hand(job["id"])
        job["pid"] = worker.pid
        self._save(job)
        while not os.path.exists(result) and worker.poll() is None:
            if self._stop.wait(0.05):
                return  # left "running": stop() ends the worker, the next server resumes the job
        returncode = worker.poll()
        if returncode is not None:
            self._worker = None
        self._settle(job, returncode)

    def _settle(self, job, returncode):
        """Finish a job whose worker has exited (or died with an earlier server)."""
        d = self.job_dir(job["id"])
        try:
            outcome = read_json(os.path.join(d, "result.json"))
        except (FileNotFoundError, ValueError):
            outcome = None
        if outcome is not None and outcome.get("ok"):
            self._done(job, outcome.get("result") or {})
        elif outcome is not None and outcome.get("type") == "StoreLocked":
            waited = job.get("lock_wait_s", 0.0)
            if waited >= LOCK_WAIT_S:
                self._fail(job, f"the store stayed locked by another writer for {LOCK_WAIT_S:.0f} s: {outcome['error']}")
                return
            job.update(state="queued", lock_wait_s=waited + 1.0, attempts=job["attempts"] - 1)
            job["progress"] = {"stage": "waiting for the store lock"}
            self._save(job)
            self._stop.wait(1.0)
            with self._lock:
                self._queue.appendleft(job["id"])  # it keeps its turn
        elif outcome is not None:
            self._fail(job, outcome.get("error") or "the job failed")
        else:
            # The worker died without a word (killed, or its server crashed): did it commit?
            now = _store_state(self.store_path, job["kind"], job["params"])
            done = _committed(job["kind"], job.get("before"), now)
            if done is True:
                self._done(job, {"recovered": True, "note": "the worker was interrupted after its commit"})
            elif done == "partial":
                self._fail(job, f"interrupted while writing version {now['version']!r}, which holds no PLOT "
                                "entries yet; create the domain again under another name")
            elif job.get("attempts", 0) >= MAX_ATTEMPTS:
                self._fail(job, f"interrupted {job['attempts']} times (last exit status {returncode})")
            else:
                log.warning("job %s: interrupted (exit status %s); running it again", job["id"], returncode)
                job.update(state="queued", pid=None)
                job["progress"] = {"stage": "resuming", "interrupted": job.get("attempts", 0)}
                self._save(job)
                with self._lock:
                    self._queue.appendleft(job["id"])  # it keeps its turn

    def _done(self, job, result):
        p = job["params"]
        if self.tokens is not None:
            if job["kind"] == "tenant_create" and job.get("token_hash"):
                self.tokens.set(p["tenant"], dict(job["token_hash"], created=time.time(), job=job["id"]))
            elif job["kind"] == "tenant_rm":
                self.tokens.remove(p["tenant"])
        job.update(state="done", finished=time.time(), result=result, error=None, pid=None)
        job["progress"] = dict(job.get("progress") or {}, stage="done", fraction=1.0)
        self._save(job)
        with self._lock:
            self._active.pop(job["id"], None)
        self.finished["done"] += 1
        try:
            self.on_commit(job)
        except Exception:  # noqa: BLE001
            log.exception("job %s: refreshing after the commit failed", job["id"])

    def _fail(self, job, error):
        job.update(state="failed", finished=time.time(), error=str(error).strip().splitlines()[0][:2000]
                   if str(error).strip() else "failed", pid=None)
        self._save(job)
        with self._lock:
            self._active.pop(job["id"], None)
        self.finished["failed"] += 1


class JobsUnavailable(Exception):
    pass


def _is_job_process(pid, store_path) -> bool:
    """Whether pid is (still) a job worker of this store (a zombie is not)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            if f.read().rsplit(b") ", 1)[-1][:1] == b"Z":
                return False
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (OSError, ValueError):
        return False
    return b"--job-worker" in args and os.fsencode(store_path) in args


# -- the job worker (a child process) ------------------------------------------------------------


class _Progress:
    """Stands in for tqdm inside a job worker: writes the bar's state to progress.json."""

    path = None

    def __init__(self, iterable=None, total=None, desc=None, disable=False, **_):
        self.iterable, self.total, self.desc, self.n = iterable, total, desc, 0
        self.postfix, self._last = {}, 0.0
        self._write(force=True)

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n=1):
        self.n += n
        self._write()

    def set_postfix(self, ordered_dict=None, refresh=True, **kw):
        self.postfix = {k: str(v) for k, v in dict(ordered_dict or {}, **kw).items()}

    def set_description(self, desc=None, refresh=True):
        self.desc = desc

    def refresh(self):
        self._write(force=True)

    def close(self):
        self._write(force=True)

    def _write(self, force=False):
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < 0.5):
            return
        self._last = now
        fraction = (self.n / self.total) if self.total else None
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, {"stage": self.desc, "step": self.n, "total": self.total,
                                          "fraction": fraction, **self.postfix, "updated": time.time()})


def _die_with_parent(parent_pid):
    """Linux: the kernel kills this worker when its server dies (no orphan writer)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(3)  # the server is already gone


def _execute(store_path, kind, p):
    from runtime import manager

    if kind == "domain_create":
        return manager.domain_create(store_path, p["name"], [p["corpus_path"]], parent=p["parent"], alpha=p["alpha"],
                                     mlm_steps=p["mlm_steps"], lr=p["lr"], batch_size=p["batch_size"],
                                     max_len=p["max_len"], corpus_format="jsonl", seed=p["seed"], progress=True)
    if kind == "domain_update":
        return manager.domain_update(store_path, p["name"], p["new_name"], [p["corpus_path"]], alpha=p["alpha"],
                                     mlm_steps=p["mlm_steps"], lr=p["lr"], batch_size=p["batch_size"],
                                     max_len=p["max_len"], include_old=p["include_old"], corpus_format="jsonl",
                                     seed=p["seed"], progress=True)
    if kind == "tenant_create":
        return manager.tenant_create(store_path, p["tenant"], version=p["version"], train_path=p["train_path"],
                                     task=p["task"], pet_type=p["pet_type"], epochs=p["epochs"],
                                     max_examples=p["max_examples"], lr=p["lr"], batch_size=p["batch_size"],
                                     max_len=p["max_len"], bottleneck=p["bottleneck"], rank=p["rank"],
                                     seed=p["seed"], progress=True)
    if kind == "tenant_update":
        return manager.tenant_update(store_path, p["tenant"], train_path=p.get("train_path"), version=p["version"],
                                     epochs=p["epochs"], max_examples=p["max_examples"], lr=p["lr"],
                                     batch_size=p["batch_size"], max_len=p["max_len"], seed=p["seed"], progress=True)
    if kind == "tenant_rm":
        return manager.tenant_rm(store_path, p["tenant"])
    raise ValueError(f"unknown job kind {kind!r}")


def job_worker(store_path, job_id, parent_pid=0, threads=1) -> int:
    """A job worker process: job_id "-" runs the job ids read from stdin, one after the other,
    until EOF (or WORKER_JOBS of them); another id runs that job alone. Each outcome goes to
    the job's result.json, its output to the job's log.txt."""
    _die_with_parent(parent_pid)
    import torch
    import tqdm

    torch.set_num_threads(max(1, threads))
    tqdm.tqdm = _Progress
    import runtime.manager  # noqa: F401 - the imports a job needs, done before it comes
    import runtime.plot  # noqa: F401
    import runtime.train

    runtime.train.tqdm = _Progress
    with contextlib.suppress(Exception):  # the optimizer's first use imports torch._dynamo (seconds)
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.AdamW([w], lr=1e-3)
        (w * w).sum().backward()
        opt.step()
    if job_id != "-":
        return _one_job(store_path, job_id)
    for _ in range(WORKER_JOBS):
        job_id = sys.stdin.readline().strip()
        if not JOB_ID.match(job_id):
            return 0  # EOF: the server retired this worker or stopped
        _one_job(store_path, job_id)
    return 0


def _one_job(store_path, job_id) -> int:
    d = os.path.join(store_path, "jobs", job_id)
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(os.path.join(d, "log.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    _Progress.path = os.path.join(d, "progress.json")
    try:
        job = read_json(os.path.join(store_path, "jobs", f"{job_id}.json"))
        result = _execute(store_path, job["kind"], job["params"])
        out, code = {"ok": True, "result": result}, 0
    except Exception as e:  # noqa: BLE001 - every failure becomes the job's error
        import traceback

        traceback.print_exc()
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        out, code = {"ok": False, "type": type(e).__name__, "error": message}, 1
    finally:
        _Progress.path = None
    sys.stdout.flush()
    sys.stderr.flush()
    atomic_write_json(os.path.join(d, "result.json"), out)
    return code


# -- the dispatcher -------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("tenant", "text", "future", "enqueued", "deadline", "state")

    def __init__(self, tenant, text, future, enqueued, deadline):
        self.tenant, self.text, self.future, self.enqueued, self.deadline = tenant, text, future, enqueued, deadline
        self.state = "queued"  # queued | taken | dropped


class Expired(Exception):
    """A queued text whose caller's deadline would pass before its batch could finish."""


class Dispatcher:
    """The input queue, batching, the worker threads that run the runtime, the output routing."""

    def __init__(self, rt, metrics, *, max_batch, max_wait_s, queue_limit, mode="shared", dedicated_resident=4):
        self.rt, self.m = rt, metrics
        self.max_batch, self.max_wait_s, self.queue_limit = int(max_batch), float(max_wait_s), int(queue_limit)
        self.mode = mode
        self.inflight_limit = 1 if mode == "dedicated" else 2  # 2: the runtime pipelines prepare and compute
        self.pending = collections.deque()
        self.depth = 0  # texts queued and not yet handed to the runtime
        self.inflight = 0
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.inflight_limit)
        self._pool = ThreadPoolExecutor(self.inflight_limit, thread_name_prefix="hkstore-infer")
        self._tasks = set()
        self._task = None
        self.batches = 0
        self.batch_seconds = 0.0  # moving average of a batch's time in the runtime
        if mode == "dedicated":
            self._dedicated = _DedicatedModels(rt, dedicated_resident)

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for e in self.pending:
            if not e.future.done():
                e.future.set_exception(RuntimeError("the server is shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def offer(self, tenant, texts, deadline=math.inf):
        """Queue texts of one request (answer by `deadline`, perf_counter time); None when the
        queue has no room for them."""
        if self.depth + len(texts) > self.queue_limit:
            return None
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        entries = [_Entry(tenant, t, loop.create_future(), now, deadline) for t in texts]
        self.pending.extend(entries)
        self.depth += len(entries)
        self.m.queue_depth.set(self.depth)
        self._wake.set()
        return entries

    def drop(self, entries):
        """Forget entries whose caller gave up; those not yet started leave the queue."""
        for e in entries:
            if e.state == "queued":
                e.state = "dropped"
                self.depth -= 1
            if not e.future.done():
                e.future.cancel()
        self.m.queue_depth.set(self.depth)

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            while not self.depth:
                self._wake.clear()
                await self._wake.wait()
            await self._slots.acquire()
            while True:  # fill the open batch until max_batch or its first text's max wait
                self._trim()
                if not self.depth:
                    break
                deadline = self.pending[0].enqueued + self.max_wait_s
                now = time.perf_counter()
                if self.depth >= self.max_batch or now >= deadline:
                    break
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), deadline - now)
            batch = self._take()
            if not batch:
                self._slots.release()
                continue
            task = loop.create_task(self._launch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _trim(self):
        while self.pending and self.pending[0].state != "queued":
            self.pending.popleft()

    def _take(self):
        batch = []
        if self.mode == "dedicated":  # one tenant per batch
            tenant, keep = None, collections.deque()
            while self.pending:
                e = self.pending.popleft()
                if e.state != "queued":
                    continue
                if tenant is None:
                    tenant = e.tenant
                if e.tenant == tenant and len(batch) < self.max_batch:
                    batch.append(e)
                else:
                    keep.append(e)
            self.pending = keep
        else:
            while self.pending and len(batch) < self.max_batch:
                e = self.pending.popleft()
                if e.state == "queued":
                    batch.append(e)
        self.depth -= len(batch)
        # Under overload the oldest texts may not make their deadline any more: answer them now
        # (504) instead of spending a batch slot on an answer nobody waits for.
        now, live = time.perf_counter(), []
        for e in batch:
            if now + self.batch_seconds > e.deadline:
                e.state = "dropped"
                if not e.future.done():
                    e.future.set_exception(Expired())
                self.m.rejected.labels("expired").inc()
            else:
                e.state = "taken"
                live.append(e)
        self.m.queue_depth.set(self.depth)
        return live

    async def _launch(self, batch):
        loop = asyncio.get_running_loop()
        self.inflight += 1
        self.m.inflight.set(self.inflight)
        started = time.perf_counter()
        for e in batch:
            self.m.queue_wait.observe(started - e.enqueued)
        try:
            outs = await loop.run_in_executor(self._pool, self._compute, [(e.tenant, e.text) for e in batch])
        except Exception as exc:  # noqa: BLE001 - handed to the callers
            outs = [exc] * len(batch)
        finally:
            self.inflight -= 1
            self.m.inflight.set(self.inflight)
            self._slots.release()
        self.batches += 1
        seconds = time.perf_counter() - started
        self.batch_seconds += 0.2 * (seconds - self.batch_seconds)  # EWMA: what the next batch will take
        self.m.batch_size.observe(len(batch))
        self.m.batch_seconds.observe(seconds)
        for e, out in zip(batch, outs):
            if e.future.done():
                continue
            if isinstance(out, BaseException):
                e.future.set_exception(out)
            else:
                e.future.set_result(out)

    def _compute(self, requests):
        """In a worker thread: results (or the exception of each request) of one batch."""
        if self.mode == "dedicated":
            if self._dedicated.swap(requests[0][0]):
                self.m.swaps.inc()
            self._dedicated.lower([t for _, t in requests])
        return self._infer(requests)

    def _infer(self, requests):
        import runtime

        try:
            return self.rt.infer([{"tenant": t, "text": x} for t, x in requests])
        except (runtime.BadRequest, StoreError) as e:
            # infer checks every request before it runs any: one bad request fails the whole
            # batch. Split it to find the culprits; the others are answered.
            if len(requests) == 1:
                return [e]
            half = len(requests) // 2
            return self._infer(requests[:half]) + self._infer(requests[half:])


class _DedicatedModels:
    """The dedicated baseline's per-tenant model emulation (see the module doc)."""

    def __init__(self, rt, resident):
        import torch

        self.rt = rt
        self.resident = max(1, int(resident))
        count = sum(p.numel() for p in rt.encoder.parameters())
        self._host = torch.zeros(count)  # a tenant's full weights as loaded from its checkpoint
        self._device = torch.empty(count)  # the slot the serving model computes with
        self._lru = collections.OrderedDict()
        self.swaps = 0

    def swap(self, tenant) -> bool:
        if tenant in self._lru:
            self._lru.move_to_end(tenant)
            return False
        self._device.copy_(self._host)
        self._lru[tenant] = True
        while len(self._lru) > self.resident:
            self._lru.popitem(last=False)
        self.swaps += 1
        return True

    def lower(self, texts):
        import torch

        enc = self.rt.encoder
        seqs = enc.tokenize(texts, max_len=self.rt.max_len)
        ids, mask = enc.pad(seqs)
        with torch.no_grad():
            enc.lower(ids, mask)


# -- metrics --------------------------------------------------------------------------------------


class Metrics:
    def __init__(self, service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        self.queue_depth = Gauge("hkstore_queue_depth", "Texts waiting in the input queue", registry=r)
        self.queue_limit = Gauge("hkstore_queue_limit", "Texts the input queue holds at most", registry=r)
        self.inflight = Gauge("hkstore_inflight_batches", "Batches the runtime is computing", registry=r)
        self.batch_size = Histogram("hkstore_batch_size", "Texts per batch handed to the runtime",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("hkstore_batch_seconds", "Runtime time per batch", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.queue_wait = Histogram("hkstore_queue_wait_seconds", "Time a text waits before its batch starts",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("hkstore_request_latency_seconds", "Infer request latency in the server (all outcomes)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("hkstore_infer_requests", "Infer requests by HTTP status", ["code"], registry=r)
        self.texts = Counter("hkstore_infer_texts", "Texts answered", registry=r)
        self.rejected = Counter("hkstore_rejected", "Infer requests rejected", ["reason"], registry=r)
        self.swaps = Counter("hkstore_dedicated_swaps", "Full-model swaps (dedicated mode)", registry=r)
        r.register(_RuntimeCollector(service))


def _flatten(prefix, obj, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}_{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out[re.sub(r"[^a-zA-Z0-9_]", "_", prefix).lower()] = float(obj)
    return out


class _RuntimeCollector:
    """Read at scrape time: the runtime's counters, the store's size, the jobs."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        svc = self.service
        rt = svc.rt
        if rt is None:
            return
        stats = rt.stats()
        flat = _flatten("", stats, {})
        info = GaugeMetricFamily("hkstore_runtime_info", "The runtime serving this server", labels=["device", "mode"])
        info.add_metric([str(stats.get("device", "")), svc.mode], 1.0)
        yield info
        caches = {"host": stats.get("host_pet_cache") or {}, "device": stats.get("device_pet_cache") or {}}
        for key in ("hits", "misses", "evictions"):
            c = CounterMetricFamily(f"hkstore_pet_cache_{key}", f"PET cache {key} (host: decoded PETs; device: GPU)",
                                    labels=["cache"])
            for name, pc in caches.items():
                if key in pc:
                    c.add_metric([name], float(pc[key]))
            yield c
        for key in ("entries", "bytes"):
            g = GaugeMetricFamily(f"hkstore_pet_cache_{key}", f"PET cache {key}", labels=["cache"])
            for name, pc in caches.items():
                if key in pc:
                    g.add_metric([name], float(pc[key]))
            yield g
        hot = stats.get("hot_tier") or {}  # the GPU executor's PLOT hot tier
        for key in ("hits", "misses", "rebuilds"):
            if key in hot:
                yield CounterMetricFamily(f"hkstore_plot_hot_tier_{key}", f"PLOT hot tier {key} (windows)",
                                          value=float(hot[key]))
        for key in ("rows", "capacity", "bytes", "hit_rate"):
            if key in hot:
                yield GaugeMetricFamily(f"hkstore_plot_hot_tier_{key}", f"PLOT hot tier {key}", value=float(hot[key]))
        g = GaugeMetricFamily("hkstore_runtime_stat", "Numeric fields of Runtime.stats()", labels=["name"])
        for name, value in flat.items():
            g.add_metric([name], value)
        yield g
        snap = rt.store.snapshot()
        yield GaugeMetricFamily("hkstore_tenants", "Tenants in the served snapshot", value=len(snap.pets))
        yield GaugeMetricFamily("hkstore_versions", "PLOT versions in the served snapshot", value=len(snap.versions))
        jobs = GaugeMetricFamily("hkstore_jobs", "Manage jobs not finished, by state", labels=["state"])
        for state, n in svc.jobs.counts().items():
            jobs.add_metric([state], n)
        yield jobs
        fin = CounterMetricFamily("hkstore_jobs_finished", "Manage jobs finished by this server", labels=["state"])
        for state in ("done", "failed"):
            fin.add_metric([state], svc.jobs.finished.get(state, 0))
        yield fin


# -- the service and the app ----------------------------------------------------------------------


class HTTPError(Exception):
    def __init__(self, status, detail, headers=None):
        self.status, self.detail, self.headers = status, detail, headers


class Service:
    """Everything one app holds: runtime, dispatcher, jobs, tokens, metrics."""

    def __init__(self, store_path, *, admin_token, max_batch, max_wait_ms, queue_limit, request_timeout_s, device,
                 max_len, mode, dedicated_resident, job_threads, runtime_options, torch_threads):
        self.store_path = os.path.abspath(store_path)
        self.admin_token = admin_token
        self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000.0
        self.queue_limit, self.request_timeout_s = queue_limit, request_timeout_s
        self.device, self.max_len, self.mode = device, max_len, mode
        self.dedicated_resident = dedicated_resident
        self.torch_threads = int(torch_threads)
        self.runtime_options = dict(runtime_options or {})
        self.rt = None
        self.dispatcher = None
        self.tokens = TokenStore(self.store_path)
        self.jobs = Jobs(self.store_path, on_commit=self._committed, tokens=self.tokens, threads=job_threads)
        self.metrics = Metrics(self)
        self.metrics.queue_limit.set(queue_limit)
        self._current = None
        self._watch_task = None
        self._refresh = threading.Lock()

    async def start(self):
        import runtime

        if self.torch_threads > 0:
            import torch

            # The runtime computes from several threads (prepare, compute, prefetch); OpenMP pools
            # of 2+ threads in each contend badly on a small machine (100x slower batches seen).
            torch.set_num_threads(self.torch_threads)
        options = dict(self.runtime_options)
        options.setdefault("max_batch", max(self.max_batch, 1))
        self.rt = await asyncio.to_thread(runtime.open, self.store_path, self.device, max_len=self.max_len, **options)
        self._current = self._read_current()
        await asyncio.to_thread(self._warm_up)
        self.dispatcher = Dispatcher(self.rt, self.metrics, max_batch=self.max_batch, max_wait_s=self.max_wait_s,
                                     queue_limit=self.queue_limit, mode=self.mode,
                                     dedicated_resident=self.dedicated_resident)
        self.dispatcher.start()
        await asyncio.to_thread(self.jobs.start)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self):
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        await asyncio.to_thread(self.jobs.stop)
        if self.rt is not None:
            await asyncio.to_thread(self.rt.close)

    def _warm_up(self):
        """One request through the runtime, so the first caller does not pay for lazy init."""
        pets = self.rt.store.snapshot().pets
        if pets:
            with contextlib.suppress(Exception):
                self.rt.infer([{"tenant": next(iter(pets)), "text": "warm up"}])

    def _read_current(self):
        try:
            with open(os.path.join(self.store_path, "CURRENT"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def refresh(self):
        """Serve the store's newest manifest (thread-safe; cheap when nothing changed)."""
        with self._refresh:
            current = self._read_current()
            if current != self._current:
                self.rt.refresh()
                self._current = current

    def _committed(self, job):
        self.refresh()

    async def _watch(self):
        """Pick up commits made outside this server (the CLI) within a second."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self._read_current() != self._current:
                    await asyncio.to_thread(self.refresh)
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("refreshing the store snapshot failed")

    # -- auth --

    def principal(self, creds):
        """"admin", a tenant name, or an HTTPError 401."""
        token = creds.credentials if creds is not None else None
        if not token:
            raise HTTPError(401, "missing bearer token (Authorization: Bearer <token>)", {"WWW-Authenticate": "Bearer"})
        if hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return "admin"
        tenant = self.tokens.verify(token)
        if tenant is None:
            raise HTTPError(401, "invalid token", {"WWW-Authenticate": "Bearer"})
        return tenant

    def require_admin(self, creds):
        who = self.principal(creds)
        if who != "admin":
            raise HTTPError(403, "this operation needs the admin token")

    def require_tenant(self, creds, tenant):
        who = self.principal(creds)
        if who != "admin" and who != tenant:
            raise HTTPError(403, f"this token does not give access to tenant {tenant!r}")
        if tenant not in self.rt.store.snapshot().pets:
            raise HTTPError(404, f"unknown tenant {tenant!r}")
        return who

    # -- future view of names, for conflicts at submission --

    def planned(self):
        """(tenants, versions) as they will be once every queued job has run."""
        snap = self.rt.store.snapshot()
        tenants, versions = set(snap.pets), set(snap.version_names)
        for job in self.jobs.pending():
            p = job["params"]
            if job["kind"] == "tenant_create":
                tenants.add(p["tenant"])
            elif job["kind"] == "tenant_rm":
                tenants.discard(p["tenant"])
            elif job["kind"] == "domain_create":
                versions.add(p["name"])
            elif job["kind"] == "domain_update":
                versions.add(p["new_name"])
        return tenants, versions


def _name(kind, name):
    try:
        check_name(kind, name)
    except StoreError as e:
        raise HTTPError(422, str(e)) from None
    if not _valid_name(name):
        raise HTTPError(422, f"invalid {kind} name {name!r}")
    return name


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _examples_file(examples):
    if isinstance(examples[0], ClassificationExample):
        return "train.jsonl", _jsonl({"text": e.text, "label": e.label} for e in examples)
    lines = []
    for e in examples:
        lines += [f"{w}\t{t}" for w, t in zip(e.tokens, e.tags)] + [""]
    return "train.conll", ("\n".join(lines) + "\n").encode()


def _result_view(r) -> dict:
    timings = {k: round(float(v) * 1000.0, 3) for k, v in (r.timings or {}).items()}
    out = {"task": r.task, "version": r.version, "labels": list(r.labels), "probabilities": r.probabilities,
           "batch_size": int(r.batch_size), "timings_ms": timings}
    if r.task == "classification":
        out["label"] = r.label
    else:
        out["tags"], out["tokens"] = list(r.tags), list(r.tokens)
    return out


class _BodyLimit:
    """ASGI middleware: 413 for bodies over the limit (uploads get the larger one); bodies
    without Content-Length are read up to the limit and replayed."""

    def __init__(self, app, infer_limit=MAX_INFER_BODY, upload_limit=MAX_UPLOAD_BODY):
        self.app, self.infer_limit, self.upload_limit = app, infer_limit, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit = self.infer_limit if path.endswith("/infer") else self.upload_limit
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_json(send, 400, {"detail": "invalid Content-Length"})
            if n > limit:
                return await _send_json(send, 413, {"detail": f"request body of {n} bytes exceeds {limit} bytes"})
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _send_json(send, 413, {"detail": f"request body exceeds {limit} bytes"})
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_json(send, status, obj):
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(store_path, *, admin_token, max_batch=32, max_wait_ms=5, queue_limit=1024, request_timeout_s=30,
               device="auto", max_len=128, mode="shared", dedicated_resident=4, job_threads=1,
               torch_threads=1, runtime_options=None) -> FastAPI:
    """The serving app over the store at store_path (see the module doc). The runtime opens
    when the app starts (uvicorn's lifespan) and closes when it stops.

    mode: "shared" (hPLM: one shared encoder, mixed-tenant batches) or "dedicated" (the
    baseline emulation). torch_threads: torch's intra-op threads in the server (0: torch's
    default); job_threads: in each job worker. runtime_options go to runtime.open
    (pet_cache_bytes, pipeline, ...).
    """
    from contextlib import asynccontextmanager

    if not isinstance(admin_token, str) or len(admin_token) < 16:
        raise ValueError("the admin token must be a string of at least 16 characters")
    if not os.path.exists(os.path.join(store_path, "CURRENT")):
        raise StoreError(f"{store_path}: no store here (no CURRENT file)")
    if mode not in ("shared", "dedicated"):
        raise ValueError(f"mode must be shared or dedicated, got {mode!r}")
    if min(max_batch, queue_limit) < 1 or max_wait_ms < 0 or request_timeout_s <= 0:
        raise ValueError("max_batch and queue_limit must be positive, max_wait_ms >= 0, request_timeout_s > 0")
    svc = Service(store_path, admin_token=admin_token, max_batch=int(max_batch), max_wait_ms=float(max_wait_ms),
                  queue_limit=int(queue_limit), request_timeout_s=float(request_timeout_s), device=device,
                  max_len=int(max_len), mode=mode, dedicated_resident=dedicated_resident, job_threads=job_threads,
                  runtime_options=runtime_options, torch_threads=torch_threads)

    @asynccontextmanager
    async def lifespan(app):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="hkstore", version="1",
                  description="Multi-tenant inference over one shared encoder, with durable manage jobs (HMI §4).",
                  lifespan=lifespan)
    app.state.service = svc
    app.add_middleware(_BodyLimit)
    bearer = HTTPBearer(auto_error=False, description="The admin token, or a tenant's API token")

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        status = 400 if any(e.get("type") == "json_invalid" for e in errors) else 422
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors]
        return JSONResponse({"detail": detail}, status_code=status)

    @app.exception_handler(JobsUnavailable)
    async def _no_jobs(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "60"})

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal server error"}, status_code=500)

    TenantPath = Annotated[str, Path(pattern=NAME_PATTERN, min_length=1, max_length=64)]
    errors_infer = {401: {"description": "missing or invalid token"}, 403: {"description": "not this tenant's token"},
                    404: {"description": "unknown tenant"}, 413: {"description": "body too large"},
                    422: {"description": "invalid request"}, 429: {"description": "queue full (Retry-After)"},
                    504: {"description": "not answered within the request timeout"}}
    errors_admin = {401: {"description": "missing or invalid token"}, 403: {"description": "not the admin token"},
                    422: {"description": "invalid request"}}
    errors_manage = {**errors_admin, 404: {"description": "unknown tenant or version"},
                     409: {"description": "the name is taken"}, 413: {"description": "body too large"},
                     503: {"description": "another server runs this store's jobs"}}

    @app.get("/healthz", response_model=Health, tags=["observability"])
    async def healthz():
        snap = svc.rt.store.snapshot()
        return {"status": "ok", "device": svc.rt.device, "mode": svc.mode, "tenants": len(snap.pets),
                "versions": len(snap.versions), "queue_depth": svc.dispatcher.depth, "jobs": svc.jobs.counts(),
                "jobs_enabled": svc.jobs.enabled}

    @app.get("/metrics", tags=["observability"], response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        data = await asyncio.to_thread(generate_latest, svc.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/tenants/{tenant}/infer", response_model=InferResponse, response_model_exclude_none=True,
              tags=["infer"], responses=errors_infer)
    async def infer(tenant: TenantPath, body: InferBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        import runtime

        t0 = time.perf_counter()
        m = svc.metrics
        status = 200
        try:
            _name("tenant", tenant)
            svc.require_tenant(creds, tenant)
            texts = body.all_texts()
            if len(texts) > svc.queue_limit:
                raise HTTPError(422, f"{len(texts)} texts, more than the queue holds ({svc.queue_limit})")
            entries = svc.dispatcher.offer(tenant, texts, t0 + svc.request_timeout_s)
            if entries is None:
                m.rejected.labels("queue_full").inc()
                raise HTTPError(429, f"the input queue is full ({svc.queue_limit} texts); retry later",
                                {"Retry-After": "1"})
            remaining = svc.request_timeout_s - (time.perf_counter() - t0)
            try:
                outs = await asyncio.wait_for(asyncio.gather(*(e.future for e in entries), return_exceptions=True),
                                              max(remaining, 0.0))
            except asyncio.TimeoutError:
                svc.dispatcher.drop(entries)
                m.rejected.labels("timeout").inc()
                raise HTTPError(504, f"no answer within {svc.request_timeout_s:g} s") from None
            except asyncio.CancelledError:  # the client went away
                svc.dispatcher.drop(entries)
                status = 499
                raise
            if any(isinstance(out, Expired) for out in outs):
                svc.dispatcher.drop(entries)
                m.rejected.labels("timeout").inc()
                raise HTTPError(504, f"no answer within {svc.request_timeout_s:g} s (the queue is too long)")
            results = []
            for j, out in enumerate(outs):
                where = f"texts[{j}]: " if body.texts is not None else ""
                if isinstance(out, UnknownTenant):
                    raise HTTPError(404, f"unknown tenant {tenant!r}")
                if isinstance(out, runtime.IncompatiblePet):
                    raise HTTPError(409, where + str(out))
                if isinstance(out, (runtime.BadRequest, StoreError)):
                    raise HTTPError(422, where + str(out))
                if isinstance(out, BaseException):
                    raise out
                results.append(_result_view(out))
            m.texts.inc(len(results))
            return {"tenant": tenant, "results": results}
        except HTTPError as e:
            status = e.status
            raise
        except Exception:
            status = 500
            raise
        finally:
            m.requests.labels(str(status)).inc()
            m.latency.observe(time.perf_counter() - t0)

    @app.get("/v1/tenants", tags=["manage"], responses=errors_admin)
    async def list_tenants(creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        svc.require_admin(creds)
        snap = svc.rt.store.snapshot()
        tokens = svc.tokens.tenants()
        return {"tenants": [{"tenant": t, "has_token": t in tokens} for t in sorted(snap.pets)]}

    @app.get("/v1/tenants/{tenant}", tags=["manage"], responses={**errors_admin, 404: {"description": "unknown tenant"}})
    async def get_tenant(tenant: TenantPath, creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        _name("tenant", tenant)
        svc.require_tenant(creds, tenant)
        try:
            record = await asyncio.to_thread(svc.rt.store.snapshot().read_pet, tenant)
        except UnknownTenant:
            raise HTTPError(404, f"unknown tenant {tenant!r}") from None
        keep = ("version", "pet_type", "task", "labels", "created")
        return {"tenant": tenant, **{k: record.meta.get(k) for k in keep}}

    @app.get("/v1/domains", tags=["manage"], responses=errors_admin)
    async def list_domains(creds: HTTPAuthorizationCredentials = Depends(bearer)) -> dict:
        svc.require_admin(creds)
        snap = svc.rt.store.snapshot()
        return {"versions": [{"name": v["name"], "parent": v["parent"], "created": v["created"],
                              "segments": len(v["segments"]),
                              "info": {k: v["info"][k] for k in ("alpha", "ngrams_kept", "documents", "updates")
                                       if k in v["info"]}} for v in snap.versions]}

    async def _submit(kind, params, uploads, extra=None):
        job = await asyncio.to_thread(svc.jobs.submit, kind, params, uploads, extra)
        return svc.jobs.view(job)

    def _check_jobs():
        if not svc.jobs.enabled:
            raise JobsUnavailable("this server does not run jobs: another server on this store does")

    @app.post("/v1/domains", status_code=202, response_model=JobAccepted, tags=["manage"], responses=errors_manage)
    async def domain_create(body: DomainCreateBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        _check_jobs()
        _name("version", body.name)
        _, versions = svc.planned()
        if body.name in versions:
            raise HTTPError(409, f"version {body.name!r} already exists")
        if body.parent not in versions:
            raise HTTPError(404, f"unknown parent version {body.parent!r}")
        params = body.model_dump(exclude={"documents"})
        uploads = {"corpus.jsonl": _jsonl({"text": d} for d in body.documents)}
        return {"job": await _submit("domain_create", dict(params, documents=len(body.documents)), uploads)}

    @app.post("/v1/domains/{name}/update", status_code=202, response_model=JobAccepted, tags=["manage"],
              responses=errors_manage)
    async def domain_update(name: TenantPath, body: DomainUpdateBody,
                            creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        _check_jobs()
        _name("version", name)
        _name("version", body.new_name)
        _, versions = svc.planned()
        if name not in versions:
            raise HTTPError(404, f"unknown version {name!r}")
        if body.new_name in versions:
            raise HTTPError(409, f"version {body.new_name!r} already exists")
        params = dict(body.model_dump(exclude={"documents"}), name=name, documents=len(body.documents))
        uploads = {"corpus.jsonl": _jsonl({"text": d} for d in body.documents)}
        return {"job": await _submit("domain_update", params, uploads)}

    @app.post("/v1/tenants", status_code=202, response_model=TenantJobAccepted, tags=["manage"],
              responses=errors_manage)
    async def tenant_create(body: TenantCreateBody, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", body.tenant)
        _name("version", body.version)
        tenants, versions = svc.planned()
        if body.tenant in tenants:
            raise HTTPError(409, f"tenant {body.tenant!r} already exists (or a queued job creates it)")
        if body.version not in versions:
            raise HTTPError(404, f"unknown version {body.version!r}")
        name, data = _examples_file(body.examples)
        if (name == "train.conll") != (body.task == "tagging"):
            raise HTTPError(422, f"the examples do not fit task {body.task!r}")
        token = new_tenant_token(body.tenant)
        params = dict(body.model_dump(exclude={"examples"}), examples=len(body.examples))
        job = await _submit("tenant_create", params, {name: data}, {"token_hash": hash_token(token)})
        return {"job": job, "token": token}

    @app.post("/v1/tenants/{tenant}/update", status_code=202, response_model=JobAccepted, tags=["manage"],
              responses=errors_manage)
    async def tenant_update(tenant: TenantPath, body: TenantUpdateBody,
                            creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", tenant)
        tenants, versions = svc.planned()
        if tenant not in tenants:
            raise HTTPError(404, f"unknown tenant {tenant!r}")
        if body.version is not None and body.version not in versions:
            raise HTTPError(404, f"unknown version {body.version!r}")
        uploads = {}
        if body.examples:
            name, data = _examples_file(body.examples)
            uploads[name] = data
        params = dict(body.model_dump(exclude={"examples"}), tenant=tenant,
                      examples=len(body.examples) if body.examples else 0)
        return {"job": await _submit("tenant_update", params, uploads)}

    @app.delete("/v1/tenants/{tenant}", status_code=202, response_model=JobAccepted, tags=["manage"],
                responses=errors_manage)
    async def tenant_rm(tenant: TenantPath, creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        _check_jobs()
        _name("tenant", tenant)
        tenants, _ = svc.planned()
        if tenant not in tenants:
            raise HTTPError(404, f"unknown tenant {tenant!r}")
        return {"job": await _submit("tenant_rm", {"tenant": tenant}, {})}

    @app.get("/v1/jobs/{job_id}", response_model=JobView, tags=["manage"],
             responses={**errors_admin, 404: {"description": "unknown job"}})
    async def get_job(job_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")],
                      creds: HTTPAuthorizationCredentials = Depends(bearer)):
        svc.require_admin(creds)
        job = svc.jobs.load(job_id)
        if job is None:
            raise HTTPError(404, f"unknown job {job_id!r}")
        return svc.jobs.view(job)

    @app.get("/v1/jobs", response_model=JobList, tags=["manage"], responses=errors_admin)
    async def list_jobs(creds: HTTPAuthorizationCredentials = Depends(bearer),
                        state: Optional[Literal["queued", "running", "done", "failed"]] = None,
                        limit: Annotated[int, Query(ge=1, le=1000)] = 50):
        svc.require_admin(creds)
        jobs = await asyncio.to_thread(svc.jobs.list, limit, state)
        return {"jobs": [svc.jobs.view(j) for j in jobs]}

    return app


# -- the command ----------------------------------------------------------------------------------


def resolve_admin_token(store, token_file=None) -> str:
    """The admin token: --admin-token-file, else $HKSTORE_ADMIN_TOKEN, else STORE/admin.token
    (made with a fresh random token, mode 0600, on first use)."""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    elif os.environ.get("HKSTORE_ADMIN_TOKEN"):
        token = os.environ["HKSTORE_ADMIN_TOKEN"].strip()
    else:
        path = os.path.join(store, "admin.token")
        if not os.path.exists(path):
            atomic_write(path, (secrets.token_urlsafe(32) + "\n").encode(), mode=0o600)
            click.echo(f"admin token written to {path}", err=True)
        with open(path) as f:
            token = f.read().strip()
    if len(token) < 16:
        raise click.ClickException("the admin token must be at least 16 characters")
    return token


@click.command("serve")
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told otherwise).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--admin-token-file", type=click.Path(dir_okay=False, exists=True),
              help="File holding the admin token (default: $HKSTORE_ADMIN_TOKEN, else STORE/admin.token).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-batch", type=click.IntRange(1, 4096), default=32, show_default=True)
@click.option("--max-wait-ms", type=click.FloatRange(0, 60_000), default=5, show_default=True)
@click.option("--queue-limit", type=click.IntRange(1, 1 << 20), default=1024, show_default=True)
@click.option("--request-timeout", type=click.FloatRange(0.001, 3600), default=30, show_default=True,
              help="Seconds before an infer request gets 504.")
@click.option("--max-len", type=click.IntRange(3, 4096), default=128, show_default=True, help="Tokens per text.")
@click.option("--mode", type=click.Choice(["shared", "dedicated"]), default="shared", show_default=True,
              help="shared: hPLM; dedicated: the per-tenant full-model baseline (emulated).")
@click.option("--dedicated-resident", type=click.IntRange(1, 100_000), default=4, show_default=True,
              help="dedicated mode: full models kept loaded.")
@click.option("--job-threads", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Torch threads of a job worker.")
@click.option("--torch-threads", type=click.IntRange(0, 256), default=1, show_default=True,
              help="Torch intra-op threads of the server (0: torch's default).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="warning",
              show_default=True)
@click.option("--access-log/--no-access-log", default=False, show_default=True)
def serve(store, host, port, admin_token_file, device, max_batch, max_wait_ms, queue_limit, request_timeout, max_len,
          mode, dedicated_resident, job_threads, torch_threads, log_level, access_log):
    """Serve STORE over HTTP: infer for every tenant, manage jobs (see runtime/serve.py)."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: binding {host}, not loopback: the server is reachable from other hosts", err=True)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(store, admin_token=resolve_admin_token(store, admin_token_file), max_batch=max_batch,
                         max_wait_ms=max_wait_ms, queue_limit=queue_limit, request_timeout_s=request_timeout,
                         device=device, max_len=max_len, mode=mode, dedicated_resident=dedicated_resident,
                         job_threads=job_threads, torch_threads=torch_threads)
    except (StoreError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--job-worker"]:
        store, job_id, parent, threads = argv[1], argv[2], int(argv[3]), int(argv[4])
        code = job_worker(store, job_id, parent, threads)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the outcome is on disk: skip the interpreter's slow teardown
    serve.main(args=argv, prog_name="hkstore serve")


if __name__ == "__main__":
    main()


__all__ = ["Dispatcher", "Jobs", "TokenStore", "atomic_write", "atomic_write_json", "create_app", "hash_token",
           "job_worker", "new_tenant_token", "serve", "token_matches"]
