"""`hkstore students`: construction and scoring of a tenant's students (mounted lazily).

    hkstore students create STORE TENANT --dev FILE [--students 4] [--layers 1] [--corpus FILE ...]
    hkstore students create STORE TENANT            (again, e.g. after tenant update: the stored settings)
    hkstore students ls STORE
    hkstore students eval STORE TENANT --test FILE
    hkstore students rm STORE TENANT
    hkstore tenant create STORE TENANT ... --students N --students-dev FILE   (the PET, then its students)

Students are distilled from a trained teacher, so they come after it, and construction's room
never imports this one: `hkstore tenant` is mounted from here, construction's commands with
`--students` added to `create` and `update` (`tenant` below).
"""

from __future__ import annotations

import os

import click

from runtime.construct import manager
from runtime.construct.commands import _json_option, _quiet_option, _run, _store_arg
from runtime.construct.commands import tenant as build_tenant


@click.group("students")
def students():
    """Student Parallelism: boosted shallow students that can serve a tenant under bursts."""


@students.command("create")
@_store_arg
@click.argument("tenant")
@click.option("--dev", "dev_path", type=click.Path(dir_okay=False),
              help="Labeled validation file: when to stop adding students, and the best k (default: the one "
                   "the tenant's students were made with).")
@click.option("--students", "max_students", type=int, help="At most this many students.  [default: 4]")
@click.option("--layers", type=int, help="Transformer layers per student.  [default: 1]")
@click.option("--lam", type=float, help="Stacking distillation weight (students of 2+ layers).  [default: 0.5]")
@click.option("--epochs", type=int, help="[default: 8]")
@click.option("--lr", type=float, help="[default: 2e-3]")
@click.option("--corpus", "corpus_paths", multiple=True, type=click.Path(dir_okay=False),
              help="Unlabeled in-domain text the students also learn from (repeatable).")
@click.option("--max-corpus", default=2000, show_default=True, help="At most this many corpus pieces.")
@click.option("--max-examples", type=int, default=None)
@click.option("--fresh", is_flag=True, help="Start over instead of resuming an unfinished group.")
@_quiet_option
@_json_option
def create(store, tenant, dev_path, max_students, layers, lam, epochs, lr, corpus_paths, max_corpus, max_examples,
           fresh, quiet, as_json):
    """Distill TENANT's PET into students (resumes an unfinished run unless --fresh). Run again
    after `tenant update` (the students are then stale): options not given are the stored
    group's (its --dev among them), else the defaults."""
    from runtime.student.build import recorded_settings, students_create

    def run(path, name):
        given = {"dev_path": dev_path, "students": max_students, "layers": layers, "lam": lam, "epochs": epochs,
                 "lr": lr, "corpus_paths": corpus_paths or None}
        settings = {**recorded_settings(path, name), **{k: v for k, v in given.items() if v is not None}}
        if not settings.get("dev_path"):
            raise ValueError(f"--dev is needed: tenant {name!r} has no students whose settings to reuse")
        return students_create(path, name, max_corpus=max_corpus, max_examples=max_examples, resume=not fresh,
                               progress=not quiet, **settings)

    _run(run, store, tenant, as_json=as_json)


@students.command("ls")
@_store_arg
@_json_option
def ls(store, as_json):
    """Tenants with students: how many, best k, scores on dev, and whether they are served
    (ready), stale (distilled from an earlier PET: the teacher serves) or unfinished."""
    import hkstore
    from runtime.student.record import state

    def listing(path):
        with hkstore.open(path) as st:
            snap = st.snapshot()
            rows = []
            for tenant in sorted(snap.students):
                meta = snap.read_students(tenant).meta
                rows.append({"tenant": tenant, "state": state(meta, snap.read_pet(tenant).meta),
                             "students": meta.get("students"), "layers": meta.get("layers"),
                             "best_k": meta.get("best_k"), "metric": meta.get("metric"),
                             "teacher_score": meta.get("teacher_score"), "scores": meta.get("scores")})
        return rows

    def show(path):
        rows = listing(path)
        if as_json:
            return {"tenants": rows}
        click.echo(f"{'tenant':28} {'state':10} {'students':>8} {'layers':>6} {'best_k':>6}  scores on dev (k = 1..; teacher)")
        for r in rows:
            scores = " ".join(f"{x:.3f}" for x in r["scores"] or [])
            teacher = f"; {r['teacher_score']:.3f}" if r["teacher_score"] is not None else ""
            click.echo(f"{r['tenant']:28} {r['state']:10} {r['students']!s:>8} {r['layers']!s:>6} {r['best_k']!s:>6}  "
                       f"{scores}{teacher}")
        return {}  # printed

    _run(show, store, as_json=as_json)


@students.command("eval")
@_store_arg
@click.argument("tenant")
@click.option("--test", "test_path", required=True, type=click.Path(dir_okay=False))
@click.option("--max-examples", type=int, default=None)
@_json_option
def evaluate(store, tenant, test_path, max_examples, as_json):
    """Score the teacher and the first k students, every k, on a labeled file."""
    from runtime.student.evaluate import students_eval

    _run(students_eval, store, tenant, test_path, max_examples=max_examples, as_json=as_json)


@students.command("rm")
@_store_arg
@click.argument("tenant")
@_json_option
def rm(store, tenant, as_json):
    """Delete TENANT's students (its PET stays)."""
    import hkstore

    def remove(path, name):
        with hkstore.open(path, writable=True) as st:
            st.delete_students(name)
        return {"tenant": name, "students_removed": True}

    _run(remove, store, tenant, as_json=as_json)


# -- `hkstore tenant create/update --students N`: the PET, then its students -----------------


def _student_options():
    return [
        click.Option(["--students", "students_n"], type=click.IntRange(min=1), default=None,
                     help="Then distill the tenant into at most N students (Student Parallelism) with `students "
                          "create`'s defaults; that command has every setting."),
        click.Option(["--students-dev", "students_dev"], type=click.Path(dir_okay=False), default=None,
                     help="With --students: the labeled validation file (when to stop adding students, the best "
                          "k). Default: the one the tenant's students were made with."),
        click.Option(["--students-corpus", "students_corpus"], multiple=True, type=click.Path(dir_okay=False),
                     help="With --students: unlabeled in-domain text the students also learn from (repeatable)."),
    ]


def _resumes(snap, tenant, options) -> bool:
    """Whether a `tenant create --students` that was cut off is being run again: the tenant
    exists, made from the same --train on the same --version, and its students are missing
    or unfinished. Then its PET is kept and only the students are (re)made."""
    if options.get("replace") or tenant not in snap.pets:
        return False
    meta = snap.read_pet(tenant).meta
    done = tenant in snap.students and snap.read_students(tenant).meta.get("complete")
    same = ((meta.get("train") or {}).get("path") == os.path.abspath(options["train_path"])
            and meta.get("version") == options["version"])
    return same and not done


def _tenant_then_students(store, tenant, *, job, creating, options, n, dev, corpus, progress):
    import hkstore
    from runtime.model.stored import is_decoder_store
    from runtime.student.build import recorded_settings, students_create

    with hkstore.open(store) as st:
        if is_decoder_store(st.meta):
            raise ValueError("--students: students serve encoder tenants, and this is a decoder store")
        resume = creating and _resumes(st.snapshot(), tenant, options)
    # Every check before the PET's training, so a mistake costs seconds, not a trained PET.
    settings = {**recorded_settings(store, tenant), "students": n}
    if dev:
        settings["dev_path"] = dev
    if corpus:
        settings["corpus_paths"] = tuple(corpus)
    if not settings.get("dev_path"):
        raise ValueError(f"--students needs --students-dev FILE: tenant {tenant!r} has no students whose "
                         "validation file to reuse")
    for path in (settings["dev_path"], *settings.get("corpus_paths", ())):
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
    if resume:
        made = {"tenant": tenant, "pet": "kept (it exists, made from the same --train and --version)"}
    else:
        made = job(store, tenant, progress=progress, **options)
    return {**made, "students": students_create(store, tenant, progress=progress, **settings)}


def _with_students(command: click.Command, job, creating: bool) -> click.Command:
    def callback(students_n, students_dev, students_corpus, **kwargs):
        if students_n is None:
            if students_dev or students_corpus:
                raise click.ClickException("--students-dev and --students-corpus go with --students N")
            return command.callback(**kwargs)
        store, tenant, quiet, as_json = (kwargs.pop(k) for k in ("store", "tenant", "quiet", "as_json"))
        _run(_tenant_then_students, store, tenant, job=job, creating=creating, options=kwargs, n=students_n,
             dev=students_dev, corpus=students_corpus, progress=not quiet, as_json=as_json)

    again = ("Cut off during the students, run it again: the PET is kept and the students resume."
             if creating else "Cut off during the students: `hkstore students create STORE TENANT` resumes them.")
    return click.Command(command.name, params=[*command.params, *_student_options()], callback=callback,
                         help=f"{command.help}\n\nWith --students N the tenant is then distilled into students. {again}")


tenant = click.Group(build_tenant.name, help=build_tenant.help, commands={
    **build_tenant.commands,
    "create": _with_students(build_tenant.commands["create"], manager.tenant_create, creating=True),
    "update": _with_students(build_tenant.commands["update"], manager.tenant_update, creating=False),
})
