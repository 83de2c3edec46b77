"""End to end: a tiny store built with runtime.construct.manager, served through runtime.infer.

The model is a random 4-layer BERT (d = 32, 2 lower layers) written as a Hugging Face
directory whose vocabulary is the words of a few dozen standard-library docstrings, so that
build, a domain branch and five tenants (adapter, LoRA, BitFit, diff, mask; classification
and tagging; root and domain versions) take seconds. Checked: a mixed-tenant batch equals
one request at a time and the per-request reference, the errors, and concurrent callers.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import pathlib
import re
import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

import hkstore
import runtime
from formats.pack import PetRecord
from runtime.construct import manager
from runtime.model import pet as petlib
from runtime.plot.retrieve import retrieve

MODULES = ("json", "os.path", "textwrap", "string")


def docstring_sentences(modules=MODULES, per_module=12):
    """(first docstring sentence, module) of public callables of a few stdlib modules."""
    import importlib

    out = []
    for name in modules:
        mod = importlib.import_module(name)
        found = 0
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            first = " ".join(doc.strip().split("\n\n")[0].split())
            if 15 < len(first) < 160:
                out.append((first, name))
                found += 1
            if found == per_module:
                break
    return out


def tiny_model(path, texts, d=32, heads=4, ffn=64, layers=4, seed=0):
    """A random BERT checkpoint in Hugging Face layout over the texts' words (plus single
    characters, so any text tokenizes without [UNK])."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for t in texts for w in re.findall(r"[a-z0-9]+|[^\sa-z0-9]", t.lower())})
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(chars + words + ["##" + c for c in chars])]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    config = {"_name_or_path": "tiny-bert", "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": ffn, "vocab_size": len(vocab), "max_position_embeddings": 64, "pad_token_id": 0,
              "layer_norm_eps": 1e-12, "hidden_act": "gelu"}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    w = {"embeddings.word_embeddings.weight": torch.randn(len(vocab), d, generator=g),
         "embeddings.position_embeddings.weight": torch.randn(64, d, generator=g),
         "embeddings.token_type_embeddings.weight": torch.randn(2, d, generator=g),
         "embeddings.LayerNorm.weight": torch.ones(d), "embeddings.LayerNorm.bias": torch.zeros(d)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name, shape in [("attention.self.query", (d, d)), ("attention.self.key", (d, d)),
                            ("attention.self.value", (d, d)), ("attention.output.dense", (d, d)),
                            ("intermediate.dense", (ffn, d)), ("output.dense", (d, ffn))]:
            w[p + name + ".weight"] = torch.randn(shape, generator=g) / shape[1] ** 0.5
            w[p + name + ".bias"] = torch.randn(shape[0], generator=g) * 0.1
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + name + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
            w[p + name + ".bias"] = 0.1 * torch.randn(d, generator=g)
    save_file(w, str(path / "model.safetensors"))
    return path


def build_tiny_store(root):
    """A store with root + domain "strings" and tenants of every PET type; returns (path, info)."""
    data = docstring_sentences()
    texts = [t for t, _ in data]
    model = tiny_model(root / "model", texts)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    domain = root / "domain.txt"
    domain.write_text("\n".join(t for t, m in data if m in ("textwrap", "string")) + "\n")
    cls = root / "cls.jsonl"
    cls.write_text("".join(json.dumps({"text": t, "label": m}) + "\n" for t, m in data))
    conll = root / "tags.conll"
    keywords = {"return", "returns", "string", "file", "path", "text"}
    lines = []
    for t in texts:
        for word in re.findall(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]", t):
            lines.append(f"{word}\t{'B-KW' if word.lower() in keywords else 'O'}")
        lines.append("")
    conll.write_text("\n".join(lines) + "\n")
    store = root / "store"
    manager.build(store, model_path=model, corpus_paths=[corpus], lower_layers=2, progress=False)
    manager.domain_create(store, "strings", [domain], alpha=60, mlm_steps=2, batch_size=8, progress=False)
    tenants = {  # tenant -> (version, task, pet type)
        "adapter-cls": ("root", "classification", "adapter"),
        "lora-cls": ("strings", "classification", "lora"),
        "bitfit-tag": ("root", "tagging", "bitfit"),
        "diff-cls": ("strings", "classification", "diff"),
        "mask-tag": ("strings", "tagging", "mask"),
        "head-cls": ("root", "classification", "head"),
    }
    for tenant, (version, task, kind) in tenants.items():
        manager.tenant_create(store, tenant, version=version, task=task, pet_type=kind, epochs=1, max_examples=16,
                              bottleneck=8, rank=4, density=0.05, batch_size=8,
                              train_path=cls if task == "classification" else conll, progress=False,
                              levels=("plot",),  # the PLOT and exact levels; tests/test_cascade.py adds full-depth PETs
                              precision="fp32")  # served fp32, so answers compare with fp32 references
    return store, {"texts": texts, "tenants": tenants}


@functools.lru_cache(maxsize=None)
def shared_tiny_store():
    """One tiny store per test session (test_executor_gpu.py serves it too)."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="hkstore-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    return build_tiny_store(root)


@pytest.fixture(scope="module")
def tiny():
    return shared_tiny_store()


@pytest.fixture(scope="module")
def rt(tiny):
    with runtime.open(tiny[0], device="cpu", max_len=48, max_batch=64) as r:
        yield r


def requests_for(tiny, count=18):
    store, info = tiny
    tenants = list(info["tenants"])
    texts = info["texts"]
    return [{"tenant": tenants[j % len(tenants)], "text": texts[(5 * j) % len(texts)]} for j in range(count)]


def reference_logits(store_path, encoder, tenant, ids):
    """The per-request reference: retrieve + Encoder.upper + head on the request alone."""
    st = hkstore.open(store_path)
    try:
        meta, pet = manager.load_tenant(st, tenant, encoder)
        x, m, _ = retrieve(st.snapshot(), meta["version"], [ids])
        with torch.no_grad():
            return petlib.head(pet, encoder.upper(x, m, pet))[0].numpy()
    finally:
        st.close()


def test_mixed_batch_equals_one_at_a_time_and_reference(tiny, rt):
    reqs = requests_for(tiny)
    together = rt.infer(reqs)
    assert {r.batch_size for r in together} == {len(reqs)}  # one mixed batch
    assert {r.version for r in together} == {"root", "strings"}  # mixed PLOT versions too
    for req, res in zip(reqs, together):
        alone = rt.infer([req])[0]
        np.testing.assert_allclose(res.logits, alone.logits, rtol=1e-4, atol=1e-5)
        ids = rt.encoder.tokenize([req["text"]])[0]
        np.testing.assert_allclose(res.logits, reference_logits(tiny[0], rt.encoder, req["tenant"], ids),
                                   rtol=1e-4, atol=1e-5)
        assert res.tenant == req["tenant"]
        assert set(res.timings) >= {"retrieval", "transfer", "compute", "total"}
        if res.task == "classification":
            assert res.label in res.labels and abs(sum(res.probabilities) - 1) < 1e-5
            assert res.label == res.labels[int(np.argmax(res.logits))]
        else:
            words = re.findall(r"[a-z0-9]+|[^\sa-z0-9]", req["text"].lower())
            assert [w.lower() for w in res.tokens] == words
            assert len(res.tags) == len(words) == len(res.probabilities)
            assert all(t in res.labels for t in res.tags)


def test_ids_requests_and_one_shot(tiny, rt):
    ids = rt.encoder.tokenize([tiny[1]["texts"][0]])[0]
    by_ids = rt.infer([runtime.Request("bitfit-tag", ids=ids), {"tenant": "lora-cls", "ids": ids}])
    by_text = rt.infer([{"tenant": "bitfit-tag", "text": tiny[1]["texts"][0]}])[0]
    assert len(by_ids[0].tags) == len(ids)  # a tag per id, [CLS] and [SEP] included
    np.testing.assert_allclose(by_ids[0].logits, by_text.logits, rtol=1e-5, atol=1e-6)
    once = runtime.infer(tiny[0], [{"tenant": "lora-cls", "ids": np.array(ids)}], device="cpu")
    np.testing.assert_allclose(once[0].logits, by_ids[1].logits, rtol=1e-5, atol=1e-6)


def test_errors(tiny, rt):
    with pytest.raises(runtime.UnknownTenant):
        rt.infer([{"tenant": "nobody", "text": "hello"}])
    assert issubclass(runtime.UnknownTenant, hkstore.StoreError)
    with pytest.raises(runtime.EmptyText):
        rt.infer([{"tenant": "lora-cls", "text": "   "}])
    with pytest.raises(runtime.EmptyText):
        rt.infer([{"tenant": "lora-cls", "ids": []}])
    with pytest.raises(runtime.TextTooLong):
        rt.infer([{"tenant": "lora-cls", "text": " ".join(["string"] * 60)}])
    with pytest.raises(runtime.BadRequest):
        rt.infer([{"tenant": "lora-cls", "text": "a", "ids": [2, 3]}])
    with pytest.raises(runtime.BadRequest):
        rt.infer([{"tenant": "lora-cls", "ids": [2, 10**6, 3]}])
    assert issubclass(runtime.EmptyText, ValueError) and issubclass(runtime.TextTooLong, ValueError)
    # One bad request fails the call before anything runs.
    with pytest.raises(runtime.UnknownTenant):
        rt.infer([{"tenant": "lora-cls", "text": "fine"}, {"tenant": "nobody", "text": "hello"}])


def test_truncate_cuts_instead_of_refusing(tiny):
    long_text = " ".join(["string"] * 60)
    with runtime.open(tiny[0], device="cpu", max_len=16, truncate=True) as cut:
        tagged, = cut.infer([{"tenant": "bitfit-tag", "text": long_text}])
        assert tagged.truncated > 0 and len(tagged.tags) == len(tagged.tokens) == 14  # [CLS] 14 words [SEP]
        with pytest.raises(runtime.TextTooLong, match="truncate"):  # a request may ask for the strict rule
            cut.infer([{"tenant": "lora-cls", "text": long_text, "truncate": False}])
    with runtime.open(tiny[0], device="cpu", max_len=16) as strict:
        one, = strict.infer([runtime.Request("lora-cls", text=long_text, truncate=True)])
        ids = strict.encoder.tokenize([long_text])[0]
        same, = strict.infer([{"tenant": "lora-cls", "ids": ids[:15] + ids[-1:]}])
        assert one.truncated == len(ids) - 16 and same.truncated == 0
        np.testing.assert_allclose(one.logits, same.logits, rtol=1e-5, atol=1e-6)


def test_embed_pools_the_last_hidden_state(tiny, rt):
    import torch

    from runtime.plot.retrieve import retrieve

    texts = tiny[1]["texts"][:3]
    vectors, counts = rt.embed(texts, policy="fast")
    assert vectors.shape == (3, rt.encoder.config.d) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    ids = rt.encoder.tokenize(texts)
    assert counts == [len(i) for i in ids]
    with torch.no_grad():  # the same by hand: root PLOT, shared upper layers, mean over real tokens
        inputs, mask, _ = retrieve(rt.store.snapshot(), "root", ids)
        h = rt.encoder.upper(inputs, mask)
        want = torch.stack([h[b, :len(i)].mean(0) for b, i in enumerate(ids)])
    np.testing.assert_allclose(vectors, torch.nn.functional.normalize(want, dim=-1).numpy(), atol=1e-5)
    exact, _ = rt.embed(texts)  # the base model's default: the whole encoder, no PLOT
    with torch.no_grad():
        h = rt.encoder(*rt.encoder.pad(ids))
        want = torch.stack([h[b, :len(i)].mean(0) for b, i in enumerate(ids)])
    np.testing.assert_allclose(exact, torch.nn.functional.normalize(want, dim=-1).numpy(), atol=1e-5)
    np.testing.assert_allclose(rt.embed(ids)[0], exact, atol=1e-6)  # token ids, as the tokenizer gives them
    mine, _ = rt.embed(texts[:1], tenant="lora-cls")  # the tenant's PET moves its embedding
    assert not np.allclose(mine[0], vectors[0], atol=1e-4)
    # policy exact for a tenant: the full-context lower layers its version stands for, its PET above
    from runtime.model.pet import load_pet, pet_meta
    from runtime.model.stored import context_encoder

    record = rt.store.snapshot().read_pet("lora-cls")
    pet = load_pet(rt.encoder, record.tensors, pet_meta(record.meta))
    lower = context_encoder(rt.store, record.meta["version"], rt.encoder)
    with torch.no_grad():
        h = rt.encoder.upper(lower.lower(*lower.pad(ids[:1])), torch.ones(1, len(ids[0]), dtype=bool), pet)
    np.testing.assert_allclose(rt.embed(texts[:1], tenant="lora-cls", policy="exact")[0][0],
                               torch.nn.functional.normalize(h.mean(1), dim=-1)[0].numpy(), atol=1e-5)
    with pytest.raises(runtime.UnknownTenant):
        rt.embed(["x"], tenant="nobody")


def test_incompatible_pets(tiny, rt):
    store_path = tiny[0]
    with hkstore.open(store_path, writable=True) as st:
        good = st.get_pet("lora-cls")
        for tenant, change in [("other-base", {"base_model": "bert-base-uncased"}),
                               ("gone-version", {"version": "no-such-version"})]:
            st.put_pet(PetRecord(tenant=tenant, meta=dict(good.meta, tenant=tenant, **change), tensors=good.tensors))
        bad_shape = dict(good.tensors)
        bad_shape["head.weight"] = np.zeros((2, 7), dtype=np.float32)
        st.put_pet(PetRecord(tenant="bad-shape", meta=dict(good.meta, tenant="bad-shape"), tensors=bad_shape))
    for tenant in ("other-base", "gone-version", "bad-shape"):  # created after rt opened: found by refresh
        with pytest.raises(runtime.IncompatiblePet):
            rt.infer([{"tenant": tenant, "text": "hello"}])
    assert issubclass(runtime.IncompatiblePet, hkstore.StoreError)
    assert rt.infer([{"tenant": "lora-cls", "text": "hello"}])[0].label in good.meta["labels"]  # still served


def test_concurrent_callers_get_their_own_results(tiny, rt):
    reqs = requests_for(tiny, 24)
    expected = [r.logits for r in rt.infer(reqs)]
    chunks = [list(range(j, len(reqs), 4)) for j in range(4)]
    got, errors = {}, []

    def worker(indices):
        try:
            for _ in range(2):
                for j, res in zip(indices, rt.infer([reqs[j] for j in indices])):
                    got.setdefault(j, []).append(res)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for j, results in got.items():
        assert len(results) == 2
        for res in results:
            assert res.tenant == reqs[j]["tenant"]
            np.testing.assert_allclose(res.logits, expected[j], rtol=1e-4, atol=1e-5)


def test_pipeline_off_and_small_batches_agree(tiny, rt):
    reqs = requests_for(tiny, 10)
    expected = [r.logits for r in rt.infer(reqs)]
    with runtime.open(tiny[0], device="cpu", max_batch=3, pipeline=False, prefetch=False, max_len=48) as other:
        got = other.infer(reqs)
        assert max(r.batch_size for r in got) <= 3
        for e, r in zip(expected, got):
            np.testing.assert_allclose(r.logits, e, rtol=1e-4, atol=1e-5)
        assert other.stats()["host_pet_cache"]["entries"] == len({q["tenant"] for q in reqs})


class _EchoExecutor:
    """The layer below the engine, faked: logits = the row's position in its batch, its first id."""

    def gather(self, snapshot, rows):
        from runtime.exec.rows import Gathered

        return Gathered([], None, [None] * len(rows))

    def prepare(self, gathered, rows):
        from runtime.exec.rows import Prepared

        return Prepared(rows)

    def compute(self, prepared):
        return [np.array([float(j), float(row.ids[0])]) for j, row in enumerate(prepared.rows)]


class _WatchedCondition(threading.Condition):
    """The engine's condition, with `waiting` set once a thread waits on it."""

    waiting = None

    def wait(self, timeout=None):
        type(self).waiting.set()
        return super().wait(timeout)


@pytest.mark.parametrize("max_batch, count", [(64, 18), (4, 10), (1, 3)])
def test_one_submit_is_never_split_across_batches(monkeypatch, max_batch, count):
    """A worker already waiting when a call submits must still see all of its rows (a
    per-item put let it wake after the first one: a flaky 1 + 17 split)."""
    from runtime import engine
    from runtime.exec.rows import Row

    monkeypatch.setattr(engine.threading, "Condition", _WatchedCondition)
    monkeypatch.setattr(_WatchedCondition, "waiting", threading.Event())
    # one thread, which waits on the queue's condition for work
    eng = engine.Engine(_EchoExecutor(), lambda: None, max_batch=max_batch, batching="fifo", pipeline=False)
    try:
        assert _WatchedCondition.waiting.wait(10), "the worker never waited on the queue"
        outs = eng.run([Row([k], None, "root") for k in range(count)])
    finally:
        eng.close()
    # Items go in order, in batches as full as max_batch allows.
    sizes = [min(max_batch, count - start) for start in range(0, count, max_batch)]
    assert [o.batch_size for o in outs] == [size for size in sizes for _ in range(size)]
    assert [int(o.logits[1]) for o in outs] == list(range(count))


def test_open_warms_the_store_in_the_background(tiny):
    """runtime.open checks every value row once on a background thread (Store.warm), so the
    first lookups pay no row check; close waits for it."""
    with runtime.open(tiny[0], device="cpu", max_len=48) as r:
        assert r._warming is not None
        r._warming.join(30)
        segments = {id(s): s for v in range(len(r.store.snapshot().version_names))
                    for s in r.store.snapshot().version_segments(v)}
        assert segments and all(s._all_rows_ok for s in segments.values())
        assert r.infer([{"tenant": next(iter(tiny[1]["tenants"])), "text": tiny[1]["texts"][0]}])


def test_a_max_len_past_the_models_positions_is_the_models(tiny):
    """A text longer than the model has positions is too long (or cut), never a failed lookup."""
    with runtime.open(tiny[0], device="cpu", max_len=100_000) as rt:
        positions = rt.encoder.config.max_len
        assert rt.max_len == positions
        long_text = " ".join(["string"] * (2 * positions))
        with pytest.raises(runtime.TextTooLong):
            rt.infer([{"tenant": "lora-cls", "text": long_text}])
        cut, = rt.infer([{"tenant": "lora-cls", "text": long_text, "truncate": True}])
        assert cut.truncated > 0
