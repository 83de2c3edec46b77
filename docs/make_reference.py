"""Writes docs/cli.md (every command's --help) and docs/http.md (every HTTP route of
`hkstore serve`) from the code itself, so the reference cannot drift from it:

    python docs/make_reference.py            # rewrite both
    python docs/make_reference.py --check    # exit 1 if either is out of date (tests run this)
"""

import json
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


# One example request per route that takes a body (checked against the route's own body model
# when the reference is made, so an example cannot go stale).
HTTP_EXAMPLES = {
    ("POST", "/v1/tenants/{tenant}/infer"): {"texts": ["Return the sum of two numbers.", "Join two paths."]},
    ("POST", "/v1/embeddings"): {"model": "acme", "input": ["the cat sat"], "encoding_format": "float"},
    ("POST", "/v1/tenants"): {"tenant": "acme", "version": "root", "task": "classification",
                              "examples": [{"text": "Return the sum.", "label": "math"},
                                           {"text": "Join two paths.", "label": "path"}]},
    ("POST", "/v1/tenants/{tenant}/update"): {"examples": [{"text": "Split a path.", "label": "path"}], "epochs": 1},
    ("POST", "/v1/domains"): {"name": "bio", "parent": "root", "documents": ["The cell divides.", "Genes code."]},
    ("POST", "/v1/domains/{name}/update"): {"new_name": "bio2", "documents": ["Proteins fold."]},
    ("POST", "/v1/completions"): {"model": "acme", "prompt": "the history of", "max_tokens": 16},
    ("POST", "/v1/chat/completions"): {"model": "acme", "messages": [{"role": "user", "content": "hello"}]},
}
_PATH_EXAMPLES = {"{tenant}": "acme", "{name}": "bio", "{job_id}": "0123456789abcdef"}


def _type(schema, spec) -> str:
    """A JSON schema as a short type: string, array of string, InferResult, "a" | "b", ..."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema or "oneOf" in schema:
        kinds = [_type(x, spec) for x in schema.get("anyOf", schema.get("oneOf"))]
        return " or ".join(k for k in kinds if k != "null")
    if "enum" in schema:
        return " | ".join(json.dumps(x) for x in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    if schema.get("type") == "array":
        return f"array of {_type(schema.get('items', {}), spec)}"
    return schema.get("type", "any")


def _fields(name, spec) -> str:
    model = spec["components"]["schemas"][name]
    required = set(model.get("required", ()))
    out = []
    for field, schema in model.get("properties", {}).items():
        text = f"`{field}` {_type(schema, spec)}"
        if field in required:
            text += " (required)"
        elif schema.get("default") is not None:
            text += f" (default {json.dumps(schema['default'])})"
        out.append(text)
    return "; ".join(out)


def http_reference() -> str:
    from fastapi.routing import APIRoute

    from runtime.serve.app import create_app

    import hkstore

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "s")
        hkstore.create(store, d=4, vocab_size=8).close()  # the routes do not depend on what it holds
        app = create_app(store, admin_token="x" * 32)
        routes = sorted((r for r in app.routes if isinstance(r, APIRoute)), key=lambda r: (r.path, sorted(r.methods)))
        spec = app.openapi()
    out = ["# The HTTP API of `hkstore serve`", "",
           "Generated from the server's routes by `python docs/make_reference.py`; do not edit by hand.",
           "The full schemas: `GET /openapi.json` on a running server. `$ADMIN_TOKEN` is the admin token,",
           "`$TOKEN` a tenant's own token (`hkstore token issue STORE TENANT`) or the admin token. Errors are",
           '`{"detail": ...}`, on the OpenAI-compatible routes OpenAI\'s `{"error": {"message", "type", "param",',
           '"code"}}`; a body that is not JSON is 400, one that does not fit the schema (or is not UTF-8) 422.', "",
           "| method | path | what |", "| --- | --- | --- |"]
    for r in routes:
        doc = " ".join((r.description or r.summary or r.name.replace("_", " ")).split("\n\n")[0].split())
        out.append(f"| {', '.join(sorted(r.methods))} | `{r.path}` | {doc.replace('|', '/')} |")
    for r in routes:
        for method in sorted(r.methods):
            op = spec["paths"][r.path][method.lower()]
            out += ["", f"## `{method} {r.path}`", ""]
            out += [" ".join(p.split()) for p in (r.description or r.name.replace("_", " ")).split("\n\n")]
            out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                out.append(f"Body: {_fields(_type(body, spec), spec)}.")
                out.append("")
            ok = next(code for code in op["responses"] if code.startswith("2"))
            answer = op["responses"][ok].get("content", {}).get("application/json", {}).get("schema", {})
            shown = _type(answer, spec)
            fields = f": {_fields(shown, spec)}" if shown in spec["components"]["schemas"] else ""
            errors = ", ".join(code for code in sorted(op["responses"]) if not code.startswith("2"))
            out.append(f"Answer: {ok}{fields}." + (f" Errors: {errors}." if errors else ""))
            out.append("")
            path = r.path
            for k, v in _PATH_EXAMPLES.items():
                path = path.replace(k, v)
            admin = "not the admin token" in op["responses"].get("403", {}).get("description", "")
            cmd = f"curl -X {method} http://127.0.0.1:8080{path}" if method != "GET" else \
                f"curl http://127.0.0.1:8080{path}"
            if op.get("security"):
                cmd += f' -H "Authorization: Bearer ${"ADMIN_TOKEN" if admin else "TOKEN"}"'
            if body is not None:
                example = HTTP_EXAMPLES[(method, r.path)]
                r.dependant.body_params[0].field_info.annotation.model_validate(example)  # still valid
                cmd += f" \\\n     -H 'Content-Type: application/json' -d '{json.dumps(example)}'"
            out += ["```sh", cmd, "```"]
    out += ["", "## Shapes inside bodies and answers", ""]
    bodies = {_type(op["requestBody"]["content"]["application/json"]["schema"], spec)
              for ops in spec["paths"].values() for op in ops.values() if "requestBody" in op}
    for name in sorted(set(spec["components"]["schemas"]) - bodies - {"HTTPValidationError", "ValidationError"}):
        out.append(f"- `{name}`: {_fields(name, spec)}.")
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
