"""runtime/'s rooms depend on each other one way only (README: Layout), and no module imports
itself back through others. Imports are read from the source (function-level ones included),
so a lazy import that points the wrong way fails here too."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "runtime"

# room -> the rooms it may import ("api" is runtime/__init__.py)
ALLOWED = {
    "model": set(),
    "plot": {"model"},
    "exec": {"model", "plot"},
    "sched": {"model", "plot", "exec"},
    "build": {"model", "plot"},
    # profiling reads labelled held-out files with construction's readers
    "level": {"model", "plot", "exec", "sched", "build"},
    "api": {"model", "plot", "exec", "sched", "gen", "level", "student"},
    "serve": {"api", "model", "plot", "sched", "build"},
    "demo": {"api", "model", "build"},
    "gen": {"model", "plot", "exec", "sched"},
    # construction reads the teacher through build's manager; serving hands exec's Prepared to the scheduler
    "student": {"model", "plot", "exec", "build"},
    "errors": set(),
}
# serve reaches build only through the manager's public functions (the manage jobs)
SERVE_MAY_IMPORT_FROM_BUILD = {"runtime.build", "runtime.build.manager", "runtime.build.plot", "runtime.build.train"}


def _modules():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(path) -> set:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("runtime"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("runtime"))
    return out


def _room(module: str) -> str:
    """runtime/__init__.py and the files beside it (the API's command-line front, e.g. infer_cli)
    are the "api" room; a subpackage is its own room."""
    parts = module.split(".")
    if module == "runtime.errors":
        return "errors"
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else "api"


def _graph():
    mods = dict(_modules())
    return {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}


def test_rooms_point_one_way():
    bad = []
    for mod, deps in _graph().items():
        room = _room(mod)
        for dep in deps:
            target = _room(dep)
            if target == room or target == "errors":  # every room may raise the request errors
                continue
            if target not in ALLOWED[room]:
                bad.append(f"{mod} -> {dep}")
            elif room == "serve" and target == "build" and dep not in SERVE_MAY_IMPORT_FROM_BUILD:
                bad.append(f"{mod} -> {dep} (serve uses build's public manager only)")
    assert not bad, "imports against the layout:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    # modules importing a package's __init__ (runtime) are fine: the API imports lazily
    graph = {m: {d for d in deps if d != "runtime"} for m, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_can_fail(tmp_path):
    """The graph sees function-level imports (how a wrong arrow would hide)."""
    p = tmp_path / "x.py"
    p.write_text("def f():\n    from runtime.sched.scheduler import Scheduler\n")
    assert "runtime.sched.scheduler" in _imports(p)
