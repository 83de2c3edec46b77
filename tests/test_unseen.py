"""runtime.plot.unseen: training inputs as a version serves text it has never seen. Each
window moves down its own FORMAT.md §4 backoff chain, one step with probability `rate` at a
time; retrieve then serves what the store holds for the shorter key."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_model import cli  # noqa: F401 (the fixture)
from test_grow import env  # noqa: F401 (the fixture: a tiny store with a domain and unseen text)

import hkstore
from formats.backoff import backoff, key_order
from runtime.construct import manager, recipe
from runtime.plot.retrieve import retrieve
from runtime.plot.unseen import unseen_windows
from runtime.plot.window import corpus_windows

PAD = 0


def chain(row, kind):
    """Every key on row's backoff chain, row first (the reference: FORMAT.md §4 one step at a time)."""
    out = [tuple(row)]
    while key_order(np.array([out[-1]]), kind, PAD)[0] > 1:
        out.append(tuple(backoff(np.array([out[-1]]), kind, PAD)[0]))
    return out


seqs_st = st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(seqs=seqs_st, n=st.sampled_from([2, 3, 5]), kind=st.sampled_from(["centered", "causal"]),
       rate=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_every_window_lands_on_its_own_chain(seqs, n, kind, rate, seed):
    wins, _ = corpus_windows(seqs, n, kind, PAD)
    out = unseen_windows(wins, rate, np.random.default_rng(seed), kind, PAD)
    assert out.shape == wins.shape and out.dtype == np.uint32
    for a, b in zip(wins, out):
        assert tuple(b) in chain(a, kind)
    if rate == 0:
        np.testing.assert_array_equal(out, wins)
    if rate == 1:
        assert (key_order(out, kind, PAD) == 1).all()


def test_the_rate_sets_how_far_windows_fall():
    rng = np.random.default_rng(0)
    wins = rng.integers(1, 1000, size=(20000, 3)).astype(np.uint32)  # all tri-grams
    for rate in (0.25, 0.5, 0.75):
        order = key_order(unseen_windows(wins, rate, np.random.default_rng(1), "centered", PAD), "centered", PAD)
        share = np.bincount(order, minlength=4)[1:] / len(order)
        np.testing.assert_allclose(share, [rate * rate, rate * (1 - rate), 1 - rate], atol=0.02)
    with pytest.raises(ValueError, match="not in"):
        unseen_windows(wins, 1.5, rng, "centered", PAD)


def test_retrieve_serves_the_shortened_keys(env):  # noqa: F811
    with hkstore.open(env["store"]) as s:
        snap = s.snapshot()
        seqs = env["unseen"][:8]
        _, _, exact = retrieve(snap, "dom", seqs)
        x1, mask, uni = retrieve(snap, "dom", seqs, unseen=1.0)
        real = mask.numpy()
        assert (uni.order[real] == 1).all() and (exact.order[real] > 1).any()
        # the same as serving the uni-gram keys directly
        wins, _ = corpus_windows(seqs, snap.meta["n"], snap.meta["window"], snap.meta["pad_id"])
        res = snap.lookup("dom", unseen_windows(wins, 1.0, np.random.default_rng(), snap.meta["window"],
                                                snap.meta["pad_id"]))
        np.testing.assert_array_equal(uni.version[real], res.version)
        a, _, _ = retrieve(snap, "dom", seqs, unseen=0.5, rng=np.random.default_rng(3))
        b, _, _ = retrieve(snap, "dom", seqs, unseen=0.5, rng=np.random.default_rng(3))
        assert (a == b).all() and not (a == x1).all()


def test_tenant_create_unseen_trains_and_is_recorded(env, cli, tmp_path):  # noqa: F811
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(env["store"], store)
    out = manager.tenant_create(store, "u", version="dom", train_path=env["cls"], epochs=2, unseen=0.5,
                                max_len=32, progress=False)
    assert out["steps"] > 0
    with hkstore.open(store) as s:
        assert s.get_pet("u").meta["train"]["unseen"] == 0.5
    runner = CliRunner()
    r = runner.invoke(cli, ["tenant", "create", store, "v", "--version", "dom", "--train", env["cls"], "--epochs", "1",
                            "--unseen", "0.3", "--max-len", "32", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tenant"] == "v"
    for pet_type in ("lora", "adapter"):  # no --unseen: the PET type's recipe
        r = runner.invoke(cli, ["tenant", "create", store, f"d-{pet_type}", "--version", "dom", "--train", env["cls"],
                                "--pet", pet_type, "--epochs", "1", "--levels", "plot", "--max-len", "32", "--quiet"])
        assert r.exit_code == 0, r.output
        with hkstore.open(store) as s:
            assert s.get_pet(f"d-{pet_type}").meta["train"]["unseen"] == recipe.recipe(pet_type).unseen
    assert recipe.recipe("lora").unseen != recipe.recipe("adapter").unseen
    bad = runner.invoke(cli, ["tenant", "create", store, "w", "--version", "dom", "--train", env["cls"],
                              "--unseen", "2"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    with hkstore.open(store) as s:
        assert "w" not in s.snapshot().pets
    # Every upper-layer weight as the PET (issue 21's hplm-full row): --pet diff --density 1.
    r = runner.invoke(cli, ["tenant", "create", store, "full", "--version", "dom", "--train", env["cls"], "--epochs",
                            "1", "--pet", "diff", "--density", "1", "--max-len", "32", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    with hkstore.open(store) as s:
        record = s.get_pet("full")
        assert record.meta["density"] == 1.0
        d = s.meta["d"]
        square = [v for k, v in record.tensors.items() if k.split(".")[-2] in "qkvo" and k.endswith(".index")]
        assert square and all(len(np.unique(ix)) == d * d for ix in square)  # every weight of each d x d target
