"""benchmarks/bench_runtime.py's rows for the GPU lane, run here so that they are known to work
when a GPU comes: PEFT's mixed-adapter baseline (the encoder's own weights, per-row adapters) and
section (a) with its GPU columns - full-depth and PEFT mixed included - on the CUDA emulation,
its results as JSON."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import bench_runtime
from runtime.model.encoder import load_encoder


@pytest.fixture(scope="module")
def peft_mixed():
    pytest.importorskip("peft")
    enc = load_encoder()
    return enc, bench_runtime.PeftMixed(SimpleNamespace(enc=enc), pool=3)


def test_peft_mixed_runs_the_encoders_weights(peft_mixed):
    """With the adapters off, PEFT's model is the encoder: the same [CLS] state for the same ids."""
    enc, peft = peft_mixed
    from runtime.exec.plan import pad_ids

    ids = [[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102]]
    padded, lengths = pad_ids(ids, enc.config.pad_id)
    mask = torch.arange(padded.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
    with torch.no_grad(), peft.model.disable_adapter():
        got = peft.model(input_ids=torch.from_numpy(padded), attention_mask=mask.long()).last_hidden_state[:, 0]
        want = enc.full(enc.embed(torch.from_numpy(padded)), mask)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_peft_mixed_gives_each_row_its_tenants_adapter(peft_mixed):
    """Rows of one batch answer with their own tenant's adapter: the same text differs across
    tenants of different weight sets, and equals across a tenant and the one its name aliases
    (tenant pool + k runs set k's weights under a name of its own)."""
    _, peft = peft_mixed
    text = [101, 2023, 2003, 1037, 3231, 102]
    out = peft.run([(0, text), (1, text), (4, text), (2, [101, 7592, 102])]).numpy()
    assert out.shape == (4, 3) and np.isfinite(out).all()
    assert not np.allclose(out[0], out[1], atol=1e-4)
    np.testing.assert_allclose(out[2], out[1], rtol=1e-5, atol=1e-6)  # tenant 4 = set 4 % 3 = 1
    assert "t4" in peft.model.peft_config and peft.named == 5
    alone = peft.run([(1, text)]).numpy()
    np.testing.assert_allclose(alone[0], out[1], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_section_a_runs_its_gpu_rows_on_the_emulation(tmp_path):
    """--device emu: every system of (a) on the GPU executor (the kernels emulated), full-depth
    and PEFT mixed too, for each tenant count; the JSON holds a positive rate for each."""
    from runtime.exec.emu.module import compiler_missing_reason

    if compiler_missing_reason():
        pytest.skip(compiler_missing_reason())
    pytest.importorskip("peft")
    out = tmp_path / "a.json"
    bench_runtime.main(["--quick", "--device", "emu", "--gpu-only", "--skip", "b,c,d", "--tenants", "1,3",
                        "--requests", "4", "--seq-len", "8", "--batch", "4", "--threads", "1", "--peft",
                        "--json", str(out), "--out", str(tmp_path / "a.md")])
    report = json.loads(out.read_text())
    assert list(report["a"]) == ["emu"]
    rates = report["a"]["emu"]["requests_per_s"]
    for T in ("1", "3"):
        assert set(rates[T]) == {"hPLM", "dedicated", "adapter-only", "shared", "full-depth", "PEFT mixed"}
        assert all(v > 0 for v in rates[T].values())
    assert "GPU: the full-depth level" in (tmp_path / "a.md").read_text()


def test_the_gpu_lane_script_parses_and_fits_what_a_run_returns():
    """benchmarks/gpu_lane.sh is valid bash, and writes at most 8 distinct files under $OUT (what a
    lent machine's run brings back), each a plain name."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_lane.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    names = set(re.findall(r"\$OUT/([^\s\"';]+)", script.read_text()))
    assert 0 < len(names) <= 8, names
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names
