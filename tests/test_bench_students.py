"""benchmarks.bench_students' per-tenant burst table: each tenant's p99 over its own requests of
one mode, its score averaged over that mode's rounds."""

import numpy as np
from hypothesis import given, settings, strategies as st

from benchmarks.bench_students import by_tenant

latency = st.lists(st.floats(0.001, 10.0), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.tuples(latency, latency, st.floats(0, 1), st.floats(0, 1)),
                       min_size=1))
def test_rows_take_each_tenants_own_requests_of_each_mode(tenants):
    results = []
    for rnd in range(2):  # two rounds of each mode; a request: (sent, latency s, level, tenant)
        for m, mode in enumerate(("top", "auto")):
            results.append({"mode": mode, "scored": {t: v[2 + m] for t, v in tenants.items()},
                            "latency": [(0.0, x, "full", t) for t, v in tenants.items() for x in v[m][rnd::2] or v[m]]})
    rows = by_tenant(results)
    assert [r["tenant"] for r in rows] == sorted(tenants)
    for row in rows:
        v = tenants[row["tenant"]]
        for m, mode in enumerate(("top", "auto")):
            mine = [x for r in results if r["mode"] == mode for x in r["latency"] if x[3] == row["tenant"]]
            assert row[f"{mode}_p99_ms"] == round(np.percentile([x[1] for x in mine], 99) * 1e3)
            assert row[f"{mode}_score"] == round(100 * v[2 + m], 1)
        assert abs(row["auto_minus_top"] - (100 * v[3] - 100 * v[2])) <= 0.05 + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 500), st.floats(1, 500), st.floats(0, 1), st.floats(0, 1)), min_size=2,
                max_size=4))
def test_stepped_rows_average_each_mode_over_its_rounds(rounds):
    """Each round is (top's p99, auto's p99, top's score, auto's score) of one tenant in one phase."""
    from benchmarks.bench_students import stepped_cascade_rows

    results = [{"mode": mode, "phases": [{"rate": 5.0, "p99_ms_by_tenant": {"t": r[m]}, "scored": {"t": r[2 + m]}}]}
               for r in rounds for m, mode in enumerate(("top", "auto"))]
    [row] = stepped_cascade_rows(results)
    top, auto = np.mean([r[0] for r in rounds]), np.mean([r[1] for r in rounds])
    assert row["tenant"] == "t" and row["top_p99_ms"] == round(top) and row["auto_p99_ms"] == round(auto)
    gain = 100 * (np.mean([r[3] for r in rounds]) - np.mean([r[2] for r in rounds]))
    assert abs(row["auto_minus_top"] - gain) <= 0.05 + 1e-9
