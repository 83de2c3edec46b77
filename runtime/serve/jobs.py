"""Durable manage jobs (HMI §4.1 a-e) for the HTTP server: records under STORE/jobs, one runner
thread, a worker process that calls runtime.construct.manager. See runtime/serve/app.py for the protocol.

    python -m runtime.serve.jobs --job-worker STORE JOB_ID|- PARENT_PID THREADS    (the worker)
"""

import collections
import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import hkstore
from hkstore.files import atomic_write, atomic_write_json, read_json
from hkstore.errors import StoreError

log = logging.getLogger("hkstore.serve")

JOB_ID = re.compile(r"^[0-9a-f]{16}$")
MAX_ATTEMPTS = 3  # runs of a job interrupted by crashes before it is marked failed
WORKER_JOBS = 20  # jobs one worker process runs before a fresh one takes over
LOCK_WAIT_S = 120.0  # how long a job waits for another writer's store lock

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
        # the folder that holds the runtime package: the source tree or site-packages
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        with open(os.path.join(self.dir, "worker.log"), "ab") as log_file:  # until it has a job's log.txt
            self._worker = subprocess.Popen(
                [self.python, "-m", "runtime.serve.jobs", "--job-worker", self.store_path, "-", str(os.getpid()),
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
            try:
                if job["kind"] == "tenant_create" and job.get("token_hash"):
                    self.tokens.set(p["tenant"], dict(job["token_hash"], created=time.time(), job=job["id"]))
                elif job["kind"] == "tenant_rm":
                    self.tokens.remove(p["tenant"])
            except StoreError as e:  # a damaged tokens.json: the store's change stands; say what did not happen
                log.error("job %s: %s", job["id"], e)
                result = dict(result or {}, token_error=str(e))
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
    from runtime.construct import manager

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
                                     seed=p["seed"], levels=p.get("levels", ["plot"]),
                                     precision=p.get("precision", "auto"), progress=True)
    if kind == "tenant_update":
        return manager.tenant_update(store_path, p["tenant"], train_path=p.get("train_path"), version=p["version"],
                                     epochs=p["epochs"], max_examples=p["max_examples"], lr=p["lr"],
                                     batch_size=p["batch_size"], max_len=p["max_len"], seed=p["seed"],
                                     precision=p.get("precision"), progress=True)
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
    import runtime.construct.manager  # noqa: F401 - the imports a job needs, done before it comes
    import runtime.construct.plot  # noqa: F401
    import runtime.construct.train  # noqa: F401 - its bars look tqdm.tqdm up at call time: _Progress
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




def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--job-worker"] or len(argv) != 5:
        raise SystemExit("usage: python -m runtime.serve.jobs --job-worker STORE JOB_ID|- PARENT_PID THREADS")
    code = job_worker(argv[1], argv[2], int(argv[3]), int(argv[4]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the outcome is on disk: skip the interpreter's slow teardown


if __name__ == "__main__":
    main()
