"""End to end over a tiny random BERT written to disk: build, domains, tenants, errors.

The corpus and tasks are first lines of stdlib docstrings (text every Python has); the model
is a 6-layer d=32 BERT over a vocabulary made from that text, so every step takes
milliseconds. Nothing here checks accuracy: benchmarks/hmi_accuracy.py does, on real data.
"""

import json
import os

import numpy as np
import pytest
import torch

import hkstore
from runtime.construct import manager, recipe
from runtime.model import stored
from runtime.model.pet import PET_TYPES
from runtime.demo.stdlib_text import first_lines as docstring_lines
from runtime.model.tiny import make_tiny_model, words_of

# -- shared fixtures' builders (other test modules import them) --------------------------------


def make_data(root):
    """Corpus + classification (math vs os.path docstrings) + tagging (tag 'return' words)."""
    import os.path as osp

    math_lines, path_lines = docstring_lines("math")[:16], docstring_lines(osp)[:16]
    corpus = os.path.join(root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(math_lines + path_lines) + "\n")
    domain = os.path.join(root, "domain.txt")
    with open(domain, "w") as f:
        f.write("\n".join(math_lines * 2) + "\n")
    more = os.path.join(root, "more.txt")
    with open(more, "w") as f:
        f.write("\n".join(path_lines) + "\n")
    cls = os.path.join(root, "cls.jsonl")
    with open(cls, "w") as f:
        for line in math_lines:
            f.write(json.dumps({"text": line, "label": "math"}) + "\n")
        for line in path_lines:
            f.write(json.dumps({"text": line, "label": "path"}) + "\n")
    tag = os.path.join(root, "tag.conll")
    with open(tag, "w") as f:
        for line in math_lines + path_lines:
            for w in words_of(line):
                f.write(f"{w}\tNN\tO\t{'B-RET' if w.startswith('return') else 'O'}\n")
            f.write("\n")
    return {"corpus": corpus, "domain": domain, "more": more, "cls": cls, "tag": tag,
            "texts": math_lines + path_lines}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mgr"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    out = manager.build(data["store"], model_path=data["model"], corpus_paths=[data["corpus"]], max_len=32,
                        distill_steps=3, chunk=200, progress=False)
    data["build"] = out
    return data


# -- build ------------------------------------------------------------------------------------


def test_build_makes_a_verified_root_with_distilled_weights(env):
    out = env["build"]
    assert out["keys"] > out["distinct_windows"] > 0 and out["chunks"] > 1
    assert hkstore.verify(env["store"])["ok"]
    with hkstore.open(env["store"]) as st:
        meta, info = st.meta, st.snapshot().versions[0]["info"]
        assert meta["model_path"] == os.path.abspath(env["model"]) and meta["base_model"] == "tiny-bert"
        assert info["lower_weights"]["file"] == "models/root.safetensors" and info["distill"]["steps"] == 3
        assert os.path.isfile(os.path.join(env["store"], "models", "root.safetensors"))
        assert info["build"]["complete"]
        # The root's position table: fitted at build, to the base model's full-context outputs.
        table = st.snapshot().position("root")
        assert table.shape == (st.snapshot().versions[0]["position"]["rows"], meta["d"]) and table.any()
        assert info["position"]["cosine_after"] > info["position"]["cosine_before"]
        # The root's values come from the distilled lower layers, not the base model's.
        enc = stored.version_encoder(st, "root")
        base = stored.base_encoder(st)
        assert not torch.equal(enc.layers[0].q.weight, base.layers[0].q.weight)
        assert torch.equal(enc.layers[4].q.weight, base.layers[4].q.weight)
    # A rerun finds the build complete and computes nothing.
    again = manager.build(env["store"], model_path=env["model"], corpus_paths=[env["corpus"]], max_len=32,
                          distill_steps=3, chunk=200, progress=False)
    assert again["resumed"] and again["keys_computed"] == 0 and again["chunks_skipped"] == again["chunks"]
    with hkstore.open(env["store"]) as st:  # and fits no new table
        np.testing.assert_array_equal(st.snapshot().position("root"), table)


# -- domains ----------------------------------------------------------------------------------


def test_domain_create_and_update(env):
    out = manager.domain_create(env["store"], "mathdom", [env["domain"]], alpha=50, mlm_steps=3, max_len=32,
                                lr=1e-3, progress=False)
    assert 0 < out["ngrams_kept"] < out["ngrams_seen"] and out["alpha"] == 50
    assert os.path.isfile(os.path.join(env["store"], "models", "mathdom.safetensors"))
    with hkstore.open(env["store"]) as st:
        snap = st.snapshot()
        v = snap.versions[snap.version_index("mathdom")]
        assert v["parent"] == "root" and v["info"]["mlm"]["steps"] == 3
        dom = stored.version_encoder(st, "mathdom")
        root = stored.version_encoder(st, "root")
        assert not torch.equal(dom.word.weight, root.word.weight)
        assert torch.equal(dom.layers[3].q.weight, root.layers[3].q.weight)
        # Each domain version fits its own table (through its own lookups), not the root's.
        assert v["position"]["file"] != snap.versions[0]["position"]["file"]
        assert not np.array_equal(snap.position("mathdom"), snap.position("root"))
    up = manager.domain_update(env["store"], "mathdom", "mathdom-2", [env["more"]], mlm_steps=2, lr=1e-3,
                               progress=False)
    assert up["parent"] == "root" and up["alpha"] == 50 and up["ngrams_seen"] > out["ngrams_seen"]
    with hkstore.open(env["store"]) as st:
        v2 = stored.version_encoder(st, "mathdom-2")
        v1 = stored.version_encoder(st, "mathdom")
        assert not torch.equal(v1.word.weight, v2.word.weight)
    assert hkstore.verify(env["store"])["ok"]


def _distance(a, b):
    return sum(float((p - q).norm()) for p, q in zip(stored.lower_state(a).values(), stored.lower_state(b).values()))


def test_distilled_domain_keeps_teacher_and_student(env):
    from runtime.construct.plot import corpus_windows
    from runtime.plot.window import window_values

    out = manager.domain_create(env["store"], "mathdist", [env["domain"]], mlm_steps=3, lr=1e-3, distill_steps=4,
                                distill_lr=1e-3, max_len=32, progress=False)
    assert out["distill"]["steps"] == 4 and out["mlm"]["steps"] == 3
    with hkstore.open(env["store"]) as st:
        snap = st.snapshot()
        info = snap.versions[snap.version_index("mathdist")]["info"]
        assert info["context_weights"]["file"] == "models/mathdist.context.safetensors"
        assert stored.is_distilled(st, "mathdist") and stored.is_distilled(st, "root")
        base, root = stored.base_encoder(st), stored.version_encoder(st, "root")
        teacher, student = stored.context_encoder(st, "mathdist"), stored.version_encoder(st, "mathdist")
        # The teacher is the base model (the distilled root's context) after MLM; the student
        # starts from the root's window-distilled layers, not from the teacher.
        assert 0 < _distance(teacher, base) and 0 < _distance(student, root)
        assert _distance(student, root) < _distance(student, teacher)
        # The branch's own values are the student's windows.
        wins, _ = corpus_windows(base.tokenize([open(env["domain"]).readline()], 32), 3, "centered", 0)
        hit = snap.lookup("mathdist", wins)
        own = hit.version == snap.version_index("mathdist")
        assert own.any()
        with torch.no_grad():
            expected = window_values(student, wins[own]).numpy()
            teachers = window_values(teacher, wins[own]).numpy()
        np.testing.assert_allclose(hit.values[own].astype(np.float32), expected, atol=1e-2)
        assert not np.allclose(hit.values[own].astype(np.float32), teachers, atol=1e-2)
    # An update continues from the teacher (mlm_steps=0: the same full-context layers) and
    # distills again by default.
    up = manager.domain_update(env["store"], "mathdist", "mathdist-2", [env["more"]], mlm_steps=0, distill_lr=1e-3,
                               progress=False)
    assert up["distill"]["steps"] == 4
    with hkstore.open(env["store"]) as st:
        assert _distance(stored.context_encoder(st, "mathdist-2"), teacher) == 0
        assert _distance(stored.version_encoder(st, "mathdist-2"), student) > 0
    assert hkstore.verify(env["store"])["ok"]


def test_domain_errors(env):
    with pytest.raises(hkstore.UnknownVersion, match="nope"):
        manager.domain_create(env["store"], "x1", [env["domain"]], parent="nope", mlm_steps=0, progress=False)
    with pytest.raises(ValueError, match="no such file"):
        manager.domain_create(env["store"], "x2", ["/nonexistent/corpus.txt"], mlm_steps=0, progress=False)
    with pytest.raises(ValueError, match="alpha"):
        manager.domain_create(env["store"], "x3", [env["domain"]], alpha=150, mlm_steps=0, progress=False)
    with pytest.raises(hkstore.StoreError, match="root"):
        manager.domain_update(env["store"], "root", "x4", [env["domain"]], mlm_steps=0, progress=False)
    empty = os.path.join(os.path.dirname(env["corpus"]), "empty.txt")
    open(empty, "w").close()
    with pytest.raises(ValueError, match="empty corpus"):
        manager.domain_create(env["store"], "x5", [empty], mlm_steps=0, progress=False)
    with hkstore.open(env["store"]) as st:
        assert not {"x1", "x2", "x3", "x4", "x5"} & set(st.snapshot().version_names)


# -- tenants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pet_type", ["adapter", "lora"])
def test_tenant_create_classification(env, pet_type):
    tenant = f"cls-{pet_type}"
    out = manager.tenant_create(env["store"], tenant, version="root", train_path=env["cls"], pet_type=pet_type,
                                epochs=4, max_len=32, lr=1e-2, batch_size=8, progress=False)
    assert out["labels"] == ["math", "path"] and out["loss_last"] < out["loss_first"]
    with hkstore.open(env["store"]) as st:
        rec = st.get_pet(tenant)
        for key in ("tenant", "base_model", "version", "pet_type", "task", "labels", "layers", "created"):
            assert key in rec.meta
        assert rec.meta["layers"] == [3, 4, 5] and rec.meta["pet_type"] == pet_type
        assert rec.meta["base_model"] == "tiny-bert" and rec.meta["version"] == "root"
        assert "head.weight" in rec.tensors
        assert (pet_type == "adapter") == ("layers.3.adapter.o.down.weight" in rec.tensors)
        # Adapters tune both LayerNorms (Houlsby); the deltas were trained, not left at zero.
        assert rec.meta.get("norms", []) == (["ln_attn", "ln_ffn"] if pet_type == "adapter" else [])
        if pet_type == "adapter":
            assert np.abs(rec.tensors["layers.5.norm.ln_ffn.weight"]).max() > 0
    score = manager.tenant_eval(env["store"], tenant, env["cls"])
    assert score["metric"] == "accuracy" and 0 <= score["score"] <= 1


def ensure_domains(env):
    """test_domain_create_and_update's versions, when this test runs alone."""
    with hkstore.open(env["store"]) as st:
        names = st.snapshot().version_names
    if "mathdom" not in names:
        manager.domain_create(env["store"], "mathdom", [env["domain"]], mlm_steps=1, max_len=32, progress=False)
    if "mathdom-2" not in names:
        manager.domain_update(env["store"], "mathdom", "mathdom-2", [env["more"]], mlm_steps=1, progress=False)


def test_tenant_tagging_update_and_rm(env):
    ensure_domains(env)
    out = manager.tenant_create(env["store"], "tagger", version="mathdom", train_path=env["tag"], task="tagging",
                                pet_type="bitfit", epochs=2, max_len=32, lr=1e-2, progress=False)
    assert out["labels"] == ["B-RET", "O"] and out["task"] == "tagging"
    score = manager.tenant_eval(env["store"], "tagger", env["tag"])
    assert score["metric"] == "entity_f1"
    with hkstore.open(env["store"]) as st:
        before = st.get_pet("tagger")
    up = manager.tenant_update(env["store"], "tagger", epochs=1, progress=False)
    with hkstore.open(env["store"]) as st:
        after = st.get_pet("tagger")
    assert up["version"] == "mathdom" and after.meta["train"]["updates"] == 1
    assert after.meta["created"] >= before.meta["created"]
    assert not np.array_equal(after.tensors["head.weight"], before.tensors["head.weight"])
    # Moving the tenant to the updated domain version.
    up = manager.tenant_update(env["store"], "tagger", version="mathdom-2", epochs=1, progress=False)
    assert up["version"] == "mathdom-2"
    # Labels that do not match the head.
    with pytest.raises(hkstore.StoreError, match="do not match"):
        manager.tenant_update(env["store"], "tagger", train_path=env["cls"], progress=False)
    manager.tenant_rm(env["store"], "tagger")
    with hkstore.open(env["store"]) as st:
        assert "tagger" not in st.pets()
    with pytest.raises(hkstore.UnknownTenant):
        manager.tenant_rm(env["store"], "tagger")
    with pytest.raises(hkstore.UnknownTenant):
        manager.tenant_update(env["store"], "tagger", progress=False)


def test_tenants_create_trains_several_in_one_pass(env):
    specs = [dict(tenant="pass-a", version="root", train_path=env["cls"], pet_type="lora", epochs=1, max_len=32),
             dict(tenant="pass-b", version="root", train_path=env["tag"], task="tagging", pet_type="bitfit",
                  epochs=1, max_len=32)]
    outs = manager.tenants_create(env["store"], specs, progress=False)
    assert [o["tenant"] for o in outs] == ["pass-a", "pass-b"] and outs[1]["task"] == "tagging"
    with hkstore.open(env["store"]) as st:
        snap = st.snapshot()
        # pet_bytes is the record's size in the pack, the figure `hkstore pack ls` shows.
        assert [o["pet_bytes"] for o in outs] == [snap.pets["pass-a"]["length"], snap.pets["pass-b"]["length"]]
    # All or nothing: a tenant that exists fails the pass before anything is stored.
    with pytest.raises(hkstore.StoreError, match="already exists"):
        manager.tenants_create(env["store"], [dict(specs[0], tenant="pass-c"), specs[1]], progress=False)
    with hkstore.open(env["store"]) as st:
        assert "pass-c" not in st.pets()
    for t in ("pass-a", "pass-b"):
        manager.tenant_rm(env["store"], t)


def test_diff_pet_survives_update(env):
    manager.tenant_create(env["store"], "differ", version="root", train_path=env["cls"], pet_type="diff", epochs=1,
                          max_len=32, progress=False, density=0.05)
    up = manager.tenant_update(env["store"], "differ", epochs=1, progress=False)
    with hkstore.open(env["store"]) as st:
        rec = st.get_pet("differ")
    assert up["pet_type"] == "diff" and rec.tensors["layers.3.diff.q.index"].dtype == np.int32


def test_tenant_errors(env):
    with pytest.raises(hkstore.UnknownVersion):
        manager.tenant_create(env["store"], "t-x", version="nope", train_path=env["cls"], progress=False)
    with pytest.raises(ValueError, match="no such file"):
        manager.tenant_create(env["store"], "t-x", version="root", train_path="/nonexistent.jsonl", progress=False)
    with pytest.raises(ValueError, match="expected a JSON object"):
        manager.tenant_create(env["store"], "t-x", version="root", train_path=env["corpus"], progress=False)
    with pytest.raises(ValueError, match="unknown PET type"):
        manager.tenant_create(env["store"], "t-x", version="root", train_path=env["cls"], pet_type="prefix",
                              progress=False)
    with pytest.raises(hkstore.StoreError, match="invalid tenant name"):
        manager.tenant_create(env["store"], "bad name", version="root", train_path=env["cls"], progress=False)
    manager.tenant_create(env["store"], "dup", version="root", train_path=env["cls"], pet_type="head", epochs=1,
                          max_len=32, progress=False)
    with pytest.raises(hkstore.StoreError, match="already exists"):
        manager.tenant_create(env["store"], "dup", version="root", train_path=env["cls"], progress=False)
    with pytest.raises(hkstore.StoreError, match="no such store"):
        manager.tenant_create("/nonexistent/store", "t-x", version="root", train_path=env["cls"], progress=False)
    for kind in PET_TYPES:
        assert kind in recipe.PLOT


def test_build_errors(tmp_path, env):
    with pytest.raises(hkstore.StoreError, match="config.json"):
        manager.build(str(tmp_path / "s1"), model_path=str(tmp_path), corpus_paths=[env["corpus"]], progress=False)
    with pytest.raises(ValueError, match="no such file"):
        manager.build(str(tmp_path / "s2"), model_path=env["model"], corpus_paths=[str(tmp_path / "none.txt")],
                      progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        manager.build(str(tmp_path / "s3"), model_path=env["model"], corpus_paths=[str(bad)], progress=False)
    with pytest.raises(hkstore.StoreError, match="other settings"):
        manager.build(env["store"], model_path=env["model"], corpus_paths=[env["corpus"]], n=5, progress=False)
    assert not os.path.exists(tmp_path / "s2" / "CURRENT")


def test_pet_sweep_scores_each_grid_point(env):
    from experiments.pet_sweep import main, sweep

    rows = sweep(env["store"], "root", env["cls"], env["cls"], "classification", targets=[("o",), None],
                 epochs=[1, 3], lrs=[1e-2], max_len=32)
    assert [(r["targets"], r["epochs"]) for r in rows] == [
        (["o"], 1), (["o"], 3), (["o", "ffn_out"], 1), (["o", "ffn_out"], 3)]
    assert all(0 <= r["score"] <= 1 for r in rows)
    # more epochs fit the training set better (same seed, same inputs)
    assert rows[1]["loss_last"] < rows[0]["loss_last"] and rows[3]["loss_last"] < rows[2]["loss_last"]
    by_seed = sweep(env["store"], "root", env["cls"], env["cls"], "classification", epochs=[1], lrs=[1e-2],
                    max_len=32, seeds=[0, 1])
    assert [r["seed"] for r in by_seed] == [0, 1] and by_seed[0]["loss_last"] != by_seed[1]["loss_last"]
    assert by_seed[0]["loss_last"] == rows[2]["loss_last"]  # seed 0 is the default: the same run
    wide = sweep(env["store"], "root", env["cls"], env["cls"], "classification", epochs=[1], lrs=[1e-2],
                 max_len=32, bottlenecks=[4, 64])
    assert [r["bottleneck"] for r in wide] == [4, 64] and wide[1]["loss_last"] == rows[2]["loss_last"]
    assert main(["--store", env["store"], "--train", "/no/such.jsonl", "--test", env["cls"],
                 "--task", "classification"]) == 1
