"""benchmarks.bench_cores: a --quick run end to end (tiny model, one and two workers through
`hkstore serve`), its summary in the results format benchmarks.claims reads, and the smaps
reading behind its memory table."""

import json
import os

import numpy as np
import pytest

from benchmarks import bench_cores


def test_smaps_counts_a_mapped_file(tmp_path):
    path = tmp_path / "store" / "seg.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(4 << 20))
    before = bench_cores.smaps(os.getpid(), str(tmp_path / "store"))
    m = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(m.sum()) > 0  # every page touched
    after = bench_cores.smaps(os.getpid(), str(tmp_path / "store"))
    assert before["store_rss_mib"] == 0
    assert after["store_rss_mib"] >= 3.9 and after["rss_mib"] >= after["store_rss_mib"]
    del m


def test_summary_takes_the_worst_case():
    args = bench_cores.parse_args(["--workers", "1,2", "--out", "/tmp/unused-bench-cores"])
    rows = [{"level": lv, "tenants": 1, "workers": w, "texts_per_s": tp, "vs_1": tp / base, "p99_closed_ms": 10.0,
             "p99_same_load_ms": None, "cpu_ms_per_text": 2.0, "load": 1.5}
            for lv, base, pair in (("plot", 100.0, (100.0, 190.0)), ("top", 50.0, (50.0, 80.0)))
            for w, tp in zip((1, 2), pair)]
    out = bench_cores.summary(args, {"rows": rows, "memory": {}})
    assert out["workers2_vs_1"] == 1.6  # the top's, the smaller
    assert out["section"] == bench_cores.SECTION and len(out["tables"][0]["rows"]) == 4
    assert out["tables"][0]["rows"][0][6] == "n/a"


@pytest.mark.slow
def test_quick_run(tmp_path):
    out = tmp_path / "out"
    bench_cores.main(["--quick", "--out", str(out), "--tenants", "1,4", "--levels", "plot", "--clients", "4"])
    result = json.loads((out / "cores.json").read_text())
    rows = result["raw"]["rows"]
    assert {(r["tenants"], r["workers"]) for r in rows} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    assert all(r["texts_per_s"] > 0 and r["errors"] == 0 for r in rows)
    assert len(result["raw"]["memory"]["2"]) == 3  # the server and its two workers
    assert "workers2_vs_1" in result
