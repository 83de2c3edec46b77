"""Feasibility of a "full-depth level": a tenant PET on every encoder layer (0..5), trained on
exact inputs (token ids -> the whole encoder), against full fine-tuning ("dedicated").

    python -m experiments.full_depth --out OUT

Same data as benchmarks.hmi_accuracy (its prepare_data: the seeded --max-train / --max-test
subsamples, --max-len), scored on --eval-split (dev to choose settings, test to report them). Rows:

  dedicated      the harness's row_dedicated: every weight + head, lr 2e-4, 6 epochs (its settings)
  fd-lora        LoRA r=16 (scale 2 = alpha 32) on q,k,v,o,ffn_in,ffn_out of layers 0..5 + head
  upper-lora     the same LoRA on layers 3..5 only, over exact full-context lower layers
                 (the "exact level")
  fd-adapter     Houlsby adapter (bottleneck 64, after o and ffn_out, + LayerNorm deltas: the
                 project's default adapter) on layers 0..5 + head
  fd-diff        diff pruning on all six projections of layers 0..5 + head: one dense delta
                 trained (lr --lr-diff, with the L1 penalty), then the largest |delta| of each
                 projection kept at every --densities; at --retrain-densities the kept entries
                 alone trained --retrain-epochs more (magnitude pruning, then retraining)
  upper-adapter  the harness's adapter-only PET (layers 3..5, exact lower) with the new recipe
  adapter-only   the harness's row_adapter_only, its current recipe (lr 2e-3, warm-up 10%)
  upper-lora8    the hplm-lora row's PET (LoRA r=8, scale 2, on q and v of layers 3..5) over exact
                 lower layers, its current recipe (--lr-lora 5e-3, warm-up 10%)
  upper-lora8-new  the same PET with the new recipe

The new recipe (fd-*, upper-*): AdamW lr --lr (1e-3), --epochs (10) epochs, linear warm-up over
--warmup (6%) of the steps then linear decay to zero, batch 16, weight decay 0.01, clip 1.0. It
is runtime.construct.train._fit's own schedule (warm-up + linear decay is already built in: its
TrainConfig.warmup, default 0.1), so the only changes from the harness's PET recipe are the
learning rate and the warm-up share: no LambdaLR of our own.

No model-side code is needed: an encoder loaded with lower_layers=0 has every layer "upper",
so create_pet accepts layers 0..5 and Encoder.upper(h, mask, pet) applies the PET on all six;
with h = Encoder.embed(ids) (frozen, so computed once per example) that is exactly the whole
encoder's forward with the PET (padded positions differ, but they are masked out of attention
and out of the loss). The PET is then trained by runtime.construct.train.train_pet unchanged.

Results after every (task, row) in OUT/results.json (resumable: finished rows are skipped;
a rerun with other training settings is refused) and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.hmi_accuracy import HELD_OUT, SCIBERT
from runtime.construct.full import embeddings
from runtime.construct.recipe import FULL

TASK_ORDER = ("NCBI-disease", "chemprot", "bc5cdr", "citation_intent", "sciie", "sci-cite")
KNOWN = TASK_ORDER + tuple(HELD_OUT)  # --tasks may name a held-out task (its own --data)
ROWS = ("dedicated", "fd-lora", "upper-lora", "fd-adapter", "fd-diff", "adapter-only", "upper-adapter", "upper-lora8",
        "upper-lora8-new")
TITLES = {
    "dedicated": "dedicated (full fine-tuning, harness recipe)",
    "fd-lora": "full-depth LoRA r16, all 6 targets, layers 0-5",
    "upper-lora": "upper-only LoRA r16, all 6 targets, layers 3-5 (exact lower)",
    "fd-adapter": "full-depth adapter b64 + LN deltas, layers 0-5",
    "fd-diff": "full-depth diff, six targets, layers 0-5 (score at the first density)",
    "adapter-only": "adapter-only, layers 3-5 (harness recipe: lr 2e-3, warm-up 10%)",
    "upper-adapter": "adapter-only, layers 3-5, new recipe",
    "upper-lora8": "hplm-lora PET (r8, q+v, layers 3-5) on exact lower, harness recipe (lr 5e-3, warm-up 10%)",
    "upper-lora8-new": "hplm-lora PET (r8, q+v, layers 3-5) on exact lower, new recipe",
}
# Settings a finished row's meaning depends on: a rerun must keep them.
FIXED = ("max_train", "max_test", "max_len", "seed", "data_seed", "eval_split", "batch_size", "epochs", "lr", "warmup",
         "rank", "scale", "bottleneck", "epochs_full", "lr_full", "lr_adapter", "lr_lora", "lr_diff", "densities",
         "retrain_densities", "retrain_epochs")
T0 = time.time()


def say(msg):
    wall = time.time() - T0
    print(f"[{wall:7.1f}s wall, cpu {time.process_time():7.1f}s] {msg}", flush=True)


def new_recipe(args):
    from runtime.construct.train import TrainConfig

    return TrainConfig(lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, warmup=args.warmup,
                       seed=args.seed, progress=args.progress)


def scored(t, encoder, pet, xs) -> float:
    """t's score of pet's predictions on inputs xs (through the encoder's PET layers)."""
    from runtime.model.pet import head
    from benchmarks.hmi_accuracy import padded, predict

    return t.score(predict(lambda b: head(pet, encoder.upper(*padded(b), pet)), xs))


def pet_row(args, encoder, t, inputs_of, pet_type, layers, recipe=None, **options):
    """Train a PET of pet_type on `layers` of encoder (new recipe) on inputs_of(ids) and score it."""
    from runtime.construct.train import train_pet
    from runtime.model.pet import create_pet

    pet = create_pet(encoder, pet_type, t.kind, t.labels, layers=list(layers), seed=args.seed, **options)
    train_x, test_x = inputs_of(encoder, t.train_ids), inputs_of(encoder, t.test_ids)
    trained, log = train_pet(encoder, pet, train_x, t.train_y, recipe or new_recipe(args))
    return scored(t, encoder, trained, test_x), log, trained


def fd_lora(args, whole, t):
    """The full-depth PET as tenant create trains it (runtime.construct.full.train_full: the
    recipe), with this run's settings, which default to the recipe's."""
    from runtime.construct.full import train_full

    trained, log, _ = train_full(whole, t.kind, t.labels, t.train_ids, t.train_y, lr=args.lr, epochs=args.epochs,
                                 warmup=args.warmup, batch_size=args.batch_size, rank=args.rank, scale=args.scale,
                                 seed=args.seed, progress=args.progress)
    return scored(t, whole, trained, embeddings(whole, t.test_ids)), log, trained


def kept_only(whole, sparse):
    """A pruned diff back in training form with its kept entries the only ones that learn:
    the other gradients are zeroed, so AdamW (and the L1 penalty, whose gradient at 0 is 0)
    leaves them at 0 and export keeps the same entries."""
    import torch

    from runtime.construct.train import trainable

    dense = trainable(whole, sparse)
    for name, delta in dense.tensors.items():
        if name.endswith(".delta"):
            mask = torch.zeros(delta.numel())
            mask[sparse.tensors[name[:-len("delta")] + "index"].long()] = 1.0
            delta.register_hook(lambda g, m=mask.view_as(delta): g * m)
    return dense


def fd_diff(args, whole, t):
    """The fd-diff row: (score at the first density, losses, the PET at it, per-density results).
    Bytes are as a full-depth record stores a diff: an int32 index and an fp16 value per entry."""
    from runtime.construct.train import TrainConfig, train_pet
    from runtime.model.pet import TARGETS, Pet, create_pet, export

    train_x, test_x = embeddings(whole, t.train_ids), embeddings(whole, t.test_ids)

    def cfg(epochs):
        return TrainConfig(lr=args.lr_diff, epochs=epochs, batch_size=args.batch_size, warmup=args.warmup,
                           seed=args.seed, progress=args.progress)

    def stored(p):
        return sum(v.numel() * (4 if k.endswith(".index") else 2) for k, v in p.tensors.items()
                   if not k.startswith("head."))

    dense = create_pet(whole, "diff", t.kind, t.labels, level="full", layers=list(range(6)), targets=TARGETS,
                       density=args.densities[0], seed=args.seed)
    _, log = train_pet(whole, dense, train_x, t.train_y, cfg(args.epochs))
    by, first = {}, None
    for d in args.densities:
        sparse = export(Pet(dense.tensors, {**dense.meta, "density": d}))
        first = first or sparse
        entry = {"score": scored(t, whole, sparse, test_x), "pet_bytes_stored": stored(sparse)}
        if d in args.retrain_densities:
            again, more = train_pet(whole, kept_only(whole, sparse), train_x, t.train_y, cfg(args.retrain_epochs))
            entry |= {"retrained_score": scored(t, whole, again, test_x), "retrained_bytes_stored": stored(again),
                      "retrain_loss_last": more[-1]}
        by[f"{d:g}"] = entry
        say(f"{t.name} / fd-diff at density {d:g}: {100 * entry['score']:.1f}"
            + (f", retrained {100 * entry['retrained_score']:.1f}" if "retrained_score" in entry else ""))
    return by[f"{args.densities[0]:g}"]["score"], log, first, by


def pet_bytes(pet, encoder_bytes):
    total = sum(v.numel() * v.element_size() for v in pet.tensors.values())
    body = sum(v.numel() * v.element_size() for k, v in pet.tensors.items() if not k.startswith("head."))
    return {"pet_bytes": total, "pet_bytes_no_head": body, "pet_share_of_encoder": round(total / encoder_bytes, 5),
            "pet_meta": {k: v for k, v in pet.meta.items() if k != "labels"}}


def save_pet(path: Path, pet):
    """The trained PET in index form (runtime.model.pet.export), for later evaluation (int8, cascades)."""
    import torch
    from runtime.model.pet import export

    path.parent.mkdir(parents=True, exist_ok=True)
    done = export(pet)
    torch.save({"tensors": done.tensors, "meta": done.meta}, path)


def run_row(args, ctx, t, row):
    from runtime.model.pet import TARGETS
    from benchmarks.hmi_accuracy import cfg, full_lower, row_adapter_only, row_dedicated

    t0 = time.time()
    extra, pet = {}, None
    whole, base = ctx["whole0"], ctx["base"]
    lora = {"targets": TARGETS, "rank": args.rank, "scale": args.scale}
    if row == "dedicated":
        score, log = row_dedicated(args, ctx, t)
    elif row == "adapter-only":
        score, log = row_adapter_only(args, ctx, t)
    elif row == "fd-lora":
        score, log, pet = fd_lora(args, whole, t)
        extra = pet_bytes(pet, ctx["encoder_bytes"])
    elif row == "fd-diff":
        score, log, pet, by = fd_diff(args, whole, t)
        extra = pet_bytes(pet, ctx["encoder_bytes"]) | {"by_density": by}
    elif row == "upper-lora":
        score, log, pet = pet_row(args, base, t, full_lower, "lora", range(3, 6), **lora)
        extra = pet_bytes(pet, ctx["encoder_bytes"])
    elif row == "fd-adapter":
        score, log, pet = pet_row(args, whole, t, embeddings, "adapter", range(6), bottleneck=args.bottleneck)
        extra = pet_bytes(pet, ctx["encoder_bytes"])
    elif row == "upper-adapter":
        score, log, pet = pet_row(args, base, t, full_lower, "adapter", range(3, 6), bottleneck=args.bottleneck)
        extra = pet_bytes(pet, ctx["encoder_bytes"])
    elif row in ("upper-lora8", "upper-lora8-new"):
        old = cfg(args, args.lr_lora)  # the harness's: warm-up TrainConfig's default 10%
        recipe = old if row == "upper-lora8" else None
        score, log, pet = pet_row(args, base, t, full_lower, "lora", range(3, 6), recipe=recipe,
                                  targets=("q", "v"), rank=8, scale=2.0)
        extra = pet_bytes(pet, ctx["encoder_bytes"])
    else:
        raise ValueError(row)
    seconds = time.time() - t0
    if args.save_pets and pet is not None:
        save_pet(Path(args.out) / "pets" / f"{t.name}-{row}.pt", pet)
    return {"score": score, "metric": "accuracy" if t.kind == "classification" else "entity_f1",
            "seconds": round(seconds, 1), "steps": len(log), "s_per_step": round(seconds / max(len(log), 1), 3),
            "loss_first": log[0], "loss_last": log[-1], **extra}


def markdown(results) -> str:
    rows, tasks = results["rows"], [t for t in KNOWN if t in results["rows"]]
    lines = ["| row (dev, seed 0) | " + " | ".join(tasks) + " | mean | mean gap to dedicated | s / task |",
             "|---|" + "---|" * (len(tasks) + 3)]
    for row in ROWS:
        cells = [rows[t].get(row) for t in tasks]
        if not any(cells):
            continue
        scores = [100 * c["score"] for c in cells if c]
        done = len(scores) == len(tasks)
        mean = sum(scores) / len(scores) if scores else 0
        gaps = [100 * (rows[t][row]["score"] - rows[t]["dedicated"]["score"])
                for t in tasks if row in rows[t] and "dedicated" in rows[t]]
        gap = f"{sum(gaps) / len(gaps):+.1f}" if gaps and row != "dedicated" else "–"
        secs = [c["seconds"] for c in cells if c]
        lines.append(f"| {TITLES[row]} | " + " | ".join(f"{100 * c['score']:.1f}" if c else "" for c in cells)
                     + f" | {mean:.1f}{'' if done else ' (partial)'} | {gap} | {sum(secs) / len(secs):.0f} |")
    lines += ["", "Per-task gap to dedicated (points):", "",
              "| row | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for row in ROWS[1:]:
        if any(row in rows[t] for t in tasks):
            lines.append(f"| {row} | " + " | ".join(
                f"{100 * (rows[t][row]['score'] - rows[t]['dedicated']['score']):+.1f}"
                if row in rows[t] and "dedicated" in rows[t] else "" for t in tasks) + " |")
    sizes = {row: c for t in tasks for row, c in rows[t].items() if "pet_bytes" in c}
    if sizes:
        lines += ["", f"Encoder fp32 bytes: {results['encoder_bytes']:,}", ""]
        for row, c in sizes.items():
            lines.append(f"- {row}: {c['pet_bytes_no_head']:,} bytes without the head "
                         f"({100 * c['pet_bytes_no_head'] / results['encoder_bytes']:.2f}% of the encoder; "
                         f"with the last task's head {c['pet_bytes']:,})")
    return "\n".join(lines) + "\n"


def save(out: Path, results):
    from hkstore.files import atomic_write_json

    atomic_write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(SCIBERT))
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default=",".join(TASK_ORDER))
    p.add_argument("--rows", default="dedicated,fd-lora,upper-lora")
    p.add_argument("--max-train", type=int, default=600, help="as benchmarks.hmi_accuracy")
    p.add_argument("--max-test", type=int, default=400, help="as benchmarks.hmi_accuracy")
    p.add_argument("--max-len", type=int, default=64, help="as benchmarks.hmi_accuracy")
    p.add_argument("--seed", type=int, default=0, help="training seed (PET initialisation, example order)")
    p.add_argument("--data-seed", type=int, default=0,
                   help="the --max-train / --max-test subsamples' seed (the harness's extra seeds keep 0)")
    p.add_argument("--eval-split", choices=("dev", "test"), default="dev",
                   help="score on dev (choosing settings) or test (reporting the chosen ones)")
    p.add_argument("--batch-size", type=int, default=16)
    # The new recipe is the product's full-depth recipe (runtime.construct.recipe.FULL["lora"]).
    p.add_argument("--epochs", type=int, default=FULL["lora"].epochs,
                   help="PET rows (and the harness's adapter-only row)")
    p.add_argument("--lr", type=float, default=FULL["lora"].lr, help="the new recipe's learning rate (PET rows)")
    p.add_argument("--warmup", type=float, default=FULL["lora"].warmup,
                   help="the new recipe's warm-up share of the steps")
    p.add_argument("--rank", type=int, default=FULL["lora"].options["rank"])
    p.add_argument("--scale", type=float, default=FULL["lora"].options["scale"], help="LoRA alpha / rank")
    p.add_argument("--bottleneck", type=int, default=64)
    p.add_argument("--epochs-full", type=int, default=6, help="dedicated (the harness's default)")
    p.add_argument("--lr-full", type=float, default=2e-4, help="dedicated (the harness's default)")
    p.add_argument("--lr-adapter", type=float, default=2e-3, help="adapter-only row (the harness's default)")
    p.add_argument("--lr-lora", type=float, default=5e-3, help="upper-lora8 row (the harness's hplm-lora default)")
    p.add_argument("--lr-diff", type=float, default=2e-4,
                   help="fd-diff row (full fine-tuning's chosen rate: a dense delta moves every weight)")
    p.add_argument("--densities", default="0.005,0.01,0.02,0.035",
                   help="fd-diff row: shares of each projection's weights kept (comma-separated)")
    p.add_argument("--retrain-densities", default="0.02", help="fd-diff row: those retrained after pruning")
    p.add_argument("--retrain-epochs", type=int, default=3, help="fd-diff row: epochs on the kept entries")
    p.add_argument("--progress", action="store_true", help="tqdm bars inside each training loop")
    p.add_argument("--save-pets", action="store_true", help="keep each trained PET in OUT/pets/TASK-ROW.pt")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.densities = [float(d) for d in args.densities.split(",") if d]
    args.retrain_densities = [float(d) for d in args.retrain_densities.split(",") if d]
    if not args.densities or not all(0 < d <= 1 for d in args.densities + args.retrain_densities):
        p.error("densities must be in (0, 1]")
    rows = [r for r in args.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        p.error(f"unknown rows {bad}; expected some of {', '.join(ROWS)}")
    if bad := [t for t in args.tasks if t not in KNOWN]:
        p.error(f"unknown tasks {bad}")

    import torch

    torch.set_num_threads(1)
    from runtime.model.encoder import load_encoder
    from benchmarks.hmi_accuracy import Task, prepare_data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    config = {k: getattr(args, k) for k in FIXED}
    # the fd-lora row trains by the product's recipe: its dropout is part of a row's meaning
    config |= {"dropout": FULL["lora"].dropout, "lora_dropout": FULL["lora"].lora_dropout}
    # A setting the saved run predates counts as today's (it has no row that depends on it), but a
    # run made before the recipe had dropout was made without it.
    saved = dict(results.get("config") or {})
    if saved:
        saved.setdefault("dropout", 0.0)
        saved.setdefault("lora_dropout", 0.0)
    if saved and (diff := [k for k in config if saved.get(k, config[k]) != config[k]]):
        raise SystemExit(f"{path} was made with other settings ({', '.join(diff)}); use another --out")
    results["config"] = config

    # The harness's sampling (its args: tasks, data, max_train, max_test, seed, eval_split,
    # max_domain_docs, general); it also writes the (unused here) corpora under OUT/data.
    hargs = argparse.Namespace(tasks=args.tasks, data=args.data, max_train=args.max_train, max_test=args.max_test,
                               seed=args.data_seed, eval_split=args.eval_split, max_domain_docs=0, general="")
    data = prepare_data(hargs, out)
    base = load_encoder(None, 3)
    whole0 = load_encoder(None, 0)  # every layer "upper": PETs may sit on 0..5
    encoder_bytes = sum(v.numel() * v.element_size() for v in base.state_dict().values())
    results["encoder_bytes"] = encoder_bytes
    ctx = {"base": base, "whole0": whole0, "encoder_bytes": encoder_bytes}
    say(f"torch threads {torch.get_num_threads()}; encoder {encoder_bytes:,} fp32 bytes; "
        f"tasks {args.tasks}; rows {rows}")

    todo = [(t, r) for t in args.tasks for r in rows if r not in results["rows"].get(t, {})]
    timings: dict[str, list[float]] = {}
    for t in results["rows"].values():
        for r, c in t.items():
            timings.setdefault(r, []).append(c["seconds"])
    task, name = None, None
    for n, (tname, row) in enumerate(todo):
        if tname != name:
            task, name = Task(tname, data["tasks"][tname], base, args.max_len), tname
        say(f"[{n + 1}/{len(todo)}] {tname} / {row}: {len(task.train_ids)} train, "
            f"{len(task.test_ids)} {args.eval_split} examples")
        r = run_row(args, ctx, task, row)
        results["rows"].setdefault(tname, {})[row] = r
        save(out, results)
        timings.setdefault(row, []).append(r["seconds"])
        every = [s for v in timings.values() for s in v]
        left = sum(sum(timings.get(rr, every)) / len(timings.get(rr, every)) for _, rr in todo[n + 1:])
        say(f"{tname} / {row}: {100 * r['score']:.1f} in {r['seconds']:.0f}s ({r['steps']} steps, "
            f"{r['s_per_step']:.2f} s/step, loss {r['loss_first']:.3f} -> {r['loss_last']:.4f}); "
            f"{len(todo) - n - 1} rows left, ETA {left / 60:.0f} min")
    save(out, results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
