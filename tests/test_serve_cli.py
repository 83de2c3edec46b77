"""`hkstore serve` before it serves: refusals are one line and write nothing; it says where it
listens and where the admin token is (uvicorn.Server.run is stubbed: no server starts here)."""

import os

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import hkstore  # noqa: E402
from runtime.serve.cli import serve  # noqa: E402


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "s")
    with hkstore.create(path, d=4, vocab_size=8) as st:
        uni = np.zeros((8, 3), dtype=np.uint32)
        uni[:, 1] = np.arange(8)
        st.add_segment("root", uni, np.zeros((8, 3, 4)))
    return path


def one_line_error(result):
    assert result.exit_code == 1 and result.output.startswith("Error: ") and result.output.count("\n") == 1, \
        result.output
    return result.output


def test_a_directory_that_is_no_store_is_refused_before_any_token_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("HKSTORE_ADMIN_TOKEN", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not an hkstore store" in one_line_error(CliRunner().invoke(serve, [str(empty)]))
    assert os.listdir(empty) == []


def test_cuda_without_a_gpu_is_one_line(store, monkeypatch):
    import runtime

    monkeypatch.setattr(runtime, "_cuda_available", lambda: False)
    assert "--device cuda: no CUDA GPU" in one_line_error(CliRunner().invoke(serve, [store, "--device", "cuda"]))


def test_it_says_where_it_listens_and_where_the_admin_token_is(store, monkeypatch):
    import uvicorn

    monkeypatch.delenv("HKSTORE_ADMIN_TOKEN", raising=False)
    calls = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append(sockets))
    r = CliRunner().invoke(serve, [store, "--port", "18123", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    token_file = os.path.join(os.path.abspath(store), "admin.token")
    assert f"serving {store} on http://127.0.0.1:18123" in r.output and f"(admin token: {token_file};" in r.output
    assert os.path.exists(token_file) and calls[0][0].getsockname()[1] == 18123  # bound before it serves
    calls[0][0].close()
    assert "runtime/serve" not in CliRunner().invoke(serve, ["--help"]).output  # no source files in the help


def test_ray_says_where_it_listens_and_where_the_admin_token_is_at_once(store, monkeypatch):
    """`serve --ray` prints its address and the admin token's place before Ray starts (flushed:
    a piped stdout used to hold it until shutdown). Ray itself is stubbed: no cluster here."""
    import io

    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from runtime.serve import ray_app

    stream = io.StringIO()
    line = ray_app.announce("starting on", "127.0.0.1", 8123, "admin token: /x/admin.token", stream=stream)
    assert stream.getvalue() == line + "\n" and "http://127.0.0.1:8123" in line and "/x/admin.token" in line

    class Started(Exception):
        pass

    def init(**kw):  # Ray would start here: everything said by now was said before it
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("HKSTORE_ADMIN_TOKEN", raising=False)
    r = CliRunner().invoke(serve, [store, "--ray", "--port", "8124"])
    assert isinstance(r.exception, Started), r.output
    token_file = os.path.join(os.path.abspath(store), "admin.token")
    assert "http://127.0.0.1:8124" in r.output and f"admin token: {token_file}" in r.output, r.output


def test_tenant_labels_are_bounded():
    from runtime.serve.metrics import TenantLabels

    label = TenantLabels(limit=2)
    assert [label(t) for t in ("a", "b", "c", "a", "other", "d", "b")] == ["a", "b", "other", "a", "other", "other",
                                                                          "b"]


def test_batching_reaches_the_runtime_and_is_refused_under_ray(store, monkeypatch):
    import uvicorn

    from runtime.serve import cli

    made = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: [s.close() for s in sockets])
    monkeypatch.setattr(cli, "create_app", lambda path, **kw: made.append(kw["runtime_options"]))
    r = CliRunner().invoke(serve, [store, "--device", "cpu", "--batching", "coordinated", "--truncate"])
    assert r.exit_code == 0, r.output
    assert made == [{"batching": "coordinated", "truncate": True}]
    assert "Ray replicas batch by length" in one_line_error(
        CliRunner().invoke(serve, [store, "--ray", "--batching", "fifo"]))
    assert "'lifo' is not one of" in CliRunner().invoke(serve, [store, "--batching", "lifo"]).output


def test_precision_reaches_the_runtime_and_bf16_without_the_instructions_is_one_line(store, monkeypatch):
    import uvicorn

    from runtime.exec import precision
    from runtime.serve import cli

    made = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: [s.close() for s in sockets])
    monkeypatch.setattr(cli, "create_app", lambda path, **kw: made.append(kw["runtime_options"]))
    assert CliRunner().invoke(serve, [store, "--device", "cpu"]).exit_code == 0
    assert CliRunner().invoke(serve, [store, "--device", "cpu", "--precision", "fp32"]).exit_code == 0
    assert "dtype" not in made[0] and made[1]["dtype"] == "fp32"  # auto: the runtime's own default
    monkeypatch.setattr(precision, "bf16_native", lambda: None)
    assert "AVX512_BF16" in one_line_error(CliRunner().invoke(serve, [store, "--device", "cpu", "--precision", "bf16"]))
    assert len(made) == 2
