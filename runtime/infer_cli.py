"""`hkstore infer STORE --tenant T "text" ...`: runtime.infer from the shell.

Texts come from the arguments or, with none (or ``-``), from stdin as JSON lines: each line an
object ``{"text": ...}`` or ``{"ids": [...]}``, optionally with its own ``"tenant"`` (default
--tenant), ``"truncate"``, ``"policy"`` and ``"level"``. Every text is one request; all of them run as one mixed batch
through ``runtime.Runtime.infer``. ``--json`` prints one JSON object per request (JSON lines,
in input order), as ``POST /v1/tenants/{tenant}/infer`` answers them. Bad input is one line
and exit 1, naming the text (its argument number) or the stdin line that holds it.
"""

import json
import sys

import click

from formats.errors import FormatError
from hkstore.errors import StoreError

USER_ERRORS = (StoreError, FormatError, ValueError, OSError)


def result_view(r) -> dict:
    """A runtime.Result as JSON: the fields the HTTP API answers with."""
    out = {"tenant": r.tenant, "task": r.task, "version": r.version, "labels": list(r.labels)}
    if r.task == "classification":
        out.update(label=r.label, probabilities=[round(float(p), 6) for p in r.probabilities])
    else:
        out.update(tokens=list(r.tokens), tags=list(r.tags))
    if r.truncated:
        out["truncated"] = int(r.truncated)
    if r.confidence is not None:
        out.update(level=int(r.level), confidence=round(float(r.confidence), 6), pruned=int(r.pruned),
                   level_name=r.level_name)
    return out


def read_requests(lines, tenant) -> list:
    """Requests of JSON lines (see the module doc), each with its line number under "_line";
    lines may be bytes (decoded here, so an undecodable one is named) or str. A bad line is a
    ValueError naming it."""
    out = []
    for n, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"stdin line {n}: not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start})") \
                    from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"stdin line {n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"stdin line {n}: expected a JSON object with text or ids")
        obj.setdefault("tenant", tenant)
        if obj["tenant"] is None:
            raise ValueError(f"stdin line {n}: no tenant (give --tenant or a \"tenant\" field)")
        out.append(dict(obj, _line=n))
    if not out:
        raise ValueError("no requests on stdin")
    return out


def _where(lines, j) -> str:
    """Request j by its stdin line, else by its argument."""
    return f"stdin line {lines[j]}" if lines[j] is not None else f"text {j + 1}"


def _check_texts(requests, lines):
    """Texts the runtime would refuse for their characters, named, before the model loads."""
    from runtime.serving import MAX_TEXT_CHARS, unicode_problem

    for j, r in enumerate(requests):
        text = r.get("text")
        if not isinstance(text, str):
            continue
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"{_where(lines, j)}: {len(text):,} characters, more than {MAX_TEXT_CHARS:,} (the limit "
                             "per text, as the HTTP server's; --truncate cuts tokens, not characters)")
        if bad := unicode_problem(text):
            raise ValueError(f"{_where(lines, j)}: not valid UTF-8 ({bad})")


def _first_bad(rt, requests, lines, error) -> str:
    """A batch's error named by the first request that raises alone (the runtime checks a
    batch whole: its error says what is wrong, not where)."""
    for j, r in enumerate(requests):
        try:
            rt._asks([r])
        except USER_ERRORS as e:
            return f"{_where(lines, j)}: {_one_line(e)}"
    return _one_line(error)


def _one_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@click.command("infer")
@click.argument("store")
@click.argument("texts", nargs=-1)
@click.option("--tenant", help="Tenant serving the texts (JSON lines may name their own).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-len", type=click.IntRange(3, 4096), default=128, show_default=True, help="Tokens per text.")
@click.option("--truncate/--no-truncate", default=False, show_default=True,
              help="Cut texts longer than --max-len instead of refusing them.")
@click.option("--policy", type=click.Choice(["fast", "auto", "exact"]), default=None,
              help="fast (the PLOT level), exact (the tenant's top: its full-depth PET, else full-context lower "
                   "layers), auto (Tabi's dispatcher). Default: auto for a profiled tenant, else fast.")
@click.option("--level", type=click.Choice(["plot", "exact", "full"]), default=None,
              help="Pin a level instead of a policy: plot, exact (full-context lower layers) or full (the "
                   "full-depth PET).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per request (JSON lines).")
def infer(store, texts, tenant, device, max_len, truncate, policy, level, as_json):
    """Classify or tag TEXTS with a tenant's model (or JSON lines from stdin)."""
    import runtime

    if policy and level:
        raise click.UsageError("give --policy or --level, not both")
    try:
        if not texts or texts == ("-",):
            requests = read_requests(getattr(sys.stdin, "buffer", sys.stdin), tenant)
        else:
            if tenant is None:
                raise click.ClickException("give --tenant for the texts")
            requests = [{"tenant": tenant, "text": t} for t in texts]
        lines = [r.pop("_line", None) for r in requests]
        _check_texts(requests, lines)
        for key, value in (("policy", policy), ("level", level)):
            if value:
                for r in requests:
                    r.setdefault(key, value)
        with runtime.open(store, device=device, max_len=max_len, truncate=truncate) as rt:
            try:
                results = rt.infer(requests)
            except USER_ERRORS as e:
                if len(requests) == 1 and lines[0] is None:
                    raise
                raise click.ClickException(_first_bad(rt, requests, lines, e)) from None
    except USER_ERRORS as e:
        raise click.ClickException(_one_line(e)) from None
    for r in results:
        v = result_view(r)
        if as_json:
            click.echo(json.dumps(v))
        elif r.task == "classification":
            p = max(v["probabilities"])
            click.echo(f"{r.tenant}\t{r.label}\tprobability {p:.3f}"
                       + (f"\t(cut {r.truncated} tokens)" if r.truncated else ""))
        else:
            tagged = " ".join(w if t == "O" else f"{w}/{t}" for w, t in zip(r.tokens, r.tags))
            click.echo(f"{r.tenant}\t{tagged}")
