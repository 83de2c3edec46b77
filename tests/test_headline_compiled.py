"""benchmarks.headline_compiled's claims from its rows: the headline is the shipped default's worst
tenant count, per policy; its results file is the BENCHMARKS section's table, cell for cell."""

import json

from benchmarks import headline_compiled as h


def rows():
    out = []
    for level in ("top", "auto"):
        for T, slow in ((1, 1.0), (16, 1.25)):
            for p, ms in (("fp32", 30.0), ("auto", 10.0 if level == "top" else 6.0)):
                out.append({"level": level, "tenants": T, "precision": p, "server_cpu_ms_per_text": ms * slow,
                            "compiled_cpu_ms_per_text": 24.0, "vs_compiled": round(24.0 / (ms * slow), 2),
                            "spread": [1.0, 3.0], "load": 2.0})
    return out


def test_the_headline_is_the_shipped_defaults_worst_count(tmp_path, monkeypatch):
    args = h.parse_args(["--out", str(tmp_path), "--tenants", "1,16"])
    out = h.claims(args, {"rows": rows()})
    assert out == {"headline_top_vs_compiled": round(24.0 / 12.5, 2), "headline_auto_vs_compiled": round(24.0 / 7.5, 2)}
    args.precisions = ["fp32"]
    assert h.claims(args, {"rows": rows()})["headline_top_vs_compiled"] == round(24.0 / 37.5, 2)
    monkeypatch.setattr(h, "HEADLINE", str(tmp_path / "headline.json"))
    monkeypatch.setattr(h, "RESULTS", str(tmp_path / "precision.json"))
    (tmp_path / "precision.json").write_text(json.dumps({"top_vs_compile": 2.2}))
    args.argv = ["--write"]
    h.write(args, {"rows": rows()}, out)
    written = json.loads((tmp_path / "headline.json").read_text())
    assert written["section"] == h.SECTION and len(written["tables"][0]["rows"]) == 8
    assert written["tables"][0]["rows"][1] == ["top", "1", "auto", 10.0, 24.0, "2.4 (1.0-3.0)"]
    merged = json.loads((tmp_path / "precision.json").read_text())
    assert merged == {"top_vs_compile": 2.2, **out}  # the other benchmark's keys stay
