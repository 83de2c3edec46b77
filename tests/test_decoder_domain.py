"""hkstore domain create / update on a decoder store (runtime.construct.decoder_domain): causal
windows of the domain corpus valued by the further pre-trained lower layers, the alpha rule,
fallback to the parent, the position table, the served perplexity of the domain text, and
one-line errors for what decoder stores do not support."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_cli_model import cli  # noqa: F401 - the hkstore construction commands as one click group
from test_decoder_tenant import _one_thread  # noqa: F401 - tiny models: one torch thread

import hkstore
from runtime.construct import manager
from runtime.construct.decoder_domain import train_lower_lm
from runtime.construct.decoder_store import build_decoder, tokenize_decoder_corpus
from runtime.construct.decoder_tenant import _ppl, lm_tenant_create
from runtime.construct.plot import ngram_counts
from runtime.model import stored
from runtime.model.tiny_decoder import make_tiny_decoder
from runtime.plot.causal import causal_values
from runtime.plot.retrieve import retrieve_list

GENERAL = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]
DOMAIN = ["storage engines keep tables of vectors , versions and packs .",
          "the engine keeps packs of vectors and tables of versions .",
          "tables keep vectors ; packs keep versions ."] * 3
MORE = ["versions of tables keep packs of engines ."] * 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddom")
    model = make_tiny_decoder(tmp / "m", GENERAL + DOMAIN + MORE, d=32, layers=4, max_len=48, scale=1.0)
    for name, lines in (("general", GENERAL), ("domain", DOMAIN), ("more", MORE)):
        (tmp / f"{name}.txt").write_text("\n".join(lines))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "general.txt"], n=3, lower_layers=2,
                  progress=False)
    return tmp


def _served_ppl(store_path, version, lines):
    with hkstore.open(store_path) as st:
        dec = stored.base_decoder(st)
        seqs = [s for s in tokenize_decoder_corpus(dec, lines, 48) if len(s) > 1]
        with torch.no_grad():
            return _ppl(dec, None, retrieve_list(st.snapshot(), version, seqs), seqs)


def test_domain_create_on_a_decoder_store(cli, env):  # noqa: F811
    s = str(env / "s")
    r = CliRunner().invoke(cli, ["domain", "create", s, "bio", "--corpus", str(env / "domain.txt"), "--mlm-steps",
                                 "30", "--lr", "1e-2", "--alpha", "60", "--max-len", "48", "--batch-size", "4",
                                 "--json", "-q"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["architecture"] == "decoder" and out["parent"] == "root" and out["alpha"] == 60
    with hkstore.open(s) as st:
        snap = st.snapshot()
        v = snap.versions[snap.version_index("bio")]
        assert v["info"]["mlm"]["loss"] == "causal lm" and v["info"]["mlm"]["loss_last"] < v["info"]["mlm"]["loss_first"]
        base = stored.base_decoder(st)
        teacher = stored.version_encoder(st, "bio", base)
        assert not torch.equal(teacher.layers[0].q.weight, base.layers[0].q.weight)
        assert torch.equal(teacher.layers[3].q.weight, base.layers[3].q.weight)  # the upper layers stay
        assert not np.array_equal(snap.position("bio"), snap.position("root"))

        # The alpha rule over the corpus's causal windows: the branch holds exactly the most
        # frequent ones, the smallest set covering 60% of the occurrences.
        seqs = tokenize_decoder_corpus(base, DOMAIN, 48)
        keys, counts = ngram_counts(seqs, 3, "causal", st.meta["pad_id"])
        got = st.lookup("bio", keys)
        real = (keys != st.meta["pad_id"]).sum(1)
        own = (np.asarray(got.version) == snap.version_index("bio")) & (np.asarray(got.order) == real)
        assert own.any() and not own.all()
        assert counts[own].min() >= counts[~own].max()
        total = counts.sum()
        assert counts[own].sum() >= 0.6 * total > counts[own].sum() - counts[own].min()
        # Valued by the further pre-trained lower layers, each key on its real tokens alone.
        with torch.no_grad():
            want = causal_values(teacher, keys[own]).numpy()[:, -1:]  # a decoder store keeps the last slot
        assert got.values.shape[1:] == (1, st.meta["d"])
        assert np.abs(got.values[own].astype(np.float32) - want).max() < 2e-2
        # A window the branch lacks is served by the root, as the root serves it.
        general = np.array([k for k in ngram_counts(tokenize_decoder_corpus(base, GENERAL, 48), 3, "causal",
                                                    st.meta["pad_id"])[0]
                            if st.lookup("bio", k[None]).version[0] == 0], dtype=np.uint32)
        assert len(general)
        np.testing.assert_array_equal(st.lookup("bio", general).values, st.lookup("root", general).values)
    # Domain knowledge: the domain text is likelier through the branch than through the root.
    assert _served_ppl(s, "bio", DOMAIN) < _served_ppl(s, "root", DOMAIN)
    # A decoder tenant trains on the domain version.
    t = lm_tenant_create(s, "bio-t", train_path=env / "domain.txt", version="bio", epochs=2, batch_size=4, lr=1e-2,
                         progress=False)
    assert t["version"] == "bio" and t["train_ppl_after"] < t["train_ppl_before"]
    assert hkstore.verify(s)["ok"]


def test_domain_update_and_a_distilled_domain(cli, env):  # noqa: F811
    s = str(env / "s")
    with hkstore.open(s) as st:
        have = "bio" in st.snapshot().version_names
    if not have:  # (run alone)
        manager.domain_create(s, "bio", [env / "domain.txt"], alpha=60, mlm_steps=5, lr=1e-2, max_len=48,
                              progress=False)
    r = CliRunner().invoke(cli, ["domain", "update", s, "bio", "bio-2", "--corpus", str(env / "more.txt"),
                                 "--mlm-steps", "5", "--lr", "1e-2", "--batch-size", "4", "--json", "-q"])
    assert r.exit_code == 0, r.output
    up = json.loads(r.output)
    assert up["parent"] == "root" and up["from"] == "bio" and up["alpha"] == 60
    with hkstore.open(s) as st:
        snap = st.snapshot()
        info = snap.versions[snap.version_index("bio-2")]["info"]
        assert info["updates"] == "bio" and len(info["corpus"]) == 2  # the old corpus counted too
        base = stored.base_decoder(st)
        v1, v2 = stored.version_encoder(st, "bio", base), stored.version_encoder(st, "bio-2", base)
        assert not torch.equal(v1.layers[0].q.weight, v2.layers[0].q.weight)  # trained on from bio's
    out = manager.domain_create(s, "bio-d", [env / "domain.txt"], mlm_steps=3, lr=1e-2, distill_steps=3,
                                distill_lr=1e-3, max_len=48, batch_size=4, progress=False)
    with hkstore.open(s) as st:
        info = st.snapshot().versions[st.snapshot().version_index("bio-d")]["info"]
        assert out["distill"]["steps"] == 3 and info["context_weights"] and info["lower_weights"]
        assert stored.is_distilled(st, "bio-d")


def test_causal_lm_training_leaves_the_upper_layers_and_head(env):
    with hkstore.open(env / "s") as st:
        base = stored.base_decoder(st)
    seqs = tokenize_decoder_corpus(base, DOMAIN, 48)
    upper = [p.clone() for p in base.upper_parameters()] + [base.word.weight.clone()]
    from runtime.construct.train import TrainConfig

    student, log = train_lower_lm(base, base, seqs, TrainConfig(lr=1e-2, max_steps=10, epochs=10, batch_size=4,
                                                                progress=False))
    assert log[-1] < log[0]
    assert all(torch.equal(a, b) for a, b in zip(upper, [*base.upper_parameters(), base.word.weight]))
    assert not torch.equal(student.word.weight, base.word.weight)


def test_domain_grow_on_a_decoder_store_serves_the_corpus_windows_exactly(cli, env):  # noqa: F811
    s = str(env / "s")
    # Under a domain with lower layers of its own: grown windows must be valued by those.
    from runtime.construct.decoder_domain import decoder_domain_create

    decoder_domain_create(s, "g-dom", [env / "domain.txt"], lm_steps=5, lr=1e-2, max_len=48, batch_size=4,
                          progress=False)
    with hkstore.open(s, writable=True) as st:
        st.create_version("grown", "g-dom")
        dec = stored.base_decoder(st)
        seqs = tokenize_decoder_corpus(dec, MORE, 48)
    from runtime.plot.window import corpus_windows

    wins, _ = corpus_windows(seqs, 3, "causal", dec.config.pad_id)
    real = (wins != dec.config.pad_id).sum(1)
    with hkstore.open(s) as st:
        before = np.asarray(st.lookup("grown", wins).order)
    assert (before < real).any()  # MORE is in no corpus: some of its windows back off
    r = CliRunner().invoke(cli, ["domain", "grow", s, "grown", "--corpus", str(env / "more.txt"), "--max-len", "48",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["distinct_missed"] > 0
    with hkstore.open(s) as st:
        got = st.lookup("grown", wins)
        assert (np.asarray(got.order) == real).all()
        # Each grown value is what the decoder store's construction stores for that key.
        grown = np.asarray(got.version) == st.snapshot().version_index("grown")
        own = stored.version_encoder(st, "grown", stored.base_decoder(st))
        assert not torch.equal(own.word.weight, dec.word.weight)
        want = causal_values(own, wins[grown]).numpy()[:, -1:]  # the last slot, all a decoder store keeps
        np.testing.assert_allclose(np.asarray(got.values[grown], dtype=np.float32), want, atol=2e-3, rtol=2e-3)
        assert np.asarray(st.lookup("g-dom", wins).order).tolist() == before.tolist()  # the parent is untouched


def test_what_decoder_stores_do_not_support_is_one_line(cli, env):  # noqa: F811
    s = str(env / "s")
    r = CliRunner().invoke(cli, ["domain", "update", s, "root", "x", "--corpus", str(env / "more.txt"), "-q"])
    assert r.exit_code != 0 and "is the root" in r.output
    r = CliRunner().invoke(cli, ["domain", "create", s, "y", "--corpus", str(env / "more.txt"), "--parent", "nope",
                                 "-q"])
    assert r.exit_code != 0 and "nope" in r.output
