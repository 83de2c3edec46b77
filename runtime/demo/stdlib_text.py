"""Text every Python installation has: the docstrings of the standard library.

The README's demo, the load generator and the tests build corpora and small labelled tasks
from it, so none of them needs a download or a data set.
"""

from __future__ import annotations

import importlib
import inspect


def docstrings(modules) -> list[tuple[str, str, str]]:
    """(first paragraph, module, "class" | "function") of the public classes, functions and
    methods each module defines itself, 20-300 characters, in a fixed order. Modules that
    do not import (a Python built without them) are skipped."""
    out = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            items = []
            if inspect.isclass(obj):
                items.append(("class", obj))
                items += [("function", f) for m, f in sorted(vars(obj).items())
                          if not m.startswith("_") and (inspect.isfunction(f) or inspect.ismethoddescriptor(f))]
            elif callable(obj):
                items.append(("function", obj))
            for kind, o in items:
                doc = o.__doc__ if isinstance(o.__doc__, str) else None
                if not doc:
                    continue
                text = " ".join(inspect.cleandoc(doc).strip().split("\n\n")[0].split())
                if 20 <= len(text) <= 300 and not text.startswith(attr + "("):
                    out.append((text, name, kind))
    return out


def first_lines(module) -> list[str]:
    """Distinct first lines (at least 3 words) of the docstrings of a module's public
    callables, imported ones included; `module` is a module or its name."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    out = []
    for name, f in sorted(inspect.getmembers(module)):
        doc = inspect.getdoc(f) if callable(f) and not name.startswith("_") else None
        if doc and len(doc.split()) >= 3:
            out.append(doc.splitlines()[0].strip())
    return list(dict.fromkeys(out))
