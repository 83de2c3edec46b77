"""The CPU executor against the per-request reference (runtime.model.encoder.Encoder.upper + head).

Property: on random tiny encoders and random PETs of every type (adapter, LoRA with mixed
ranks and targets, BitFit, diff, mask, head-only; classification and tagging), a request's
logits from a mixed-tenant batch equal the reference run on that request alone, whatever
else is in its batch and whichever LoRA kernel (SGMV or BGMV) runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.implementations import BertWordPieceTokenizer

from runtime.model import pet as petlib
from runtime.exec.cpu import CpuExecutor
from runtime.model.encoder import Config, Encoder
from runtime.exec.plan import plan_batch

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORDS = "the results were good a and clear method cells grew well this is work bad unclear died early in dish"


def tiny_encoder(tmp_dir, d=32, heads=4, ffn=48, layers=4, lower=2, seed=0):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS.split())]
    path = tmp_dir / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    config = Config(vocab_size=len(vocab), d=d, heads=heads, ffn=ffn, num_layers=layers, max_len=64, pad_id=0, eps=1e-12)
    torch.manual_seed(seed)
    enc = Encoder(config, BertWordPieceTokenizer(str(path)), path.read_bytes(), lower_layers=lower)
    with torch.no_grad():  # non-trivial LayerNorm parameters too
        for blk in enc.layers:
            for ln in (blk.ln_attn, blk.ln_ffn):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0, 0.1)
    return enc.requires_grad_(False).eval()


def random_pet(enc, pet_type, task, seed, **options):
    """A trained-looking exported PET: every tensor random (not the identity init)."""
    g = torch.Generator().manual_seed(seed)
    labels = [f"l{j}" for j in range(2 + seed % 3)]
    pet = petlib.create_pet(enc, pet_type, task, labels, seed=seed, **options)
    with torch.no_grad():
        for name, v in pet.tensors.items():
            if name.endswith(".score"):
                v.copy_(torch.randn(v.shape, generator=g))
            else:
                v.copy_(torch.randn(v.shape, generator=g) * 0.2)
    return petlib.export(pet)


def pet_zoo(enc, seed):
    """One PET of each kind (and two LoRA ranks, a layer subset), tasks alternating."""
    upper = list(range(enc.lower_layers, enc.config.num_layers))
    specs = [
        ("adapter", {"bottleneck": 8}),
        ("adapter", {"bottleneck": 5, "layers": upper[-1:]}),
        ("lora", {"rank": 4, "targets": ("q", "v")}),
        ("lora", {"rank": 2, "targets": ("k", "o", "ffn_in", "ffn_out"), "scale": 0.5}),
        ("bitfit", {}),
        ("diff", {"density": 0.05}),
        ("mask", {"density": 0.05}),
        ("head", {}),
    ]
    return [random_pet(enc, kind, ("classification", "tagging")[(j + seed) % 2], seed * 31 + j, **opts)
            for j, (kind, opts) in enumerate(specs)]


def reference(enc, x, pet):
    """The per-request reference: upper layers + head on the request alone, unpadded."""
    with torch.no_grad():
        mask = torch.ones(1, len(x), dtype=torch.bool)
        logits = petlib.head(pet, enc.upper(x[None], mask, pet))[0]
    return logits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    enc = tiny_encoder(tmp_path_factory.mktemp("tiny"))
    return enc, pet_zoo(enc, 1)


def check_batch(enc, zoo, assignment, lengths, seed, lora_kernel):
    g = torch.Generator().manual_seed(seed)
    B, L, d = len(assignment), max(lengths), enc.config.d
    inputs = torch.randn(B, L, d, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    inputs[~mask] = 7.0  # padding content must not leak into any result
    ex = CpuExecutor(enc, lora_kernel=lora_kernel)
    serving = [ex.load_pet(p, key=k) for k, p in enumerate(zoo)]
    out = ex.run(inputs, mask, [serving[a] for a in assignment], keys=list(assignment))
    for b, a in enumerate(assignment):
        ref = reference(enc, inputs[b, : lengths[b]], zoo[a])
        assert out[b].shape == ref.shape
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=2e-5)


@SETTINGS
@given(data=st.data())
def test_mixed_batch_equals_one_at_a_time(setup, data):
    enc, zoo = setup
    B = data.draw(st.integers(1, 9))
    assignment = data.draw(st.lists(st.integers(0, len(zoo) - 1), min_size=B, max_size=B))
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=B, max_size=B))
    kernel = data.draw(st.sampled_from(["auto", "sgmv", "bgmv"]))
    check_batch(enc, zoo, assignment, lengths, data.draw(st.integers(0, 2**31 - 1)), kernel)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), d_heads=st.sampled_from([(16, 2), (24, 3), (40, 5)]),
       layers=st.sampled_from([(3, 1), (4, 2), (3, 0)]))
def test_random_models(tmp_path_factory, seed, d_heads, layers):
    enc = tiny_encoder(tmp_path_factory.mktemp("m"), d=d_heads[0], heads=d_heads[1], ffn=2 * d_heads[0] + 3,
                       layers=layers[0], lower=layers[1], seed=seed)
    zoo = pet_zoo(enc, seed)
    rng = np.random.default_rng(seed)
    assignment = rng.integers(0, len(zoo), size=7).tolist()
    check_batch(enc, zoo, assignment, rng.integers(1, 10, size=7).tolist(), seed, "auto")


def test_plan_groups_tenants_and_picks_kernels(setup):
    enc, zoo = setup
    ex = CpuExecutor(enc)
    s = [ex.load_pet(p, key=k) for k, p in enumerate(zoo)]
    plan = plan_batch([s[2], s[4], s[2], s[3]])  # lora, bitfit, lora again, lora
    assert plan.perm.tolist() == [0, 2, 1, 3]
    assert plan.seg_starts.tolist() == [0, 2, 3, 4]
    q = plan.groups[("lora", 2, "q")]
    assert q.seg_ids.tolist() == [0, -1, -1] and not q.bgmv  # tenant 2 has two requests: SGMV
    k = plan.groups[("lora", 2, "k")]
    assert k.seg_ids.tolist() == [-1, -1, 0]
    assert plan_batch([s[2], s[3]]).groups[("lora", 2, "q")].bgmv  # each request its own LoRA


def test_mask_pet_becomes_a_diff(setup):
    enc, zoo = setup
    serving = CpuExecutor(enc).load_pet(zoo[6])
    kinds = {k[0] for k in serving.parts}
    assert kinds == {"diff"}
    index, value = serving.parts[("diff", 2, "q")]
    w = enc.layers[2].q.weight.flatten()
    torch.testing.assert_close(value, -w[index.long()])
