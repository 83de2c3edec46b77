"""Could an early exit inside the full-depth level buy the cascade's cost goal?

    python -m experiments.early_exit --out OUT --pets DEV_RUN/pets            # exits on frozen PETs
    python -m experiments.early_exit --out OUT --joint --tasks NCBI-disease    # PET + exits trained together
    python -m experiments.early_exit --report OUT --joint-run JOINT_OUT        # the table (--write: results file)

The cascade's cheap levels (students, the PLOT level) are separate models: a query they pass up
pays for them *and* for the top. An exit head after layer k of the top's own forward is a level
whose work is reused: a query that goes on pays only the remaining layers, so a cascade "exit at
k, else the top" costs share_k * k/6 + (1 - share_k) of the top (FLOP-proportional: the six
layers cost the same). This measures that bound on dev (the harness's sample, seed 0):

* frozen: a linear head per exit layer fit on the train split's hidden states of a trained
  full-depth PET (experiments.full_depth --save-pets), the PET unchanged;
* joint (--joint): the full-depth LoRA trained by its recipe with exit heads at --joint-exits,
  the loss the mean of every head's (DeeBERT-style), so the lower layers learn to be read early.

Confidence: the top softmax probability (classification), its minimum over a sentence's first
sub-tokens (tagging: the sentence exits only if every word is sure). For each exit, the threshold
with the lowest cost whose cascade stays within --tolerance points of the top on dev; that
threshold is then applied to the test split (the harness's sample of it), which reports the
score and the cost. FLOP-proportional cost, not a served result. Results per task in
OUT/results.json (resumable), the jointly trained PETs and exit heads in OUT/pets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.hmi_accuracy import SCIBERT

IGNORE = -100
T0 = time.time()


def say(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def hidden(whole, pet, xs, keep):
    """{layer: per-example (L, d) hidden states after that layer} for layers in keep (1..6)."""
    import torch

    from benchmarks.hmi_accuracy import padded

    out = {k: [] for k in keep}
    with torch.no_grad():
        for s in range(0, len(xs), 64):
            part = xs[s:s + 64]
            h, m = padded(part)
            for i in range(whole.config.num_layers):
                h = whole.layer(i, h, m, pet)
                if i + 1 in out:
                    out[i + 1] += [h[b, :len(x)].clone() for b, x in enumerate(part)]
    return out


def readout(kind, h):
    """What a head reads: [CLS] (classification) or every token (tagging)."""
    return h[..., 0, :] if kind == "classification" else h


def fit_probe(kind, states, labels, n, epochs=200, lr=5e-3):
    """A linear head on frozen states (full-batch-ish AdamW; the states are small)."""
    import torch
    import torch.nn.functional as F

    if kind == "classification":
        x, y = torch.stack([readout(kind, h) for h in states]), torch.as_tensor(labels)
    else:
        x, y = torch.cat(states), torch.cat([torch.as_tensor(t) for t in labels])
        x, y = x[y != IGNORE], y[y != IGNORE]
    lin = torch.nn.Linear(x.shape[1], n)
    opt = torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(512):
            opt.zero_grad()
            F.cross_entropy(lin(x[idx]), y[idx]).backward()
            opt.step()
    return lin.requires_grad_(False)


def train_joint(args, whole, t):
    """(exported full-depth PET, {layer: exit head}) trained together: mean of the heads' losses."""
    import torch

    from runtime.construct import recipe as recipes
    from runtime.construct.full import embeddings
    from runtime.construct.train import _dropout, _fit, _pad_inputs, _task_loss
    from runtime.model.pet import create_pet, export, head

    options, cfg = recipes.settings("lora", "full", seed=args.seed, progress=False)
    pet = create_pet(whole, "lora", t.kind, t.labels, level="full", seed=args.seed, **options)
    g = torch.Generator().manual_seed(args.seed + 7)
    heads = {k: torch.nn.Linear(whole.config.d, len(t.labels)) for k in args.joint_exits}
    for lin in heads.values():
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.02)
            lin.bias.zero_()
    inputs, drop = embeddings(whole, t.train_ids), _dropout(cfg)

    def loss_of(batch):
        x, real = _pad_inputs([inputs[j] for j in batch])
        x = drop("hidden", x) if drop else x
        labels, losses = [t.train_y[j] for j in batch], []
        for i in range(whole.config.num_layers):
            x = whole.layer(i, x, real, pet, drop)
            if i + 1 in heads:
                losses.append(_task_loss(t.kind, heads[i + 1](readout(t.kind, x)), labels))
        losses.append(_task_loss(t.kind, head(pet, x), labels))
        return sum(losses) / len(losses)

    params = list(pet.tensors.values()) + [p for lin in heads.values() for p in lin.parameters()]
    _fit(params, len(inputs), loss_of, cfg, "joint exits")
    return export(pet), {k: lin.requires_grad_(False) for k, lin in heads.items()}


def confidence(t, zs):
    """Per example: the top softmax probability, or for tagging its minimum over the sentence's
    first sub-tokens."""
    import torch

    if t.kind == "classification":
        return torch.stack([z.softmax(-1).max() for z in zs])
    out = []
    for z, y in zip(zs, t.test_y):
        first = torch.as_tensor(y) != IGNORE
        p = z.softmax(-1).max(-1).values
        out.append(p[first].min() if first.any() else p.min())
    return torch.stack(out)


def answers(t, exit_logits, top_logits):
    """(confidence, exit predictions, top predictions) per example: what every threshold reads."""
    return (confidence(t, exit_logits), [z.argmax(-1) for z in exit_logits], [z.argmax(-1) for z in top_logits])


def cascade_at(t, k, got, tau):
    """(score, share answered at the exit, cost vs the top) of "exit k if sure, else the top";
    got: answers()'s."""
    conf, exit_pred, top_pred = got
    use = (conf >= tau).tolist()
    share = sum(use) / len(use)
    pred = [(a if u else b).tolist() for a, b, u in zip(exit_pred, top_pred, use)]
    return t.score(pred), share, share * k / 6 + (1 - share)


def cascades(t, exit_logits, top_logits, tolerance):
    """Per exit: the cheapest threshold within tolerance of the top on t, and the oracle (exit
    exactly where the exit's answer is the top's)."""
    import torch

    top_pred = [z.argmax(-1) for z in top_logits]
    top = t.score([p.tolist() for p in top_pred])
    found = {}
    for k, zs in exit_logits.items():
        got, best = answers(t, zs, top_logits), None
        for tau in [*torch.linspace(0, 1, 401).tolist(), 1.01]:
            s, share, cost = cascade_at(t, k, got, tau)
            if s >= top - tolerance / 100 and (best is None or cost < best["cost"]):
                best = {"cost": round(cost, 3), "score": round(100 * s, 1), "share": round(share, 3),
                        "threshold": round(tau, 4)}
        pred = got[1]
        same = sum(bool(torch.equal(a, b)) for a, b in zip(pred, top_pred)) / len(pred)
        found[k] = {"alone": round(100 * t.score([p.tolist() for p in pred]), 1), "best": best,
                    "oracle_cost": round(same * k / 6 + (1 - same), 3)}
    return round(100 * top, 1), found


SECTION = "Early exits inside the full-depth level"  # docs/history/tabi-log.md
TASK_ORDER = ("chemprot", "citation_intent", "sci-cite", "bc5cdr", "NCBI-disease", "sciie")


def cheapest(found: dict) -> str:
    """The exit whose dev-chosen cascade costs least on dev (ties: the earlier exit)."""
    return min(found, key=lambda k: (found[k]["best"]["cost"], int(k)))


def _chosen(r: dict) -> list:
    """[top, "exit k", answered %, gap to top, cost vs top] on test of a run's entry for a task,
    k the exit whose dev-chosen cascade is cheapest on dev."""
    k = cheapest(r["dev"]["exits"])
    test = r["test"]["exits"][k]
    return [r["test"]["top"], f"exit {k}", round(100 * test["share"], 1), round(r["test"]["top"] - test["score"], 1),
            test["cost"]]


def report(frozen: dict, joint: dict | None = None) -> dict:
    """The results file's table: per task the frozen run's chosen cascade on test and, where the
    joint run has the task, its own (its top is its own PET's); means over each run's tasks."""
    import statistics

    tasks = [t for t in TASK_ORDER if t in frozen]
    rows, cols = [], {"frozen": [], "joint": []}
    for name in tasks:
        f = _chosen(frozen[name])
        j = _chosen(joint[name]) if joint and name in joint else ["", "", "", "", ""]
        cols["frozen"].append(f)
        if j[0] != "":
            cols["joint"].append(j)
        rows.append([name, *f, *j])

    def means(got):
        if not got:
            return ["", "", "", "", ""]
        return [round(statistics.mean(g[0] for g in got), 1), "", "", round(statistics.mean(g[3] for g in got), 2),
                round(statistics.mean(g[4] for g in got), 3)]

    rows.append([f"mean ({len(cols['frozen'])} / {len(cols['joint'])} tasks)", *means(cols["frozen"]),
                 *means(cols["joint"])])
    columns = ["task (test)", "top", "frozen: exit", "answered there %", "gap to top", "cost vs top",
               "joint: its top", "joint: exit", "answered there %", "gap to its top", "cost vs its top"]
    out = {"tables": [{"columns": columns, "rows": rows}], "tolerance": frozen["config"]["tolerance"],
           "frozen_cost_mean": means(cols["frozen"])[4]}
    if cols["joint"]:
        out["joint_cost_mean"] = means(cols["joint"])[4]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(SCIBERT))
    p.add_argument("--out", help="where the run writes (required unless --report)")
    p.add_argument("--tasks", default="NCBI-disease,chemprot,bc5cdr,citation_intent,sciie,sci-cite")
    p.add_argument("--pets", help="a full_depth run's pets/ (TASK-fd-lora.pt): exits on those, frozen")
    p.add_argument("--joint", action="store_true", help="train the PET and its exits together instead")
    p.add_argument("--joint-exits", default="2,3,4", help="exit layers trained with --joint")
    p.add_argument("--tolerance", type=float, default=1.0, help="points below the top a cascade may lose")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-train", type=int, default=600, help="as benchmarks.hmi_accuracy")
    p.add_argument("--report", type=Path, help="a frozen run's OUT: print its table (no training)")
    p.add_argument("--joint-run", type=Path, help="with --report: a --joint run's OUT, beside it")
    p.add_argument("--write", action="store_true", help="with --report: write docs/history/results/early_exit.json")
    args = p.parse_args(argv)
    if args.report:
        frozen = json.loads((args.report / "results.json").read_text())
        joint = json.loads((args.joint_run / "results.json").read_text()) if args.joint_run else None
        got = report(frozen, joint)
        from benchmarks.bench_runtime import md_table

        print(md_table(got["tables"][0]["columns"], got["tables"][0]["rows"]))
        if args.write:
            path = Path(__file__).resolve().parent.parent / "docs" / "history" / "results" / "early_exit.json"
            old = json.loads(path.read_text()) if path.exists() else {"section": SECTION}
            path.write_text(json.dumps(old | got, indent=1, ensure_ascii=False) + "\n")
        return 0
    if not args.out:
        p.error("--out is required")
    if bool(args.pets) == args.joint:
        p.error("give exactly one of --pets and --joint")
    args.joint_exits = [int(k) for k in args.joint_exits.split(",") if k]

    import torch

    torch.set_num_threads(1)
    from benchmarks.hmi_accuracy import Task, prepare_data
    from runtime.construct.full import embeddings
    from runtime.model.encoder import load_encoder
    from runtime.model.pet import head, load_pet

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in args.tasks.split(",") if t]

    def sample(split):
        hargs = argparse.Namespace(tasks=tasks, data=args.data, max_train=args.max_train, max_test=400, seed=0,
                                   eval_split=split, max_domain_docs=0, general="")
        return prepare_data(hargs, out)["tasks"]

    dev, test = sample("dev"), sample("test")  # the same train sample; evaluation files by split
    base, whole = load_encoder(None, 3), load_encoder(None, 0)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["config"] = {"mode": "joint" if args.joint else "frozen", "tolerance": args.tolerance,
                         "joint_exits": args.joint_exits, "seed": args.seed, "max_train": args.max_train}
    for name in tasks:
        if name in results:
            continue
        started = time.time()
        t, tt = Task(name, dev[name], base, 64), Task(name, test[name], base, 64)
        if args.joint:
            pet, heads = train_joint(args, whole, t)
            keep = sorted(heads)
            (out / "pets").mkdir(exist_ok=True)
            torch.save({"tensors": pet.tensors, "meta": pet.meta,
                        "exits": {k: lin.state_dict() for k, lin in heads.items()}}, out / "pets" / f"{name}.pt")
        else:
            blob = torch.load(Path(args.pets) / f"{name}-fd-lora.pt")
            pet, keep = load_pet(whole, blob["tensors"], blob["meta"]), [1, 2, 3, 4, 5]
            train_states = hidden(whole, pet, embeddings(whole, t.train_ids), keep)
            heads = {k: fit_probe(t.kind, train_states[k], t.train_y, len(t.labels)) for k in keep}

        def logits(task):
            states = hidden(whole, pet, embeddings(whole, task.test_ids), [*keep, 6])
            with torch.no_grad():
                return ({k: [heads[k](readout(task.kind, h)) for h in states[k]] for k in keep},
                        [head(pet, h[None])[0] for h in states[6]])

        (dev_exits, dev_top), (test_exits, test_top) = logits(t), logits(tt)
        dev_score, found = cascades(t, dev_exits, dev_top, args.tolerance)
        top = round(100 * tt.score([z.argmax(-1).tolist() for z in test_top]), 1)
        on_test = {}
        for k, f in found.items():  # the threshold chosen on dev, applied to test
            score, share, cost = cascade_at(tt, k, answers(tt, test_exits[k], test_top), f["best"]["threshold"])
            alone = tt.score([z.argmax(-1).tolist() for z in test_exits[k]])
            on_test[k] = {"score": round(100 * score, 1), "share": round(share, 3), "cost": round(cost, 3),
                          "alone": round(100 * alone, 1)}
        results[name] = {"dev": {"top": dev_score, "exits": found}, "test": {"top": top, "exits": on_test},
                         "seconds": round(time.time() - started, 1)}
        path.write_text(json.dumps(results, indent=1) + "\n")
        k = min(found, key=lambda k: found[k]["best"]["cost"])
        say(f"{name}: dev top {dev_score}, exits alone " + ", ".join(f"{k}: {f['alone']}" for k, f in found.items())
            + f"; cheapest on dev: exit {k} at {found[k]['best']['cost']} of the top. Test: top {top}, "
            + f"that cascade {on_test[k]['score']} at {on_test[k]['cost']} of the top")
    return 0


if __name__ == "__main__":
    sys.exit(main())
