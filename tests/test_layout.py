"""The packages depend on each other one way only, formats <- hkstore <- runtime <- tools <- the
lab (benchmarks, experiments), and inside runtime its rooms do too (README: Layout). Imports are
read from the source, function-level ones included, plus the modules tools/cli.py mounts by
name; so a lazy import or a command string that points the wrong way fails here too. The tables
list only arrows that exist, so a table cannot quietly allow more than the code does."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("formats", "hkstore", "runtime", "tools", "benchmarks", "experiments")

# package -> the packages it imports (besides itself)
PACKAGE_ARROWS = {
    "formats": set(),
    "hkstore": {"formats"},
    "runtime": {"formats", "hkstore"},
    "tools": {"formats", "hkstore", "runtime"},
    "benchmarks": {"formats", "hkstore", "runtime", "tools"},
    "experiments": {"formats", "hkstore", "runtime", "tools", "benchmarks"},
}
# runtime's room -> the rooms it imports ("api" is runtime/__init__.py and the files beside it)
ROOM_ARROWS = {
    "model": set(),
    "plot": {"model"},
    "exec": {"model", "plot"},
    "sched": set(),
    # a trained level's precision is chosen by scoring it through the CPU executor (construct/precision.py),
    # a decoder tenant's through generation's prefill (construct/decoder_tenant.py)
    "construct": {"model", "plot", "exec", "gen"},
    # profiling reads labelled held-out files with construction's readers, and runs exec's rows
    "level": {"model", "exec", "construct"},
    # the serving loop: schedules (sched, student's buffer), routes (level, student), runs exec's plans
    "engine": {"exec", "level", "sched", "student"},
    "api": {"model", "plot", "exec", "sched", "gen", "level", "student", "engine"},
    "serve": {"api", "model", "construct"},
    "demo": {"api", "construct"},
    "gen": {"model", "plot", "exec"},
    # construction reads the teacher through construct's manager; evaluation runs exec's stacked students
    "student": {"model", "plot", "exec", "construct"},
}
# serve reaches construct only through the manager's public functions (the manage jobs)
SERVE_FROM_CONSTRUCT = {"runtime.construct", "runtime.construct.manager", "runtime.construct.plot",
                        "runtime.construct.train"}


def modules(root=REPO, packages=PACKAGES) -> dict:
    """dotted name -> path of every module of the packages under root."""
    out = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path, packages=PACKAGES) -> set:
    """Every module of the packages that the file imports, at any depth of the code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in packages:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in packages)
    return out


def mounted() -> dict:
    """tools/cli.py's commands mounted by module name: their arrows count like imports."""
    from tools.cli import MODEL_COMMANDS

    return {"tools.cli": {module for module, _ in MODEL_COMMANDS.values()}}


def graph(root=REPO, packages=PACKAGES, extra=None) -> dict:
    mods = modules(root, packages)
    g = {m: {i for i in imports(p, packages) if i in mods and i != m} for m, p in mods.items()}
    for m, deps in (extra or {}).items():
        g.setdefault(m, set()).update(deps)
    return g


def room(module: str) -> str:
    """runtime.X... for a subpackage X; runtime/__init__.py and the files beside it (the API's
    command-line fronts, e.g. infer_cli) are the "api" room."""
    parts = module.split(".")
    if module == "runtime.errors":
        return "errors"
    if module == "runtime.engine":  # the serving loop: a room of its own, between the API and the rest
        return "engine"
    return parts[1] if len(parts) > 1 and (REPO / "runtime" / parts[1]).is_dir() else "api"


def arrows(g: dict) -> tuple[set, set]:
    """The package arrows and runtime's room arrows that the graph has."""
    packages, rooms = set(), set()
    for m, deps in g.items():
        for d in deps:
            a, b = m.split(".")[0], d.split(".")[0]
            if a != b:
                packages.add((a, b))
            elif a == "runtime" and room(m) != room(d) and "errors" not in (room(m), room(d)):
                rooms.add((room(m), room(d)))
    return packages, rooms


def violations(g: dict) -> list:
    bad = []
    for m, deps in g.items():
        for d in deps:
            a, b = m.split(".")[0], d.split(".")[0]
            if a != b and b not in PACKAGE_ARROWS[a]:
                bad.append(f"{m} -> {d}")
            if a == b == "runtime":
                src, dst = room(m), room(d)
                if src == dst or dst == "errors":  # every room may raise the request errors
                    continue
                if dst not in ROOM_ARROWS[src]:
                    bad.append(f"{m} -> {d}")
                elif src == "serve" and dst == "construct" and d not in SERVE_FROM_CONSTRUCT:
                    bad.append(f"{m} -> {d} (serve uses construct's public manager only)")
    return sorted(bad)


def cycles(g: dict) -> list:
    # importing a package's __init__ is fine: hkstore's and runtime's import their parts lazily
    g = {m: {d for d in deps if d not in PACKAGES} for m, deps in g.items()}
    state, stack, found = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                found.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m)
    return found


def test_every_arrow_points_down():
    bad = violations(graph(extra=mounted()))
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_the_tables_allow_only_arrows_that_exist():
    packages, rooms = arrows(graph(extra=mounted()))
    unused = {(a, b) for a, bs in PACKAGE_ARROWS.items() for b in bs} - packages
    unused |= {(a, b) for a, bs in ROOM_ARROWS.items() for b in bs} - rooms
    assert not unused, f"allowed but never used (remove them from the tables): {sorted(unused)}"


def test_no_import_cycles():
    found = cycles(graph(extra=mounted()))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_mounted_commands_resolve():
    import importlib

    from tools.cli import MODEL_COMMANDS

    for name, (module, attr) in MODEL_COMMANDS.items():
        assert getattr(importlib.import_module(module), attr).name == name


def test_no_executor_in_the_policy_rooms():
    """level/ and student/ keep policy and construction: their input sources and math run in
    exec's plans, so neither room holds an executor class (nor one that wraps another)."""
    found = []
    for name in ("level", "student"):
        for path in (REPO / "runtime" / name).rglob("*.py"):
            found += [f"{path.relative_to(REPO)}: {node.name}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.ClassDef) and node.name.endswith("Executor")]
    assert not found, found


def test_the_engine_drives_exec_one_way():
    """The engine imports exec's executors and plans; nothing in exec imports the engine."""
    g = graph(extra=mounted())
    assert any(room(d) == "exec" for d in g["runtime.engine"])
    assert not [m for m, deps in g.items() if room(m) == "exec" and "runtime.engine" in deps]
    assert "engine" not in ROOM_ARROWS["exec"]


def test_a_forbidden_arrow_fails_the_checks(tmp_path):
    """A store module that imports the runtime (lazily, inside a function), a model-room module that
    imports the scheduling room, an exec module that imports the engine, and a mounted command
    string that points into the lab all fail."""
    for package in ("hkstore", "runtime/model", "runtime/sched", "runtime/exec", "benchmarks"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "hkstore" / "x.py").write_text("def f():\n    from runtime.model import m\n")
    (tmp_path / "runtime" / "model" / "m.py").write_text("from runtime.sched.s import S\n")
    (tmp_path / "runtime" / "sched" / "s.py").write_text("S = 1\n")
    (tmp_path / "runtime" / "exec" / "e.py").write_text("def f():\n    from runtime.engine import Engine\n")
    (tmp_path / "runtime" / "engine.py").write_text("X = 1\n")
    g = graph(tmp_path, ("hkstore", "runtime", "benchmarks"), extra={"hkstore.cli": {"benchmarks"}})
    assert violations(g) == ["hkstore.cli -> benchmarks", "hkstore.x -> runtime.model", "hkstore.x -> runtime.model.m",
                             "runtime.exec.e -> runtime.engine", "runtime.model.m -> runtime.sched.s"]
    g["runtime.sched.s"] = {"runtime.model.m"}
    assert cycles(g) == ["runtime.model.m -> runtime.sched.s -> runtime.model.m"]
