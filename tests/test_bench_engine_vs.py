"""benchmarks.bench_engine_vs' tables: each round's new / old, paired by round whatever order the
checkouts ran in, and the median with its range over the rounds."""

import statistics

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_engine_vs import batching_table, per_round, row, versus_table

rates = st.lists(st.tuples(st.floats(1, 1e4), st.floats(1, 1e4)), min_size=1, max_size=6)


def runs_of(pairs, key="hplm_1"):
    out = []
    for rnd, (old, new) in enumerate(pairs):
        first, second = ("new", new), ("old", old)
        for system, value in ((first, second) if rnd % 2 == 0 else (second, first)):
            out.append({"system": system, "round": rnd, key: value})
    return out


@given(rates)
def test_each_round_is_paired_with_itself(pairs):
    old, new, ratio = per_round(runs_of(pairs), lambda r: {"x": r["hplm_1"]})["x"]
    assert old == [o for o, _ in pairs] and new == [n for _, n in pairs]
    assert ratio == [n / o for o, n in pairs]


@given(rates)
def test_a_row_shows_the_median_ratio_and_its_range(pairs):
    label, old, new, cell = row("r", per_round(runs_of(pairs), lambda r: {"x": r["hplm_1"]})["x"], 1)
    ratios = [n / o for o, n in pairs]
    assert old == round(statistics.median(o for o, _ in pairs), 1)
    assert cell == f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def test_a_round_one_checkout_missed_is_left_out():
    runs = runs_of([(100.0, 110.0), (100.0, 90.0)]) + [{"system": "new", "round": 2, "hplm_1": 1.0}]
    table = versus_table({"runtime": runs})
    assert table["rows"] == [["hPLM requests/s, 1 tenant", 100.0, 100.0, "1.00 (0.90-1.10)"]]


def test_the_batching_table_has_a_row_per_mode_and_three_cells_per_rate():
    runs = [{"system": m, "round": r, "15.0": {"throughput": 10.0 + r, "p50_ms": 50.0, "p99_ms": 900.0}}
            for r in range(3) for m in ("fifo", "length", "coordinated")]
    table = batching_table({"batching": runs})
    assert table["columns"] == ["batching", "15 req/s: served req/s", "p50 ms", "p99 ms"]
    assert table["rows"][1] == ["length", "11.0 (10.0-12.0)", "50 (50-50)", "900 (900-900)"]
