"""Writes docs/cli.md (every command's --help) and docs/http.md (every HTTP route of
`hkstore serve`) from the code itself, so the reference cannot drift from it:

    python docs/make_reference.py            # rewrite both
    python docs/make_reference.py --check    # exit 1 if either is out of date (tests run this)
"""

import os
import sys
import tempfile

import click

HERE = os.path.dirname(os.path.abspath(__file__))


def commands(group, path=("hkstore",)):
    """(path, command) of the group and everything under it, in help order."""
    yield path, group
    if isinstance(group, click.Group):
        ctx = click.Context(group, info_name=path[-1])
        for name in group.list_commands(ctx):
            yield from commands(group.get_command(ctx, name), path + (name,))


def cli_reference() -> str:
    from tools.cli import main

    out = ["# The `hkstore` command line", "",
           "Generated from each command's `--help` by `python docs/make_reference.py`; do not edit by hand.", ""]
    for path, cmd in commands(main):
        ctx = click.Context(cmd, info_name=" ".join(path), terminal_width=100, max_content_width=100)
        out += [f"## `{' '.join(path)}`", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(out)


def http_reference() -> str:
    from fastapi.routing import APIRoute

    from runtime.serve.app import create_app

    import hkstore

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "s")
        hkstore.create(store, d=4, vocab_size=8).close()  # the routes do not depend on what it holds
        app = create_app(store, admin_token="x" * 32)
        routes = [r for r in app.routes if isinstance(r, APIRoute)]
    out = ["# The HTTP API of `hkstore serve`", "",
           "Generated from the server's routes by `python docs/make_reference.py`; do not edit by hand.",
           "The full schemas: `GET /openapi.json` on a running server.", "",
           "| method | path | what |", "| --- | --- | --- |"]
    for r in sorted(routes, key=lambda r: (r.path, sorted(r.methods))):
        doc = " ".join((r.description or r.summary or r.name.replace("_", " ")).split("\n\n")[0].split())
        out.append(f"| {', '.join(sorted(r.methods))} | `{r.path}` | {doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main(argv, directory=HERE) -> int:
    stale = []
    for name, text in (("cli.md", cli_reference()), ("http.md", http_reference())):
        path = os.path.join(directory, name)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if "--check" in argv:
            if old != text:
                stale.append(name)
        elif old != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote docs/{name}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python docs/make_reference.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
