"""Tenant tokens under concurrent writers and damage: processes issuing and revoking at once
(the CLI's functions, a long-lived TokenStore as the server's jobs hold, the real CLI) lose no
update, a revoked token is refused by a live TokenStore of another process as soon as revoke
returns, and a tokens.json damaged in any way refuses tenant tokens without an exception."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkstore
from formats.pack import PetRecord
from hkstore.errors import StoreError
from hkstore.tokens import TokenStore, hash_token, issue, new_tenant_token, parse_tokens, revoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, V = 8, 30
WORKERS, ROUNDS = 4, 25  # 100 rounds in all
PER_WORKER = 4  # tenants each worker owns


def make_store(path, tenants):
    """A tiny store (no model needed) holding the given tenants."""
    model = os.path.join(os.path.dirname(path), "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"hidden_size": D, "vocab_size": V, "num_hidden_layers": 4, "pad_token_id": 0}, f)
    with open(os.path.join(model, "vocab.txt"), "w") as f:
        f.write("\n".join(f"w{i}" for i in range(V)))
    from click.testing import CliRunner

    from tools.cli import main

    r = CliRunner().invoke(main, ["init", path, "--model", model, "--lower-layers", "2"])
    assert r.exit_code == 0, r.output
    st_ = hkstore.open(path, writable=True)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    st_.add_segment("root", uni, np.random.default_rng(0).standard_normal((V, 3, D)))
    for t in tenants:
        st_.put_pet(PetRecord(t, {"pet_type": "adapter", "task": "classification", "version": "root"},
                              {"w": np.ones(4, dtype=np.float32)}))
    st_.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "s")
    make_store(path, [f"t{w}x{j}" for w in range(WORKERS) for j in range(PER_WORKER)] + ["cli0", "cli1", "cli2"])
    return path


def _worker(store, w, events):
    """ROUNDS issues and revokes on this worker's own tenants. Even workers call the CLI's
    functions (a fresh TokenStore each time); odd ones keep one TokenStore, as the server's
    jobs do, and write hashes of tokens made here (what a tenant-create job records)."""
    live = TokenStore(store)
    for r in range(ROUNDS):
        tenant = f"t{w}x{r % PER_WORKER}"
        if r % 5 == 4:
            if w % 2 == 0:
                revoke(store, tenant)
            else:
                live.remove(tenant)
            events.put(("revoked", tenant, None))
        elif w % 2 == 0:
            events.put(("issued", tenant, issue(store, tenant)["token"]))
        else:
            token = new_tenant_token(tenant)
            live.set(tenant, dict(hash_token(token), created=time.time(), job="test"))
            events.put(("issued", tenant, token))
    events.put(("end", w, None))


def test_concurrent_issue_and_revoke_lose_nothing_and_revoke_holds_at_once(store):
    ctx = multiprocessing.get_context("fork")
    events = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(store, w, events)) for w in range(WORKERS)]
    observer = TokenStore(store)  # a live reader in this process, as a server holds one
    t0 = time.monotonic()
    for p in procs:
        p.start()
    current, dead, ended = {}, set(), 0
    accepted_after_revoke = []
    while ended < WORKERS:
        kind, tenant, token = events.get(timeout=60)
        if kind == "end":
            ended += 1
            continue
        if tenant in current:
            dead.add(current.pop(tenant))  # replaced or revoked: it must never verify again
        if kind == "issued":
            current[tenant] = token
        else:
            # revoke has returned in the worker: this process's reader must refuse at once
            accepted_after_revoke += [t for t in dead if observer.verify(t) is not None]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    elapsed = time.monotonic() - t0
    assert accepted_after_revoke == []
    lost = [t for t in current.values() if observer.verify(t) is None]
    assert lost == [] and len(current) > 0
    assert [t for t in dead if TokenStore(store).verify(t) is not None] == []
    assert len(dead) + len(current) == WORKERS * ROUNDS - WORKERS * (ROUNDS // 5) and elapsed < 60
    assert not [f for f in os.listdir(store) if ".tmp." in f]


def test_the_real_cli_issues_concurrently_without_losing_a_token(store):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tools.cli", "token", "issue", store, f"cli{j}"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    tokens = TokenStore(store)
    assert [tokens.verify(out.strip()) for out, _ in outs] == ["cli0", "cli1", "cli2"]


def test_a_change_that_keeps_mtime_size_and_inode_is_seen(tmp_path):
    """A replaced token makes a file of the same size; written within one timestamp tick with
    a recycled inode number, its mtime, size and inode all match the file a reader last read.
    The reader must still see the new token (here the file is rewritten in place and its mtime
    set back, which gives that same stamp)."""
    tokens = TokenStore(str(tmp_path))
    first, second = new_tenant_token("acme"), new_tenant_token("acme")
    tokens.set("acme", hash_token(first))
    reader = TokenStore(str(tmp_path))
    assert reader.verify(first) == "acme"
    st0 = os.stat(tokens.path)
    data = json.dumps({"format": 1, "tenants": {"acme": hash_token(second)}}, indent=1, sort_keys=True).encode()
    data = data.ljust(st0.st_size)  # (JSON allows trailing spaces)
    assert len(data) == st0.st_size
    with open(tokens.path, "r+b") as f:
        f.write(data)
    os.utime(tokens.path, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    st1 = os.stat(tokens.path)
    assert (st1.st_ino, st1.st_size, st1.st_mtime_ns) == (st0.st_ino, st0.st_size, st0.st_mtime_ns)
    assert reader.verify(first) is None and reader.verify(second) == "acme"


WHOLE = [b"", b"{", b"\xff\xfe\x00garbage", b"[]", b"null", b'{"format": 1}', b'{"tenants": []}',
         b'{"format": 2, "tenants": {}}', b"[" * 100_000, b'{"format": 1, "tenants": {"acme": {"salt": "00"']
ENTRIES = [b'{"format": 1, "tenants": {"acme": "x"}}',
           b'{"format": 1, "tenants": {"acme": {"salt": "zz", "hash": "00"}}}',
           b'{"format": 1, "tenants": {"acme": {"salt": 5, "hash": ["a"]}}}',
           b'{"format": 1, "tenants": {"acme": {"hash": "\xc3\xa9"}}}',
           b'{"format": 1, "tenants": {"a b": {"salt": "00", "hash": "00"}, "acme": null}}']


@pytest.mark.parametrize("data,whole", [(d, True) for d in WHOLE] + [(d, False) for d in ENTRIES])
def test_a_damaged_file_refuses_tenant_tokens_and_says_why(tmp_path, data, whole):
    tokens = TokenStore(str(tmp_path))
    good = new_tenant_token("acme")
    tokens.set("acme", hash_token(good))
    with open(tokens.path, "wb") as f:
        f.write(data)
    assert tokens.verify(good) is None and tokens.verify("acme~x") is None
    assert tokens.problem()
    if whole:  # a writer refuses to build on it (that would drop every entry it holds)
        with pytest.raises(StoreError, match="tokens.json is damaged"):
            tokens.set("beta", hash_token(new_tenant_token("beta")))
    else:  # damaged entries are kept as they are; the rest is written
        other = new_tenant_token("beta")
        tokens.set("beta", hash_token(other))
        assert tokens.verify(other) == "beta" and tokens.verify(good) is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_any_bytes_parse_without_an_exception(data):
    tenants, problem = parse_tokens(data)
    assert isinstance(tenants, dict) and (problem is None or isinstance(problem, str))


def test_revoke_and_issue_on_a_damaged_file_are_one_line_errors(store):
    from click.testing import CliRunner

    from tools.cli import main

    path = os.path.join(store, "tokens.json")
    saved = open(path, "rb").read()
    try:
        with open(path, "wb") as f:
            f.write(b"{not json")
        for verb in ("issue", "revoke"):
            r = CliRunner().invoke(main, ["token", verb, store, "cli0"])
            assert r.exit_code != 0 and "tokens.json is damaged" in r.output and "Traceback" not in r.output
            assert len(r.output.strip().splitlines()) == 1, r.output
    finally:
        with open(path, "wb") as f:
            f.write(saved)
