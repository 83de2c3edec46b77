"""hkstore pack import of PEFT LoRA adapters of causal LMs (GPT-2 fused c_attn, OPT, Llama) into a
decoder store: the imported tenant's logits equal PEFT's on the same weights."""

import json

import pytest
import torch
from click.testing import CliRunner

import hkstore
from tools.cli import main
from runtime.construct.decoder_store import build_decoder
from runtime.construct.decoder_tenant import load_lm_pet
from runtime.model.decoder import load_decoder
from runtime.model.tiny_decoder import make_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEXTS = ["the cat sat on the mat .", "a dog ran in the park and the cat ran too ."]


def _model(arch, vocab):
    t = transformers
    common = {"vocab_size": vocab, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    if arch == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=48, **common)), \
            ["c_attn", "c_proj"], "h"
    if arch == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=32, num_hidden_layers=3, ffn_dim=64, num_attention_heads=4,
                                            max_position_embeddings=48, word_embed_proj_dim=32, **common)), \
            ["q_proj", "v_proj", "out_proj", "fc1", "fc2"], "layers"
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, num_hidden_layers=3, intermediate_size=48,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                            **common)), ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], "layers"


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_imported_peft_lora_matches_peft(arch, tmp_path):
    torch.manual_seed(0)
    tok = make_tokenizer(TEXTS)
    model, targets, pattern = _model(arch, tok.get_vocab_size())
    model.eval()
    model.save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=tmp_path / "m", corpus_paths=[tmp_path / "c.txt"], n=3, lower_layers=1,
                  progress=False, position=False)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, layers_to_transform=[1, 2],
                          layers_pattern=pattern, task_type="CAUSAL_LM")
    tuned = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    tuned.save_pretrained(tmp_path / "a")
    r = CliRunner().invoke(main, ["pack", "import", str(tmp_path / "s"), str(tmp_path / "a"), "--tenant", "t",
                                  "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["task"] == "lm"
    with hkstore.open(tmp_path / "s") as st:
        dec = load_decoder(tmp_path / "m", lower_layers=1)
        pet = load_lm_pet(st, "t", dec)
    x = torch.tensor([dec.tokenize(TEXTS[1:])[0]])
    with torch.no_grad():
        theirs = tuned(x).logits
        ours = dec(x, pet=pet)
        base = dec(x)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (base - theirs).abs().max().item() > 1e-3  # the adapter matters


def test_lower_layer_lora_is_refused(tmp_path):
    torch.manual_seed(0)
    tok = make_tokenizer(TEXTS)
    model, targets, pattern = _model("opt", tok.get_vocab_size())
    model.save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("\n".join(TEXTS))
    build_decoder(tmp_path / "s", model_path=tmp_path / "m", corpus_paths=[tmp_path / "c.txt"], n=3, lower_layers=1,
                  progress=False, position=False)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                               task_type="CAUSAL_LM")).save_pretrained(tmp_path / "a")
    r = CliRunner().invoke(main, ["pack", "import", str(tmp_path / "s"), str(tmp_path / "a"), "--tenant", "t"])
    assert r.exit_code == 1 and "not an upper layer" in r.output and "Traceback" not in r.output
