"""runtime.construct.grow: the windows a version misses, valued by its own lower layers and written
back, are then served exactly; nothing else changes. Over a tiny random BERT on disk."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli_model import cli  # noqa: F401 (the fixture)
from test_manager import make_data

import hkstore
from formats.backoff import key_order
from hkstore.errors import StoreError
from runtime.construct import manager
from runtime.construct.grow import grow, missed_windows
from runtime.construct.plot import compute_values
from runtime.model import stored
from runtime.model.tiny import make_tiny_model, words_of
from runtime.plot.window import corpus_windows


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grow"))
    data = make_data(root)
    data["model"] = make_tiny_model(os.path.join(root, "model"), data["texts"])
    data["store"] = os.path.join(root, "store")
    # The root holds the math lines only: the os.path lines are text no table saw.
    manager.build(data["store"], model_path=data["model"], corpus_paths=[data["domain"]], max_len=32,
                  distill_steps=2, progress=False)
    manager.domain_create(data["store"], "dom", [data["domain"]], mlm_steps=2, lr=1e-2, max_len=32, progress=False)
    with hkstore.open(data["store"]) as s, open(data["more"]) as f:
        data["unseen"] = manager.tokenize_corpus(stored.base_encoder(s), f.read().splitlines(), 32)
    return data


def _served(snapshot, version, seqs):
    meta = snapshot.meta
    wins, _ = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
    res = snapshot.lookup(version, wins)
    return wins, res


def test_grow_serves_missed_windows_exactly_with_the_versions_own_values(env):
    with hkstore.open(env["store"], writable=True) as s:
        keys, before = missed_windows(s.snapshot(), "dom", env["unseen"])
        assert before["missed"] > 0 and len(keys) == before["distinct_missed"]
        wins, old = _served(s.snapshot(), "dom", env["unseen"])
        out = grow(s, "dom", env["unseen"])
        assert out["distinct_missed"] == len(keys) and out["segment"]
        snap = s.snapshot()
        assert missed_windows(snap, "dom", env["unseen"])[1]["missed"] == 0
        _, new = _served(snap, "dom", env["unseen"])
        assert (new.order == key_order(wins, snap.meta["window"], snap.meta["pad_id"])).all()
        # A grown window holds what construction would have stored: the domain's lower layers.
        grown = np.isin(wins.view([("", wins.dtype)] * wins.shape[1]).ravel(),
                        keys.view([("", keys.dtype)] * keys.shape[1]).ravel())
        expect = compute_values(stored.version_encoder(s, "dom"), wins[grown])
        np.testing.assert_array_equal(new.values[grown], expect.astype(new.values.dtype))
        assert (new.version[grown] == snap.version_index("dom")).all()
        # Windows that were already exact are served as before; the root is untouched.
        np.testing.assert_array_equal(new.values[~grown], old.values[~grown])
        assert missed_windows(snap, "root", env["unseen"])[1]["missed"] != 0
        again = grow(s, "dom", env["unseen"])
        assert again["missed"] == 0 and again["segment"] is None
    assert hkstore.verify(env["store"])["ok"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(st.lists(st.integers(5, 60), min_size=1, max_size=9), min_size=1, max_size=4))
def test_after_grow_every_window_is_exact(env, seqs):
    with hkstore.open(env["store"], writable=True) as s:
        if "prop" not in s.snapshot().version_names:
            s.create_version("prop", "root")
        grow(s, "prop", seqs)
        wins, res = _served(s.snapshot(), "prop", seqs)
        assert (res.order == key_order(wins, s.meta["window"], s.meta["pad_id"])).all()


def test_grow_refuses_a_read_only_store_and_a_sealed_version(env):
    with hkstore.open(env["store"]) as s, pytest.raises(StoreError, match="writable"):
        grow(s, "dom", env["unseen"])
    with hkstore.open(env["store"], writable=True) as s:
        s.create_version("frozen", "root")
        s.seal("frozen")
        with pytest.raises(StoreError, match="sealed"):
            grow(s, "frozen", env["unseen"])


def test_cli_domain_grow_and_tenant_eval_on_another_version(env, cli, tmp_path):  # noqa: F811 (the fixture)
    log = tmp_path / "traffic.txt"
    # Reversed sentences: windows no version holds yet, whatever the other tests grew.
    log.write_text("\n".join(" ".join(reversed(words_of(t))) for t in env["texts"]) + "\n")
    with hkstore.open(env["store"], writable=True) as s:
        s.create_version("cached", "dom")
    r = CliRunner().invoke(cli, ["domain", "grow", env["store"], "cached", "--corpus", str(log), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["version"] == "cached" and out["distinct_missed"] > 0 and out["documents"] > 0
    r = CliRunner().invoke(cli, ["domain", "grow", env["store"], "nope", "--corpus", str(log)])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "nope" in r.output
    manager.tenant_create(env["store"], "t", version="dom", train_path=env["cls"], epochs=1, max_len=32,
                          progress=False)
    r = CliRunner().invoke(cli, ["tenant", "eval", env["store"], "t", "--test", env["cls"], "--version", "cached",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["version"] == "cached"
    r = CliRunner().invoke(cli, ["tenant", "eval", env["store"], "t", "--test", env["cls"], "--version", "nope"])
    assert r.exit_code == 1 and "nope" in r.output
