"""HMI Table 3 / Table 5 analogue on the SciBERT benchmark tasks, on a 2-core CPU.

    python -m benchmarks.hmi_accuracy --data ../shared/data/scibert --out OUT

Tasks: chemprot, citation_intent, sci-cite (accuracy); bc5cdr, NCBI-disease, sciie (entity F1).
Domains: biology (chemprot, bc5cdr, NCBI-disease), cs (citation_intent, sciie), biomed (sci-cite).

Rows (Table 3):
  dedicated     full fine-tuning of every layer (embeddings included) + head, per task
  shared        the frozen encoder, a head only
  adapter-only  lower layers computed in full context, adapter + head above
  plot-only     PLOT inputs of the task's domain branch, the upper layers fully fine-tuned + head
  hplm          PLOT of the domain branch + adapter (Houlsby: after attention and after the FFN,
                bottleneck 64, plus LayerNorm deltas): a tenant made by
                runtime.construct.manager.tenant_create and scored by tenant_eval, i.e. through the
                serving path (runtime.plot.retrieve)
  hplm-grown    the hplm row's tenant (same PET), served from a child of its domain version grown
                with the windows of the evaluation text it served only by backing off, valued by
                the domain's lower layers (`hkstore domain grow`): the PLOT as a cache that grows
                with a tenant's traffic (text, never labels). Needs the hplm row first.
  hplm-lora     the same with LoRA (the recipe's: r16 on all six projections, lr 2e-3), what
                tenant create trains by default
  hplm-wide     hplm with a wider adapter (bottleneck --wide-bottleneck, default 256): how much
                of the gap to dedicated is the adapter's capacity, at what cost in bytes
  hplm-full     hplm with every upper-layer weight tuned (a dense diff PET, density 1, lr
                --lr-diff): the PLOT-only row as a real tenant, trained as served (--unseen)
  full          the full-depth PET `hkstore tenant create` trains beside the PLOT one (its level
                "full"): runtime.construct.full.train_full with the recipe's settings (LoRA r16 on
                every target of every layer, lr 1e-3, 6% warm-up; --batch-size and --seed apply) on
                the base encoder's embeddings; not among the default rows (ask for it by --rows)
The PET rows' settings (epochs, batch size, learning rates, adapter bottleneck, LoRA rank) are
the product's recipe (runtime.construct.recipe): the options' defaults come from it, so a row
measures the tenant `hkstore tenant create` makes unless an option overrides it.
--lower-layers is the split (default 3 of all-MiniLM-L6-v2's 6: half, as HMI splits BERT-base):
the layers the PLOT replaces; PETs and the upper-layer rows work on the rest. The dedicated and
shared rows do not depend on it.
Table 5: the domain branch at alpha in {0, 30, 50, 100}% (hplm adapter rows; alpha 0 = an
empty branch: everything from the root) with the branch's bytes. Ablation of window
distillation (HMI builds on the pretrained layers; SkipBERT distills them): root PLOT + adapter
tenants on a root without distillation (with and without its position table) and on the
distilled root, and domain PLOT + adapter tenants on a domain branch without distillation;
and the hPLM tenant without the adapter's LayerNorm deltas. --extra-seeds repeats the
dedicated and hPLM rows (those of SEED_ROWS in --rows) under other training seeds (same data
and store), so the gap between them is reported with its seed noise.

The store: the root PLOT is built from the unlabeled text of every task's sampled train and
test examples (a stand-in for HMI's general corpus) by the base lower layers window-distilled
for --distill-steps (`hkstore build --distill-steps`); a domain version is the base lower
layers further pre-trained (MLM) on its tasks' train text (up to --max-domain-docs documents per
task, labels unused), then window-distilled toward themselves for --domain-distill-steps
starting from the root's distilled layers (`hkstore domain create --distill-steps`), plus the
top-alpha% n-grams of that text. Every version's position table is fitted
(runtime.construct.plot.fit_position). Everything is subsampled (--max-train/--max-test/--max-len) and
epochs are capped (10 for the PET / head / upper-layer rows, 6 for full fine-tuning, at lr 2e-4: both chosen on dev) so the
run takes about 100 minutes on 2 idle cores (2 h 20 min with --extra-seeds 1,2). Results go to
OUT/results.json (resumable per (task, row): finished rows are skipped on a rerun) and
OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime.construct.recipe import PLOT

# the suite where the project's machines keep it: beside the repository, never inside it
SCIBERT = Path(__file__).resolve().parents[2] / "shared" / "data" / "scibert"
TASKS = {  # name: (task kind, directory under --data, domain)
    "chemprot": ("classification", "text_classification/chemprot", "biology"),
    "citation_intent": ("classification", "text_classification/citation_intent", "cs"),
    "sci-cite": ("classification", "text_classification/sci-cite", "biomed"),
    "bc5cdr": ("tagging", "ner/bc5cdr", "biology"),
    "NCBI-disease": ("tagging", "ner/NCBI-disease", "biology"),
    "sciie": ("tagging", "ner/sciie", "cs"),
}
# Tasks outside the suite (experiments.heldout_task writes them under a --data root of their own):
# a run may name them, none runs them by default.
HELD_OUT = {"sciie-task-method": ("classification", "text_classification/sciie-task-method", "cs")}
ROWS = ("dedicated", "shared", "adapter-only", "plot-only", "hplm", "hplm-grown", "hplm-lora", "hplm-wide", "hplm-full",
        "full")
DEFAULT_ROWS = ROWS[:-1]  # the full row is asked for by name (--rows): it lengthens a run by about a third
ROW_TITLES = {
    "dedicated": "dedicated (full fine-tuning)",
    "shared": "shared (frozen encoder, head only)",
    "adapter-only": "adapter-only (full lower + adapter)",
    "plot-only": "PLOT-only (domain PLOT + upper fine-tuning)",
    "hplm": "hPLM (domain PLOT + adapter)",
    "hplm-grown": "hPLM, PLOT grown with the evaluation text's missed windows",
    "hplm-lora": "hPLM with LoRA r16 (the shipped default)",
    "hplm-wide": "hPLM, adapter bottleneck {wide_bottleneck}",
    "hplm-full": "hPLM, every upper-layer weight tuned (dense diff PET)",
    "full": "full-depth LoRA (every layer, exact inputs: tenant create's full level)",
}
VARIANTS = {  # ablation rows -> title; "root-plain*" read OUT/store-plain, whose root is not distilled
    "root-plain-nopos": "root PLOT, no distillation, no position table",
    "root-plain": "root PLOT, no distillation",
    "root": "root PLOT, distilled",
    "domain-mlm": "domain PLOT, MLM only (no distillation)",
    "domain": "domain PLOT, MLM + distillation (the hPLM row)",
    "domain-nonorm": "domain PLOT, MLM + distillation; adapter without its LayerNorm deltas",
}
ALPHAS = (0, 30, 50, 100)
SEED_ROWS = ("dedicated", "hplm", "hplm-lora", "hplm-grown", "hplm-wide", "hplm-full")  # the rows the goal compares, repeated under --extra-seeds
T0 = time.time()


def title(row, results) -> str:
    return ROW_TITLES[row].format(wide_bottleneck=results.get("config", {}).get("wide_bottleneck", 256))


def say(msg):
    wall = time.time() - T0
    print(f"[{wall:7.1f}s wall, {time.process_time() / max(wall, 1e-9) * 50:3.0f}% of 2 cores] {msg}", flush=True)


# -- data -------------------------------------------------------------------------------------


def prepare_data(args, out: Path) -> dict:
    """Sample each task's train and evaluation examples (seeded) into OUT/data, plus the corpora.

    The root corpus is the general text (--general: WikiText-2 valid) plus every task's sampled
    train text; a domain corpus is its tasks' train text. No evaluation text (dev or test, of
    any task) enters a corpus: a line equal to one is dropped and counted (the suite repeats a
    few sentences across its splits), so every evaluation window is one no table was built from.
    """
    from runtime.construct.manager import _subsample, read_task

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    tasks, root_texts, domain_texts, held_out = {}, [], {}, set()
    for name in args.tasks:
        kind, sub, domain = (TASKS | HELD_OUT)[name]
        files = {}
        for split, cap in (("train", args.max_train), ("eval", args.max_test)):
            source = "train" if split == "train" else args.eval_split
            (x, y), _ = read_task(Path(args.data) / sub / f"{source}.txt", kind)
            pick = _subsample(len(x), cap, args.seed)
            x, y = [x[i] for i in pick], [y[i] for i in pick]
            path = data_dir / f"{name}.{source}.{'jsonl' if kind == 'classification' else 'conll'}"
            write_task(path, kind, x, y)
            files[split] = str(path)
            if split == "train":
                root_texts += texts_of(kind, x)
        for source in ("dev", "test"):  # both held out, whichever is evaluated
            (x, _), _ = read_task(Path(args.data) / sub / f"{source}.txt", kind)
            held_out.update(" ".join(t.split()) for t in texts_of(kind, x))
        (full_x, _), _ = read_task(Path(args.data) / sub / "train.txt", kind)
        full_x = [full_x[i] for i in _subsample(len(full_x), args.max_domain_docs, args.seed)]
        domain_texts.setdefault(domain, []).extend(texts_of(kind, full_x))
        tasks[name] = {"kind": kind, "domain": domain, "eval_split": args.eval_split, **files}
    if args.general:
        root_texts = general_text(args.general) + root_texts
    corpora, dropped = {"root": str(data_dir / "root.txt")}, {}
    dropped["root"] = write_lines(corpora["root"], root_texts, held_out)
    for domain, texts in domain_texts.items():
        corpora[domain] = str(data_dir / f"domain-{domain}.txt")
        dropped[domain] = write_lines(corpora[domain], texts, held_out)
    return {"tasks": tasks, "corpora": corpora, "dropped_eval_lines": dropped}


def texts_of(kind, x) -> list[str]:
    return list(x) if kind == "classification" else [" ".join(words) for words in x]


def general_text(path) -> list[str]:
    """WikiText paragraphs, one a line; headings (`= Title =`) and blank lines skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not (line.startswith("=") and line.endswith("=")):
                out.append(line)
    return out


def write_lines(path, texts, held_out=frozenset()) -> int:
    """Write one normalized text a line, skipping texts in held_out; the number skipped."""
    dropped = 0
    with open(path, "w") as f:
        for t in texts:
            t = " ".join(t.split())
            if t in held_out:
                dropped += 1
            elif t:
                f.write(t + "\n")
    return dropped


def write_task(path, kind, x, y):
    with open(path, "w") as f:
        if kind == "classification":
            for text, label in zip(x, y):
                f.write(json.dumps({"text": text, "label": label}) + "\n")
        else:
            for words, tags in zip(x, y):
                f.write("".join(f"{w}\t{t}\n" for w, t in zip(words, tags)) + "\n")


# -- scoring ----------------------------------------------------------------------------------


class Task:
    """A task's encoded train and test sets, shared by the baseline rows."""

    def __init__(self, name, info, encoder, max_len):
        from runtime.construct.manager import encode_eval, encode_task, read_task

        self.name, self.kind = name, info["kind"]
        (x, y), self.labels = read_task(info["train"], self.kind)
        self.train_ids, self.train_y = encode_task(encoder, (x, y), self.kind, self.labels, max_len)
        (tx, ty), _ = read_task(info["eval"], self.kind)
        self.test_words, self.test_gold = tx, ty
        self.test_ids, self.test_y = encode_eval(encoder, (tx, ty), self.kind, self.labels, max_len)

    def score(self, predicted) -> float:
        from runtime.construct.data import accuracy, entity_f1, word_tags

        if self.kind == "classification":
            return accuracy(self.test_y, predicted)
        pred = [word_tags(p, t, self.labels, len(w)) for p, t, w in zip(predicted, self.test_y, self.test_words)]
        gold = [[t if t in self.labels else "O" for t in ts] for ts in self.test_gold]
        return entity_f1(gold, pred)


def predict(logits_of, items, batch=64):
    """argmax predictions (per example or per token) of logits_of(list of items) in batches."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(items), batch):
            out += logits_of(items[start:start + batch]).argmax(-1).tolist()
    return out


def full_lower(encoder, seqs, batch=64):
    """Full-context lower-layer outputs, one (L, d) tensor per sequence."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(seqs), batch):
            part = seqs[start:start + batch]
            h = encoder.lower(*encoder.pad(part))
            out += [h[b, :len(s)].clone() for b, s in enumerate(part)]
    return out


def padded(xs):
    from runtime.construct.train import _pad_inputs

    return _pad_inputs(xs)


# -- rows ------------------------------------------------------------------------------------


def cfg(args, lr, epochs=None):
    from runtime.construct.train import TrainConfig

    return TrainConfig(lr=lr, epochs=epochs or args.epochs, batch_size=args.batch_size, seed=args.seed,
                       progress=args.progress)


def row_dedicated(args, ctx, t: Task):
    from runtime.model.pet import create_pet, head
    from runtime.construct.train import train_full

    base = ctx["base"]
    student, hd, log = train_full(base, create_pet(base, "head", t.kind, t.labels, seed=args.seed),
                                  t.train_ids, t.train_y, cfg(args, args.lr_full, args.epochs_full))
    return t.score(predict(lambda b: head(hd, student(*student.pad(b), hd)), t.test_ids)), log


def row_shared(args, ctx, t: Task):
    from runtime.model.pet import create_pet, head
    from runtime.construct.train import train_pet

    whole = ctx["whole"]  # the same weights with every layer "lower": upper() is the identity
    train_x, test_x = full_lower(whole, t.train_ids), full_lower(whole, t.test_ids)
    pet, log = train_pet(whole, create_pet(whole, "head", t.kind, t.labels, seed=args.seed), train_x, t.train_y,
                         cfg(args, args.lr_head, args.epochs * 3))
    return t.score(predict(lambda b: head(pet, padded(b)[0]), test_x)), log


def row_adapter_only(args, ctx, t: Task):
    from runtime.construct.recipe import settings
    from runtime.model.pet import create_pet, head
    from runtime.construct.train import train_pet

    base = ctx["base"]
    train_x, test_x = full_lower(base, t.train_ids), full_lower(base, t.test_ids)
    options, config = settings("adapter", lr=args.lr_adapter, epochs=args.epochs, batch_size=args.batch_size,
                               seed=args.seed, progress=args.progress)
    pet, log = train_pet(base, create_pet(base, "adapter", t.kind, t.labels, seed=args.seed, **options), train_x,
                         t.train_y, config)
    return t.score(predict(lambda b: head(pet, base.upper(*padded(b), pet)), test_x)), log


def full_settings(args) -> dict:
    """The full row's overrides of the full-depth recipe: the run's batch size and seed only."""
    return {"batch_size": args.batch_size, "seed": args.seed, "progress": args.progress}


def row_full(args, ctx, t: Task):
    """The full-depth PET tenant create trains (runtime.construct.full), scored on exact inputs."""
    import numpy as np

    from runtime.construct.full import full_logits, train_full
    from runtime.construct.recipe import FULL_PET_TYPE, describe
    from runtime.model.encoder import load_encoder

    if "whole0" not in ctx:  # every layer "upper": the PET may sit on all of them
        ctx["whole0"] = load_encoder(args.model, 0)
    whole = ctx["whole0"]
    pet, log, _ = train_full(whole, t.kind, t.labels, t.train_ids, t.train_y, **full_settings(args))
    predicted = [np.asarray(z).argmax(-1).tolist() for z in full_logits(whole, pet, t.test_ids)]
    pet_bytes = sum(v.numel() * v.element_size() for v in pet.tensors.values())
    return t.score(predicted), log, {"pet_bytes": pet_bytes, "recipe": describe(FULL_PET_TYPE, "full")}


def row_plot_only(args, ctx, t: Task, version):
    import hkstore
    from runtime.model.pet import create_pet, head
    from runtime.plot.retrieve import retrieve_list
    from runtime.construct.train import train_upper

    base = ctx["base"]
    with hkstore.open(ctx["store"]) as st:
        train_x = retrieve_list(st.snapshot(), version, t.train_ids)
        test_x = retrieve_list(st.snapshot(), version, t.test_ids)
    student, hd, log = train_upper(base, create_pet(base, "head", t.kind, t.labels, seed=args.seed), train_x,
                                   t.train_y, cfg(args, args.lr_full))
    return t.score(predict(lambda b: head(hd, student.upper(*padded(b), hd)), test_x)), log


def run_row(args, ctx, task: Task, row, suffix=""):
    """One Table 3 cell: its score, time, first/last training loss (+ tenant extras)."""
    t0 = time.time()
    extra = {}
    if row == "dedicated":
        score, log = row_dedicated(args, ctx, task)
    elif row == "shared":
        score, log = row_shared(args, ctx, task)
    elif row == "adapter-only":
        score, log = row_adapter_only(args, ctx, task)
    elif row == "plot-only":
        score, log = row_plot_only(args, ctx, task, TASKS[task.name][2])
    elif row == "hplm-grown":
        score, log, extra = row_grown(args, ctx, task, suffix)
    elif row == "full":
        score, log, extra = row_full(args, ctx, task)
    else:
        pet_type = {"hplm-lora": "lora", "hplm-full": "diff"}.get(row, "adapter")
        options = {"hplm-wide": {"bottleneck": args.wide_bottleneck}, "hplm-full": {"density": 1.0}}.get(row, {})
        score, log, extra = row_tenant(args, ctx, task, ctx["store"], TASKS[task.name][2], pet_type,
                                       f"{task.name}-{row}{suffix}", **options)
    return {"score": score, "metric": "accuracy" if task.kind == "classification" else "entity_f1",
            "seconds": round(time.time() - t0, 1), "loss_first": log[0], "loss_last": log[-1], **extra}


def row_tenant(args, ctx, t: Task, store, version, pet_type, tenant, **options):
    """A real tenant: manager.tenant_create (inputs by retrieve) + tenant_eval (serving path);
    options (bottleneck, norms) go to tenant_create, whose defaults are the hPLM row's."""
    from runtime.construct import manager

    lr = {"adapter": args.lr_adapter, "lora": args.lr_lora, "diff": args.lr_diff}[pet_type]
    taught = {"levels": ("plot", "full"), "corpus_paths": [ctx["data"]["corpora"][TASKS[t.name][2]]]} \
        if args.self_train else {"levels": ("plot",)}
    out = manager.tenant_create(store, tenant, version=version, train_path=ctx["data"]["tasks"][t.name]["train"],
                                task=t.kind, pet_type=pet_type, epochs=args.epochs, lr=lr,
                                batch_size=args.batch_size, max_len=args.max_len, seed=args.seed, replace=True,
                                unseen=args.unseen, progress=args.progress, **taught, **options)
    score = manager.tenant_eval(store, tenant, ctx["data"]["tasks"][t.name]["eval"], max_len=args.max_len)
    return score["score"], [out["loss_first"], out["loss_last"]], {"pet_bytes": out["pet_bytes"]}


def row_grown(args, ctx, t: Task, suffix=""):
    """The hplm row's tenant served from '<domain>-traffic-<split>' (a child of its domain version
    that every task of the domain grows with its evaluation text): the score, and what growing cost
    against computing the lower layers in full context for the same text."""
    import hkstore
    from runtime.construct import manager
    from runtime.construct.grow import grow

    tenant, version = f"{t.name}-hplm{suffix}", f"{TASKS[t.name][2]}-traffic-{args.eval_split}"
    with hkstore.open(ctx["store"], writable=True) as st:
        if tenant not in st.pets():
            raise SystemExit(f"row hplm-grown needs the hplm row's tenant {tenant!r}: add hplm to --rows")
        if version not in st.snapshot().version_names:
            st.create_version(version, TASKS[t.name][2], info={"grown_from": "evaluation text (no labels)"})
        grown = grow(st, version, t.test_ids)
    t0 = time.time()
    full_lower(ctx["base"], t.test_ids)
    full_s = time.time() - t0
    score = manager.tenant_eval(ctx["store"], tenant, ctx["data"]["tasks"][t.name]["eval"], max_len=args.max_len,
                                version=version)
    extra = {"grown": {k: grown[k] for k in ("windows", "missed", "distinct_missed", "value_seconds")},
             "full_lower_seconds": round(full_s, 3)}
    return score["score"], [None, None], extra


# -- the store --------------------------------------------------------------------------------


def branch_bytes(store_path, version):
    import hkstore

    with hkstore.open(store_path) as st:
        snap = st.snapshot()
        segs = snap.versions[snap.version_index(version)]["segments"]
        return sum(os.path.getsize(os.path.join(store_path, "segments", s)) for s in segs)


def ensure_root(args, ctx, store, distill_steps, results, key):
    from runtime.construct import manager

    if key in results["construction"] and results["construction"][key].get("complete"):
        return
    say(f"building {key} (distill_steps={distill_steps})")
    out = manager.build(store, model_path=args.model, corpus_paths=[ctx["data"]["corpora"]["root"]],
                        lower_layers=args.lower_layers, max_len=args.max_len, distill_steps=distill_steps,
                        distill_lr=args.lr_distill, progress=args.progress)
    out["complete"] = True
    results["construction"][key] = out
    say(f"{key}: {out['keys']} keys ({out['distinct_windows']} corpus windows) in {out['seconds']:.0f}s, "
        f"{out['windows_per_s']} windows/s")
    save(args, results)


def ensure_domain(args, ctx, domain, results, distill=True) -> str:
    """The domain's version (distilled), or '<domain>-mlm' (MLM only, for the ablation)."""
    import hkstore
    from runtime.construct import manager

    name = domain if distill else f"{domain}-mlm"
    with hkstore.open(ctx["store"]) as st:
        snap = st.snapshot()
        if name in snap.version_names:
            v = snap.versions[snap.version_index(name)]
            if v["segments"] or not v["info"].get("ngrams_kept"):
                return name
            raise SystemExit(f"version {name!r} of {ctx['store']} was left half-built; delete the store and rerun")
    steps = args.domain_distill_steps if distill else 0
    say(f"domain {name}: MLM {args.mlm_steps} steps + distillation {steps} steps + branch alpha={args.alpha}")
    out = manager.domain_create(ctx["store"], name, [ctx["data"]["corpora"][domain]], alpha=args.alpha,
                                mlm_steps=args.mlm_steps, lr=args.lr_mlm, distill_steps=steps,
                                distill_lr=args.lr_distill, max_len=args.max_len, progress=args.progress)
    out["bytes"] = branch_bytes(ctx["store"], name)
    results["construction"][f"domain:{name}"] = out
    say(f"domain {name}: kept {out['ngrams_kept']}/{out['ngrams_seen']} n-grams, {out['bytes']} bytes, "
        f"{out['seconds']:.0f}s")
    save(args, results)
    return name


def window_coverage(args, ctx, results):
    """How each task's evaluation windows are served (by order) at its domain version and at the
    root, and WikiText-2 test (general text no table saw) at the root: results["coverage"]."""
    import hkstore
    from runtime.construct.manager import read_task, tokenize_corpus
    from runtime.plot.window import corpus_windows
    from tools.report import coverage

    base = ctx["base"]
    texts = {}
    for name in args.tasks:
        info = ctx["data"]["tasks"][name]
        (x, _), _ = read_task(info["eval"], info["kind"])
        texts[(f"{name} ({args.eval_split})", info["domain"])] = texts_of(info["kind"], x)
    wikitest = Path(args.general).with_name("test.txt") if args.general else None
    if wikitest and wikitest.exists():
        texts[("WikiText-2 test", None)] = general_text(wikitest)
    with hkstore.open(ctx["store"]) as st:
        snap, meta = st.snapshot(), st.meta
        for (label, domain), docs in texts.items():
            seqs = tokenize_corpus(base, docs, args.max_len)
            wins, _ = corpus_windows(seqs, meta["n"], meta["window"], meta["pad_id"])
            for version in ([domain] if domain else []) + ["root"]:
                c = coverage(snap, version, wins)
                results["coverage"][f"{label}@{version}"] = {
                    "text": label, "version": version, "windows": c["windows"], "exact": c["exact_share"],
                    "by_order": {o: v["share"] for o, v in c["by_order"].items()}}
    save(args, results)


def ensure_alpha_branch(args, ctx, domain, alpha, results):
    """Version '<domain>-a<alpha>' under the root: the domain's lower layers, another alpha."""
    import hkstore
    from runtime.construct import manager
    from runtime.model import stored
    from runtime.construct.plot import build_branch, fit_position

    name = domain if alpha == args.alpha else f"{domain}-a{alpha:g}"
    with hkstore.open(ctx["store"], writable=True) as st:
        if name not in st.snapshot().version_names:
            say(f"branch {name}")
            enc, target = stored.version_encoder(st, domain), stored.context_encoder(st, domain)
            docs = manager.read_corpora([ctx["data"]["corpora"][domain]])
            seqs = manager.tokenize_corpus(enc, docs, args.max_len)
            out = build_branch(st, name, "root", enc, seqs, alpha, {"lower_weights_of": domain})
            out["position"] = fit_position(st, name, target, seqs)
            results["construction"][f"branch:{name}"] = out
    return name


def nopos_copy(store_path, copy_path) -> str:
    """The store with the root's position table dropped (the ablation): segments are
    hard-linked (immutable files), manifests and packs copied (packs are appended to)."""
    import shutil

    import hkstore

    copy_path = str(copy_path)
    if not os.path.exists(os.path.join(copy_path, "CURRENT")):
        shutil.rmtree(copy_path, ignore_errors=True)
        shutil.copytree(store_path, copy_path, ignore=shutil.ignore_patterns("segments", "LOCK"))
        shutil.copytree(os.path.join(store_path, "segments"), os.path.join(copy_path, "segments"),
                        copy_function=os.link)
        with hkstore.open(copy_path, writable=True) as st:
            st.set_position("root", None)
    return copy_path


# -- results ----------------------------------------------------------------------------------


def save(args, results):
    results["wall_s"] = results.get("_elapsed_before", 0.0) + (time.time() - T0)
    # CPU seconds of this process (all threads): wall time on an otherwise idle 2-core machine
    # is about cpu_s / 2; the two differ when other work shares the cores.
    results["cpu_s"] = results.get("_cpu_before", 0.0) + time.process_time()
    path = Path(args.out) / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, path)
    (Path(args.out) / "results.md").write_text(markdown(results))


def seed_spread(results, tasks) -> list[str]:
    """Markdown lines: dedicated and each hPLM row of SEED_ROWS per training seed, and each
    one's mean gap to dedicated."""
    by = {}  # (row, seed) -> {task: score}
    for r in results.get("seeds", {}).values():
        by.setdefault((r["row"], r["seed"]), {})[r["task"]] = r["score"]
    base_seed = results.get("config", {}).get("seed", 0)
    for row in SEED_ROWS:
        if by and all(row in results["rows"].get(t, {}) for t in tasks):
            by[(row, base_seed)] = {t: results["rows"][t][row]["score"] for t in tasks}

    def complete(row, seed):
        return len(by.get((row, seed), {})) == len(tasks)

    # The seeds are those the goal's two rows both have; another row joins once it has every
    # one of them (a comparable mean).
    seeds_of = {row: {s for (r, s) in by if r == row and complete(row, s)} for row in SEED_ROWS}
    seeds = sorted(seeds_of["dedicated"] & seeds_of["hplm"])
    if len(seeds) < 2:
        return []
    rows = [r for r in SEED_ROWS if seeds_of[r] >= set(seeds)]
    lines = ["", "## Training seeds: dedicated vs hPLM (same data, store and settings)", "",
             "| row | seed | " + " | ".join(tasks) + " | mean |", "|---|---|" + "---|" * (len(tasks) + 1)]
    means = {}
    for row in rows:
        for seed in seeds:
            v = by[(row, seed)]
            means[(row, seed)] = sum(v.values()) / len(v)
            lines.append(f"| {title(row, results)} | {seed} | " + " | ".join(f"{100 * v[t]:.1f}" for t in tasks)
                         + f" | {100 * means[(row, seed)]:.1f} |")
    avg = {row: 100 * sum(means[(row, seed)] for seed in seeds) / len(seeds) for row in rows}
    lines.append("")
    for row in rows[1:]:
        gaps = [100 * (means[("dedicated", seed)] - means[(row, seed)]) for seed in seeds]
        lines.append(f"Mean over {len(seeds)} seeds: dedicated {avg['dedicated']:.1f}, {title(row, results)} "
                     f"{avg[row]:.1f}, gap {avg['dedicated'] - avg[row]:.1f} points (per seed: "
                     + ", ".join(f"{g:.1f}" for g in gaps) + ")")
    return lines


def markdown(results) -> str:
    tasks = [t for t in TASKS if t in results.get("config", {}).get("tasks", TASKS)]
    metric = {t: "acc" if TASKS[t][0] == "classification" else "F1" for t in tasks}
    split = results.get("config", {}).get("eval_split", "test")
    lines = [f"## Table 3 analogue: accuracy (classification) / entity F1 (NER), % ({split} split)", "",
             "| row | " + " | ".join(f"{t} ({metric[t]})" for t in tasks) + " | mean |",
             "|---|" + "---|" * (len(tasks) + 1)]
    for row in ROWS:
        if row not in DEFAULT_ROWS and not any(row in results["rows"].get(t, {}) for t in tasks):
            continue  # a row asked for by name only: no line of dashes in every table
        cells, vals = [], []
        for t in tasks:
            r = results["rows"].get(t, {}).get(row)
            cells.append(f"{100 * r['score']:.1f}" if r else "-")
            if r:
                vals.append(r["score"])
        mean = f"{100 * sum(vals) / len(vals):.1f}" if len(vals) == len(tasks) else "-"
        lines.append(f"| {title(row, results)} | " + " | ".join(cells) + f" | {mean} |")
    lines += seed_spread(results, tasks)
    if results.get("alpha"):
        lines += ["", "## Table 5 analogue: domain branch size alpha (hPLM adapter rows)", "",
                  "| alpha | task | score % | branch n-grams kept / seen | branch bytes |", "|---|---|---|---|---|"]
        for key, r in sorted(results["alpha"].items(), key=lambda kv: (kv[1]["task"], kv[1]["alpha"])):
            lines.append(f"| {r['alpha']:g}% | {r['task']} | {100 * r['score']:.1f} | "
                         f"{r.get('ngrams_kept', 0)} / {r.get('ngrams_seen', 0)} | {r['bytes']:,} |")
    if results.get("distill"):
        lines += ["", "## Ablation (PLOT + adapter): position table, window distillation, adapter LayerNorms", "",
                  "| PLOT | task | score % |", "|---|---|---|"]
        for key, r in sorted(results["distill"].items(), key=lambda kv: (kv[1]["task"], list(VARIANTS).index(kv[1]["variant"]))):
            lines.append(f"| {VARIANTS[r['variant']]} | {r['task']} | {100 * r['score']:.1f} |")
    if results.get("coverage"):
        n = max(int(o) for r in results["coverage"].values() for o in r["by_order"])
        lines += ["", "## Coverage: evaluation windows by served order (% of windows)", "",
                  "| text | version | windows | " + " | ".join(f"order {o}" for o in range(n, 0, -1))
                  + " | exact (no backoff) |", "|---|---|---|" + "---|" * (n + 1)]
        for r in results["coverage"].values():
            lines.append(f"| {r['text']} | {r['version']} | {r['windows']:,} | "
                         + " | ".join(f"{100 * r['by_order'].get(str(o), 0):.1f}" for o in range(n, 0, -1))
                         + f" | {100 * r['exact']:.1f} |")
        dropped = results.get("dropped_eval_lines")
        if dropped:
            lines.append("")
            lines.append("Corpus lines dropped because they equal an evaluation text: "
                         + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    c = results.get("construction", {})
    lines += ["", "## Construction", ""]
    for key, r in c.items():
        lines.append(f"- {key}: " + ", ".join(f"{k}={r[k]}" for k in ("keys", "ngrams_kept", "ngrams_seen", "bytes",
                                                                     "windows_per_s", "seconds") if k in r)
                     + ("".join(f", position cosine {p['cosine_before']} -> {p['cosine_after']}"
                                for p in [r.get("position")] if p)))
    if "wall_s" in results:
        lines += ["", f"Total wall time: {results['wall_s'] / 60:.1f} min; CPU time {results.get('cpu_s', 0) / 60:.1f} min "
                  f"(about {results.get('cpu_s', 0) / 120:.1f} min of wall time on 2 otherwise idle cores)"]
    return "\n".join(lines) + "\n"


# -- main -------------------------------------------------------------------------------------

RESUMABLE = ("tasks", "rows", "alpha_tasks", "distill_tasks", "extra_seeds")  # may differ on a rerun
# Settings only rows depend on (not the store): free to change while no row has a score, so the
# store of a final run can be built while its settings are still being chosen on dev.
TRAINING = ("epochs", "epochs_full", "batch_size", "lr_full", "lr_head", "lr_adapter", "lr_lora", "lr_diff", "wide_bottleneck",
            "unseen", "self_train")


# What a saved run that predates an option did (not the option's default today).
PREDATES = {"unseen": 0.0, "self_train": False}


def changed_settings(saved: dict, config: dict, defaults: dict, scored: bool = True) -> list[str]:
    """The settings of config that would change the meaning of a saved run's rows (or store,
    while nothing is scored yet). An option the saved run predates counts as PREDATES says, else as its default."""
    old = defaults | PREDATES | saved
    free = RESUMABLE + (() if scored else TRAINING)
    return [k for k in config if k not in free and old.get(k) != config[k]]



def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(SCIBERT), help="the SciBERT task suite (default: ../shared/data/scibert beside the repository)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="HF BERT directory (default: embedded all-MiniLM-L6-v2)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"some of {', '.join(ROWS)}")
    p.add_argument("--alpha-tasks", default="citation_intent,sciie",
                   help="tasks of the alpha table ('' = none); the defaults share the cs branches")
    p.add_argument("--distill-tasks", default="citation_intent,NCBI-disease", help="tasks of the ablation rows")
    p.add_argument("--general", default=None,
                   help="general text for the root corpus, one paragraph a line (default: wikitext-2/valid.txt "
                        "beside --data; '' = none); the root is built from it plus the tasks' train text")
    p.add_argument("--eval-split", choices=("dev", "test"), default="dev",
                   help="the split scored: choose settings on dev, report test once with the chosen ones")
    p.add_argument("--fast", action="store_true",
                   help="the quick table: tasks citation_intent,NCBI-disease; rows dedicated,adapter-only,hplm,hplm-grown; "
                        "no alpha or ablation rows (about a third of the full run)")
    p.add_argument("--max-domain-docs", type=int, default=3000,
                   help="train documents per task in a domain corpus (MLM + n-gram counts)")
    p.add_argument("--lower-layers", type=int, default=3,
                   help="layers the PLOT replaces; PETs go on the rest (all-MiniLM-L6-v2 has 6)")
    p.add_argument("--max-train", type=int, default=600)
    p.add_argument("--max-test", type=int, default=400)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--epochs", type=int, default=PLOT["adapter"].epochs,
                   help="epochs of every row but dedicated and full (shared: 3x); default the recipe's")
    # Chosen on dev (experiments.hmi_tune, BENCHMARKS.md issue 21): 3 epochs at 1e-4 under-trained it by 4.5 points.
    p.add_argument("--epochs-full", type=int, default=6, help="epochs of the dedicated row (full fine-tuning)")
    p.add_argument("--batch-size", type=int, default=PLOT["adapter"].batch_size)
    p.add_argument("--alpha", type=float, default=50, help="alpha of the main domain branches")
    p.add_argument("--mlm-steps", type=int, default=40)
    p.add_argument("--distill-steps", type=int, default=1000, help="window distillation of the root")
    p.add_argument("--domain-distill-steps", type=int, default=300,
                   help="window distillation of each domain (from the distilled root's layers)")
    p.add_argument("--lr-full", type=float, default=2e-4)
    p.add_argument("--lr-head", type=float, default=5e-3)
    # 5e-3 scored as well on seed 0 but collapsed on sci-cite under seed 1 (BENCHMARKS.md).
    p.add_argument("--lr-adapter", type=float, default=PLOT["adapter"].lr)
    p.add_argument("--lr-lora", type=float, default=PLOT["lora"].lr)
    p.add_argument("--lr-diff", type=float, default=PLOT["diff"].lr,
                   help="the hplm-full row's (dense diff PET; chosen on dev)")
    p.add_argument("--unseen", type=float, default=None,
                   help="the PLOT rows' tenants train on inputs as served to unseen text (runtime.plot.unseen); "
                        "default each PET type's recipe, as tenant create")
    p.add_argument("--self-train", action="store_true",
                   help="the PLOT rows' tenants also learn the full-depth level's answers on their domain corpus "
                        "(tenant create --corpus; the full-depth level is trained too)")
    p.add_argument("--wide-bottleneck", type=int, default=256, help="the adapter bottleneck of the hplm-wide row")
    p.add_argument("--lr-mlm", type=float, default=1e-4)
    p.add_argument("--lr-distill", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="data sampling and training seed")
    p.add_argument("--extra-seeds", default="",
                   help="comma-separated training seeds to repeat the dedicated and hPLM rows under")
    p.add_argument("--progress", action="store_true", help="tqdm bars for every loop")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.fast:
        args.tasks, args.rows, args.alpha_tasks, args.distill_tasks = ("citation_intent,NCBI-disease",
                                                                       "dedicated,adapter-only,hplm,hplm-grown", "", "")
    if args.general is None:
        default = Path(args.data).parent / "wikitext-2" / "valid.txt"
        args.general = str(default) if default.exists() else ""
    if args.general and Path(args.general).name == "test.txt":
        p.error("--general must not be a test split: its text would be in the table evaluated on")
    args.tasks = [t for t in args.tasks.split(",") if t]
    rows = [r for r in args.rows.split(",") if r]
    for t in args.tasks:
        if t not in TASKS:
            p.error(f"unknown task {t!r}; expected some of {', '.join(TASKS)}")
    for r in rows:
        if r not in ROWS:
            p.error(f"unknown row {r!r}; expected some of {', '.join(ROWS)}")
    alpha_tasks = [t for t in args.alpha_tasks.split(",") if t in args.tasks]
    distill_tasks = [t for t in args.distill_tasks.split(",") if t in args.tasks]
    try:
        seeds = [int(x) for x in args.extra_seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--extra-seeds must be comma-separated integers, got {args.extra_seeds!r}")
    seeds = [x for x in dict.fromkeys(seeds) if x != args.seed]

    import torch

    import hkstore
    from runtime.model.encoder import load_encoder

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    config = {k: v for k, v in vars(args).items() if k not in ("out", "progress", "fast")}
    # A resumed run may pick other tasks or rows, but nothing that changes a finished row's meaning.
    if results.get("config"):
        scored = any(results.get(k) for k in ("rows", "seeds", "alpha", "distill"))
        differs = changed_settings(results["config"], config, {k: p.get_default(k) for k in config}, scored)
        if differs:
            raise SystemExit(f"{path} was made with other settings ({', '.join(differs)}); use another --out")
    results.setdefault("rows", {})
    results.setdefault("alpha", {})
    results.setdefault("distill", {})
    results.setdefault("seeds", {})
    results.setdefault("construction", {})
    results.setdefault("coverage", {})
    results["config"] = config
    results["_elapsed_before"] = results.get("wall_s", 0.0)
    results["_cpu_before"] = results.get("cpu_s", 0.0)

    say(f"torch threads {torch.get_num_threads()}; sampling data")
    data = prepare_data(args, out)
    results["dropped_eval_lines"] = data["dropped_eval_lines"]
    base = load_encoder(args.model, args.lower_layers)
    # "whole": every layer lower, so upper() is the identity (the shared row's frozen encoder)
    ctx = {"data": data, "store": str(out / "store"), "base": base,
           "whole": load_encoder(args.model, base.config.num_layers)}
    ensure_root(args, ctx, ctx["store"], args.distill_steps, results, "root")
    for domain in dict.fromkeys(TASKS[t][2] for t in args.tasks):
        ensure_domain(args, ctx, domain, results)
    if not results["coverage"]:
        window_coverage(args, ctx, results)
        say("coverage: " + "; ".join(f"{k} exact {100 * r['exact']:.1f}%" for k, r in results["coverage"].items()))

    cache = {}

    def task_of(name):
        if name not in cache:
            cache.clear()  # one task's encoded data at a time
            cache[name] = Task(name, data["tasks"][name], ctx["base"], args.max_len)
        return cache[name]

    for name in args.tasks:
        for row in rows:
            if row in results["rows"].get(name, {}):
                continue
            task = task_of(name)
            say(f"{name} / {row}: {len(task.train_ids)} train, {len(task.test_ids)} test examples")
            results["rows"].setdefault(name, {})[row] = run_row(args, ctx, task, row)
            save(args, results)
            say(f"{name} / {row}: {100 * results['rows'][name][row]['score']:.1f} "
                f"({results['rows'][name][row]['seconds']:.0f}s)")

    # The goal's two rows again under other training seeds (same data, store and settings):
    # how much of a difference between them is seed noise.
    for seed in seeds:
        targs = argparse.Namespace(**{**vars(args), "seed": seed})
        for name in args.tasks:
            for row in [r for r in SEED_ROWS if r in rows]:
                key = f"{name}@{row}@{seed}"
                if key in results["seeds"]:
                    continue
                r = run_row(targs, ctx, task_of(name), row, suffix=f"-s{seed}")
                results["seeds"][key] = {"task": name, "row": row, "seed": seed, **r}
                save(args, results)
                say(f"seed {seed}: {name} / {row}: {100 * r['score']:.1f} ({r['seconds']:.0f}s)")

    for name in alpha_tasks:
        domain = TASKS[name][2]
        for alpha in ALPHAS:
            key = f"{name}@{alpha:g}"
            if key in results["alpha"]:
                continue
            version = ensure_alpha_branch(args, ctx, domain, alpha, results)
            t0 = time.time()
            if alpha == args.alpha and "hplm" in results["rows"].get(name, {}):
                score = results["rows"][name]["hplm"]["score"]
            else:
                score, _, _ = row_tenant(args, ctx, task_of(name), ctx["store"], version, "adapter",
                                         f"{name}-a{alpha:g}")
            with hkstore.open(ctx["store"]) as st:
                snap = st.snapshot()
                vinfo = snap.versions[snap.version_index(version)]["info"]
            results["alpha"][key] = {"task": name, "alpha": alpha, "version": version, "score": score,
                                     "bytes": branch_bytes(ctx["store"], version),
                                     "ngrams_kept": vinfo.get("ngrams_kept"), "ngrams_seen": vinfo.get("ngrams_seen"),
                                     "seconds": round(time.time() - t0, 1)}
            save(args, results)
            say(f"alpha {alpha:g}% / {name}: {100 * score:.1f}, branch {results['alpha'][key]['bytes']:,} bytes")

    if distill_tasks:
        plain = str(out / "store-plain")
        ensure_root(args, ctx, plain, 0, results, "root-plain")
        for name in distill_tasks:
            domain = TASKS[name][2]
            for variant in VARIANTS:
                key = f"{name}@{variant}"
                if key in results["distill"]:
                    continue
                if variant == "domain" and "hplm" in results["rows"].get(name, {}):
                    results["distill"][key] = {"task": name, "variant": variant,
                                               "score": results["rows"][name]["hplm"]["score"]}
                    continue
                store, version = ctx["store"], "root"
                if variant == "root-plain-nopos":
                    store = nopos_copy(plain, out / "store-plain-nopos")
                elif variant == "root-plain":
                    store = plain
                elif variant == "domain-mlm":
                    version = ensure_domain(args, ctx, domain, results, distill=False)
                elif variant in ("domain", "domain-nonorm"):
                    version = domain
                t0 = time.time()
                score, _, _ = row_tenant(args, ctx, task_of(name), store, version, "adapter", f"{name}-{variant}",
                                         norms=() if variant == "domain-nonorm" else None)
                results["distill"][key] = {"task": name, "variant": variant, "score": score,
                                           "seconds": round(time.time() - t0, 1)}
                save(args, results)
                say(f"{VARIANTS[variant]} + adapter / {name}: {100 * score:.1f}")

    save(args, results)
    say(f"done in {(time.time() - T0) / 60:.1f} min (this invocation); results in {out}/results.md")
    print(markdown(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
