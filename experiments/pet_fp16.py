"""Full-depth PETs in fp32 against the same PETs as their records store them (fp16 layer tensors,
fp32 head: runtime.construct.full.stored_tensors), served as full rows on the task's dev sample.

Both are scored through the serving path (the CPU executor; the fp16 PET held in fp16 as the
runtime's host cache holds it, computed in fp32), on the dev sample of experiments.int8_accuracy
(600/400, max-len 64, seed 0). Per task: the fp32 score, the fp16 score, their difference,
the share of dev predictions (per example, or per token for tagging) that changed and the
largest logit gap over the first batch.

    python -m experiments.pet_fp16 RUN/pets --out OUT [--tasks sciie,chemprot]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.int8_accuracy import dev_tasks, full_rows, load_full_pets, score_full, serve


def compare(encoder, pets, tasks, batch) -> dict:
    """{task: {metric, examples, fp32, fp16, fp16 - fp32, changed %}} of each PET and its fp16 record's form."""
    from runtime.construct.full import stored_tensors
    from runtime.exec.cpu import CpuExecutor
    from runtime.model.pet import load_pet

    ex = CpuExecutor(encoder, prefetch=False)
    out = {}
    for name, task in tasks.items():
        pet = pets[name]
        half = load_pet(encoder, stored_tensors(pet.tensors), pet.meta, half=True)
        servings = {"fp32": ex.load_pet(pet, key=name), "fp16": ex.load_pet(half, key=name)}
        r = score_full({"fp32": ex, "fp16": ex}, servings, task, batch)
        out[name] = {"metric": "accuracy" if task.kind == "classification" else "entity F1",
                     "examples": len(task.test_ids), "fp32": round(r["fp32"]["score"], 3),
                     "fp16": round(r["fp16"]["score"], 3),
                     "fp16 - fp32": round(r["fp16"]["score"] - r["fp32"]["score"], 3),
                     "changed %": round(100 - r["fp16"]["agree"], 3),
                     "max |logit gap|": logit_gap(ex, servings, task.test_ids[:batch])}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def logit_gap(ex, servings, ids) -> float:
    """The largest |fp16 - fp32| logit over ids (predictions alone hide a gap short of a flip)."""
    got = {k: serve(ex, full_rows(p, ids)) for k, p in servings.items()}
    return float(max(abs(a - b).max() for a, b in zip(got["fp16"], got["fp32"])))


def main(argv=None):
    import torch

    from runtime.model.encoder import load_encoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pets", help="a directory of TASK-ROW.pt full-depth PETs (experiments.full_depth --save-pets)")
    ap.add_argument("--out", required=True, help="where the sampled data and pet-fp16.json go")
    ap.add_argument("--row", default="fd-lora", help="the saved PETs' row name")
    ap.add_argument("--tasks", help="comma-separated task names (default: every saved PET's)")
    ap.add_argument("--data", help="the SciBERT task data (default: benchmarks.hmi_accuracy's)")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    encoder = load_encoder(None, 2)  # full rows run every layer whatever the split
    pets = load_full_pets(args.pets, args.row, encoder)
    if args.tasks:
        wanted = args.tasks.split(",")
        if missing := [t for t in wanted if t not in pets]:
            ap.error(f"no saved {args.row} PET for {missing} in {args.pets}")
        pets = {t: pets[t] for t in wanted}
    if not pets:
        ap.error(f"no {args.row} PETs in {args.pets}")
    tasks = dev_tasks(pets, encoder, args.out, args.data)
    result = {"pets": args.pets, "row": args.row, "tasks": compare(encoder, pets, tasks, args.batch_size)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pet-fp16.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
