"""Every figure the project draws: small functions that write one PNG each and return its path.

Matplotlib with the Agg canvas attached to a standalone Figure (no pyplot, so no global state,
no GUI backend, safe to call from any thread or a process that uses pyplot itself). Used by
tools/report.py and the benchmark scripts in tools/; no other module draws.

    line_plot({"hkstore": (xs, ys), "lmdb": (xs, ys)}, "entries", "ms", "open.png", logx=True)
    bar_plot(["fp16", "int8"], {"bytes/entry": [2310, 1190]}, "bytes", "size.png")
    cdf_plot({"biology": distances}, "cosine distance", "cdf.png")
    histogram_plot(distances, "cosine distance", "hist.png")
    stacked_bars(["biology"], {"root": [0.4], "biology": [0.6]}, "share of windows", "cov.png")
    alpha_plot(xs, ys, "alpha.png", marks={"50%": (0.004, 0.5)})
    tree_plot([{"name": "root", "parent": None, "label": "root\\n1,000 entries"}, ...], "tree.png")
"""

from __future__ import annotations

import os

import numpy as np

DPI = 110
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
          "#CCB974", "#64B5CD"]


def _figure(width=7.0, height=4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path):
    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=DPI)
    return path


def _finish(ax, xlabel, ylabel, title, logx=False, logy=False, legend=True):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=11)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="both" if (logx or logy) else "major", alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _empty(ax, message="no data"):
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


# -- generic plots (benchmarks reuse these) -------------------------------------------------


def line_plot(series, xlabel, ylabel, path, *, logx=False, logy=False, title=None, hlines=None, markers=True):
    """Lines: series maps label -> (xs, ys). hlines maps label -> y (dashed reference lines)."""
    fig = _figure()
    ax = fig.add_subplot()
    styles = ["o-", "s--", "^:", "d-.", "v-", "x--"]
    for i, (label, (xs, ys)) in enumerate(series.items()):
        style = styles[i % len(styles)] if markers else "-"
        ax.plot(list(xs), list(ys), style, label=label, color=COLORS[i % len(COLORS)], markersize=4)
    for label, y in (hlines or {}).items():
        ax.axhline(y, color="grey", lw=0.8, ls="--", label=label)
    if not series:
        _empty(ax)
    _finish(ax, xlabel, ylabel, title, logx, logy)
    return _save(fig, path)


def bar_plot(labels, values, ylabel, path, *, title=None, logy=False, xlabel=""):
    """Grouped bars: one group per label; values is a list (one series) or a dict name -> list."""
    if not isinstance(values, dict):
        values = {"": list(values)}
    labels = [str(x) for x in labels]
    fig = _figure(max(5.0, min(14.0, 1.0 + 0.5 * len(labels) * max(1, len(values)))), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(values))
    x = np.arange(len(labels))
    for i, (name, ys) in enumerate(values.items()):
        ax.bar(x + (i - (len(values) - 1) / 2) * width, list(ys), width, label=name or None,
               color=COLORS[i % len(COLORS)])
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=30 if max((len(s) for s in labels), default=0) > 8 else 0,
                       ha="right" if max((len(s) for s in labels), default=0) > 8 else "center", fontsize=8)
    if not labels:
        _empty(ax)
    _finish(ax, xlabel, ylabel, title, logy=logy)
    return _save(fig, path)


def cdf_plot(series, xlabel, path, *, logx=False, title=None, ylabel="share \u2264 x"):
    """Empirical CDFs: series maps label -> values (any length; empty series are skipped)."""
    fig = _figure()
    ax = fig.add_subplot()
    drawn = 0
    for i, (label, values) in enumerate(series.items()):
        v = np.sort(np.asarray(values, dtype=np.float64).ravel())
        if logx:
            v = v[v > 0]
        if not len(v):
            continue
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} ({len(v):,})",
                color=COLORS[i % len(COLORS)])
        drawn += 1
    ax.set_ylim(0, 1.02)
    if not drawn:
        _empty(ax)
    _finish(ax, xlabel, ylabel, title, logx=logx and drawn > 0)
    return _save(fig, path)


def histogram_plot(values, xlabel, path, *, bins=40, value_range=None, title=None, ylabel="keys", logy=False):
    """A histogram of values with fixed-width bins over value_range (default [0, max])."""
    v = np.asarray(values, dtype=np.float64).ravel()
    fig = _figure()
    ax = fig.add_subplot()
    if len(v):
        lo, hi = value_range or (min(0.0, float(v.min())), float(v.max()))
        if hi <= lo:
            hi = lo + 1e-6
        ax.hist(v, bins=bins, range=(lo, hi), color=COLORS[0], edgecolor="white", linewidth=0.4)
    else:
        _empty(ax)
    _finish(ax, xlabel, ylabel, title, logy=logy and len(v) > 0)
    return _save(fig, path)


def stacked_bars(rows, segments, xlabel, path, *, title=None, percent=True):
    """Horizontal stacked bars: one bar per row, segments maps segment name -> one value per row
    (shares in [0, 1] when percent, drawn as %). Segments are stacked in dict order."""
    rows = [str(r) for r in rows]
    fig = _figure(7.5, max(2.2, 1.3 + 0.45 * len(rows)))
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    base = np.zeros(len(rows))
    scale = 100.0 if percent else 1.0
    for i, (name, vals) in enumerate(segments.items()):
        vals = np.asarray(vals, dtype=np.float64) * scale
        ax.barh(y, vals, left=base, label=str(name), color=COLORS[i % len(COLORS)], height=0.6)
        for j, (b, w) in enumerate(zip(base, vals)):
            if w >= (8 if percent else 0.08 * max(1e-12, float(base.max() + vals.max()))):
                ax.text(b + w / 2, j, f"{w:.0f}%" if percent else f"{w:g}", ha="center", va="center",
                        fontsize=7, color="white")
        base = base + vals
    ax.set_yticks(y)
    ax.set_yticklabels(rows, fontsize=8)
    ax.invert_yaxis()
    if percent:
        ax.set_xlim(0, 100)
    if not rows:
        _empty(ax)
    _finish(ax, xlabel, "", title, legend=False)
    if segments and rows:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)


def alpha_plot(kept_share, covered_share, path, *, marks=None, title=None, logx=True):
    """The α curve: share of occurrences covered (y) against the share of distinct n-grams kept
    (x, most frequent first). marks maps a label -> (x, y) point to annotate."""
    fig = _figure()
    ax = fig.add_subplot()
    x = np.asarray(kept_share, dtype=np.float64)
    y = np.asarray(covered_share, dtype=np.float64)
    if len(x):
        ax.plot(100 * x, 100 * y, "-", color=COLORS[0], label="corpus n-grams")
        for i, (label, (mx, my)) in enumerate((marks or {}).items()):
            ax.plot([100 * mx], [100 * my], "o", color=COLORS[(i + 1) % len(COLORS)], markersize=5)
            ax.annotate(label, (100 * mx, 100 * my), textcoords="offset points", xytext=(6, -10), fontsize=7)
        ax.set_ylim(0, 102)
    else:
        _empty(ax)
    _finish(ax, "% of distinct n-grams kept (most frequent first)", "% of occurrences covered", title,
            logx=logx and len(x) > 0, legend=False)
    return _save(fig, path)


# -- the version tree ---------------------------------------------------------------------------


def tree_layout(nodes):
    """(x, depth) per node name: leaves spaced one apart in order, parents centred over their
    children (a tidy layered layout). nodes: [{"name", "parent"}] in creation order."""
    children = {}
    names = [n["name"] for n in nodes]
    for n in nodes:
        parent = n["parent"] if n["parent"] in names else None
        children.setdefault(parent, []).append(n["name"])
    pos, next_leaf = {}, [0.0]

    def place(name, depth):
        kids = children.get(name, [])
        for k in kids:
            place(k, depth + 1)
        if kids:
            x = (pos[kids[0]][0] + pos[kids[-1]][0]) / 2
        else:
            x = next_leaf[0]
            next_leaf[0] += 1.0
        pos[name] = (x, depth)

    for root in children.get(None, []):
        place(root, 0)
    return pos


def tree_plot(nodes, path, *, title=None, highlight=None):
    """Draw a version tree: nodes [{"name", "parent", "label"}]; label is the box text (may hold
    newlines). highlight names a node to draw in a second colour."""
    pos = tree_layout(nodes)
    width = max((p[0] for p in pos.values()), default=0) + 1
    depth = max((p[1] for p in pos.values()), default=0) + 1
    lines = max((str(n.get("label", n["name"])).count("\n") + 1 for n in nodes), default=1)
    fig = _figure(max(4.0, min(24.0, 1.9 * width)), max(1.6, min(18.0, (0.35 + 0.16 * lines) * depth + 0.3)))
    ax = fig.add_subplot()
    for n in nodes:
        if n["parent"] in pos and n["name"] in pos:
            (x0, y0), (x1, y1) = pos[n["parent"]], pos[n["name"]]
            ax.plot([x0, x0, x1, x1], [y0, (y0 + y1) / 2, (y0 + y1) / 2, y1], "-", color="#999999", lw=1, zorder=1)
    for n in nodes:
        x, y = pos[n["name"]]
        face = "#FCE9D9" if n["name"] == highlight else "#E3ECF7"
        edge = COLORS[1] if n["name"] == highlight else COLORS[0]
        ax.text(x, y, str(n.get("label", n["name"])), ha="center", va="center", fontsize=7, zorder=2,
                bbox={"boxstyle": "round,pad=0.4", "facecolor": face, "edgecolor": edge})
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(depth - 0.4, -0.6)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    if not nodes:
        _empty(ax)
    return _save(fig, path)


def nice_bytes(n):
    """1234567 -> '1.2 MB' (decimal units), for labels."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"  # pragma: no cover


__all__ = ["alpha_plot", "bar_plot", "cdf_plot", "histogram_plot", "line_plot", "nice_bytes", "stacked_bars",
           "tree_layout", "tree_plot"]
