"""Section (a) of benchmarks/bench_runtime.py, its full-depth system: the synthetic pool is the
product's full-depth recipe with distinct, non-zero weights, held as the runtime holds a stored
one (fp16 layers); memory per tenant is one shared model plus a PET each; a --quick run reports
full-depth throughput for every tenant count."""

import json

import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import bench_runtime
from runtime.model.encoder import load_encoder
from runtime.model.pet import TARGETS, is_full


@given(full=st.integers(1, 10**9), pet=st.integers(1, 10**8), tenants=st.integers(1, 10**5))
def test_memory_per_tenant_is_one_shared_model_plus_a_pet_each(full, pet, tenants):
    mem = bench_runtime.full_depth_memory(full, pet, tenants)
    assert mem["dedicated"] == full
    assert abs(mem["full-depth"] * tenants - (full + tenants * pet)) <= 1e-6 * (full + tenants * pet)
    assert mem["full-depth"] >= pet
    bigger = bench_runtime.full_depth_memory(full, pet, tenants + 1)["full-depth"]
    assert bigger < mem["full-depth"]  # the shared model spreads over more tenants


def test_the_pool_is_the_full_depth_recipe_with_distinct_nonzero_weights():
    enc = load_encoder()
    pool = bench_runtime.full_depth_pool(enc, torch.Generator().manual_seed(0), size=2)
    layers = list(range(enc.config.num_layers))
    for p in pool:
        assert is_full(p.meta) and p.meta["layers"] == layers and p.meta["rank"] == 16
        assert sorted(p.meta["targets"]) == sorted(TARGETS)
    a, b = ({k: v for k, v in p.parts.items() if k[0] == "lora"} for p in pool)
    assert a.keys() == b.keys() and {k[1] for k in a} == set(layers)
    for k in a:
        assert all(t.abs().sum() > 0 for t in a[k])  # B != 0: every tenant's edit is live
        assert not all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    # memory per tenant counts what the runtime holds of a stored full-depth PET: fp16 layers, fp32 head
    p = pool[0]
    layer_values = sum(t.numel() for part in p.parts.values() for t in part)
    assert {t.dtype for part in p.parts.values() for t in part} == {torch.float16}
    assert p.nbytes == 2 * layer_values + 4 * (p.head_weight.numel() + p.head_bias.numel())


def test_quick_run_reports_full_depth_throughput(tmp_path):
    """Full-depth beside dedicated and PEFT's mixed-adapter batching, in the table and the JSON."""
    out, js = tmp_path / "out.md", tmp_path / "out.json"
    bench_runtime.main(["--quick", "--device", "cpu", "--skip", "b,c,d", "--tenants", "1,3", "--threads", "1",
                        "--peft", "--json", str(js), "--out", str(out)])
    text = out.read_text()
    table = text.split("the full-depth level", 1)[1]
    head = next(ln for ln in table.splitlines() if ln.startswith("| tenants"))
    cols = [c.strip() for c in head.split("|")[1:-1]]
    rows = [ln.split("|")[1:-1] for ln in table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r[0].strip() for r in rows] == ["1", "3"]
    for r in rows:
        cell = dict(zip(cols, (c.strip().rstrip("x") for c in r)))
        for c in ("full-depth req/s", "PEFT mixed req/s", "full-depth / PEFT mixed", "full-depth / dedicated"):
            assert float(cell[c]) > 0
    assert "of dedicated's" in table
    rates = json.loads(js.read_text())["a"]["cpu"]["requests_per_s"]
    for T, r in zip(("1", "3"), rows):
        assert rates[T]["full-depth"] > 0 and rates[T]["PEFT mixed"] > 0
        assert f"{rates[T]['full-depth']:.2f}" == r[1].strip()
