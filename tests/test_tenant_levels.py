"""A tenant's levels through the CLI on a tiny store: tenant create trains the PLOT-level PET and
(by default) a full-depth PET beside it, tenant update keeps both current, tenant rm removes
both, tenant ls / info report them; and the product and the accuracy harness train by one
recipe (runtime.construct.recipe)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

import hkstore
from runtime.construct import manager, recipe
from runtime.model.tiny import make_tiny_model
from test_cli_model import cli  # noqa: F401 - the construction commands as one click group
from test_manager import make_data

FAST = ["--epochs", "1", "--max-len", "32", "-q"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("levels"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32, progress=False)
    return data


def run(cli, *args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def records(store, tenant):
    with hkstore.open(store) as st:
        snap = st.snapshot()
        pet = snap.read_pet(tenant) if tenant in snap.pets else None
        full = snap.read_full(tenant) if tenant in snap.full else None
        return pet, full


def test_create_trains_a_current_full_depth_pet_beside_the_pet(cli, env):
    r = run(cli, "tenant", "create", env["store"], "both", "--version", "root", "--train", env["cls"], "--pet", "lora",
            "--calibration-share", "0.3", *FAST, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["levels"] == ["plot", "full"] and set(out["level_seconds"]) == {"plot", "full"}
    pet, full = records(env["store"], "both")
    assert full.meta["level"] == "full" and full.meta["pet_created"] == pet.meta["created"]
    assert full.meta["layers"] == list(range(6))  # the lower layers too (the store's split is 3)
    assert full.meta["pet_type"] == "lora" and full.meta["targets"] == list(recipe.ALL_TARGETS)
    assert full.meta["train"]["epochs"] == 1 and full.meta["train"]["lr"] == recipe.FULL["lora"].lr
    assert set(full.meta["layers"]) > set(pet.meta["layers"]) and out["full"]["pet_bytes"] > 0
    assert_stored_dtypes(pet, full)

    r = run(cli, "tenant", "info", env["store"], "both", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert {"plot", "exact", "full"} <= set(info["levels"]) and info["served"] == ["plot", "exact", "full"]
    assert not info["levels"]["full"]["stale"] and info["cascade"]["state"] == "none"
    for level in ("plot", "exact", "full"):  # scored on the calibration share held out of training
        assert 0 <= info["levels"][level]["held_out"] <= 1, level


def assert_stored_dtypes(pet, full):
    """A full-depth record stores every layer tensor in fp16 and its head in fp32; the PLOT-level PET stays fp32."""
    layers = {k: v.dtype for k, v in full.tensors.items() if k.startswith("layers.")}
    assert layers and set(layers.values()) == {np.dtype(np.float16)}, layers
    assert full.tensors["head.weight"].dtype == full.tensors["head.bias"].dtype == np.float32
    assert {v.dtype for v in pet.tensors.values()} == {np.dtype(np.float32)}


def test_levels_plot_stores_no_full_depth_pet(cli, env):
    r = run(cli, "tenant", "create", env["store"], "plot-only", "--version", "root", "--train", env["cls"],
            "--levels", "plot", *FAST, "--json")
    assert r.exit_code == 0, r.output
    pet, full = records(env["store"], "plot-only")
    assert pet is not None and full is None
    info = json.loads(run(cli, "tenant", "info", env["store"], "plot-only", "--json").output)
    assert set(info["levels"]) == {"plot", "exact"} and info["levels"]["plot"]["held_out"] is None


def test_update_retrains_the_full_depth_pet_with_the_new_pet(cli, env):
    manager.tenant_create(env["store"], "upd", version="root", train_path=env["cls"], pet_type="lora", epochs=1,
                          max_len=32, progress=False)
    _, before = records(env["store"], "upd")
    r = run(cli, "tenant", "update", env["store"], "upd", "-q", "--json")
    assert r.exit_code == 0, r.output
    pet, full = records(env["store"], "upd")
    assert full.meta["pet_created"] == pet.meta["created"] != before.meta["pet_created"]
    assert full.meta["train"]["updates"] == 1
    assert_stored_dtypes(pet, full)  # trained further in fp32 from its fp16 record, stored in fp16 again
    assert any(not np.array_equal(full.tensors[k], before.tensors[k]) for k in full.tensors)


def test_replacing_without_the_full_level_drops_the_old_one(env):
    manager.tenant_create(env["store"], "swap", version="root", train_path=env["cls"], epochs=1, max_len=32,
                          progress=False)
    manager.tenant_create(env["store"], "swap", version="root", train_path=env["cls"], epochs=1, max_len=32,
                          levels=("plot",), replace=True, progress=False)
    pet, full = records(env["store"], "swap")
    assert pet is not None and full is None  # never a stale full-depth PET left behind


def test_rm_removes_the_pet_and_the_full_depth_pet(cli, env):
    manager.tenant_create(env["store"], "gone", version="root", train_path=env["cls"], epochs=1, max_len=32,
                          progress=False)
    assert records(env["store"], "gone")[1] is not None
    r = run(cli, "tenant", "rm", env["store"], "gone", "--json")
    assert r.exit_code == 0, r.output
    assert records(env["store"], "gone") == (None, None)


def test_ls_lists_each_tenants_levels(cli, env):
    manager.tenant_create(env["store"], "listed", version="root", train_path=env["cls"], epochs=1, max_len=32,
                          progress=False)
    r = run(cli, "tenant", "ls", env["store"], "--json")
    assert r.exit_code == 0, r.output
    rows = {row["tenant"]: row for row in json.loads(r.output)["tenants"]}
    assert rows["listed"]["levels"] == ["plot", "exact", "full"]
    with hkstore.open(env["store"]) as st:
        snap = st.snapshot()
        assert rows["listed"]["bytes"] == snap.pets["listed"]["length"] + snap.full["listed"]["length"]
    plain = run(cli, "tenant", "ls", env["store"])
    assert plain.exit_code == 0 and any(line.startswith("listed ") for line in plain.output.splitlines())


@pytest.mark.parametrize("args,message", [
    (["tenant", "create", "{store}", "t2", "--version", "root", "--train", "{cls}", "--levels", "plot,deep"],
     "unknown level 'deep'"),
    (["tenant", "create", "{store}", "t2", "--version", "root", "--train", "{cls}", "--levels", "full"],
     "levels must include plot"),
    (["tenant", "create", "{store}", "t2", "--version", "root", "--train", "{cls}", "--levels", "plot", "--corpus",
      "{cls}"], "add level full"),
    (["tenant", "info", "{store}", "ghost"], "unknown tenant 'ghost'"),
    (["tenant", "ls", "{store}/../nostore"], "no such store"),
])
def test_errors_are_one_line(cli, env, args, message):
    r = run(cli, *[a.format(store=env["store"], cls=env["cls"]) for a in args])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], r.output


def test_corpus_texts_labeled_by_the_top_train_the_plot_level(cli, env, tmp_path):
    """--corpus: the full-depth level labels the domain texts that are not training texts (at
    most --max-corpus of them) and the PLOT-level PET trains on them beside the labels."""
    import os.path as osp

    from test_manager import docstring_lines

    fresh = [line for line in docstring_lines(os) if line.strip()][:6]
    corpus = tmp_path / "domain.txt"
    corpus.write_text("\n".join(env["texts"][:5] + fresh) + "\n")  # five of them have labels already
    r = run(cli, "tenant", "create", env["store"], "taught", "--version", "root", "--train", env["cls"], "--corpus",
            corpus, *FAST, "--json")
    assert r.exit_code == 0, r.output
    pet, full = records(env["store"], "taught")
    assert pet.meta["train"]["corpus"] == {"paths": [str(corpus)], "examples": len(fresh)}
    assert json.loads(r.output)["corpus_examples"] == len(fresh)
    assert full.meta["pet_created"] == pet.meta["created"] and full.meta["train"]["examples"] == len(env["texts"])
    r = run(cli, "tenant", "create", env["store"], "taught", "--version", "root", "--train", env["tag"], "--task",
            "tagging", "--corpus", corpus, "--max-corpus", 4, "--replace", *FAST, "--json")
    assert r.exit_code == 0, r.output
    assert records(env["store"], "taught")[0].meta["train"]["corpus"]["examples"] == 4


@pytest.mark.parametrize("task", ["classification", "tagging"])
def test_pseudo_labels_are_the_tops_argmax_where_labels_go(env, monkeypatch, task):
    """Classification: one label per text; tagging: a label at each word's first sub-token,
    IGNORE where encode_tagging puts it. The top here answers label (token id mod 3)."""
    from runtime.construct import full as fulllib
    from runtime.construct.data import IGNORE, encode_tagging
    from runtime.construct.pseudo import pseudo_examples
    from runtime.model.stored import load_model

    def fake_logits(whole, pet, seqs):
        eye = np.eye(3)
        return [eye[sum(s) % 3] if task == "classification" else eye[np.asarray(s) % 3] for s in seqs]

    monkeypatch.setattr(fulllib, "full_logits", fake_logits)
    encoder = load_model(env["model"], 3)
    kept = env["texts"][:7]
    ids, targets = pseudo_examples(encoder, None, None, kept, task, ["A", "B", "C"], 32)
    assert ids == (encoder.tokenize(kept, 32) if task == "classification" else
                   encode_tagging(encoder, [d.split() for d in kept], [["A"] * len(d.split()) for d in kept],
                                  ["A", "B", "C"], 32)[0])
    if task == "classification":
        assert targets == [sum(s) % 3 for s in ids]
        return
    slots = encode_tagging(encoder, [d.split() for d in kept], [["A"] * len(d.split()) for d in kept],
                           ["A", "B", "C"], 32)[1]
    assert [[x == IGNORE for x in t] for t in targets] == [[x == IGNORE for x in t] for t in slots]
    assert all(x == IGNORE or x == s[j] % 3 for s, t in zip(ids, targets) for j, x in enumerate(t))


def test_the_texts_to_label_leave_out_empty_and_labeled_ones():
    docs = ["a b", "  ", "c  d", "e", "f g h"]
    assert manager._unlabeled(docs, [" c d "], 10, 0) == ["a b", "e", "f g h"]
    got = manager._unlabeled(docs, [], 2, 0)
    assert len(got) == 2 and set(got) <= {"a b", "c  d", "e", "f g h"}


class Stop(Exception):
    @classmethod
    def throw(cls):
        raise cls


def spy_settings(monkeypatch, level):
    """recipe.settings recording (options, TrainConfig without progress) of `level` calls, then
    stopping the caller before it trains."""
    seen, real = [], recipe.settings

    def spy(pet_type, lvl="plot", **kwargs):
        options, cfg = real(pet_type, lvl, **kwargs)
        if lvl == level:
            seen.append((pet_type, options, cfg.__class__(**{**cfg.__dict__, "progress": False})))
            raise Stop
        return options, cfg

    monkeypatch.setattr(recipe, "settings", spy)
    return seen


def harness(env):
    from benchmarks import hmi_accuracy

    args = hmi_accuracy.parser().parse_args(["--out", "unused", "--model", env["model"]])
    task = SimpleNamespace(name="cls", kind="classification", labels=["math", "path"], train_ids=[[2, 3]],
                           train_y=[0])
    ctx = {"data": {"tasks": {"cls": {"train": env["cls"]}}}}
    return hmi_accuracy, args, task, ctx


@pytest.mark.parametrize("pet_type", ["adapter", "lora"])
def test_the_harness_trains_tenant_creates_plot_pet(cli, env, monkeypatch, pet_type):
    """The harness's hplm / hplm-lora row and a plain `tenant create` (no training flags) train
    with the same settings: change either side alone and this fails."""
    seen = spy_settings(monkeypatch, "plot")
    run(cli, "tenant", "create", env["store"], "spy", "--version", "root", "--train", env["cls"], "--pet", pet_type,
        "-q")
    hmi, args, task, ctx = harness(env)
    with pytest.raises(Stop):
        hmi.row_tenant(args, ctx, task, env["store"], "root", pet_type, "spy")
    assert len(seen) == 2 and seen[0] == seen[1]


def test_the_harness_self_trains_with_its_domain_corpus_as_tenant_create_corpus(env, monkeypatch):
    hmi, args, task, ctx = harness(env)
    seen = []
    monkeypatch.setattr(manager, "tenant_create", lambda *a, **kw: seen.append(kw) or Stop.throw())
    ctx["data"]["corpora"] = {"biology": "bio.txt", "cs": "cs.txt"}
    task.name = "sciie"
    ctx["data"]["tasks"]["sciie"] = {"train": env["tag"]}
    for flag in ([], ["--self-train"]):
        args = hmi.parser().parse_args(["--out", "unused", "--model", env["model"], *flag])
        with pytest.raises(Stop):
            hmi.row_tenant(args, ctx, task, env["store"], "cs", "lora", "spy")
    assert seen[0]["levels"] == ("plot",) and "corpus_paths" not in seen[0]
    assert seen[1]["levels"] == ("plot", "full") and seen[1]["corpus_paths"] == ["cs.txt"]


def test_the_harness_trains_tenant_creates_full_depth_pet(cli, env, monkeypatch):
    seen = spy_settings(monkeypatch, "full")
    run(cli, "tenant", "create", env["store"], "spy-full", "--version", "root", "--train", env["cls"], "--max-len",
        32, "-q")
    hmi, args, task, ctx = harness(env)
    with pytest.raises(Stop):
        hmi.row_full(args, ctx, task)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0][0] == recipe.FULL_PET_TYPE and seen[0][2].lr == recipe.FULL["lora"].lr


def test_settings_apply_overrides_and_refuse_unknown_ones():
    options, cfg = recipe.settings("adapter", epochs=2, bottleneck=8, lr=None, seed=3)
    assert options == {"bottleneck": 8} and cfg.epochs == 2 and cfg.lr == recipe.PLOT["adapter"].lr and cfg.seed == 3
    with pytest.raises(ValueError, match="unknown recipe settings"):
        recipe.settings("adapter", momentum=0.9)
    assert recipe.settings("lora", "full")[1].dropout == recipe.FULL["lora"].dropout > 0  # training only
    with pytest.raises(ValueError, match="no full-level recipe"):
        recipe.settings("diff", "full")
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        recipe.settings("lora", epochs=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=20))
def test_held_score_of_classification_is_the_share_argmax_gets_right(pairs):
    from runtime.construct.calibration import held_score

    logits = [np.eye(3)[p] for p, _ in pairs]
    expected = sum(p == y for p, y in pairs) / len(pairs)
    assert held_score(logits, [y for _, y in pairs], "classification", ["a", "b", "c"]) == pytest.approx(expected)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.booleans()), min_size=1, max_size=8),
                min_size=1, max_size=5))
def test_held_score_of_tagging_is_entity_f1_over_the_scored_words(sentences):
    """Tokens whose target is IGNORE (later sub-tokens) carry no word: the reference drops them."""
    from runtime.construct.calibration import held_score
    from runtime.construct.data import IGNORE, entity_f1

    tags = ["O", "B-X", "I-X"]
    logits = [np.stack([np.eye(3)[p] for p, _, _ in s]) for s in sentences]
    targets = [[y if scored else IGNORE for _, y, scored in s] for s in sentences]
    gold = [[tags[y] for _, y, scored in s if scored] for s in sentences]
    predicted = [[tags[p] for p, _, scored in s if scored] for s in sentences]
    assert held_score(logits, targets, "tagging", tags) == pytest.approx(entity_f1(gold, predicted))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=200), st.floats(0.05, 0.85))
def test_a_run_is_stalled_when_its_loss_never_falls_and_long_enough_to_judge(losses, fall):
    from runtime.construct.train import stalled

    assert stalled(losses) == (len(losses) >= 50 and sum(losses[-(len(losses) // 10):]) >
                               0.9 * sum(losses[:len(losses) // 10]))
    if len(losses) >= 50:
        flat = [1.0] * len(losses)
        assert stalled(flat) and not stalled([1.0] * (len(losses) - len(losses) // 10) + [fall] * (len(losses) // 10))


def test_a_stalled_plot_level_run_is_trained_again_at_half_its_rate(env):
    """A learning rate of 0 never leaves the starting loss: tenant create says so and retrains."""
    out = manager.tenant_create(env["store"], "stalls", version="root", train_path=env["cls"], lr=0.0, epochs=60,
                                batch_size=len(open(env["cls"]).readlines()), max_len=32, levels=("plot",),
                                progress=False)
    assert out["stalled"]["lr"] == 0.0 and out["stalled"]["seed"] == 0
    pet, _ = records(env["store"], "stalls")
    assert pet.meta["train"]["stalled"] == out["stalled"] and pet.meta["train"]["lr"] == 0.0
    fine = manager.tenant_create(env["store"], "learns", version="root", train_path=env["cls"], epochs=60,
                                 batch_size=len(open(env["cls"]).readlines()), max_len=32, levels=("plot",),
                                 progress=False)
    assert "stalled" not in fine and "stalled" not in records(env["store"], "learns")[0].meta["train"]


def test_a_stalled_full_depth_run_is_trained_again_at_half_its_rate(env, monkeypatch):
    """The full-depth level has the PLOT level's guard: at a rate of 0 its loss never falls."""
    import dataclasses

    frozen = dict(recipe.FULL, lora=dataclasses.replace(recipe.FULL["lora"], lr=0.0))
    monkeypatch.setattr(recipe, "RECIPES", dict(recipe.RECIPES, full=frozen))
    out = manager.tenant_create(env["store"], "full-stalls", version="root", train_path=env["cls"], epochs=60,
                                batch_size=len(open(env["cls"]).readlines()), max_len=32, progress=False)
    assert out["full"]["stalled"]["lr"] == 0.0 and out["full"]["stalled"]["seed"] == 0
    assert out["full"]["stalled"]["loss_last"] > 0.9 * out["full"]["stalled"]["loss_first"]
    pet, full = records(env["store"], "full-stalls")
    assert full.meta["train"]["stalled"] == out["full"]["stalled"] and "stalled" not in pet.meta["train"]
    monkeypatch.undo()
    fine = manager.tenant_create(env["store"], "full-learns", version="root", train_path=env["cls"], epochs=60,
                                 batch_size=len(open(env["cls"]).readlines()), max_len=32, progress=False)
    assert "stalled" not in fine["full"] and "stalled" not in records(env["store"], "full-learns")[1].meta["train"]
