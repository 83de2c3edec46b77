"""`hkstore infer STORE --tenant T "text" ...`: runtime.infer from the shell.

Texts come from the arguments or, with none (or ``-``), from stdin as JSON lines: each line an
object ``{"text": ...}`` or ``{"ids": [...]}``, optionally with its own ``"tenant"`` (default
--tenant), ``"truncate"``, ``"policy"`` and ``"level"``. Every text is one request; all of them run as one mixed batch
through ``runtime.Runtime.infer``. ``--json`` prints one JSON object per request (JSON lines,
in input order), as ``POST /v1/tenants/{tenant}/infer`` answers them.
"""

import json
import sys

import click


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
    """Requests of JSON lines (see the module doc); a bad line is a ValueError naming it."""
    out = []
    for n, line in enumerate(lines, 1):
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
        out.append(obj)
    if not out:
        raise ValueError("no requests on stdin")
    return out


@click.command("infer")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
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

    if not texts or texts == ("-",):
        requests = read_requests(sys.stdin, tenant)
    else:
        if tenant is None:
            raise click.ClickException("give --tenant for the texts")
        requests = [{"tenant": tenant, "text": t} for t in texts]
    if policy and level:
        raise click.UsageError("give --policy or --level, not both")
    for key, value in (("policy", policy), ("level", level)):
        if value:
            for r in requests:
                r.setdefault(key, value)
    with runtime.open(store, device=device, max_len=max_len, truncate=truncate) as rt:
        results = rt.infer(requests)
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
