"""HTTP probes of benchmarks/reliability.py: malformed, oversized and unauthenticated requests
against a running `hkstore serve` (never a 5xx), unauthenticated large bodies (401 before the
body is read), and a half-open connection (closed by the header timeout).

    run_probes("http://127.0.0.1:8080", admin_token, tenant="base")  # a server already running
    probe_campaign(workdir)                                          # builds a tiny store and serves it
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = 60_000_000  # the declared size of the unauthenticated bodies: never read


def _raw(host, port, head: bytes, body: bytes = b"", timeout=10.0):
    """Send a raw request head (and part of a body); (status line or '', seconds to the answer)."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(head)
        try:
            if body:
                s.sendall(body)
        except OSError:
            pass  # the server answered and closed while we were still sending: what we want
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    return data.split(b"\r\n", 1)[0].decode(errors="replace"), time.perf_counter() - t0


def unauthenticated_bodies(url, tenant="base"):
    """Large bodies without a token to every route that takes one: (status line, seconds) each.
    Each declares 60 MB and sends 1 MiB of it; the answer must be 401 without reading the rest."""
    u = urlsplit(url)
    out = []
    for path in ("/v1/tenants", "/v1/domains", f"/v1/tenants/{tenant}/update", f"/v1/tenants/{tenant}/infer",
                 "/v1/domains/root/update"):
        for framing in (f"Content-Length: {BIG}\r\n", "Transfer-Encoding: chunked\r\n"):
            head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                    f"{framing}\r\n").encode()
            part = b'{"tenant": "x", "examples": [' + b'{"text": "a", "label": "b"}, ' * 36000
            body = part if "Length" in framing else b"%x\r\n%s\r\n" % (len(part), part)
            out.append((path, framing.split(":")[0]) + _raw(u.hostname, u.port, head, body))
    return out


def half_open(url, bound=30.0):
    """Seconds until the server closes a connection that sent half a request head."""
    u = urlsplit(url)
    t0 = time.perf_counter()
    with socket.create_connection((u.hostname, u.port), timeout=bound) as s:
        s.sendall(b"POST /v1/tenants/base/infer HTTP/1.1\r\nHost: x\r\nContent-Ty")
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            return float("inf")
        except OSError:
            pass
    return time.perf_counter() - t0


def probe_cases(tenant):
    """(name, method, path, headers, body bytes or None): each probe once with the admin token,
    once with none, once with a wrong one."""
    j = {"content-type": "application/json"}
    # A valid-looking upload (70 KB) with an invalid name: parsed only for the admin (422, no job).
    big_examples = json.dumps({"tenant": "../huge", "examples": [{"text": "a" * 100, "label": "b"}] * 700}).encode()
    cases = [
        ("infer: not JSON", "POST", f"/v1/tenants/{tenant}/infer", j, b'{"text": '),
        ("infer: wrong type", "POST", f"/v1/tenants/{tenant}/infer", j, b'{"text": 5}'),
        ("infer: nested", "POST", f"/v1/tenants/{tenant}/infer", j, b"[" * 5000 + b"]" * 5000),
        ("infer: not UTF-8", "POST", f"/v1/tenants/{tenant}/infer", j, b'{"text": "\xff\xfe"}'),
        ("infer: NUL", "POST", f"/v1/tenants/{tenant}/infer", j, b'{"text": "a\\u0000b"}'),
        ("infer: 2 MB", "POST", f"/v1/tenants/{tenant}/infer", j, b'{"text": "' + b"a" * (2 << 20) + b'"}'),
        ("infer: form body", "POST", f"/v1/tenants/{tenant}/infer", {"content-type": "application/x-www-form-urlencoded"},
         b"text=a"),
        ("infer: no content type", "POST", f"/v1/tenants/{tenant}/infer", {}, b'{"text": "a"}'),
        ("infer: unknown tenant", "POST", "/v1/tenants/nobody/infer", j, b'{"text": "a"}'),
        ("infer: bad name", "POST", "/v1/tenants/..%2F..%2Fetc/infer", j, b'{"text": "a"}'),
        ("infer: long name", "POST", "/v1/tenants/" + "a" * 5000 + "/infer", j, b'{"text": "a"}'),
        ("infer: GET", "GET", f"/v1/tenants/{tenant}/infer", {}, None),
        ("tenant create: not JSON", "POST", "/v1/tenants", j, b"{"),
        ("tenant create: schema", "POST", "/v1/tenants", j, b'{"tenant": 5}'),
        ("tenant create: 70 KB upload", "POST", "/v1/tenants", j, big_examples),
        ("tenant update: 1 MB", "POST", f"/v1/tenants/{tenant}/update", j, b'{"epochs": 1, "x": "' + b"a" * (1 << 20) + b'"}'),
        ("tenant update: bad", "POST", f"/v1/tenants/{tenant}/update", j, b'{"epochs": -1}'),
        ("tenant delete: body", "DELETE", "/v1/tenants/nobody", j, b"x" * (1 << 20)),
        ("domain create: not JSON", "POST", "/v1/domains", j, b"\x00\x01"),
        ("domain update: bad", "POST", "/v1/domains/root/update", j, b'{"new_name": "../x", "documents": []}'),
        ("job: traversal", "GET", "/v1/jobs/..%2F..%2FCURRENT", {}, None),
        ("job: unknown", "GET", "/v1/jobs/0123456789abcdef", {}, None),
        ("jobs: bad query", "GET", "/v1/jobs?limit=-5&state=nope", {}, None),
        ("tenant: GET unknown", "GET", "/v1/tenants/nobody", {}, None),
        ("tenants: list", "GET", "/v1/tenants", {}, None),
        ("domains: list", "GET", "/v1/domains", {}, None),
        ("metrics", "GET", "/metrics", {}, None),
        ("healthz: POST", "POST", "/healthz", j, b"{}"),
        ("unknown path", "PUT", "/v1/nothing", j, b"{}"),
    ]
    return cases


def raw_cases(tenant, admin):
    """Requests no HTTP client would send: (name, raw bytes)."""
    a = f"Authorization: Bearer {admin}\r\n".encode()
    infer = f"/v1/tenants/{tenant}/infer".encode()
    return [
        ("bad Content-Length", b"POST " + infer + b" HTTP/1.1\r\nHost: x\r\n" + a + b"Content-Length: abc\r\n\r\n{}"),
        ("negative Content-Length", b"POST " + infer + b" HTTP/1.1\r\nHost: x\r\n" + a + b"Content-Length: -5\r\n\r\n"),
        ("two Content-Lengths", b"POST " + infer + b" HTTP/1.1\r\nHost: x\r\n" + a
         + b"Content-Length: 2\r\nContent-Length: 9\r\n\r\n{}"),
        ("short body", b"POST " + infer + b" HTTP/1.1\r\nHost: x\r\n" + a + b"Content-Length: 50\r\n\r\n{}"),
        ("bad chunk", b"POST " + infer + b" HTTP/1.1\r\nHost: x\r\n" + a
         + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
        ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
        ("HTTP/9", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n"),
        ("64 KB header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n"),
        ("bad auth scheme", b"POST /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \xff\xfe\r\n"
         b"Content-Length: 2\r\n\r\n{}"),
        ("no Host", b"GET /healthz HTTP/1.1\r\n\r\n"),
    ]


def run_probes(url, admin, tenant="base"):
    """Every probe case with three credentials, then the raw-socket probes. Returns counts."""
    import httpx

    out = {"probes": 0, "5xx": 0, "failures": []}
    auths = {"admin": {"Authorization": f"Bearer {admin}"}, "none": {}, "wrong": {"Authorization": "Bearer nope-nope"}}
    with httpx.Client(base_url=url, timeout=30.0) as c:
        for name, method, path, headers, body in probe_cases(tenant):
            for who, auth in auths.items():
                try:
                    r = c.request(method, path, headers={**headers, **auth}, content=body)
                    status = r.status_code
                except httpx.HTTPError as e:
                    status, r = None, e
                out["probes"] += 1
                if status is None or status >= 500:
                    out["5xx"] += 1
                    out["failures"].append(f"{name} ({who}): {status} {getattr(r, 'text', r)!s:.200}")
                elif who != "admin" and path.startswith("/v1/") and method != "GET" and status not in (401, 403):
                    out["failures"].append(f"{name} ({who}): {status}, not 401: the body was looked at")
    u = urlsplit(url)
    for name, data in raw_cases(tenant, admin):
        line, _ = _raw(u.hostname, u.port, data, timeout=3)
        out["probes"] += 1
        if line.split(" ")[1:2] and line.split(" ")[1].startswith("5"):
            out["5xx"] += 1
            out["failures"].append(f"{name}: {line!r}")
    bodies = unauthenticated_bodies(url, tenant)
    out["probes"] += len(bodies)
    out["unauthenticated_fast"] = sum(1 for *_, line, s in bodies if " 401 " in line + " " and s < 5.0)
    out["slowest_401_s"] = max(s for *_, s in bodies)
    for path, framing, line, s in bodies:
        if " 401 " not in line + " ":
            out["failures"].append(f"unauthenticated {path} ({framing}): {line!r} after {s:.1f} s")
        if line.split(" ")[1:2] and line.split(" ")[1].startswith("5"):
            out["5xx"] += 1
    return out


def probe_campaign(workdir, header_timeout=2.0):
    """Build a tiny store with one tenant, serve it, run the probes and the half-open check."""
    import shutil

    from runtime.construct import manager
    from runtime.demo.stdlib_text import first_lines
    from runtime.model.tiny import make_tiny_model

    os.makedirs(workdir, exist_ok=True)
    import math
    import os.path as osp

    lines = first_lines(math)[:16] + first_lines(osp)[:16]
    corpus, cls = os.path.join(workdir, "corpus.txt"), os.path.join(workdir, "cls.jsonl")
    with open(corpus, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(cls, "w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({"text": line, "label": "math" if i < 16 else "path"}) + "\n")
    model = make_tiny_model(os.path.join(workdir, "model"), lines)
    store = os.path.join(workdir, "store")
    manager.build(store, model_path=model, corpus_paths=[corpus], max_len=32, chunk=200, progress=False)
    manager.tenant_create(store, "base", version="root", train_path=cls, epochs=1, max_len=32, progress=False)
    admin = "admin-token-for-reliability-0123"
    token_file = os.path.join(workdir, "admin.token")
    with open(token_file, "w") as f:
        f.write(admin + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    log = open(os.path.join(workdir, "server.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.cli", store, "--port", str(port), "--admin-token-file",
                             token_file, "--device", "cpu", "--max-len", "32", "--header-timeout", str(header_timeout)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        out = run_probes(url, admin)
        out["half_open_closed_s"] = half_open(url)
        return out
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        shutil.rmtree(store, ignore_errors=True)
