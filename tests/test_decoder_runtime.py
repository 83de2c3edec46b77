"""runtime.open on a decoder store: generate / stream with per-request tenants; bad requests."""

import pytest
import torch

import runtime
from hkstore.errors import UnknownTenant
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import lm_tenant_create
from runtime.model.tiny_decoder import make_tiny_decoder

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("rt")
    model = make_tiny_decoder(tmp / "m", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=48, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2, progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    lm_tenant_create(tmp / "s", "acme", train_path=tmp / "acme.txt", epochs=25, batch_size=4, lr=1e-2, progress=False)
    yield str(tmp / "s")
    torch.set_num_threads(threads)


def test_generate_and_stream_mixed_tenants(store):
    with runtime.open(store) as rt:
        assert rt.tenants() == ["acme"]
        reqs = [{"tenant": "acme", "prompt": "the cat sat on", "max_tokens": 4},
                {"prompt": "the cat sat on", "max_tokens": 4},
                {"tenant": "acme", "prompt": "a dog", "max_tokens": 6, "temperature": 0.9, "seed": 3}]
        out = rt.generate(reqs)
        assert out[0]["text"] == " the mat and the" and out[1]["ids"] != out[0]["ids"]
        assert [o["prompt_tokens"] for o in out] == [5, 5, 3]
        last = {}
        for e in rt.stream(reqs):
            last[e["index"]] = e
        assert all(last[i]["finished"] and last[i]["text"] == out[i]["text"] for i in range(3))


def test_a_prompt_of_token_ids_is_the_same_prompt(store):
    with runtime.open(store) as rt:
        ids = rt.decoder.tokenize(["the cat sat on"])[0]
        text, by_ids = rt.generate([{"prompt": "the cat sat on", "max_tokens": 4, "seed": 1 << 70, "temperature": 1},
                                    {"prompt": ids, "max_tokens": 4, "seed": 1 << 70, "temperature": 1}])
        assert by_ids == text and by_ids["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("request_, error, message", [
    ({"tenant": "nobody", "prompt": "x"}, UnknownTenant, "unknown tenant"),
    ({"prompt": "x", "temperature": -1}, runtime.BadRequest, "temperature"),
    ({"prompt": "x", "max_tokens": 1000}, runtime.BadRequest, "context"),
    ({"prompt": "x", "colour": "red"}, runtime.BadRequest, "unknown request fields"),
    ({"text": "x"}, runtime.BadRequest, "prompt"),
    ({"prompt": "the \udc00 cat"}, runtime.BadRequest, "not valid Unicode"),  # (the tokenizer: a TypeError)
    ({"prompt": [2, 10**30]}, runtime.BadRequest, "token ids"),
    ({"prompt": [2, -1]}, runtime.BadRequest, "token ids"),
    ({"prompt": []}, runtime.BadRequest, "empty prompt"),
    ({"prompt": "x", "seed": "7"}, runtime.BadRequest, "seed"),
])
def test_bad_requests_are_refused_before_anything_runs(store, request_, error, message):
    with runtime.open(store) as rt:
        with pytest.raises(error, match=message):
            rt.generate([{"prompt": "the cat", "max_tokens": 2}, request_])
        with pytest.raises(runtime.BadRequest, match="decoder store"):
            rt.infer([{"tenant": "acme", "text": "x"}])


def test_an_encoder_store_refuses_to_generate(tmp_path):
    from runtime.construct.manager import build
    from runtime.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", TEXTS, d=16, layers=2)
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build(tmp_path / "s", model_path=model, corpus_paths=[tmp_path / "c.txt"], lower_layers=1, progress=False)
    with runtime.open(tmp_path / "s") as rt:
        assert not hasattr(rt, "decoder")
        with pytest.raises(runtime.BadRequest, match="encoder store"):
            rt.generate([{"prompt": "the cat"}])


def test_concurrent_generate_calls_share_one_batch(store):
    """generate() from several threads at once: the runtime's one engine decodes them together
    (a step with more than one sequence), and each gets what it gets alone."""
    import threading

    prompts = ["the cat sat on", "a dog ran", "storage engines keep", "the park"]
    with runtime.open(store) as rt:
        alone = [rt.generate([{"tenant": "acme", "prompt": p, "max_tokens": 12, "ignore_eos": True}])[0]
                 for p in prompts]
        assert rt.generation_engine().stats()["widest_batch"] == 1
        start, got = threading.Barrier(len(prompts)), [None] * len(prompts)

        def call(i):
            start.wait()
            got[i] = rt.generate([{"tenant": "acme", "prompt": prompts[i], "max_tokens": 12, "ignore_eos": True}])[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = rt.stats()["engine"]  # (what /metrics reports)
    assert stats["widest_batch"] > 1 and stats["running"] == stats["waiting"] == stats["queued"] == 0
    assert [g["ids"] for g in got] == [a["ids"] for a in alone]
    assert [g["text"] for g in got] == [a["text"] for a in alone]


def test_stream_closed_early_cancels_the_rest(store):
    import time

    with runtime.open(store) as rt:
        events = rt.stream([{"prompt": "the cat", "max_tokens": 40, "ignore_eos": True}])
        first = next(events)
        assert first["token"] is not None and not first["finished"]
        events.close()
        eng = rt.generation_engine()
        for _ in range(200):
            if eng.stats()["running"] == 0:
                break
            time.sleep(0.01)
        assert eng.stats()["running"] == 0 and eng.stats()["queued"] == 0

