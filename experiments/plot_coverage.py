"""How much of unseen text a root PLOT serves exactly, against its corpus (issue 21).

    python -m experiments.plot_coverage --run /tmp/acc2 --out figures/coverage

Coverage depends on the keys a table holds, not on their values, so it is computed here from
key sets alone (seconds, no lower layers run): the root's keys are what `hkstore build` stores
for a corpus (its windows, their backoff chains and every uni-gram), and each evaluation window
is served at the first key of its backoff chain the set holds (FORMAT.md section 4). From the
corpora of a benchmarks.hmi_accuracy run (OUT/data) and its evaluation texts (the tasks' dev or test
files and WikiText-2 test), three tables and a PNG:

  size     exact share vs the share of the general corpus in the root (0 .. 100%, the tasks'
           train text always in): how fast coverage grows with general text
  n        the same corpus as windows of n = 2, 3, 5: exact share and uni-gram fallbacks
  backoff  n = 3: the format's chain ([a b c] -> [a b _] -> [_ b _]) against one that also tries
           [_ b c] before the uni-gram (both keep the centre), the table then also holding the
           [_ b c] of its corpus windows: the uni-gram fallbacks it saves, and the keys it costs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from formats.backoff import backoff, key_order
from runtime.construct.plot import _void as _rows
from runtime.construct.plot import root_keys
from runtime.plot.window import corpus_windows


def served_order(held: np.ndarray, wins: np.ndarray, kind: str, pad_id: int, right_bigram: bool = False) -> np.ndarray:
    """The order each window of `wins` is served at by a table holding the keys `held` (sorted
    void rows): the first key of its backoff chain in the set. right_bigram: for n = 3 centred,
    a window whose [a b _] misses tries [_ b c] before [_ b _]."""
    order = np.zeros(len(wins), dtype=np.int64)
    current = wins.copy()
    todo = np.ones(len(wins), dtype=bool)
    while todo.any():
        hit = todo & np.isin(_rows(current), held)
        order[hit] = key_order(current[hit], kind, pad_id)
        todo &= ~hit
        if right_bigram:
            two = todo & (key_order(current, kind, pad_id) == 2) & (current[:, 0] != pad_id)
            alt = current.copy()
            alt[:, 0] = pad_id
            alt[:, 2] = wins[:, 2]
            alt_two = two & (alt[:, 2] != pad_id) & np.isin(_rows(alt), held)
            order[alt_two] = 2
            todo &= ~alt_two
        single = key_order(current, kind, pad_id) <= 1
        todo &= ~single  # a uni-gram missing from the set is a miss (order 0); never with every uni-gram held
        current = backoff(current, kind, pad_id)
    return order


def coverage(corpus_seqs, eval_seqs, n: int, kind: str, pad_id: int, vocab_size: int, right_bigram=False) -> dict:
    keys, _ = root_keys(corpus_seqs, n, kind, pad_id, vocab_size)
    if right_bigram:  # the table must hold [_ b c] of its corpus windows for the chain to find them
        corpus, _ = corpus_windows(corpus_seqs, n, kind, pad_id)
        right = corpus[corpus[:, 2] != pad_id].copy()
        right[:, 0] = pad_id
        keys = np.unique(np.concatenate([keys, right]), axis=0)
    held = np.sort(_rows(keys))
    wins, _ = corpus_windows(eval_seqs, n, kind, pad_id)
    order = served_order(held, wins, kind, pad_id, right_bigram)
    own = key_order(wins, kind, pad_id)
    m = max(len(wins), 1)
    return {"windows": len(wins), "keys": len(keys), "exact": float((order == own).sum() / m),
            "by_order": {str(o): float((order == o).sum() / m) for o in range(n, -1, -1)}}


def _lines(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="OUT directory of a benchmarks.hmi_accuracy run (its data/ and results.json)")
    p.add_argument("--out", required=True, help="directory for coverage.json, coverage.md and coverage_size.png")
    p.add_argument("--fractions", default="0,0.125,0.25,0.5,1")
    args = p.parse_args(argv)
    from runtime.construct.manager import read_task, tokenize_corpus
    from runtime.model.encoder import load_encoder
    from benchmarks.hmi_accuracy import general_text, texts_of

    run = Path(args.run)
    config = json.loads((run / "results.json").read_text())["config"]
    enc = load_encoder(config.get("model"), config["lower_layers"])
    pad_id, vocab, max_len = enc.config.pad_id, enc.config.vocab_size, config["max_len"]
    general = set(general_text(config["general"])) if config.get("general") else set()
    root_lines = _lines(run / "data" / "root.txt")
    general_lines = [t for t in root_lines if t in general]
    train_lines = [t for t in root_lines if t not in general]
    texts = {}
    for name in config["tasks"]:
        kind = "classification" if (run / "data" / f"{name}.{config['eval_split']}.jsonl").exists() else "tagging"
        path = run / "data" / f"{name}.{config['eval_split']}.{'jsonl' if kind == 'classification' else 'conll'}"
        (x, _), _ = read_task(path, kind)
        texts[f"{name} ({config['eval_split']})"] = tokenize_corpus(enc, texts_of(kind, x), max_len)
    if config.get("general"):
        texts["WikiText-2 test"] = tokenize_corpus(enc, general_text(Path(config["general"]).with_name("test.txt")), max_len)
    out = {"run": str(run), "size": [], "n": [], "backoff": []}
    train_seqs = tokenize_corpus(enc, train_lines, max_len)
    general_seqs = tokenize_corpus(enc, general_lines, max_len)
    for frac in [float(f) for f in args.fractions.split(",")]:
        part = general_seqs[:round(frac * len(general_seqs))]
        words = sum(len(t.split()) for t in general_lines[:round(frac * len(general_lines))])
        for label, seqs in texts.items():
            c = coverage(part + train_seqs, seqs, 3, "centered", pad_id, vocab)
            out["size"].append({"fraction": frac, "general_words": words, "text": label, **c})
            print(f"size {frac:g} ({words} words) {label}: exact {100 * c['exact']:.1f}%", flush=True)
    full = general_seqs + train_seqs
    for n in (2, 3, 5):
        for label, seqs in texts.items():
            c = coverage(full, seqs, n, "centered", pad_id, vocab)
            out["n"].append({"n": n, "text": label, **c})
    for label, seqs in texts.items():
        for alt in (False, True):
            c = coverage(full, seqs, 3, "centered", pad_id, vocab, right_bigram=alt)
            out["backoff"].append({"chain": "either bi-gram" if alt else "format (left bi-gram)", "text": label, **c})
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "coverage.json").write_text(json.dumps(out, indent=1))
    (dest / "coverage.md").write_text(markdown(out))
    plot(out, dest / "coverage_size.png")
    print(markdown(out))
    return out


def markdown(out) -> str:
    lines = ["### Exact coverage at the root vs its general corpus (n = 3; the tasks' train text always in)", "",
             "| general words in the root | " + " | ".join(sorted({r["text"] for r in out["size"]})) + " |",
             "|---|" + "---|" * len({r["text"] for r in out["size"]})]
    for words in sorted({r["general_words"] for r in out["size"]}):
        by = {r["text"]: r for r in out["size"] if r["general_words"] == words}
        lines.append(f"| {words:,} | " + " | ".join(f"{100 * by[t]['exact']:.1f}%" for t in sorted(by)) + " |")
    lines += ["", "### Window size n (full root corpus): exact share / uni-gram fallbacks", "",
              "| n | text | exact | served by a uni-gram |", "|---|---|---|---|"]
    for r in out["n"]:
        lines.append(f"| {r['n']} | {r['text']} | {100 * r['exact']:.1f}% | {100 * r['by_order']['1']:.1f}% |")
    lines += ["", "### Backoff chain (n = 3, full root corpus)", "",
              "| chain | text | order 3 | order 2 | order 1 | root keys |", "|---|---|---|---|---|---|"]
    for r in out["backoff"]:
        b = r["by_order"]
        lines.append(f"| {r['chain']} | {r['text']} | {100 * b['3']:.1f}% | {100 * b['2']:.1f}% | {100 * b['1']:.1f}% "
                     f"| {r['keys']:,} |")
    return "\n".join(lines) + "\n"


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for text in sorted({r["text"] for r in out["size"]}):
        rows = sorted((r for r in out["size"] if r["text"] == text), key=lambda r: r["general_words"])
        ax.plot([r["general_words"] for r in rows], [100 * r["exact"] for r in rows], marker="o", label=text)
    ax.set_xlabel("general (WikiText-2 valid) words in the root corpus")
    ax.set_ylabel("evaluation windows served exactly (%)")
    ax.set_title("Root PLOT coverage of unseen text vs corpus size (n = 3)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
