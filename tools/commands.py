"""Click commands of the analyst tools, mounted by tools/cli.py (MODEL_COMMANDS):

    hkstore report STORE [--version V] [--corpus FILE] --out DIR [--json]
    hkstore explain STORE --version V "some text" [--json]

Importing this module is cheap (no torch, no matplotlib): the work is imported when a
command runs. Bad input is a one-line error (click.ClickException), never a traceback.
"""

from __future__ import annotations

import json
import os

import click

from formats.errors import FormatError
from hkstore.errors import StoreError

FORMATS = ("text", "jsonl", "conll")
USER_ERRORS = (StoreError, FormatError, ValueError, OSError)


def _emit(obj, as_json, human):
    if as_json:
        click.echo(json.dumps(obj, indent=1, default=str))
    else:
        human(obj)


def _check_store(store):
    """A missing path, a file or a folder that is no store: hkstore.open's one line, as every
    command that takes STORE says it."""
    import hkstore

    try:
        hkstore.open(store).close()
    except (StoreError, FormatError) as e:
        raise click.ClickException(_one_line(e)) from None


def _one_line(e):
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@click.command("report")
@click.argument("store")
@click.option("--version", "version", default=None,
              help="Report this version and its ancestors (default: every version).")
@click.option("--corpus", default=None, help="Corpus (plain text, JSON lines or CoNLL) to measure coverage on.")
@click.option("--corpus-format", type=click.Choice(FORMATS), default=None, help="Corpus format (default: sniffed).")
@click.option("--out", "out_dir", required=True, help="Directory for index.html, report.json and the PNG figures.")
@click.option("--sample", default=200_000, show_default=True,
              help="Most shared keys per branch whose distances are computed (a random sample beyond).")
@click.option("--top", default=20, show_default=True, help="Most-changed n-grams listed per branch.")
@click.option("--max-len", type=int, default=None,
              help="Corpus pieces of at most this many ids (default: as the store was built, else 128).")
@click.option("--json", "as_json", is_flag=True, help="Print every number of the report as JSON.")
def report(store, version, corpus, corpus_format, out_dir, sample, top, max_len, as_json):
    """An HTML report of a store: version tree, branch overlap and distances, corpus coverage, PETs."""
    _check_store(store)
    if corpus is not None and not os.path.isfile(corpus):
        raise click.ClickException(f"{corpus}: no such corpus file")
    if sample < 1 or top < 0:
        raise click.ClickException("--sample must be at least 1 and --top at least 0")
    from tools.report import write_report

    try:
        index, r = write_report(store, out_dir, version, corpus, sample=sample, top=top, corpus_format=corpus_format,
                                max_len=max_len, return_report=True)
    except USER_ERRORS as e:
        raise click.ClickException(_one_line(e)) from None

    def human(r):
        t = r["totals"]
        click.echo(f"wrote {r['index']} ({len(r['figures'])} figures): {t['versions']} versions, "
                   f"{t['tenants']} tenants, {t['bytes_live']:,} bytes live, {t['bytes_on_disk']:,} on disk "
                   "(as hkstore info)")
        for b in r["branches"]:
            s = b["cosine_distance"]
            dist = f", cosine distance p50 {s['p50']:.3g} p90 {s['p90']:.3g}" if s["count"] else ""
            click.echo(f"  {b['name']}: {b['entries']:,} entries, {b['shared']:,} shared with "
                       f"{' > '.join(b['chain'])} ({100 * b['shared_share']:.1f}%){dist}"
                       f"{' (sampled)' if b['sampled'] else ''}")
        if r["coverage"]:
            for c in r["coverage"]["versions"]:
                own = c["by_version"].get(c["version"], {}).get("share", 0.0)
                click.echo(f"  coverage at {c['version']}: {100 * own:.1f}% of {c['windows']:,} windows served by "
                           f"{c['version']} itself, {100 * c['exact_share']:.1f}% without backoff")
        for note in r["notes"]:
            click.echo(f"  note: {note}")

    _emit(dict(r, index=index), as_json, human)


@click.command("explain")
@click.argument("store")
@click.argument("text")
@click.option("--version", "version", required=True, help="The PLOT version to serve the text from.")
@click.option("--reference", type=click.Choice(["base", "version"]), default="base", show_default=True,
              help="Full-context lower layers to compare with: the base model, or the lower weights that "
                   "produced the version (domain / distilled, if the store saved them).")
@click.option("--max-len", type=int, default=None, help="Cut the text to this many ids (default: refuse a text longer than the model's positions).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def explain(store, text, version, reference, max_len, as_json):
    """Per token: its window, the version and order that served it, and the cosine distance
    between its PLOT input and the full-context lower-layer output."""
    _check_store(store)
    if not text.strip():
        raise click.ClickException("nothing to explain: empty text")
    from tools.explain import explain as run_explain

    try:
        rows = run_explain(store, version, text, reference=reference, max_len=max_len)
    except USER_ERRORS as e:
        raise click.ClickException(_one_line(e)) from None

    def human(rows):
        click.echo(f"{'pos':>4} {'token':14} {'window':32} {'version':14} {'order':>5} {'backoff':>7} {'cos dist':>9}")
        for r in rows:
            window = " ".join(r["window_tokens"])
            click.echo(f"{r['position']:>4} {r['token'][:14]:14} {window[:32]:32} {str(r['version'])[:14]:14} "
                       f"{r['order']:>5} {str(r['backoff']):>7} {r['cosine_distance']:>9.4f}")
        if max_len is not None and len(rows) == max_len:
            click.echo(f"note: the text was cut to --max-len {max_len} tokens")
        if rows:
            click.echo(f"reference: {rows[0]['reference']} full-context lower layers; mean cosine distance "
                       f"{sum(r['cosine_distance'] for r in rows) / len(rows):.4f}")

    _emit(rows, as_json, human)


__all__ = ["explain", "report"]
