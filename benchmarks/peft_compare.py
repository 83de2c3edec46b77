"""hkstore's full-depth LoRA recipe against transformers + PEFT on the same data, budget and scorer.

    python -m benchmarks.peft_compare --out OUT [--tasks NCBI-disease,sciie] [--systems hkstore,peft]

Both systems see the harness's data (benchmarks.hmi_accuracy.prepare_data: the seeded --max-train /
--max-test subsamples of --eval-split, --max-len), the same token ids (Task's encoding), the same
optimizer loop (runtime.construct.train._fit: AdamW lr --lr, weight decay 0.01, clip 1.0, --warmup of
the steps warming up then linear decay, batch 16, --epochs, the same seeded batch order) and are
scored by Task.score on the same positions (a word's first sub-token). Systems:

  hkstore       the fd-lora recipe: create_pet(load_encoder(None, 0), "lora", layers 0..5, targets
                q,k,v,o,ffn_in,ffn_out, rank 16, scale 2) + train_pet on the frozen embeddings; no dropout
  hkstore-drop  the same with train_pet's training-only dropout at PEFT's rates (TrainConfig.dropout
                0.1: hidden, attention and the embeddings; lora_dropout 0.1)
  peft          BertFor{Token,Sequence}Classification from the embedded model's directory with its
                config's dropout (hidden 0.1, attention 0.1), LoraConfig(r=16, lora_alpha=32,
                lora_dropout=0.1) on the same six projections of all six layers, the classifier in
                modules_to_save (sequence classification keeps BERT's pretrained pooler, frozen)
  peft-nodrop   peft with every dropout 0: the same function hkstore trains (a check of the harness)
  peft-every    peft trained with every sub-token labelled (HF's label_all_tokens: B- -> I- after
                the first); scored on first sub-tokens as the others
  peft-nolora-drop  peft without LoRA dropout (BERT's dropout kept)
  peft-bert-drop    peft without BERT's dropout (LoRA dropout kept)

Systems alternate within each task (hkstore first), each row's seconds recorded; results after every
(task, system) in OUT/results.json (resumable; a rerun with other settings is refused) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.hmi_accuracy import SCIBERT

TASK_ORDER = ("NCBI-disease", "sciie", "bc5cdr", "chemprot", "citation_intent", "sci-cite")
# peft variants: (hidden/attention dropout, LoRA dropout, label every sub-token)
PEFT = {"peft": (0.1, 0.1, False), "peft-nodrop": (0.0, 0.0, False), "peft-every": (0.1, 0.1, True),
        "peft-nolora-drop": (0.1, 0.0, False), "peft-bert-drop": (0.0, 0.1, False)}
SYSTEMS = ("hkstore", "hkstore-drop", *PEFT)
# The HF names of the six projections hkstore's LoRA edits, in every layer (the pooler's dense is not one).
HF_TARGETS = r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
FIXED = ("max_train", "max_test", "max_len", "seed", "eval_split", "batch_size", "epochs", "lr", "warmup", "rank",
         "scale")
T0 = time.time()


def say(msg):
    print(f"[{time.time() - T0:7.1f}s wall, cpu {time.process_time():7.1f}s] {msg}", flush=True)


def recipe(args, dropout=0.0):
    from runtime.construct.train import TrainConfig

    return TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, warmup=args.warmup,
                       seed=args.seed, progress=args.progress, dropout=dropout, lora_dropout=dropout)


def run_hkstore(args, whole, t, dropout=0.0):
    """experiments' fd-lora row: a LoRA on layers 0..5 of an encoder whose layers are all "upper"."""
    from benchmarks.hmi_accuracy import full_lower, padded, predict
    from runtime.construct.train import train_pet
    from runtime.model.pet import TARGETS, create_pet, head

    pet = create_pet(whole, "lora", t.kind, t.labels, layers=list(range(6)), targets=TARGETS, rank=args.rank,
                     scale=args.scale, seed=args.seed)
    # lower_layers 0: full_lower is the frozen embedding output, the full-depth PET's input
    train_x, test_x = full_lower(whole, t.train_ids), full_lower(whole, t.test_ids)
    trained, log = train_pet(whole, pet, train_x, t.train_y, recipe(args, dropout))
    return t.score(predict(lambda b: head(trained, whole.upper(*padded(b), trained)), test_x)), log


def peft_model(args, t, dropout, lora_dropout):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
    from runtime.model.stored import default_model_path

    torch.manual_seed(args.seed)  # the classifier's and LoRA A's initialization
    kind = AutoModelForSequenceClassification if t.kind == "classification" else AutoModelForTokenClassification
    model = kind.from_pretrained(default_model_path(), num_labels=len(t.labels), hidden_dropout_prob=dropout,
                                 attention_probs_dropout_prob=dropout)
    config = LoraConfig(r=args.rank, lora_alpha=args.rank * args.scale, lora_dropout=lora_dropout,
                        target_modules=HF_TARGETS, modules_to_save=["classifier"])
    return get_peft_model(model, config)


def every_subtoken(whole, t):
    """Training labels with every sub-token of a word labelled (B-X -> I-X after the first)."""
    from runtime.construct.data import IGNORE
    from runtime.construct.manager import read_task

    (x, y), _ = read_task(t.train_path, t.kind)
    index = {n: j for j, n in enumerate(t.labels)}
    out = []
    for (_, words), tags in zip(whole.tokenize_words(x, t.max_len), y):
        out.append([IGNORE if w is None else index[tags[w] if first else "I-" + tags[w][2:]
                                                   if tags[w].startswith("B-") else tags[w]]
                    for w, first in zip(words, [w is not None and w != p for w, p in zip(words, [None, *words])])])
    return out


def run_peft(args, whole, t, system):
    from benchmarks.hmi_accuracy import predict
    from runtime.construct.train import _fit, _task_loss

    dropout, lora_dropout, every = PEFT[system]
    model = peft_model(args, t, dropout, lora_dropout)
    labels = every_subtoken(whole, t) if every else t.train_y

    def logits_of(ids):
        x, real = whole.pad(ids)
        return model(input_ids=x, attention_mask=real.long()).logits

    def loss_of(batch):
        return _task_loss(t.kind, logits_of([t.train_ids[j] for j in batch]), [labels[j] for j in batch])

    model.train()
    log = _fit([p for p in model.parameters() if p.requires_grad], len(t.train_ids), loss_of, recipe(args), system)
    model.eval()
    return t.score(predict(logits_of, t.test_ids)), log


def run(args, whole, t, system):
    from runtime.construct.train import loss_ends

    t0 = time.time()
    if system.startswith("hkstore"):
        score, log = run_hkstore(args, whole, t, 0.1 if system == "hkstore-drop" else 0.0)
    else:
        score, log = run_peft(args, whole, t, system)
    return {"score": score, "metric": "accuracy" if t.kind == "classification" else "entity_f1",
            "seconds": round(time.time() - t0, 1), "steps": len(log), **loss_ends(log)}


def markdown(results) -> str:
    rows, tasks = results["rows"], [t for t in TASK_ORDER if t in results["rows"]]
    lines = ["| system (dev, seed 0) | " + " | ".join(tasks) + " | mean | s / task |", "|---|" + "---|" * (len(tasks) + 2)]
    for s in SYSTEMS:
        cells = [rows[t].get(s) for t in tasks]
        if not any(cells):
            continue
        scores = [100 * c["score"] for c in cells if c]
        secs = [c["seconds"] for c in cells if c]
        lines.append(f"| {s} | " + " | ".join(f"{100 * c['score']:.1f}" if c else "" for c in cells)
                     + f" | {sum(scores) / len(scores):.1f}{'' if len(scores) == len(tasks) else ' (partial)'}"
                     + f" | {sum(secs) / len(secs):.0f} |")
    return "\n".join(lines) + "\n"


def save(out: Path, results):
    from hkstore.files import atomic_write_json

    atomic_write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(results))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(SCIBERT))
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="NCBI-disease,sciie")
    p.add_argument("--systems", default="hkstore,peft")
    p.add_argument("--max-train", type=int, default=600, help="as benchmarks.hmi_accuracy")
    p.add_argument("--max-test", type=int, default=400, help="as benchmarks.hmi_accuracy")
    p.add_argument("--max-len", type=int, default=64, help="as benchmarks.hmi_accuracy")
    p.add_argument("--seed", type=int, default=0, help="data subsamples, initialization, batch order")
    p.add_argument("--eval-split", choices=("dev", "test"), default="dev")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.06, help="warm-up share of the steps")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--scale", type=float, default=2.0, help="LoRA alpha / rank")
    p.add_argument("--progress", action="store_true", help="tqdm bars inside each training loop")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.systems = [s for s in args.systems.split(",") if s]
    if bad := [s for s in args.systems if s not in SYSTEMS]:
        p.error(f"unknown systems {bad}; expected some of {', '.join(SYSTEMS)}")
    if bad := [t for t in args.tasks if t not in TASK_ORDER]:
        p.error(f"unknown tasks {bad}; expected some of {', '.join(TASK_ORDER)}")
    return args


def load_results(args, out: Path) -> dict:
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    config = {k: getattr(args, k) for k in FIXED}
    if results.get("config") and (diff := [k for k in FIXED if results["config"].get(k) != config[k]]):
        raise SystemExit(f"{path} was made with other settings ({', '.join(diff)}); use another --out")
    results["config"] = config
    return results


def main(argv=None):
    args = parse(argv)
    import torch

    torch.set_num_threads(1)
    from benchmarks.hmi_accuracy import Task, prepare_data
    from runtime.model.encoder import load_encoder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(args, out)
    hargs = argparse.Namespace(tasks=args.tasks, data=args.data, max_train=args.max_train, max_test=args.max_test,
                               seed=args.seed, eval_split=args.eval_split, max_domain_docs=0, general="")
    data = prepare_data(hargs, out)
    whole = load_encoder(None, 0)
    todo = [(t, s) for t in args.tasks for s in args.systems if s not in results["rows"].get(t, {})]
    say(f"torch threads {torch.get_num_threads()}; {len(todo)} (task, system) runs: {todo}")
    seconds, task = [], None
    for n, (name, system) in enumerate(todo):
        if task is None or task.name != name:
            task = Task(name, data["tasks"][name], whole, args.max_len)
            task.train_path, task.max_len = data["tasks"][name]["train"], args.max_len
        say(f"[{n + 1}/{len(todo)}] {name} / {system}: {len(task.train_ids)} train, {len(task.test_ids)} "
            f"{args.eval_split}")
        r = run(args, whole, task, system)
        results["rows"].setdefault(name, {})[system] = r
        save(out, results)
        seconds.append(r["seconds"])
        eta = sum(seconds) / len(seconds) * (len(todo) - n - 1)
        say(f"{name} / {system}: {100 * r['score']:.1f} in {r['seconds']:.0f}s (loss {r['loss_first']:.3f} -> "
            f"{r['loss_last']:.4f}); {len(todo) - n - 1} left, ETA {eta / 60:.0f} min")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
