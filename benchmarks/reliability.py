"""Reliability campaign: SIGKILLs during commits, compactions and gc; random damage to every
file type; malformed, oversized and unauthenticated HTTP requests. Prints the table of
BENCHMARKS.md's "Reliability" section.

    python -m benchmarks.reliability [--kills 300] [--damage 400] [--probes] [--seed 0]

The same campaigns, smaller, are permanent tests (tests/test_store_durability.py,
tests/test_hardening.py, tests/test_serve.py). What each one promises:

* crash: every commit a writer acknowledged (printed after it returned) is in the store after
  any number of SIGKILLs, `verify` passes after each kill, and packs roll (a small roll size)
  so gc rewrites them while the writer works.
* damage: after any single damage (a flipped bit, a truncation, appended garbage, a deleted
  file) to CURRENT, a manifest, a segment, a pack or a position table, `verify` reports it or
  every answer the store gives is exactly the undamaged one; a read never returns a wrong value
  without an error ("silently wrong" must be 0).
* probes (runtime/serve): no request, however malformed, oversized or unauthenticated, gets a 5xx.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, V = 8, 40
ROLL = 48 << 10  # pack roll size of the campaigns: a dozen records a pack, so gc rewrites packs


# -- the crash campaign ---------------------------------------------------------------------------


def commit_keys(i):
    """Commit i's keys: unique to it, so later commits never shadow them."""
    return np.array([[1 + i % 39, 1 + j, 1 + (i // 39) % 39] for j in range(4)], dtype=np.uint32)


def commit_values(i):
    return np.random.default_rng(i).standard_normal((4, 3, D)).astype(np.float16)


def position_table(i):
    return np.random.default_rng(10_000 + i).standard_normal((5 + i % 4, D)).astype(np.float32)


def make_store(path):
    import hkstore

    store = hkstore.create(path, d=D, vocab_size=V)
    uni = np.zeros((V, 3), dtype=np.uint32)
    uni[:, 1] = np.arange(V)
    store.add_segment("root", uni, np.random.default_rng(0).standard_normal((V, 3, D)))
    store.create_version("dom", "root")
    return store


def writer(path, start, roll):
    """Commit forever (until killed), printing each acknowledged commit number."""
    import hkstore
    import hkstore.store
    from formats.pack import PetRecord

    hkstore.store.PACK_ROLL_BYTES = roll
    store = hkstore.open(path, writable=True)
    for i in range(start, start + 100_000):
        version = "root" if i % 2 else "dom"
        store.add_segment(version, commit_keys(i), commit_values(i))
        store.put_pet(PetRecord(f"t{i}", {"i": i}, {"w": commit_values(i)}))
        # A tenant rewritten twice per commit leaves dead records: packs fall below half live
        # and gc rewrites them (FORMAT.md section 5), under readers and under the kills.
        store.put_pet(PetRecord("hot", {"i": i, "half": 0}, {"w": commit_values(i + 1)}))
        store.put_pet(PetRecord("hot", {"i": i}, {"w": commit_values(i)}))
        if i % 3 == 0:
            store.set_position("dom", position_table(i))
        if i % 5 == 0:
            hkstore.compact(store, version)
        if i % 7 == 0:
            hkstore.gc(store)
        print(i, flush=True)


def crash_campaign(path, kills, seed=1, roll=ROLL, max_delay=0.15, deadline_s=None):
    """SIGKILL a writer `kills` times at random moments. Returns counts: kills, acknowledged
    commits, losses (acknowledged but missing or different), verify failures after a kill,
    packs rewritten by gc (files that came and went), and problems (the first few, as text)."""
    import hkstore

    make_store(path).close()
    rng = random.Random(seed)
    acked, start, verify_failures, problems, done_kills = [], 0, 0, [], 0
    packs_seen = set()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    for _ in range(kills):
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            break
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.reliability", "--writer", path, str(start), str(roll)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # the writer is committing: kill it somewhere in its work
        time.sleep(rng.uniform(0, max_delay))
        proc.send_signal(signal.SIGKILL)
        out = first + proc.stdout.read()
        err = proc.stderr.read()
        proc.wait()
        done_kills += 1
        if not first and err.strip():
            problems.append(f"writer failed: {err.strip().splitlines()[-1]}")
        done = [int(line) for line in out.split()]
        acked += done
        start = (done[-1] + 1) if done else start
        packs_seen |= set(os.listdir(os.path.join(path, "packs")))
        report = hkstore.verify(path)
        if not report["ok"]:
            verify_failures += 1
            problems += report["problems"][:3]
    losses = 0
    store = hkstore.open(path)
    for i in acked:
        version = "root" if i % 2 else "dom"
        try:
            got = store.lookup(version, commit_keys(i))
            ok = ((got.order == 3).all() and got.version_names[got.version[0]] == version
                  and np.array_equal(got.values, commit_values(i).astype(got.values.dtype))
                  and np.array_equal(store.get_pet(f"t{i}").tensors["w"], commit_values(i)))
        except Exception as e:  # noqa: BLE001 - a loss, reported
            ok = False
            problems.append(f"commit {i}: {e}")
        losses += not ok
    if acked:
        hot = store.get_pet("hot")
        last = max(acked)
        # The newest acknowledged write, or the next one if it landed before the kill cut off
        # its acknowledgement.
        # (A half-done commit may have landed its first write of "hot": commit_values(i + 1).)
        want = commit_values(hot.meta.get("i", -1) + ("half" in hot.meta))
        if hot.meta.get("i") not in (last, last + 1) or not np.array_equal(hot.tensors["w"], want):
            losses += 1
            problems.append(f"tenant hot holds {hot.meta}, last acknowledged {last}")
        tables = [i for i in acked if i % 3 == 0]
        if tables:
            got = store.snapshot().position("dom")
            if not any(np.array_equal(got, position_table(j)) for j in (max(tables), max(tables) + 3)):
                losses += 1
                problems.append("position table of dom is not the last acknowledged one")
    live_packs = set(store.snapshot().manifest["packs"])
    store.close()
    return {"kills": done_kills, "acknowledged": len(acked), "losses": losses, "verify_failures": verify_failures,
            "packs_retired": len(packs_seen - live_packs), "problems": problems[:10],
            "seconds": round(time.monotonic() - started, 1)}


# -- the damage campaign --------------------------------------------------------------------------

FILE_TYPES = ("CURRENT", "manifest", "segment", "pack", "position")
DAMAGES = ("flip", "truncate", "append", "delete")
# a valid file where another belongs (a misdirected write, a botched restore): random damage
# cannot make these, and only a file's identity in the manifest tells them apart
SLOT_DAMAGES = ("wrong slot", "swap")


def damage_store(path):
    """A store with every file type: two versions with segments, position tables, three packs
    with live and dead records (and a tail past the committed end of the newest)."""
    import hkstore
    import hkstore.store
    from formats.pack import PetRecord

    old_roll = hkstore.store.PACK_ROLL_BYTES
    hkstore.store.PACK_ROLL_BYTES = 12 << 10
    try:
        store = make_store(path)
        rng = np.random.default_rng(5)
        store.add_segment("dom", commit_keys(1), commit_values(1))
        store.add_segment("dom", commit_keys(2), commit_values(2))
        store.set_position("dom", position_table(1))
        store.set_position("root", position_table(2))
        for i in range(8):
            store.put_pet(PetRecord(f"t{i % 4}", {"i": i}, {"w": rng.standard_normal((4, 16)).astype(np.float32)}))
        store.close()
    finally:
        hkstore.store.PACK_ROLL_BYTES = old_roll
    return path


def store_answers(path, windows):
    """Every answer the store gives: lookups of `windows` at each version, position tables,
    every tenant's PET. Raises on any error."""
    import hkstore

    with hkstore.open(path) as st:
        snap = st.snapshot()
        out = {}
        for v in snap.version_names:
            r = snap.lookup(v, windows)
            out[f"lookup {v}"] = (r.values.copy(), r.version.copy(), r.order.copy())
            out[f"position {v}"] = snap.position(v)
        for tenant in sorted(snap.pets):
            rec = snap.read_pet(tenant)
            out[f"pet {tenant}"] = (rec.meta, {k: t.copy() for k, t in rec.tensors.items()})
        return out


def _same(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def files_of(path, kind):
    if kind == "CURRENT":
        return ["CURRENT"]
    if kind == "manifest":
        return sorted(n for n in os.listdir(path) if n.startswith("MANIFEST-") and not n.endswith(".tmp"))
    sub = {"segment": "segments", "pack": "packs", "position": "positions"}[kind]
    return sorted(os.path.join(sub, n) for n in os.listdir(os.path.join(path, sub)))


def damage(rng, path, kind, how) -> tuple[dict, str]:
    """({file: new bytes, or None to delete it}, what was done) for one damage of a file of kind."""
    names = files_of(path, kind)
    name = rng.choice(names)
    with open(os.path.join(path, name), "rb") as f:
        original = f.read()
    others = [n for n in names if n != name]
    if how in SLOT_DAMAGES and others:
        other = rng.choice(others)
        with open(os.path.join(path, other), "rb") as f:
            theirs = f.read()
        if how == "swap":
            return {name: theirs, other: original}, f"{name} and {other} swapped"
        return {name: theirs}, f"{name} holds a copy of {other}"
    if how == "flip" or how in SLOT_DAMAGES:  # a kind with one file has no other to swap with
        data = bytearray(original)
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        return {name: bytes(data)}, f"{name} bit flip at {at}"
    if how == "truncate":
        data = original[:rng.randrange(len(original))]
        return {name: data}, f"{name} truncated to {len(data)}"
    if how == "append":
        data = original + bytes(rng.randrange(256) for _ in range(rng.choice((1, 7, 64, 4096))))
        return {name: data}, f"{name} {len(data) - len(original)} bytes appended"
    return {name: None}, f"{name} deleted"


def damage_campaign(path, trials, seed=0, damages=DAMAGES, kinds=FILE_TYPES):
    """Random single damages, round-robin over the file types. Returns per file type: trials,
    detected (verify reports it), exact (no report, every answer exactly the undamaged one),
    refused (a read raised a clear FormatError), silently wrong (a read returned a different
    answer without an error) and verify errors (verify itself crashed)."""
    import hkstore
    from hkstore import gc

    damage_store(path)
    with hkstore.open(path, writable=True) as st:  # only the live manifest: older ones are not the store
        gc(st)
    rng = random.Random(seed)
    windows = np.random.default_rng(seed).integers(0, V, (300, 3)).astype(np.uint32)
    windows = np.concatenate([windows, *(commit_keys(i) for i in (1, 2))])
    reference = store_answers(path, windows)
    assert hkstore.verify(path)["ok"]
    table = {k: {"trials": 0, "detected": 0, "exact": 0, "refused": 0, "silently_wrong": 0, "verify_errors": 0}
             for k in kinds}
    examples, harmless = [], []
    for t in range(trials):
        kind = kinds[t % len(kinds)]
        changes, detail = damage(rng, path, kind, rng.choice(damages))
        originals = {}
        for name, data in changes.items():
            full = os.path.join(path, name)
            with open(full, "rb") as f:
                originals[full] = f.read()
            if data is None:
                os.remove(full)
            else:
                with open(full, "wb") as f:
                    f.write(data)
        row = table[kind]
        row["trials"] += 1
        try:
            try:
                detected = not hkstore.verify(path)["ok"]
            except Exception as e:  # noqa: BLE001 - verify must report, never crash
                detected = False
                row["verify_errors"] += 1
                examples.append(f"{detail}: verify raised {type(e).__name__}: {e}")
            try:
                exact = _same(store_answers(path, windows), reference)
                refused = False
            except hkstore.FormatError:
                exact, refused = False, True
            except Exception as e:  # noqa: BLE001 - anything else is a bug, counted as wrong
                exact, refused = False, False
                examples.append(f"{detail}: read raised {type(e).__name__}: {e}")
            row["detected"] += detected
            row["refused"] += refused
            if not detected and exact:
                row["exact"] += 1
                harmless.append(detail)
            if not refused and not exact:
                row["silently_wrong"] += 1
                examples.append(f"{detail}: a read returned a wrong answer")
            elif not detected and not exact:
                row["silently_wrong"] += 1
                examples.append(f"{detail}: refused to read but verify saw nothing")
        finally:
            for full, data in originals.items():
                with open(full, "wb") as f:
                    f.write(data)
    return {"table": table, "problems": examples[:10], "harmless": harmless[:20]}


# -- output ---------------------------------------------------------------------------------------


def markdown(crash=None, damage=None, probes=None, slots=None):
    lines = []
    if crash:
        lines += ["| crash campaign | kills | acknowledged rounds (4-7 commits each) | losses | verify failures after a kill "
                  "| packs rewritten by gc |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |",
                  f"| SIGKILL during commits, compactions, gc | {crash['kills']} | {crash['acknowledged']} | "
                  f"{crash['losses']} | {crash['verify_failures']} | {crash['packs_retired']} |", ""]
    for title, part in (("damaged file", damage), ("valid file in the wrong slot", slots)):
        if not part:
            continue
        lines += [f"| {title} | trials | detected by verify | exact answers (harmless) | refused on read | "
                  "silently wrong |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        total = {k: 0 for k in ("trials", "detected", "exact", "refused", "silently_wrong")}
        for kind, row in part["table"].items():
            lines.append(f"| {kind} | {row['trials']} | {row['detected']} | {row['exact']} | {row['refused']} | "
                         f"{row['silently_wrong']} |")
            for k in total:
                total[k] += row[k]
        lines += [f"| all | {total['trials']} | {total['detected']} | {total['exact']} | {total['refused']} | "
                  f"{total['silently_wrong']} |", ""]
    if probes:
        lines += ["| HTTP probes | requests | 5xx | 401 before the body was read | slowest 401 (s) | half-open connection closed after (s) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |",
                  f"| malformed, oversized, unauthenticated | {probes['probes']} | {probes['5xx']} | "
                  f"{probes['unauthenticated_fast']} | {probes['slowest_401_s']:.2f} | {probes['half_open_closed_s']:.1f} |", ""]
    return "\n".join(lines)


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--writer":
        return writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--damage", type=int, default=400, help="damage trials (round-robin over the file types)")
    ap.add_argument("--slots", type=int, default=200,
                    help="trials of a valid file in another's slot (a copy over it, or two swapped)")
    ap.add_argument("--probes", action="store_true", help="also run the HTTP probes (needs torch and the serve extra)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        crash = crash_campaign(os.path.join(tmp, "crash"), args.kills, seed=args.seed) if args.kills else None
        damage = damage_campaign(os.path.join(tmp, "damage"), args.damage, seed=args.seed) if args.damage else None
        slots = damage_campaign(os.path.join(tmp, "slots"), args.slots, seed=args.seed, damages=SLOT_DAMAGES,
                                kinds=("segment", "pack", "position")) if args.slots else None
        probes = None
        if args.probes:
            from benchmarks.reliability_http import probe_campaign

            probes = probe_campaign(os.path.join(tmp, "http"))
        print(markdown(crash, damage, probes, slots))
        for part in (crash, damage, probes, slots):
            for p in (part or {}).get("problems", []):
                print("PROBLEM", p)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
