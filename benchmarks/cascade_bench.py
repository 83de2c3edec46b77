"""A tenant's cascade per task, end to end through the product: made by `tenant create --levels
plot,full` and `students create`, profiled by `hkstore levels profile`, served by `hkstore serve`.

    python -m benchmarks.cascade_bench --run RUN --out OUT [--tasks a,b] [--limit N] [--write-results]

RUN is a benchmarks.hmi_accuracy run directory: its store RUN/store (root + the domain
versions), its sampled training files RUN/data/<task>.train.{jsonl,conll} and its settings
(RUN/results.json: the suite, the sample's size and seed, max_len). Its store is copied to
OUT/store first (segments and weights hard-linked: the bench adds tenants to it). Per task:

1. the tenant ``<task>-cascade`` on the task's domain version, made by
   runtime.construct.manager.tenant_create with the product's defaults (its PLOT-level PET: LoRA
   r16 trained at unseen 0.4; levels plot,full, calibration share 0) on the run's training file at its max_len (as the harness's
   hplm row; --self-train: also `--corpus` with the run's domain corpus,
   RUN/data/domain-<domain>.txt), then its students by `hkstore students create --dev` (the
   product's defaults; --self-train: also `--corpus`, as many texts as the PLOT level's);
2. `hkstore levels profile --dev` (the default target and assurance): the dev sample is the
   run's when it scored dev, else drawn as the harness draws it (same size and seed);
3. a fresh `hkstore serve` process (CPU, one torch thread, the run's max_len, --truncate)
   answers the test sample's queries one at a time over HTTP (benchmarks.loadgen's client, the
   admin token) at policy fast, exact (the top) and auto, and with its students their best k
   pinned (the students-first bound, benchmarks.cascade_report), paced (PACE: the server at
   most half busy, a low load), the systems interleaved in rotating
   order after a few unmeasured dev queries each; per query the server process's CPU time (its
   process CPU-time clock, every thread included, read before and after the request), the
   wall latency and the level that answered (``level_name``), scored as the
   harness scores (benchmarks.hmi_accuracy.Task.score): tagging answers are per word of the
   tokenizer, each CoNLL word takes its first one's tag.

OUT/<task>.json holds every per-query output (a finished task is not redone: delete it to
redo it; the tenant, students and profile are kept in OUT/store and OUT/<task>.steps.json, so
a run cut off mid-task resumes at the step it was in), OUT/summary.md the table
(benchmarks.cascade_report: the goal, the share per level, CPU time per query, the oracle
bound); --write-results adds ``auto_gap_to_top_mean`` and ``auto_cost_vs_top`` to
benchmarks/results/accuracy.json once every task of --tasks is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cascade_report as report
from benchmarks.hmi_accuracy import TASKS, Task, write_task

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 4  # dev queries per system before the measured pass: PETs loaded, caches warm
# After each answer the client waits as long as it took: the server is busy at most half the
# time. A closed loop that sends the next query at once keeps it busy all the time, and the
# students' pruning policy rightly reads that as more load than the teacher keeps up with
# (arrivals x cost per token above its headroom) and serves students: the cascade at low load
# is what is measured here (bursts: benchmarks.student_engine).
PACE = 1.0
T0 = time.time()


def say(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# -- data ---------------------------------------------------------------------------------------


def ext(kind) -> str:
    return "jsonl" if kind == "classification" else "conll"


def split_file(args, config, task, split) -> Path:
    """OUT/data/<task>.<split>.<ext>: the run's sample of the split when it has one, else drawn
    from the suite as benchmarks.hmi_accuracy.prepare_data draws it; its first --limit examples."""
    from runtime.construct.manager import _subsample, read_task

    kind, sub, _ = TASKS[task]
    out = Path(args.out) / "data" / f"{task}.{split}.{ext(kind)}"
    if out.exists():
        return out
    sampled = Path(args.run) / "data" / out.name
    if sampled.exists():
        (x, y), _ = read_task(sampled, kind)
    else:
        suite = Path(args.data or config["data"])
        (x, y), _ = read_task(suite / sub / f"{split}.txt", kind)
        pick = _subsample(len(x), config.get("max_test", 400), config.get("seed", 0))
        x, y = [x[i] for i in pick], [y[i] for i in pick]
    if args.limit:
        x, y = x[:args.limit], y[:args.limit]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_task(out, kind, x, y)
    return out


def copy_store(source: Path, target: Path) -> None:
    """A copy of a store to add tenants to: segments and weight files (never rewritten) are
    hard-linked, manifests and packs (appended to) copied."""
    if (target / "CURRENT").exists():
        return
    if not (source / "CURRENT").exists():
        raise SystemExit(f"{source}: not an hkstore store (the harness run's store is RUN/store)")
    shutil.rmtree(target, ignore_errors=True)
    linked = ("segments", "models")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*linked, "LOCK", "admin.token"))
    for name in linked:
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name, copy_function=_link_or_copy)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


# -- construction -------------------------------------------------------------------------------


def hkstore_cli(args, *argv) -> dict:
    """`hkstore ARGV --json` in a child process (the command as a user runs it); its JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "tools.cli", *argv, "--json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hkstore {' '.join(argv[:2])} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def construct(args, config, task, store, dev) -> dict:
    """The tenant, its students and its profile (steps done before are kept: OUT/<task>.steps.json)."""
    from runtime.construct import manager, recipe

    kind, _, domain = TASKS[task]
    tenant = f"{task}-cascade"
    path = Path(args.out) / f"{task}.steps.json"
    steps = json.loads(path.read_text()) if path.exists() else {}

    def done(step, value):
        steps[step] = value
        path.write_text(json.dumps(steps, indent=1, default=str))

    corpus = [str(Path(args.run) / "data" / f"domain-{domain}.txt")] if args.self_train else []
    if "create" not in steps:
        t0 = time.time()
        say(f"{task}: tenant create {tenant} on {domain} (levels plot,full{', --corpus' if corpus else ''})")
        out = manager.tenant_create(str(store), tenant, version=domain, train_path=str(Path(args.run) / "data" /
                                    f"{task}.train.{ext(kind)}"), task=kind, max_len=config.get("max_len", 128),
                                    seed=config.get("seed", 0), levels=("plot", "full"), corpus_paths=corpus,
                                    replace=True, progress=args.progress)
        done("create", dict(out, seconds=round(time.time() - t0, 1)))
    if args.students and "students" not in steps:
        t0 = time.time()
        # with --self-train the students also learn from the corpus, as many texts as the PLOT level
        more = [a for path in corpus for a in ("--corpus", path)]
        more += ["--max-corpus", str(recipe.MAX_CORPUS)] if corpus else []
        say(f"{task}: students create{' --corpus' if corpus else ''}")
        out = hkstore_cli(args, "students", "create", str(store), tenant, "--dev", str(dev), "--quiet", *more)
        done("students", dict(out, seconds=round(time.time() - t0, 1)))
    if "profile" not in steps:
        t0 = time.time()
        say(f"{task}: levels profile on dev")
        out = hkstore_cli(args, "levels", "profile", str(store), tenant, "--dev", str(dev), "--device", "cpu")
        done("profile", dict(out, seconds=round(time.time() - t0, 1)))
    return dict(steps, tenant=tenant)


# -- serving ------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, every thread it has run included: its process CPU-time clock
    (Linux clock_getcpuclockid: nanoseconds), else /proc/PID/stat's clock ticks."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def texts_of(kind, x) -> list[str]:
    return list(x) if kind == "classification" else [" ".join(words) for words in x]


def word_predictions(words: list[str], result: dict) -> list:
    """A CoNLL sentence's tags from a tagging answer (a tag per tokenizer word of the text the
    words joined by spaces make): each word takes the tag of the first answer word that starts
    inside it; None when none does (a word cut by max_len, or one the tokenizer drops whole)."""
    text = " ".join(words)
    starts, at = [], 0
    for token in result["tokens"]:
        j = text.find(token, at)
        starts.append(j)
        at = j + len(token) if j >= 0 else at
    out, begin, k = [], 0, 0
    for w in words:
        end = begin + len(w)
        while k < len(starts) and starts[k] < begin:
            k += 1
        out.append(result["tags"][k] if k < len(starts) and begin <= starts[k] < end else None)
        begin = end + 1
    return out


def answer_of(task: Task, q: int, result: dict):
    """Query q's answer: a label index (-1 for a label the task lacks), or a tag per CoNLL word."""
    if task.kind == "classification":
        labels = list(task.labels)
        return labels.index(result["label"]) if result["label"] in labels else -1
    return word_predictions(task.test_words[q], result)


def scored(task: Task, q: int, answer):
    """What Task.score reads of query q's answer: the label index, or per sub-token a tag index
    at the words' first sub-tokens (Task.test_y's non-ignored positions)."""
    from runtime.construct.data import IGNORE

    if task.kind == "classification":
        return answer
    # Task.test_y marks the first sub-token of each word that has one, in order: the words
    # the answer tagged, in the same order (a word without a token has neither)
    labels, tags = list(task.labels), iter([t for t in answer if t is not None])
    return [labels.index(next(tags, "O")) if y != IGNORE else 0 for y in task.test_y[q]]


def counts(task: Task, q: int, answer) -> list[int]:
    """Query q's scoring counts: (correct, 1, 1), or (spans found, predicted, gold) as Task.score counts."""
    from runtime.construct.data import entity_spans, word_tags

    if task.kind == "classification":
        return [int(answer == task.test_y[q]), 1, 1]
    p = entity_spans(word_tags(scored(task, q, answer), task.test_y[q], task.labels, len(task.test_words[q])))
    g = entity_spans([t if t in task.labels else "O" for t in task.test_gold[q]])
    return [len(p & g), len(p), len(g)]


class Server:
    """`hkstore serve STORE` in a child process (benchmarks.loadgen.ServerProcess) and its admin
    token; mode hplm (the product) or dedicated (the dedicated-model baseline, --mode dedicated)."""

    def __init__(self, args, config, store, mode="hplm"):
        from benchmarks import loadgen

        self.token = secrets.token_urlsafe(24)
        token_file = Path(args.out) / "admin.token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        server_args = argparse.Namespace(out=args.out, store=str(store), device="cpu",
                                         max_len=config.get("max_len", 128), max_batch=32, max_wait_ms=5,
                                         queue_limit=1024, request_timeout=300, dedicated_resident=1)
        self.proc = loadgen.ServerProcess(server_args, mode, str(token_file), say,
                                          extra=("--torch-threads", str(args.threads), "--truncate"))
        self.client = loadgen.Client(self.proc.url, self.token, [], timeout=300)

    async def ask(self, tenant, text, options) -> tuple[dict, float, float]:
        """(the answer, server CPU seconds, wall seconds) of one request (options: its policy or pin)."""
        pid = self.proc.proc.pid
        c0 = cpu_seconds(pid)
        status, wall, _, _, payload = await self.client.call(tenant, {"text": text, **options})
        cpu = cpu_seconds(pid) - c0
        if status != 200:
            raise RuntimeError(f"the server answered {status}: {payload[:300]!r}")
        return json.loads(payload)["results"][0], cpu, wall

    async def close(self):
        await self.client.close()
        self.proc.stop()


def systems_of(steps: dict) -> dict:
    """The systems served, as request options: the three policies, and with students the tenant's
    best k pinned (``students``: the oracle bound of a students-first cascade)."""
    systems = {s: {"policy": s} for s in report.SYSTEMS}
    k = (steps.get("students") or {}).get("best_k")
    if k:
        systems["students"] = {"students": int(k)}
    return systems


async def paced_pass(server, tenant, label, texts, warm_texts, systems: dict) -> dict:
    """Every query one at a time under each system, in rotating order, paced (PACE), after
    WARMUP unmeasured warm_texts each; per system the (answer, CPU seconds, wall seconds) of
    each query."""
    names = list(systems)
    for text in warm_texts[:WARMUP]:
        for name in names:
            await server.ask(tenant, text, systems[name])
    out = {s: [] for s in names}
    t0, n = time.time(), len(texts)
    for q, text in enumerate(texts):
        for name in names[q % len(names):] + names[:q % len(names)]:
            got = await server.ask(tenant, text, systems[name])
            await asyncio.sleep(PACE * got[2])
            out[name].append(got)
        if (q + 1) % 50 == 0 or q + 1 == n:
            rate = (q + 1) / max(time.time() - t0, 1e-9)
            say(f"  {label}: {q + 1}/{n} test queries x {len(names)} systems, {rate:.1f} queries/s, ETA {(n - q - 1) / rate:.0f} s")
    return out


async def serve_pass(server, tenant, task: Task, dev_texts, systems: dict) -> dict:
    """paced_pass over the test queries; per system and query the scoring counts, CPU and wall
    seconds, the level that answered."""
    served = await paced_pass(server, tenant, task.name, texts_of(task.kind, task.test_words), dev_texts, systems)
    out = {}
    for policy, got in served.items():
        answers = [answer_of(task, q, result) for q, (result, _, _) in enumerate(got)]
        out[policy] = {"counts": [counts(task, q, a) for q, a in enumerate(answers)],
                       "cpu_s": [cpu for _, cpu, _ in got], "wall_s": [wall for _, _, wall in got],
                       "level_name": [r.get("level_name", "plot") for r, _, _ in got],
                       "students": [int(r.get("students", 0)) for r, _, _ in got], "pred": answers,
                       "score": task.score([scored(task, q, a) for q, a in enumerate(answers)])}
    return out


def run_task(args, config, task, store) -> dict:
    import hkstore
    from runtime.construct.manager import read_task
    from runtime.model.stored import base_encoder

    kind = TASKS[task][0]
    t0 = time.time()
    dev, test = split_file(args, config, task, "dev"), split_file(args, config, task, "test")
    steps = construct(args, config, task, store, dev)
    tenant = steps["tenant"]
    with hkstore.open(str(store)) as st:
        encoder = base_encoder(st)
    train = Path(args.run) / "data" / f"{task}.train.{ext(kind)}"
    t = Task(task, {"kind": kind, "train": str(train), "eval": str(test)}, encoder, config.get("max_len", 128))
    (dev_x, _), _ = read_task(dev, kind)
    say(f"{task}: serving {len(t.test_ids)} test queries through hkstore serve")
    server = Server(args, config, store)

    async def go():
        try:
            return await serve_pass(server, tenant, t, texts_of(kind, dev_x), systems_of(steps))
        finally:
            await server.close()

    served = asyncio.run(go())
    result = {"task": task, "kind": kind, "tenant": tenant, "metric": "accuracy" if kind == "classification"
              else "entity_f1", "files": {"dev": str(dev), "test": str(test), "train": str(train)},
              "steps": steps, "served": served, "seconds": round(time.time() - t0, 1),
              "server": {"threads": args.threads, "max_len": config.get("max_len", 128), "device": "cpu"}}
    for s in served:  # the counts' metric is Task.score's, query by query
        by_counts = report.metric(kind, served[s]["counts"])
        if abs(by_counts - served[s]["score"]) > 1e-9:
            raise RuntimeError(f"{task}/{s}: per-query counts give {by_counts}, Task.score {served[s]['score']}")
    return result


# -- main ---------------------------------------------------------------------------------------


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run", required=True, help="a benchmarks.hmi_accuracy output directory (its store and data)")
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--limit", type=int, default=0, help="at most this many dev and test queries per task (0: all)")
    p.add_argument("--data", default=None, help="the suite, for a dev split the run did not sample (default: the run's)")
    p.add_argument("--no-students", dest="students", action="store_false", help="skip `students create`")
    p.add_argument("--self-train", action="store_true",
                   help="tenant create and students create --corpus with the run's domain corpus "
                   "(the full-depth level teaches the PLOT level, the PLOT level its students)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (hkstore serve's default)")
    p.add_argument("--write-results", action="store_true",
                   help="add the figures to benchmarks/results/accuracy.json (every task of --tasks done)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "accuracy.json")
    p.add_argument("--progress", action="store_true", help="training progress bars")
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        raise SystemExit(f"unknown task {unknown[0]!r}; expected some of {', '.join(TASKS)}")
    if args.limit < 0:
        raise SystemExit("--limit must be >= 0")
    run, out = Path(args.run), Path(args.out)
    if not (run / "results.json").exists():
        raise SystemExit(f"{run}: no results.json (a benchmarks.hmi_accuracy output directory)")
    config = json.loads((run / "results.json").read_text()).get("config", {})
    out.mkdir(parents=True, exist_ok=True)
    settings = {"run": str(run.resolve()), "limit": args.limit, "students": args.students, "threads": args.threads}
    saved = out / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        raise SystemExit(f"{out} was made with other settings ({saved}); use another --out")
    saved.write_text(json.dumps(settings, indent=1))
    store = out / "store"
    copy_store(run / "store", store)
    for j, task in enumerate(tasks):
        path = out / f"{task}.json"
        if path.exists():
            say(f"{task}: done before ({path})")
            continue
        t0 = time.time()
        result = run_task(args, config, task, store)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, default=float))
        os.replace(tmp, path)
        left = len([t for t in tasks[j + 1:] if not (out / f"{t}.json").exists()])
        say(f"{task}: done in {time.time() - t0:.0f} s; about {left * (time.time() - t0) / 60:.0f} min for the "
            f"{left} tasks left")
    done = report.load(out, tasks)
    figures = [report.task_figures(r) for r in done]
    total = report.summary(figures)
    text = "\n".join([report.markdown(report.table(figures, total)), "", *report.profile_lines(done)])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    if args.write_results:
        if len(figures) != len(tasks):
            raise SystemExit("--write-results: not every task is done")
        report.write_accuracy(args.results, figures, total)
        say(f"wrote auto_gap_to_top_mean {total['gap_mean']:.1f} and auto_cost_vs_top "
            f"{total['cost_vs_top_mean']:.2f} into {args.results}")
    return {"figures": figures, "summary": total}


if __name__ == "__main__":
    main()
    sys.exit(0)
