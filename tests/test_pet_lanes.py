"""PET operator lanes (runtime.exec.pet_lanes, PetS Alg. 2 on the CPU): every operator is
placed on exactly one lane, and running the lanes in parallel gives the same edits as the
batched calls in one lane, on random stages where each tenant carries one PET kind."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.exec import cpu_batched, pet_lanes


def _stage(seed, segments, L, d):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 3, size=segments)
    starts = np.concatenate([[0], np.cumsum(counts)])
    rows = int(starts[-1]) * L
    kind_of = rng.integers(0, 4, size=segments)
    stage = {}
    for target in ("q", "v"):
        x, y = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
        kinds = {}
        for k, kind in enumerate(("lora", "bias", "diff", "adapter")):
            ids = np.full(segments, -1)
            mine = np.flatnonzero(kind_of == k)
            ids[mine] = np.arange(len(mine))
            T = max(len(mine), 1)
            runs, _ = cpu_batched.segment_runs(starts, ids, L)
            if kind == "lora":
                w = {"A": torch.randn(T, 3, d, generator=g), "B": torch.randn(T, d, 3, generator=g),
                     "scales": torch.ones(T)}
            elif kind == "bias":
                w = {"delta": torch.randn(T, d, generator=g)}
            elif kind == "diff":
                index = torch.cat([torch.randint(0, d * d, (5,), generator=g).sort().values for _ in range(T)])
                w = {"index": index.to(torch.int32), "value": torch.randn(5 * T, generator=g),
                     "offsets": torch.arange(T + 1) * 5}
            else:
                w = {"down": torch.randn(T, 4, d, generator=g), "down_bias": torch.randn(T, 4, generator=g),
                     "up": torch.randn(T, d, 4, generator=g), "up_bias": torch.randn(T, d, generator=g)}
            kinds[kind] = (runs, w)
        stage[target] = (x, y, kinds)
    return stage


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), segments=st.integers(1, 12), L=st.integers(1, 3), lanes=st.integers(1, 3),
       chunk=st.integers(1, 4))
def test_lanes_equal_one_lane(seed, segments, L, lanes, chunk):
    stage = _stage(seed, segments, L, 6)
    want = {t: y.clone() for t, (_, y, _) in stage.items()}
    for op in pet_lanes.split_ops({t: (x, want[t], kinds) for t, (x, _, kinds) in stage.items()}, chunk=1 << 30):
        op()
    ops = pet_lanes.split_ops(stage, chunk=chunk)
    placed = pet_lanes.assign_lanes(ops, lanes)
    assert sorted(id(o) for lane in placed for o in lane) == sorted(id(o) for o in ops)
    pool = pet_lanes.lane_pool(lanes)
    try:
        pet_lanes.run_lanes(pool, placed)
    finally:
        pool.shutdown()
    for t, (_, y, _) in stage.items():
        torch.testing.assert_close(y, want[t], rtol=1e-5, atol=1e-4)
