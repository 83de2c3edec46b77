"""Decoder tenants: an lm PET trained with the causal LM loss on PLOT inputs, stored as a
tenant, applied by generation; refusals."""

import pytest
import torch

import hkstore
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import lm_tenant_create, load_lm_pet
from runtime.gen.batcher import Batcher
from runtime.gen.plot_decode import PlotDecoder
from runtime.gen.sampling import SamplingParams
from runtime.model import pet as petlib
from runtime.model.decoder import load_decoder
from runtime.model.stored import ManagerError
from runtime.model.tiny_decoder import make_tiny_decoder

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too .",
         "storage engines keep tables of vectors , versions and packs ."]
TENANT_TEXT = ["the cat sat on the mat and the dog sat on the mat ."] * 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread is 5-7x faster than two on a machine busy with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t")
    model = make_tiny_decoder(tmp / "m", TEXTS + TENANT_TEXT, d=32, layers=4, max_len=48, scale=1.0)
    (tmp / "c.txt").write_text("\n".join(TEXTS + TENANT_TEXT))
    build_decoder(tmp / "s", model_path=model, corpus_paths=[tmp / "c.txt"], n=3, lower_layers=2, progress=False)
    (tmp / "acme.txt").write_text("\n".join(TENANT_TEXT))
    return tmp


@pytest.mark.parametrize("pet_type", ["lora", "adapter"])
def test_lm_tenant_learns_its_text_and_generation_applies_it(store_path, pet_type):
    out = lm_tenant_create(store_path / "s", f"acme-{pet_type}", train_path=store_path / "acme.txt",
                           pet_type=pet_type, epochs=25, batch_size=4, lr=1e-2, progress=False)
    assert out["task"] == "lm" and out["train_ppl_after"] < out["train_ppl_before"] / 2, out
    with hkstore.open(store_path / "s") as st:
        dec = load_decoder(st.meta["model_path"], st.meta["lower_layers"])
        pet = load_lm_pet(st, f"acme-{pet_type}", dec)
        assert pet.meta["task"] == "lm" and "head.weight" not in pet.tensors
        gen = PlotDecoder(st.snapshot(), "root", dec)
        prompt = dec.tokenize(["the cat sat on"])[0]
        b = Batcher(gen, 1 << 30)
        tuned, base = b.submit(prompt, SamplingParams(max_tokens=4), pet), b.submit(prompt, SamplingParams(max_tokens=4))
        b.run()
        assert dec.decode(b.result(tuned)["ids"]) == "the mat and the"
        assert b.result(base)["ids"] != b.result(tuned)["ids"]


def test_refusals(store_path, tmp_path):
    with pytest.raises(ValueError, match="one of"):
        lm_tenant_create(store_path / "s", "x", train_path=store_path / "acme.txt", pet_type="head")
    lm_tenant_create(store_path / "s", "dup", train_path=store_path / "acme.txt", epochs=1, progress=False)
    with pytest.raises(ManagerError, match="already exists"):
        lm_tenant_create(store_path / "s", "dup", train_path=store_path / "acme.txt", epochs=1, progress=False)
    enc = hkstore.create(tmp_path / "enc", d=4, vocab_size=5)
    enc.close()
    with pytest.raises(ManagerError, match="encoder store"):
        lm_tenant_create(tmp_path / "enc", "x", train_path=store_path / "acme.txt")
    with hkstore.open(store_path / "s") as st:
        dec = load_decoder(st.meta["model_path"], st.meta["lower_layers"])
        with pytest.raises(ValueError, match="lm PET"):
            petlib.create_pet(dec, "head", "lm", [])


def test_cli_tenant_create_and_generate_with_the_tenant(store_path):
    import json

    from click.testing import CliRunner

    from tools.cli import main

    s = str(store_path / "s")
    r = CliRunner().invoke(main, ["tenant", "create", s, "cli-acme", "--version", "root", "--train",
                                  str(store_path / "acme.txt"), "--pet", "lora", "--epochs", "25", "--batch-size", "4",
                                  "--lr", "0.01", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["task"] == "lm"
    r = CliRunner().invoke(main, ["generate", s, "the cat sat on", "--tenant", "cli-acme", "--max-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["text"] == " the mat and the"
    r = CliRunner().invoke(main, ["generate", s, "the cat", "--tenant", "nobody"])
    assert r.exit_code == 1 and "unknown tenant" in r.output


def test_cli_tenant_eval_reports_perplexity(store_path):
    import json

    from click.testing import CliRunner

    from tools.cli import main

    s = str(store_path / "s")
    lm_tenant_create(s, "eval-acme", train_path=store_path / "acme.txt", epochs=25, batch_size=4, lr=1e-2,
                     progress=False)
    r = CliRunner().invoke(main, ["tenant", "eval", s, "eval-acme", "--test", str(store_path / "acme.txt"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["perplexity"] < out["base_perplexity"] / 2 and out["tokens"] > 0
    with hkstore.open(s) as st:
        assert out["precision"] == st.snapshot().read_pet("eval-acme").meta["precision"]
    from runtime.exec.precision import bf16_native

    if bf16_native() is not None:  # the tenant's own perplexity, through generation's GEMMs at both precisions
        assert out["served_perplexity"]["fp32"] == pytest.approx(out["perplexity"], rel=1e-4)
        assert out["served_perplexity"]["bf16"] == pytest.approx(out["perplexity"], rel=0.05)
