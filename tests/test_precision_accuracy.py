"""experiments.precision_accuracy's choice and summary against a plain reference: a tenant gets
bf16 only where dev shows it loses at most the tolerance; the claim is the worst task's mean
test loss over seeds at the chosen precision."""

from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.precision_accuracy import SPLITS, summary, table

score = st.floats(0, 100, allow_nan=False).map(lambda x: round(x, 2))
entry = st.fixed_dictionaries({s: st.fixed_dictionaries({"fp32": st.fixed_dictionaries({"score": score}),
                                                         "bf16": st.fixed_dictionaries({"score": score})})
                               for s in SPLITS})
tasks = st.sampled_from(["chemprot", "sciie", "bc5cdr"])


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["s0", "s1", "s2"]), st.dictionaries(tasks, entry, min_size=1), min_size=1),
       st.sampled_from([0.0, 0.3, 1.0]))
def test_the_claim_is_the_worst_tasks_mean_loss_at_the_dev_choice(results, tolerance):
    got = summary(results, tolerance)
    worst = None
    for task in {t for r in results.values() for t in r}:
        losses = []
        for r in results.values():
            if task in r:
                dev, test = r[task]["dev"], r[task]["test"]
                pick = "bf16" if dev["fp32"]["score"] - dev["bf16"]["score"] <= tolerance else "fp32"
                losses.append(test["fp32"]["score"] - test[pick]["score"])
        mean = sum(losses) / len(losses)
        worst = mean if worst is None else max(worst, mean)
        assert abs(got["lost_chosen"][task] - mean) < 1e-9
    assert got["max_points_lost"] == round(worst, 2)
    t = table(results, tolerance)
    assert [r[0] for r in t["rows"]] == list(got["rows"]) and all(len(r) == len(t["columns"]) for r in t["rows"])
