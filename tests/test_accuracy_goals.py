"""benchmarks.accuracy_goals --pareto: the size table from full_depth dev runs."""

import json

from benchmarks import accuracy_goals

TASKS = ("NCBI-disease", "sciie")


def _run(path, rows: dict, rank=16, lr=1e-3, dropout=None):
    """A full_depth results.json: rows {row: {task: (score, pet bytes)}}."""
    path.mkdir()
    config = {"eval_split": "dev", "seed": 0, "rank": rank, "lr": lr}
    if dropout is not None:
        config["dropout"] = dropout
    out = {t: {row: {"score": s, "pet_bytes_no_head": b} for row, per in rows.items() for s, b in [per[t]]}
           for t in TASKS}
    (path / "results.json").write_text(json.dumps({"rows": out, "config": config, "encoder_bytes": 1000}))
    return path


def test_pareto_adds_other_runs_against_the_first_runs_dedicated(tmp_path):
    first = _run(tmp_path / "a", {"dedicated": {t: (0.60, 1000) for t in TASKS},
                                  "fd-lora": {"NCBI-disease": (0.58, 40), "sciie": (0.50, 40)}})
    r8 = _run(tmp_path / "b", {"fd-lora": {"NCBI-disease": (0.55, 20), "sciie": (0.57, 20)}}, rank=8, dropout=0.1)
    rows = accuracy_goals.pareto(first, [r8])["tables"][0]["rows"]
    by = {r[0]: r for r in rows}
    assert by["every weight (full fine-tuning)"][1:5] == [1000, 100.0, 60.0, 0.0]
    assert "full-depth LoRA r16, six targets, layers 0-5" not in by  # the further run stands for it
    extra = [r for r in rows if r[0].startswith("full-depth LoRA r8")]
    assert len(extra) == 1 and extra[0][0].endswith("lr 1e-3, dropout 0.1")
    alone = {r[0]: r for r in accuracy_goals.pareto(first)["tables"][0]["rows"]}
    assert alone["full-depth LoRA r16, six targets, layers 0-5"][1:] == [20, 2.0, 54.0, 6.0, "sciie 10.0"]  # fp16
    assert extra[0][1:] == [10, 1.0, 56.0, 4.0, "NCBI-disease 5.0"]


def test_pareto_leaves_out_a_run_missing_a_task(tmp_path):
    first = _run(tmp_path / "a", {"dedicated": {t: (0.60, 1000) for t in TASKS}})
    partial = tmp_path / "b"
    partial.mkdir()
    (partial / "results.json").write_text(json.dumps({
        "rows": {"NCBI-disease": {"fd-lora": {"score": 0.5, "pet_bytes_no_head": 20}}},
        "config": {"rank": 8, "lr": 1e-3}, "encoder_bytes": 1000}))
    rows = accuracy_goals.pareto(first, [partial])["tables"][0]["rows"]
    assert [r[0] for r in rows] == ["every weight (full fine-tuning)"]


def test_pareto_lists_adapter_sizes_and_each_diff_density_by_its_own_bytes(tmp_path):
    first = _run(tmp_path / "a", {"dedicated": {t: (0.60, 1000) for t in TASKS},
                                  "fd-adapter": {t: (0.50, 80) for t in TASKS}})
    small = _run(tmp_path / "b", {"fd-adapter": {t: (0.40, 20) for t in TASKS}})
    small_cfg = json.loads((small / "results.json").read_text())
    small_cfg["config"]["bottleneck"] = 16
    (small / "results.json").write_text(json.dumps(small_cfg))
    diff = tmp_path / "c"
    diff.mkdir()
    cell = {"score": 0.45, "pet_bytes_no_head": 999,
            "by_density": {"0.005": {"score": 0.45, "pet_bytes_stored": 30, "retrained_score": 0.52,
                                     "retrained_bytes_stored": 30},
                           "0.02": {"score": 0.55, "pet_bytes_stored": 120}}}
    (diff / "results.json").write_text(json.dumps({
        "rows": {t: {"fd-diff": cell} for t in TASKS}, "encoder_bytes": 1000,
        "config": {"lr_diff": 2e-4, "retrain_epochs": 3, "rank": 16, "lr": 1e-3}}))
    rows = accuracy_goals.pareto(first, [small, diff])["tables"][0]["rows"]
    titles = [r[0] for r in rows]
    assert titles[0] == "every weight (full fine-tuning)"
    adapters = [r for r in rows if "adapter" in r[0]]
    assert [r[1] for r in adapters] == [10, 40]  # fp16 as stored, smallest first
    assert adapters[0][0].startswith("full-depth adapter b16") and adapters[0][3] == 40.0
    diffs = [r for r in rows if "diff" in r[0]]
    assert [(r[1], r[3]) for r in diffs] == [(30, 45.0), (30, 52.0), (120, 55.0)]  # bytes as stored, not halved
    assert "0.5%" in diffs[0][0] and diffs[1][0].endswith("+ 3 epochs on the kept entries")
