"""The precision a decoder tenant is served at, chosen by measurement: lm_tenant_create scores
the tenant's perplexity on a sample of its training text through generation's own GEMMs in
fp32 and in bf16 and records bf16 only where it is at most 0.3% higher; an asked precision is
recorded unmeasured (bf16 refused in one line, before training, on a CPU without it); the
decoder runtime serves each tenant at its record by default."""

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

import hkstore
from runtime.construct import decoder_tenant
from runtime.construct import precision as choice
from runtime.construct.decoder_tenant import lm_tenant_create
from runtime.exec import precision as precisionlib
from runtime.model import pet as petlib
from runtime.model.decoder import load_decoder
from runtime.plot.retrieve import retrieve_list
from test_decoder_tenant import TENANT_TEXT, TEXTS, _one_thread, store_path  # noqa: F401  (the same tiny store)

native_only = pytest.mark.skipif(precisionlib.bf16_native() is None, reason="this CPU has no native bf16")


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setattr(precisionlib, "bf16_native", lambda: "avx512_bf16")


def create(store_path, tenant, **kw):
    return lm_tenant_create(store_path / "s", tenant, train_path=store_path / "acme.txt", epochs=2, batch_size=4,
                            lr=1e-2, progress=False, replace=True, **kw)


def meta_of(store_path, tenant):
    with hkstore.open(store_path / "s") as st:
        return st.snapshot().read_pet(tenant).meta


@settings(max_examples=300, deadline=None)
@given(fp32=st.floats(1.0, 1e4), rise=st.floats(-0.05, 0.05))
def test_bf16_is_chosen_exactly_when_its_perplexity_is_at_most_a_target_higher(fp32, rise):
    bf16 = fp32 * (1 + rise)
    got = choice.checked("auto", lambda: ({"fp32": fp32, "bf16": bf16}, 0.0), "perplexity", 5, "training") \
        if precisionlib.bf16_native() else None
    if got is not None:
        assert got["precision"] == ("bf16" if rise <= 0.003 + 1e-9 else "fp32")
    # the rule itself, on any machine: a perplexity may not rise by more than the target...
    assert choice.holds({"fp32": fp32, "bf16": bf16}, "perplexity") == (bf16 <= fp32 * 1.003 + 1e-12)
    # ...while a score (higher is better) may not fall by more than it
    assert choice.holds({"fp32": 0.9, "bf16": 0.9 - rise}, "accuracy") == (rise <= 0.003 + 1e-12)


@native_only
def test_the_served_perplexity_is_the_models_in_fp32_and_within_bf16_rounding_in_bf16(store_path, monkeypatch):
    create(store_path, "ref", precision="fp32")
    with hkstore.open(store_path / "s") as st:
        dec = load_decoder(st.meta["model_path"], st.meta["lower_layers"])
        record = st.snapshot().read_pet("ref")
        pet = petlib.load_pet(dec, record.tensors, petlib.pet_meta(record.meta))
        seqs = [s for s in dec.tokenize(TENANT_TEXT + TEXTS) if len(s) > 1]
        inputs = retrieve_list(st.snapshot(), "root", seqs)
    scores, seconds = decoder_tenant.served_perplexities(dec, pet, inputs, seqs, batch=3)
    with torch.no_grad():
        reference = decoder_tenant._ppl(dec, pet, inputs, seqs)  # Decoder.upper, one sequence at a time
    assert scores["fp32"] == pytest.approx(reference, rel=1e-5)
    assert scores["bf16"] != scores["fp32"] and scores["bf16"] == pytest.approx(reference, rel=0.05)
    assert seconds > 0
    monkeypatch.setattr(decoder_tenant, "LOGIT_ROWS", 5)  # the logits a few positions at a time: the same sums
    assert decoder_tenant.served_perplexities(dec, pet, inputs, seqs, batch=3)[0]["fp32"] == \
        pytest.approx(scores["fp32"], rel=1e-6)


def test_create_records_bf16_where_the_perplexity_holds_fp32_where_it_rises(store_path, native, monkeypatch):
    seen = []

    def measured(fp32, bf16):
        def served(dec, pet, inputs, seqs, batch=8):
            seen.append(len(seqs))
            return {"fp32": fp32, "bf16": bf16}, 0.5
        monkeypatch.setattr(decoder_tenant, "served_perplexities", served)

    measured(10.0, 10.02)
    out = create(store_path, "holds")
    assert out["precision"] == "bf16" and meta_of(store_path, "holds")["precision"] == "bf16"
    check = meta_of(store_path, "holds")["precision_check"]
    assert check["metric"] == "perplexity" and check["scores"] == {"fp32": 10.0, "bf16": 10.02}
    assert check["on"] == "training" and check["examples"] == seen[-1] == len(TENANT_TEXT)
    measured(10.0, 10.05)
    assert create(store_path, "rises")["precision"] == "fp32" and meta_of(store_path, "rises")["precision"] == "fp32"
    assert "bf16 may raise it 0.3%" in choice.words("fp32", meta_of(store_path, "rises")["precision_check"])


def test_asked_precisions_are_recorded_unmeasured(store_path, native, monkeypatch):
    monkeypatch.setattr(decoder_tenant, "served_perplexities", lambda *a, **k: pytest.fail("measured"))
    for asked in ("fp32", "bf16"):
        create(store_path, f"asked-{asked}", precision=asked)
        meta = meta_of(store_path, f"asked-{asked}")
        assert meta["precision"] == asked and meta["precision_check"] == {"asked": asked}


def test_bf16_on_a_cpu_without_it_is_refused_before_training(store_path, monkeypatch):
    monkeypatch.setattr(precisionlib, "bf16_native", lambda: None)
    monkeypatch.setattr(decoder_tenant, "train_lm_pet", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(precisionlib.PrecisionUnavailable, match="'bf16' needs a CPU") as err:
        create(store_path, "nope", precision="bf16")
    assert "\n" not in str(err.value)
    with hkstore.open(store_path / "s") as st:
        assert "nope" not in st.snapshot().pets
    with pytest.raises(ValueError, match="precision must be one of"):
        create(store_path, "nope", precision="fp16")


@native_only
def test_a_real_create_measures_and_the_runtime_serves_the_record_by_default(store_path):
    from runtime.gen.api import DecoderRuntime
    from runtime.gen.row_precision import RowPrecision

    out = create(store_path, "real")
    check = out["precision_check"]
    assert check["metric"] == "perplexity" and set(check["scores"]) == {"fp32", "bf16"}
    assert out["precision"] == ("bf16" if choice.holds(check["scores"], "perplexity") else "fp32")
    with DecoderRuntime(store_path / "s") as rt:  # no dtype: each tenant at its record
        assert rt.precision == "auto" and rt.batcher(rt.store.snapshot(), "root").gen.precision == "auto"
        pet = decoder_tenant.load_lm_pet(rt.store, "real", rt.decoder)
        assert RowPrecision.of(rt.precision, [pet]).all_bf16 == (out["precision"] == "bf16")


def test_cli_tenant_create_takes_a_precision_and_tenant_info_shows_it(store_path):
    from runtime.construct.commands import COMMANDS

    args = ["create", str(store_path / "s"), "cli", "--version", "root", "--train", str(store_path / "acme.txt"),
            "--epochs", "1", "--precision", "fp32", "-q", "--json"]
    r = CliRunner().invoke(COMMANDS["tenant"], args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["precision"] == "fp32"
    r = CliRunner().invoke(COMMANDS["tenant"], ["info", str(store_path / "s"), "cli"])
    assert r.exit_code == 0 and "precision plot: fp32 (asked)" in r.output, r.output


def test_serve_takes_a_precision_for_a_decoder_store_on_the_cpu(store_path):
    import click

    from runtime.serve.cli import _precision

    assert _precision("fp32", [str(store_path / "s")], "cpu") == "fp32"
    with pytest.raises(click.ClickException, match="only the CPU takes a precision"):
        _precision("fp32", [str(store_path / "s")], "cuda")


def test_the_experiment_reads_a_splits_texts_in_both_formats(tmp_path):
    from experiments.decoder_precision import texts

    cls = tmp_path / "text_classification" / "t"
    cls.mkdir(parents=True)
    (cls / "train.txt").write_text("".join(json.dumps({"text": f"text {i}", "label": "a"}) + "\n" for i in range(5)))
    assert texts(cls / "train.txt", 3) == ["text 0", "text 1", "text 2"]
    ner = tmp_path / "ner" / "t"
    ner.mkdir(parents=True)
    (ner / "test.txt").write_text("-DOCSTART- O\n\nthe O\ncat B-X\n\nsat O\n\n\nend O\n")
    assert texts(ner / "test.txt", 10) == ["the cat", "sat", "end"]
    assert texts(ner / "test.txt", 1) == ["the cat"]
