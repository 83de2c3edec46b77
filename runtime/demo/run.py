"""The README's main job on the embedded default: ``hkstore demo [STORE_DIR] [--full]``.

Everything comes with the install: the bundled all-MiniLM-L6-v2 and, as text, the docstrings
of Python's standard library (first paragraph of each public class, function and method of
~40 modules, about 900 of them). The steps, each skipped when the store already has it
(so a rerun resumes, and a finished store just serves):

1. **build** the root PLOT from all the docstrings (runtime.construct.manager.build);
2. **domain** ``email``: the lower layers further pre-trained (a few MLM steps) on the
   docstrings of the ``email`` package family, and a branch holding the top-50% of its n-grams;
3. **tenants**, one per PET type, each a small task derived from the docstrings:

   | tenant | PET | version | task |
   | --- | --- | --- | --- |
   | ``which-module`` | adapter | root | classification: which of 6 modules (logging, pathlib, datetime, random, calendar, tarfile) a docstring comes from |
   | ``class-or-function`` | LoRA | email | classification: does the docstring document a class or a function/method |
   | ``type-words`` | BitFit | root | tagging: the words naming Python types and values (str, int, bytes, None, ...) are ``B-TYPE`` |
   | ``raises`` | diff | email | classification: does the docstring talk about exceptions (raise, error, exception) |

   Every 5th example (in a fixed order) is held out: it calibrates the tenant and scores its
   levels (the held-out scores `hkstore tenant ls` and `tenant info` show), and is served in 4;
4. **serve** a mixed-tenant batch of held-out docstrings through ``runtime.infer``: printed
   predictions, held-out accuracy per tenant, and throughput with the timing breakdown.

Two sizes (PRESETS), the same model, text, steps and tenants:

- **quick** (the default, under a minute on two CPU cores: 38 s measured): the domain gets fewer MLM
  steps, each tenant trains on at most QUICK_EXAMPLES examples of at most 48 tokens for fewer
  epochs, and the four tenants are trained in one pass (manager.tenants_create: one loaded
  model, one commit). Held-out accuracies are lower than the full run's; the output says so.
- **full** (``--full``, 73 s measured): every example, the longer schedules.

A store remembers its size (STORE_DIR/demo/preset.json); the other size needs another
directory. Data files go to ``STORE_DIR/demo/`` (the store's gc leaves them alone).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time

import click

from runtime.demo.stdlib_text import docstrings

ROOT_MODULES = (
    "json re string textwrap collections itertools functools pathlib datetime argparse logging shutil subprocess csv "
    "random statistics decimal fractions heapq calendar tarfile zipfile configparser difflib posixpath "
    "email.message email.utils email.header email.parser email.generator email.policy email.headerregistry "
    "email.feedparser email.charset email.encoders email._policybase").split()
DOMAIN = "email"
MODULE_LABELS = ("logging", "pathlib", "datetime", "random", "calendar", "tarfile")
TYPE_WORDS = {"str", "string", "strings", "int", "integer", "integers", "float", "bytes", "bool", "list", "lists",
              "dict", "dictionary", "tuple", "tuples", "set", "none", "true", "false", "object", "objects"}
RAISES = re.compile(r"\b(raise[sd]?|error|errors|exception|exceptions)\b", re.IGNORECASE)
TENANTS = {  # tenant -> (pet type, version, task, data file)
    "which-module": ("adapter", "root", "classification", "modules.jsonl"),
    "class-or-function": ("lora", DOMAIN, "classification", "kinds.jsonl"),
    "type-words": ("bitfit", "root", "tagging", "types.conll"),
    "raises": ("diff", DOMAIN, "classification", "raises.jsonl"),
}
# (epochs, learning rate or None for the manager's default per PET type); BitFit and diff get
# more epochs on their small data sets (BitFit's rate is higher: biases move slowly).
TRAINING = {"which-module": (4, None), "class-or-function": (3, None), "type-words": (6, 1e-2),
            "raises": (6, 1e-3)}
QUICK_EXAMPLES = 96
# The two sizes of the demo (see the module doc): MLM steps of the domain, per-tenant
# (epochs, learning rate), the most training examples per tenant and tokens per example.
PRESETS = {
    "quick": {"mlm_steps": 6, "training": {"which-module": (3, 2e-3), "class-or-function": (3, 2e-3),
                                           "type-words": (8, 2e-2), "raises": (3, 1e-3)},
              "max_examples": QUICK_EXAMPLES, "max_len": 48},
    "full": {"mlm_steps": 20, "training": TRAINING, "max_examples": None, "max_len": 64},
}


# -- data -------------------------------------------------------------------------------------


def _split(examples):
    """(train, test): every 5th example held out."""
    return [e for j, e in enumerate(examples) if j % 5], [e for j, e in enumerate(examples) if j % 5 == 0]


def _balanced(pos, neg):
    k = min(len(pos), len(neg))
    out = []
    for a, b in zip(pos[:k], neg[:k]):
        out += [a, b]
    return out


def type_tags(words) -> list:
    """The type-words task's tag per word."""
    return ["B-TYPE" if w.lower() in TYPE_WORDS else "O" for w in words]


def tasks(docs) -> dict:
    """tenant -> (train examples, test examples); classification (text, label), tagging
    (words, tags, text)."""
    per_module = {m: [(t, m) for t, mod, _ in docs if mod == m][:50] for m in MODULE_LABELS}
    modules = [e for group in zip(*per_module.values()) for e in group]
    classes = [(t, "class") for t, _, k in docs if k == "class"]
    functions = [(t, "function") for t, _, k in docs if k == "function"][::3]
    kinds = _balanced(classes, functions)
    raises = _balanced([(t, "raises") for t, _, _ in docs if RAISES.search(t)],
                       [(t, "other") for t, _, _ in docs if not RAISES.search(t)][::2])
    tagged = []
    for t, _, _ in docs[::2]:
        words = re.findall(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]", t)  # BERT's word split
        tags = type_tags(words)
        if "B-TYPE" in tags:
            tagged.append((words, tags, t))
    return {"which-module": _split(modules), "class-or-function": _split(kinds), "type-words": _split(tagged[:240]),
            "raises": _split(raises)}


def held_out_name(name) -> str:
    """The held-out examples' file beside a tenant's training file."""
    stem, ext = os.path.splitext(name)
    return f"{stem}.held-out{ext}"


def write_data(data_dir, docs, task_data):
    os.makedirs(data_dir, exist_ok=True)
    _write(os.path.join(data_dir, "corpus.txt"), "".join(t + "\n" for t, _, _ in docs))
    _write(os.path.join(data_dir, "domain.txt"), "".join(t + "\n" for t, m, _ in docs if m.split(".")[0] == DOMAIN))
    for tenant, (_, _, task, name) in TENANTS.items():
        for examples, path in zip(task_data[tenant], (name, held_out_name(name))):
            if task == "classification":
                text = "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in examples)
            else:
                text = "".join("".join(f"{w}\t{y}\n" for w, y in zip(words, tags)) + "\n"
                               for words, tags, _ in examples)
            _write(os.path.join(data_dir, path), text)


def _write(path, text):
    """Write only if different (keeps mtimes, and the build's corpus fingerprint, stable)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _check_preset(data_dir, preset):
    """Record the store's demo size; refuse to mix sizes in one store."""
    path = os.path.join(data_dir, "preset.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            had = json.load(f).get("preset")
        if had != preset:
            flag = "--full" if had == "full" else "no --full"
            raise DemoError(f"{os.path.dirname(data_dir)} holds the {had} demo; run with {flag}, or give another "
                            f"directory for the {preset} one")
        return
    _write(path, json.dumps({"preset": preset}) + "\n")


class DemoError(ValueError):
    pass


def check_folder(store_dir):
    """A missing or empty folder, or a store (the demo resumes it): a DemoError for anything else."""
    if os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise DemoError(f"{store_dir} is a file, not a directory")
    # A folder the demo did not start is someone's: never mix a store into it. Only the demo's
    # own data folder may be there without a store (a run stopped before the build began).
    if (os.path.isdir(store_dir) and not os.path.exists(os.path.join(store_dir, "CURRENT"))
            and set(os.listdir(store_dir)) - {"demo"}):
        raise DemoError(f"{store_dir} holds other files and no store: give an empty or new folder "
                        "(or a demo store, to resume it)")


# -- the job ----------------------------------------------------------------------------------


def main(store_dir="hkstore-demo", echo=print, progress=True, full=False) -> dict:
    """Build (or resume) the demo store in store_dir and serve a mixed-tenant batch; returns a
    summary dict (accuracies, throughput, step timings). full: the full-size run (see PRESETS)."""
    import hkstore
    import runtime
    from runtime.construct import manager
    from runtime.construct.data import entity_f1

    t_start = time.perf_counter()
    preset_name = "full" if full else "quick"
    preset = PRESETS[preset_name]
    store_dir = os.fspath(store_dir)
    check_folder(store_dir)
    data_dir = os.path.join(store_dir, "demo")
    docs = docstrings(ROOT_MODULES)
    task_data = tasks(docs)
    os.makedirs(data_dir, exist_ok=True)
    _check_preset(data_dir, preset_name)
    write_data(data_dir, docs, task_data)
    summary = {"store": store_dir, "preset": preset_name, "docstrings": len(docs), "steps": {}}
    if full:
        echo(f"hkstore demo (full size): {len(docs)} standard-library docstrings -> {store_dir}")
    else:
        echo(f"hkstore demo (quick: the real model and text, shorter training: {preset['mlm_steps']} MLM steps, "
             f"at most {preset['max_examples']} examples of {preset['max_len']} tokens per tenant; "
             f"'hkstore demo --full DIR' trains longer and scores higher)")
        echo(f"{len(docs)} standard-library docstrings -> {store_dir}")

    def step(name, fn):
        t0 = time.perf_counter()
        result = fn()
        summary["steps"][name] = round(time.perf_counter() - t0, 1)
        return result

    # 1. root PLOT (manager.build resumes an unfinished build and is quick on a finished one)
    info = _store_info(store_dir)
    if info and info["root_complete"]:
        echo("1. root PLOT: already built")
    else:
        echo("1. root PLOT: building from the docstrings (lower layers of all-MiniLM-L6-v2 per window) ...")
        out = step("build", lambda: manager.build(store_dir, corpus_paths=[os.path.join(data_dir, "corpus.txt")],
                                                  progress=progress))
        echo(f"   {out['keys']:,} keys ({out['distinct_windows']:,} corpus windows, backoff keys, "
             f"every uni-gram) in {out['seconds']:.0f} s")
    # 2. domain branch
    info = _store_info(store_dir)
    if DOMAIN in info["versions"]:
        echo(f"2. domain {DOMAIN!r}: already there")
    else:
        echo(f"2. domain {DOMAIN!r}: {preset['mlm_steps']} MLM steps on the {DOMAIN} package's docstrings, "
             "then its top-50% n-grams ...")
        out = step("domain", lambda: manager.domain_create(
            store_dir, DOMAIN, [os.path.join(data_dir, "domain.txt")], alpha=50, mlm_steps=preset["mlm_steps"],
            batch_size=8, progress=progress))
        echo(f"   MLM loss {out['mlm']['loss_first']:.2f} -> {out['mlm']['loss_last']:.2f}; "
             f"{out['ngrams_kept']:,} of {out['ngrams_seen']:,} n-grams kept in {out['seconds']:.0f} s")
    # 3. tenants, in one pass
    have = _store_info(store_dir)["tenants"]
    specs = []
    for tenant, (pet_type, version, task, name) in TENANTS.items():
        if tenant in have:
            echo(f"3. tenant {tenant!r}: already trained")
            continue
        epochs, lr = preset["training"][tenant]
        echo(f"3. tenant {tenant!r}: {pet_type} PET, {task}, on version {version!r}")
        specs.append(dict(tenant=tenant, version=version, train_path=os.path.join(data_dir, name), task=task,
                          pet_type=pet_type, epochs=epochs, lr=lr, max_examples=preset["max_examples"],
                          max_len=preset["max_len"], bottleneck=32, rank=8, density=0.01,
                          held_out_path=os.path.join(data_dir, held_out_name(name))))
    if specs:
        echo(f"   training {len(specs)} tenant(s) in one pass ...")
        outs = step("tenants", lambda: manager.tenants_create(store_dir, specs, progress=progress))
        for out in outs:
            echo(f"   {out['tenant']:<18} {out['examples']} examples, {out['steps']} steps, loss "
                 f"{out['loss_first']:.2f} -> {out['loss_last']:.2f}, PET {out['pet_bytes']:,} bytes, "
                 f"{out['seconds']:.0f} s")
        if any(out["loss_last"] >= out["loss_first"] for out in outs):
            echo("   (loss: the mean over the first and the last tenth of the steps; one that did not fall "
                 "had too few steps here to learn much: --full trains longer)")
    # 4. serve
    echo("4. serving a mixed-tenant batch of held-out docstrings through runtime.infer")
    requests, gold = [], []
    for tenant, (_, _, task, _) in TENANTS.items():
        for example in task_data[tenant][1]:
            text = example[0] if task == "classification" else example[2]
            requests.append({"tenant": tenant, "text": text})
            gold.append(example[1])
    # interleave tenants, so every batch mixes them
    order = sorted(range(len(requests)), key=lambda j: (j - _first_index(requests, requests[j]["tenant"]), j))
    requests, gold = [requests[j] for j in order], [gold[j] for j in order]
    with runtime.open(store_dir, device="auto", max_len=128, max_batch=64) as rt:
        rt.infer(requests[:8])  # warm-up (PET decode, first-call costs)
        t0 = time.perf_counter()
        results = rt.infer(requests)
        wall = time.perf_counter() - t0
        summary["device"] = rt.device
    for j, res in enumerate(results):  # tagging: gold tags of the words the runtime split the text into
        if res.task == "tagging":
            gold[j] = type_tags(res.tokens)
    echo("")
    echo(f"{'tenant':<18} {'PET':<8} {'version':<8} {'text':<46} {'prediction':<22} gold")
    shown = {}
    for req, res, g in zip(requests, results, gold):
        if shown.get(req["tenant"], 0) >= 3:
            continue
        shown[req["tenant"]] = shown.get(req["tenant"], 0) + 1
        pred = res.label if res.task == "classification" else _tagged(res.tokens, res.tags)
        want = g if res.task == "classification" else _tagged(res.tokens, g)
        echo(f"{req['tenant']:<18} {TENANTS[req['tenant']][0]:<8} {res.version:<8} {_short(req['text'], 46):<46} "
             f"{_short(pred, 22):<22} {_short(want, 30)}")
    echo("")
    acc = {}
    for tenant in TENANTS:
        pairs = [(r, g) for q, r, g in zip(requests, results, gold) if q["tenant"] == tenant]
        if TENANTS[tenant][2] == "classification":
            acc[tenant] = sum(r.label == g for r, g in pairs) / len(pairs)
        else:  # entity-level F1 of the B-TYPE words
            acc[tenant] = entity_f1([g for _, g in pairs], [r.tags for r, _ in pairs])
        metric = "accuracy" if TENANTS[tenant][2] == "classification" else "entity F1"
        echo(f"held-out {metric:<9} {tenant:<18} {acc[tenant]:.2%} ({len(pairs)} examples)")
    if not full:
        echo("(quick training: the full-size run, hkstore demo --full, scores higher)")
    n = len(results)
    mean = {k: sum(r.timings[k] for r in results) / n for k in ("retrieval", "transfer", "compute", "total")}
    echo(f"\nserved {n} requests of {len(TENANTS)} tenants in {wall:.2f} s: {n / wall:.1f} requests/s "
         f"on {summary['device']} (batches of up to 64; per batch: retrieval {mean['retrieval'] * 1e3:.0f} ms, "
         f"transfer {mean['transfer'] * 1e3:.0f} ms, compute {mean['compute'] * 1e3:.0f} ms)")
    summary.update(accuracy=acc, requests=n, seconds=round(wall, 3), requests_per_s=round(n / wall, 2),
                   total_seconds=round(time.perf_counter() - t_start, 1))
    with hkstore.open(store_dir) as st:
        summary["versions"] = st.snapshot().version_names
        summary["tenants"] = sorted(st.snapshot().pets)
    summary["next"] = next_steps(store_dir, suggested_text(requests, results, gold))
    echo(f"demo done in {summary['total_seconds']:.0f} s\n")
    echo("next:")
    for line in summary["next"]:
        echo(f"  {line}")
    return summary


SUGGESTED = "which-module"  # the tenant the printed next steps query


def suggested_text(requests, results, gold, tenant=SUGGESTED, limit=160) -> str:
    """The held-out text the next steps query: one the tenant answered right (a first query that
    comes back wrong teaches nothing but doubt), the most confident of the short ones (a
    shell line stays readable); the first of its texts when it answered none right."""
    mine = [(q["text"], r) for q, r, g in zip(requests, results, gold)
            if q["tenant"] == tenant and r.task == "classification" and r.label == g]
    if not mine:
        return next(q["text"] for q in requests if q["tenant"] == tenant)
    short = [m for m in mine if len(m[0]) <= limit] or mine
    return max(short, key=lambda m: max(m[1].probabilities))[0]


def next_steps(store_dir, text, tenant=SUGGESTED) -> list:
    """The commands to run next, exactly as printed at the end of the demo."""
    s = shlex.quote(store_dir)
    body = shlex.quote(json.dumps({"text": text}))
    report = shlex.quote(os.path.join(store_dir, "report"))
    return [
        f"hkstore infer {s} --tenant {tenant} {shlex.quote(text)}    # query it from the shell",
        f"hkstore serve {s}    # HTTP on http://127.0.0.1:8080 (the serve extra: pip install 'hkstore[serve]'; "
        f"admin token: {os.path.join(store_dir, 'admin.token')})",
        f"TOKEN=$(hkstore token issue {s} {tenant})    # in another shell: the tenant's API token",
        f"curl -s -H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json' -d {body} "
        f"http://127.0.0.1:8080/v1/tenants/{tenant}/infer",
        f"hkstore report {s} --out {report}    # then open {os.path.join(store_dir, 'report', 'index.html')}",
    ]


def _first_index(requests, tenant):
    return next(j for j, r in enumerate(requests) if r["tenant"] == tenant)


def _store_info(store_dir):
    if not os.path.exists(os.path.join(store_dir, "CURRENT")):
        return None
    import hkstore

    with hkstore.open(store_dir) as st:
        snap = st.snapshot()
        build = snap.versions[0]["info"].get("build") or {}
        return {"versions": snap.version_names, "tenants": set(snap.pets), "root_complete": bool(build.get("complete"))}


def _short(text, width):
    text = str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _tagged(words, tags):
    marked = [w for w, t in zip(words, tags) if t != "O"]
    return "[" + ", ".join(marked) + "]"


@click.command("demo")
@click.argument("store_dir", required=False, default="hkstore-demo", type=click.Path())
@click.option("--full", is_flag=True, help="The full-size run: every example, longer training (minutes, not seconds).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON at the end.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--threads", type=click.IntRange(0, 256), default=1, show_default=True,
              help="Torch intra-op threads (0: torch's default, one per core). The demo's matrices are small: "
                   "one thread is as fast on two idle cores and much faster on a busy machine.")
def demo(store_dir, full, as_json, no_progress, threads):
    """Build (or resume) a demo store from the standard library's docstrings with a domain
    branch and four tenants (adapter, LoRA, BitFit, diff), then serve a mixed-tenant batch.
    Quick by default (under a minute on two cores, shorter training); --full for the full size."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        summary = main(store_dir, echo=click.echo if not as_json else (lambda *a, **k: None),
                       progress=not no_progress and not as_json, full=full)
    except DemoError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    demo()
