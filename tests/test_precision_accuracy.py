"""experiments.precision_accuracy's choice and summary against a plain reference: a tenant gets
bf16 only where dev shows it loses at most the tolerance; the claim is the worst task's mean
test loss over seeds at the chosen precision."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from experiments.precision_accuracy import SPLITS, claims_file, held_out, summary, table

score = st.floats(0, 100, allow_nan=False).map(lambda x: round(x, 2))
entry = st.fixed_dictionaries({s: st.fixed_dictionaries({"fp32": st.fixed_dictionaries({"score": score}),
                                                         "bf16": st.fixed_dictionaries({"score": score})})
                               for s in SPLITS})
tasks = st.sampled_from(["chemprot", "sciie", "bc5cdr", "sciie-task-method"])


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


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["s0", "s1", "s2"]), st.dictionaries(tasks, entry), min_size=1),
       st.sampled_from([0.0, 0.3]))
def test_the_held_out_record_is_the_summary_of_its_task_seed_by_seed(results, tolerance):
    task = "sciie-task-method"
    seeds = [s for s in sorted(results) if task in results[s]]
    assume(seeds)
    got, s = held_out(results, tolerance, task), summary(results, tolerance)
    assert got["seeds"] == seeds
    assert got["test_fp32"] == [round(results[x][task]["test"]["fp32"]["score"], 2) for x in seeds]
    assert got["chosen"] == [p["choice"] for p in s["rows"][task]]
    assert got["points_lost_chosen"] == round(s["lost_chosen"][task], 2)
    assert got["points_lost_bf16"] == round(s["lost_bf16"][task], 2)


def test_the_held_out_record_and_the_suites_claims_keep_each_other():
    run, t = {"command": "c", "date": "d"}, {"columns": [], "rows": []}
    s = {"max_points_lost": 0.1, "bf16_points_lost": 0.2}
    suite = claims_file({}, run, t, s)
    both = claims_file(suite, {"command": "h"}, t, s, held={"task": "x", "points_lost_chosen": 0.5})
    assert {k: v for k, v in both.items() if k != "held_out"} == suite
    assert both["held_out"] == {"task": "x", "points_lost_chosen": 0.5, "command": "h"}
    again = claims_file(both, {"command": "c2"}, t, {"max_points_lost": 0.3, "bf16_points_lost": 0.4})
    assert again["held_out"] == both["held_out"] and again["max_points_lost"] == 0.3 and again["command"] == "c2"
