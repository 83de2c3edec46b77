"""Check that BENCHMARKS.md shows the numbers in benchmarks/results/*.json.

Each results file holds one claim section of BENCHMARKS.md: ``section`` (its ``## `` heading),
``command``, ``machine``, ``load``, ``date``, ``tables`` (each ``{"columns": [...], "rows": [[...]]}``,
in the order the section shows them) and any further numbers under other keys. The check:

* the section exists, and its markdown tables are the results' tables, cell for cell (a number
  matches a cell that reads as that number once ``**`` and thousands commas are dropped; text
  matches the cell's text without ``**``);
* every other number in the file (nested objects included, lists skipped) appears in the
  section's text, and so does ``date``;
* every section with a ``Machine:`` line has a results file.

    python -m benchmarks.claims [--doc BENCHMARKS.md] [--results benchmarks/results]

prints one line per claim and exits 1 if anything disagrees. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
META = ("section", "command", "machine", "load", "date", "tables")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
SEPARATOR = re.compile(r"^:?-{3,}:?$")


def merge(path, numbers: dict) -> None:
    """Add numbers to a results file another benchmark writes (it keeps them when it rewrites its own)."""
    path = Path(path)
    claims = json.loads(path.read_text()) if path.exists() else {}
    claims.update(numbers)
    path.write_text(json.dumps(claims, indent=1) + "\n")


def sections(text: str) -> dict[str, str]:
    """``## `` heading -> the text up to the next ``## `` heading."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("## "):
            if name is not None:
                out[name] = "\n".join(lines)
            name, lines = line[3:].strip(), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines)
    return out


def tables(body: str) -> list[list[list[str]]]:
    """The markdown tables of a section: header row first, the |---| row left out."""
    found, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(SEPARATOR.match(c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def _plain(cell: str) -> str:
    return cell.replace("**", "").strip()


def _number(text: str) -> float | None:
    try:
        return float(_plain(text).replace(",", ""))
    except ValueError:
        return None


def same(value, cell: str) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (int, float)):
        return _number(cell) == float(value)
    return str(value).strip() == _plain(cell)


def _numbers(obj, path=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not path and key in META:
                continue
            yield from _numbers(value, f"{path}.{key}" if path else key)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def check_claim(data: dict, secs: dict[str, str]) -> list[str]:
    problems = [f"missing {key!r}" for key in ("section", "command", "machine", "date") if not data.get(key)]
    body = secs.get(data.get("section", ""))
    if body is None:
        return problems + [f"no section '## {data.get('section')}' in the document"]
    shown = tables(body)
    wanted = data.get("tables", [])
    if len(shown) != len(wanted):
        problems.append(f"{len(wanted)} tables in the results, {len(shown)} in the section")
    for t, (table, md) in enumerate(zip(wanted, shown), 1):
        rows = [table["columns"]] + table["rows"]
        if len(rows) != len(md):
            problems.append(f"table {t}: {len(rows) - 1} rows in the results, {len(md) - 1} in the section")
        for r, (row, md_row) in enumerate(zip(rows, md)):
            if len(row) != len(md_row):
                problems.append(f"table {t} row {r}: {len(row)} cells in the results, {len(md_row)} in the section")
                continue
            for c, (value, cell) in enumerate(zip(row, md_row)):
                if not same(value, cell):
                    where = "header" if r == 0 else f"row {r} ({_plain(md_row[0])!r})"
                    problems.append(f"table {t} {where}, column {_plain(md[0][c])!r}: "
                                    f"results {value!r}, document {cell!r}")
    in_text = {float(n.replace(",", "")) for n in NUMBER.findall(body)}
    for path, value in _numbers(data):
        if abs(float(value)) not in in_text:
            problems.append(f"{path} = {value!r} does not appear in the section")
    if data.get("date") and data["date"] not in body:
        problems.append(f"date {data['date']!r} does not appear in the section")
    return problems


def check(doc: Path | str = ROOT / "BENCHMARKS.md",
          results: Path | str = ROOT / "benchmarks" / "results") -> list[tuple[str, str, list[str]]]:
    """(results file, section, problems) for every results file, plus one entry per section
    with a ``Machine:`` line but no results file."""
    secs = sections(Path(doc).read_text(encoding="utf-8"))
    out, covered = [], set()
    for path in sorted(Path(results).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            out.append((path.name, "?", [f"not JSON: {e}"]))
            continue
        covered.add(data.get("section"))
        out.append((path.name, data.get("section", "?"), check_claim(data, secs)))
    for name, body in secs.items():
        if name not in covered and re.search(r"^Machine:", body, re.M):
            out.append(("-", name, ["a claim section without a results file"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", default=ROOT / "BENCHMARKS.md", type=Path)
    ap.add_argument("--results", default=ROOT / "benchmarks" / "results", type=Path)
    args = ap.parse_args(argv)
    failed = 0
    for name, section, problems in check(args.doc, args.results):
        if problems:
            failed += 1
            print(f"MISMATCH {name}: {section}")
            for p in problems:
                print(f"    {p}")
        else:
            print(f"ok       {name}: {section}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
