"""Construction commands of the hkstore CLI (mounted lazily: importing this pulls in torch).

    hkstore build STORE --corpus FILE [--corpus FILE ...] [--distill-steps N]
    hkstore domain create STORE NAME --corpus FILE [--parent root] [--alpha 50] [--mlm-steps N] [--distill-steps N]
    hkstore domain update STORE NAME NEW_NAME --corpus FILE [--distill-steps N]
    hkstore domain grow STORE NAME --corpus FILE
    hkstore tenant create STORE TENANT --version V --train FILE [--task tagging] [--pet lora] [--levels plot]
                          [--precision auto|fp32|bf16]
    hkstore tenant update STORE TENANT [--train FILE] [--version V] [--precision auto|fp32|bf16]
    hkstore tenant eval STORE TENANT --test FILE
    hkstore tenant rm STORE TENANT
    hkstore tenant ls STORE
    hkstore tenant info STORE TENANT

Each maps to one runtime.construct.manager function; --json prints its result as JSON. Errors are one
line on stderr with exit code 1.
"""

from __future__ import annotations

import json

import click

from runtime.construct import manager
from runtime.construct import recipe as recipes


def _call(fn, *args, **kwargs):
    """fn's result; its errors as one line (click prints them, exit code 1)."""
    from formats.errors import FormatError
    from hkstore.errors import StoreError

    try:
        return fn(*args, **kwargs)
    except (StoreError, FormatError, ValueError, OSError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise click.ClickException(message) from None


def _run(fn, *args, as_json=False, **kwargs):
    result = _call(fn, *args, **kwargs)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        _print(result)
    return result


def _print(result):
    """A result as `key: value` lines."""
    for key, value in result.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        elif isinstance(value, float):
            value = f"{value:.6g}"
        click.echo(f"{key}: {value}")


def _iso(seconds) -> str | None:
    """A record's time (seconds since the epoch) as people read it: ISO 8601, UTC."""
    import datetime

    if not isinstance(seconds, (int, float)):
        return seconds
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


def _held_out(metric, score) -> str:
    if score is None:
        return "held-out: none recorded (tenant create --calibration-share)"
    return f"held-out {(metric or 'score').replace('_', ' ')} {score:.3f}"


def _precision_option(default, shown):
    def option(f):
        return click.option(
            "--precision", type=click.Choice(["auto", "fp32", "bf16"]), default=default, show_default=shown,
            help="What each level serves at under a runtime at precision auto. auto: bf16 where the level's "
                 "held-out (else training) examples score at most 0.3 points lower with the shared GEMMs in "
                 "bf16 (a decoder tenant: its training text's perplexity at most 0.3% higher), else fp32 "
                 "(a CPU without native bf16: fp32); fp32 or bf16: as asked." +
                 ("" if shown else " Default: as the tenant's was asked."))(f)
    return option


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(f)


def _quiet_option(f):
    return click.option("--quiet", "-q", is_flag=True, help="No progress bars.")(f)


def _store_arg(f):
    # No click.Path check: the store's own open names a missing path, a file or a folder that
    # is no store in the one line every command that takes STORE says.
    return click.argument("store")(f)


@click.command("build")
@_store_arg
@click.option("--corpus", "corpus_paths", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="Corpus file (plain text / JSON lines / CoNLL); repeat for more.")
@click.option("--model", "model_path", type=click.Path(file_okay=False), default=None,
              help="HF BERT-format model directory (default: the embedded all-MiniLM-L6-v2).")
@click.option("--n", type=int, default=3, show_default=True, help="Window size.")
@click.option("--window", "kind", type=click.Choice(["centered", "causal"]), default="centered", show_default=True,
              help="Window kind of an encoder store (a decoder store's windows are always causal).")
@click.option("--lower-layers", type=int, default=3, show_default=True)
@click.option("--dtype", type=click.Choice(["fp16", "int8"]), default="fp16", show_default=True)
@click.option("--distill-steps", type=int, default=0, show_default=True,
              help="Window-distill the lower layers for this many steps first (0: off).")
@click.option("--max-len", type=int, default=128, show_default=True)
@click.option("--chunk", type=int, default=50_000, show_default=True, help="Keys per root segment.")
@click.option("--format", "corpus_format", type=click.Choice(["text", "jsonl", "conll"]), default=None)
@_quiet_option
@_json_option
def build(store, corpus_paths, model_path, n, kind, lower_layers, dtype, distill_steps, max_len, chunk,
          corpus_format, quiet, as_json):
    """Create STORE and build its root PLOT from corpora (resumes an interrupted build). A
    decoder --model (GPT-2, OPT, Llama layout) makes a decoder store: causal windows always."""
    import os

    from runtime.model.decoder_config import is_decoder_dir

    if os.path.exists(store) and not os.path.isdir(store):  # the wording of hkstore.open's
        raise click.ClickException(f"{store}: is a file, not a store directory")
    if model_path and is_decoder_dir(model_path):
        from runtime.construct.decoder_store import build_decoder

        _run(build_decoder, store, model_path=model_path, corpus_paths=list(corpus_paths), n=n,
             lower_layers=lower_layers, dtype=dtype, max_len=max_len, chunk=chunk, corpus_format=corpus_format,
             distill_steps=distill_steps, progress=not quiet, as_json=as_json)
        return
    _run(manager.build, store, model_path=model_path, corpus_paths=list(corpus_paths), n=n, kind=kind,
         lower_layers=lower_layers, dtype=dtype, distill_steps=distill_steps, max_len=max_len, chunk=chunk,
         corpus_format=corpus_format, progress=not quiet, as_json=as_json)


@click.group("domain")
def domain():
    """Domain versions of the PLOT tree."""


def _domain_training_options(f):
    for option in reversed([
        click.option("--corpus", "corpus_paths", multiple=True, required=True, type=click.Path(dir_okay=False)),
        click.option("--mlm-steps", type=int, default=100, show_default=True,
                     help="Further pre-training steps of the lower layers: MLM, or causal LM on a decoder store."),
        click.option("--lr", type=float, default=5e-5, show_default=True),
        click.option("--batch-size", type=int, default=16, show_default=True),
        click.option("--format", "corpus_format", type=click.Choice(["text", "jsonl", "conll"]), default=None),
        click.option("--seed", type=int, default=0, show_default=True),
    ]):
        f = option(f)
    return f


@domain.command("create")
@_store_arg
@click.argument("name")
@_domain_training_options
@click.option("--parent", default="root", show_default=True)
@click.option("--alpha", type=click.FloatRange(0, 100), default=50, show_default=True,
              help="Keep the most frequent n-grams covering this percentage of the corpus.")
@click.option("--max-len", type=int, default=128, show_default=True)
@_quiet_option
@_json_option
@click.option("--distill-steps", type=int, default=0, show_default=True,
              help="Then window-distill the layers toward their full-context outputs for this many steps (0: off).")
def domain_create(store, name, corpus_paths, mlm_steps, lr, batch_size, corpus_format, seed, parent, alpha, max_len,
                  distill_steps, quiet, as_json):
    """Further pre-train the lower layers on a domain corpus and branch NAME off PARENT."""
    _run(manager.domain_create, store, name, list(corpus_paths), parent=parent, alpha=alpha, mlm_steps=mlm_steps,
         lr=lr, distill_steps=distill_steps, batch_size=batch_size, max_len=max_len, corpus_format=corpus_format,
         seed=seed, progress=not quiet, as_json=as_json)


@domain.command("grow")
@_store_arg
@click.argument("name")
@click.option("--corpus", "corpus_paths", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="Text the version's tenants were asked about (plain text / JSON lines / CoNLL); repeat for more.")
@click.option("--format", "corpus_format", type=click.Choice(["text", "jsonl", "conll"]), default=None)
@click.option("--max-len", type=int, default=None, help="Tokens per document (default: the version's).")
@_json_option
def domain_grow(store, name, corpus_paths, corpus_format, max_len, as_json):
    """Add the windows of a corpus that NAME serves only by backing off, valued by NAME's own
    lower layers: the PLOT as a cache that grows with its tenants' traffic."""
    _run(manager.domain_grow, store, name, list(corpus_paths), max_len=max_len, corpus_format=corpus_format,
         as_json=as_json)


@domain.command("update")
@_store_arg
@click.argument("name")
@click.argument("new_name")
@_domain_training_options
@click.option("--alpha", type=click.FloatRange(0, 100), default=None, help="Default: NAME's alpha.")
@click.option("--max-len", type=int, default=None, help="Default: NAME's.")
@click.option("--old-corpus/--no-old-corpus", "include_old", default=True, show_default=True,
              help="Count NAME's corpora along with the new one when choosing n-grams.")
@_quiet_option
@_json_option
@click.option("--distill-steps", type=int, default=None, help="Window distillation steps. Default: NAME's.")
def domain_update(store, name, new_name, corpus_paths, mlm_steps, lr, batch_size, corpus_format, seed, alpha,
                  max_len, include_old, distill_steps, quiet, as_json):
    """Continue NAME's pre-training on more data into a new sibling version NEW_NAME."""
    _run(manager.domain_update, store, name, new_name, list(corpus_paths), alpha=alpha, mlm_steps=mlm_steps, lr=lr,
         distill_steps=distill_steps, batch_size=batch_size, max_len=max_len, include_old=include_old,
         corpus_format=corpus_format, seed=seed, progress=not quiet, as_json=as_json)


@click.group("tenant")
def tenant():
    """Tenants: a PET + head each, trained on a PLOT version."""


@tenant.command("create")
@_store_arg
@click.argument("tenant")
@click.option("--version", required=True, help="PLOT version the tenant is served from.")
@click.option("--train", "train_path", required=True, type=click.Path(dir_okay=False),
              help="JSON lines {text, label} (classification) or CoNLL (tagging).")
@click.option("--task", type=click.Choice(["classification", "tagging"]), default="classification", show_default=True)
@click.option("--pet-type", "--pet", "pet_type", type=click.Choice(["adapter", "lora", "bitfit", "diff", "mask", "head"]),
              default=recipes.PLOT_PET_TYPE, show_default=True,
              help="On an encoder store lora is LoRA r16 on every projection of the upper layers (the recipe's).")
@click.option("--epochs", type=int, default=None, help="Default: the PET type's recipe (every level).")
@click.option("--max-examples", type=int, default=None)
@click.option("--lr", type=float, default=None, help="Default: the PET type's recipe (the PLOT-level PET).")
@click.option("--batch-size", type=int, default=None, help="Default: the recipe's (every level).")
@click.option("--max-len", type=int, default=128, show_default=True)
@click.option("--bottleneck", type=int, default=None, help="adapter: default the recipe's (64).")
@click.option("--rank", type=int, default=None, help="lora: default the recipe's (16; 8 on a decoder store).")
@click.option("--density", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="diff / mask: the share of each target's weights the PET changes (1: every weight; "
                   "default the recipe's, 0.005).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--unseen", type=click.FloatRange(0, 1), default=None,
              help="Train on inputs as the version serves text outside its corpus: each backoff step taken "
                   "with this probability (default the PET type's recipe: 0.4 for lora, 0.3 for the others).")
@click.option("--calibration-share", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Hold this share of the examples out of training and fit the tenant's level temperatures "
                   "on it (Tabi Eq. 3; multi-level inference reads them). 0: no calibration.")
@click.option("--levels", "levels", default="plot,full", show_default=True,
              help="plot: the PET the PLOT and exact levels serve; plot,full: also a full-depth PET (every "
                   "encoder layer, exact inputs) beside it.")
@click.option("--corpus", "corpus_paths", multiple=True, type=click.Path(dir_okay=False),
              help="Unlabeled text of the tenant's domain (repeatable): the full-depth level, trained first, "
                   "labels it and the PLOT-level PET learns from those answers too (needs level full).")
@click.option("--max-corpus", type=click.IntRange(1), default=recipes.MAX_CORPUS, show_default=True,
              help="At most this many --corpus texts.")
@_precision_option("auto", True)
@click.option("--replace", is_flag=True, help="Overwrite an existing tenant.")
@_quiet_option
@_json_option
def tenant_create(store, tenant, version, train_path, task, pet_type, epochs, max_examples, lr, batch_size, max_len,
                  bottleneck, rank, density, seed, unseen, calibration_share, levels, corpus_paths, max_corpus,
                  precision, replace, quiet, as_json):
    """Fine-tune a PET for TENANT on PLOT inputs of --version and store it, and (--levels
    plot,full) a full-depth PET on exact inputs beside it; unset training settings are the PET
    type's recipe. On a decoder store: an lm PET (causal LM loss) on --train as plain text
    (--task, --levels and the head do not apply)."""
    if _is_decoder_store(store):
        from runtime.construct.decoder_tenant import lm_tenant_create

        _run(lm_tenant_create, store, tenant, train_path=train_path, version=version, pet_type=pet_type,
             epochs=epochs or 3, lr=lr, batch_size=batch_size or 16, max_len=max_len, rank=rank or 8,
             bottleneck=bottleneck or 64, seed=seed, replace=replace, precision=precision, progress=not quiet,
             as_json=as_json)
        return
    _run(manager.tenant_create, store, tenant, version=version, train_path=train_path, task=task, pet_type=pet_type,
         epochs=epochs, max_examples=max_examples, lr=lr, batch_size=batch_size, max_len=max_len,
         bottleneck=bottleneck, rank=rank, density=density, seed=seed, unseen=unseen,
         calibration_share=calibration_share, levels=levels, corpus_paths=corpus_paths, max_corpus=max_corpus,
         precision=precision, replace=replace, progress=not quiet, as_json=as_json)


@tenant.command("update")
@_store_arg
@click.argument("tenant")
@click.option("--train", "train_path", type=click.Path(dir_okay=False), default=None,
              help="New training data (default: the tenant's original file).")
@click.option("--version", default=None, help="Move the tenant to this PLOT version (default: its own).")
@click.option("--epochs", type=int, default=1, show_default=True)
@click.option("--max-examples", type=int, default=None)
@click.option("--lr", type=float, default=None, help="Default: the PET's own.")
@click.option("--batch-size", type=int, default=None, help="Default: the recipe's.")
@click.option("--seed", type=int, default=0, show_default=True)
@_precision_option(None, False)
@_quiet_option
@_json_option
def tenant_update(store, tenant, train_path, version, epochs, max_examples, lr, batch_size, seed, precision, quiet,
                  as_json):
    """Continue fine-tuning TENANT's stored PET (and its full-depth PET, when it has one); each
    level's precision is chosen again."""
    _run(manager.tenant_update, store, tenant, train_path=train_path, version=version, epochs=epochs,
         max_examples=max_examples, lr=lr, batch_size=batch_size, seed=seed, precision=precision,
         progress=not quiet, as_json=as_json)


def _is_decoder_store(store) -> bool:
    import hkstore
    from runtime.model.stored import is_decoder_store

    try:
        with hkstore.open(store) as st:
            return is_decoder_store(st.meta)
    except Exception:  # noqa: BLE001  (a missing or damaged store: the encoder path says why)
        return False


@tenant.command("eval")
@_store_arg
@click.argument("tenant")
@click.option("--test", "test_path", required=True, type=click.Path(dir_okay=False))
@click.option("--max-examples", type=int, default=None)
@click.option("--version", default=None, help="Serve the PLOT inputs from this version (default: the tenant's).")
@_json_option
def tenant_eval(store, tenant, test_path, max_examples, version, as_json):
    """Score TENANT on a labeled file through the serving path (a decoder tenant: the
    perplexity of a text file, and the base model's)."""
    if _is_decoder_store(store):
        from runtime.construct.decoder_tenant import lm_tenant_eval

        _run(lm_tenant_eval, store, tenant, test_path, max_examples=max_examples, as_json=as_json)
        return
    _run(manager.tenant_eval, store, tenant, test_path, max_examples=max_examples, version=version, as_json=as_json)


@tenant.command("rm")
@_store_arg
@click.argument("tenant")
@_json_option
def tenant_rm(store, tenant, as_json):
    """Delete TENANT's PET (a tombstone in the pack; gc reclaims the space)."""
    _run(manager.tenant_rm, store, tenant, as_json=as_json)


@tenant.command("ls")
@_store_arg
@_json_option
def tenant_ls(store, as_json):
    """List the tenants: the levels each is served by, its profiled cascade, its record bytes."""
    result = _run(manager.tenant_ls, store, as_json=True) if as_json else _call(manager.tenant_ls, store)
    if not as_json:
        for row in result["tenants"]:
            click.echo(f"{row['tenant']}  {row['version']}  {row['pet_type']}  {','.join(row['levels'])}  "
                       f"cascade {row['cascade']}  {row['bytes']:,} bytes  "
                       f"{_held_out(row['metric'], row['held_out'])}  precision {', '.join(f'{k} {v}' for k, v in row['precision'].items())}")


@tenant.command("info")
@_store_arg
@click.argument("tenant")
@_json_option
def tenant_info(store, tenant, as_json):
    """TENANT's levels (plot, exact, full, students) with their bytes, held-out scores, the
    precision each serves at and whether each is current, and its profiled cascade."""
    if as_json:
        _run(manager.tenant_info, store, tenant, as_json=True)
        return
    result = _call(manager.tenant_info, store, tenant)
    _print(dict(result, created=_iso(result["created"])))
    scores = [f"{name} {level['held_out']:.3f}" for name, level in result["levels"].items()
              if isinstance(level.get("held_out"), (int, float))]
    click.echo(f"held-out {(result['metric'] or 'score').replace('_', ' ')}: {', '.join(scores)}" if scores
               else _held_out(None, None))
    from runtime.construct.precision import words

    for name, level in result["levels"].items():
        if name == "exact" and "precision" in level:  # one record with plot, measured on plot's rows
            click.echo(f"precision exact: {level['precision']} (its PET's, as plot)")
        elif "precision" in level:
            click.echo(f"precision {name}: {words(level['precision'], level['precision_check'])}")


COMMANDS = {"build": build, "domain": domain, "tenant": tenant}
