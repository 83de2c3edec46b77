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


# Importing these has effects beyond defining names (a browser opens, a window, text printed).
NOT_IMPORTED = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__", "__phello__",
                "ensurepip", "venv", "pydoc_data", "lib2to3", "xxsubtype", "xxlimited", "xxlimited_35"}


def stdlib_corpus() -> list[tuple[str, str]]:
    """(paragraph, module) of every docstring paragraph of at least 40 characters in the
    standard library's public modules (module, class, function and method docstrings), in a
    fixed order: English text every machine with Python has, for training a small decoder
    where no other corpus is at hand."""
    import sys
    import warnings

    out = {}
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in NOT_IMPORTED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - not built here, or needs a platform this is not
                continue
            docs = [mod.__doc__]
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                docs.append(getattr(obj, "__doc__", None))
                if inspect.isclass(obj):
                    docs += [getattr(f, "__doc__", None) for m, f in sorted(vars(obj).items()) if not m.startswith("_")]
            for doc in docs:
                if not isinstance(doc, str):
                    continue
                for para in inspect.cleandoc(doc).split("\n\n"):
                    text = " ".join(para.split())
                    if len(text) >= 40:
                        out.setdefault(text, name)  # a re-exported docstring counts once, where first seen
    return list(out.items())
