"""Corpus and task readers, WordPiece tag alignment, and the task metrics.

Corpora (for PLOT construction and MLM): plain text, one document per line; JSON lines with
a "text" field; CoNLL, one sentence per document. Tasks: classification JSON lines
{"text", "label"}; CoNLL tagging (token in the first column, tag in the last, blank lines end
sentences, -DOCSTART- lines skipped). Every reader raises ValueError with one line naming
the file (and line) on a missing file, an unreadable format or an empty corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: reading data needs no torch
    from runtime.model.encoder import Encoder

FORMATS = ("text", "jsonl", "conll")
IGNORE = -100  # label of sub-tokens the loss skips (torch's cross_entropy ignore_index)


def read_corpora(paths, fmt=None) -> list[str]:
    """The documents of one corpus file or several, in order."""
    from runtime.model.stored import ManagerError

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ManagerError("no corpus files given")
    docs = []
    for p in paths:
        docs += read_corpus(p, fmt)
    return docs


def read_corpus(path: str | Path, fmt: str | None = None) -> list[str]:
    """Documents of a corpus file. fmt None sniffs the first line: a JSON object means JSON
    lines, -DOCSTART- or a tab means CoNLL, anything else plain text."""
    lines = _read_lines(path)
    fmt = fmt or _sniff(lines)
    if fmt == "text":
        docs = [line.strip() for line in lines if line.strip()]
    elif fmt == "jsonl":
        docs = [text for text, _ in _json_records(path, lines, label=False)]
    elif fmt == "conll":
        docs = [" ".join(words) for words in read_conll(path)[0]]
    else:
        raise ValueError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not docs:
        raise ValueError(f"{path}: empty corpus")
    return docs


def read_classification(path: str | Path) -> tuple[list[str], list[str]]:
    """(texts, labels) from JSON lines {"text": ..., "label": ...}."""
    records = _json_records(path, _read_lines(path), label=True)
    if not records:
        raise ValueError(f"{path}: empty corpus")
    return [text for text, _ in records], [label for _, label in records]


def read_conll(path: str | Path) -> tuple[list[list[str]], list[list[str]]]:
    """(sentences as word lists, their tags) from a CoNLL file."""
    sentences, tags, words, word_tags = [], [], [], []
    for lineno, line in enumerate(_read_lines(path), 1):
        cols = line.split()
        if cols and cols[0] == "-DOCSTART-":
            continue
        if not cols:
            if words:
                sentences.append(words)
                tags.append(word_tags)
            words, word_tags = [], []
            continue
        if len(cols) < 2:
            raise ValueError(f"{path}:{lineno}: expected a token and a tag, got {line.strip()!r}")
        words.append(cols[0])
        word_tags.append(cols[-1])
    if words:
        sentences.append(words)
        tags.append(word_tags)
    if not sentences:
        raise ValueError(f"{path}: empty corpus")
    return sentences, tags


def _read_lines(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def _sniff(lines: list[str]) -> str:
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("{"):
        return "jsonl"
    if first.startswith("-DOCSTART-") or "\t" in first:
        return "conll"
    return "text"


def _json_records(path, lines: list[str], label: bool) -> list[tuple[str, str | None]]:
    """(text, label) per non-blank line; label None unless asked for."""
    want = "'text' and 'label' fields" if label else "a 'text' field"
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        fields_ok = isinstance(obj, dict) and isinstance(obj.get("text"), str)
        if label:
            fields_ok = fields_ok and isinstance(obj.get("label"), (str, int))
        if not fields_ok:
            raise ValueError(f"{path}:{lineno}: expected a JSON object with {want}")
        records.append((obj["text"], str(obj["label"]) if label else None))
    return records


# -- sub-token alignment ------------------------------------------------------------------


def encode_tagging(encoder: Encoder, sentences: list[list[str]], tags: list[list[str]], tag_names: list[str],
                   max_len: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, labels) per sentence: a word's first sub-token carries its tag's index in
    tag_names; other sub-tokens and [CLS]/[SEP] get IGNORE. Words cut by max_len are lost."""
    index = {t: j for j, t in enumerate(tag_names)}
    all_ids, all_labels = [], []
    for (ids, word_ids), word_tags in zip(encoder.tokenize_words(sentences, max_len), tags):
        labels, previous = [], None
        for w in word_ids:
            first = w is not None and w != previous
            if first and word_tags[w] not in index:
                raise ValueError(f"tag {word_tags[w]!r} is not one of the task's tags {tag_names}")
            labels.append(index[word_tags[w]] if first else IGNORE)
            previous = w
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels


def word_tags(predicted: list[int], labels: list[int], tag_names: list[str], n_words: int) -> list[str]:
    """Word-level tags from per-sub-token predictions: read at the positions whose label is
    not IGNORE (first sub-tokens); words lost to truncation are tagged O."""
    tags = [tag_names[p] for p, y in zip(predicted, labels) if y != IGNORE]
    return tags + ["O"] * (n_words - len(tags))


# -- metrics --------------------------------------------------------------------------------


def entity_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, start, end exclusive) of each entity in a BIO or IO tag sequence.

    A span starts at B-X, or at I-X not continuing an X span; it runs over the following I-X.
    With IO tags (bc5cdr, sciie) a span is thus a maximal run of one entity type.
    """
    spans, start, kind = set(), None, None
    for j, tag in enumerate([*tags, "O"]):  # the sentinel closes a span at the end
        if tag != "O" and tag[:2] not in ("B-", "I-"):
            raise ValueError(f"tag {tag!r} is neither O nor B-/I- prefixed")
        continues = tag.startswith("I-") and tag[2:] == kind
        if start is not None and not continues:
            spans.add((kind, start, j))
            start, kind = None, None
        if tag != "O" and not continues:
            start, kind = j, tag[2:]
    return spans


def entity_f1(gold: list[list[str]], predicted: list[list[str]]) -> float:
    """Micro F1 over exact (type, start, end) spans of all sentences; 0.0 when there are none."""
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    hits = n_gold = n_pred = 0
    for g, p in zip(gold, predicted):
        gs, ps = entity_spans(g), entity_spans(p)
        hits += len(gs & ps)
        n_gold += len(gs)
        n_pred += len(ps)
    return 2 * hits / (n_gold + n_pred) if hits else 0.0


def accuracy(gold: list, predicted: list) -> float:
    if len(gold) != len(predicted) or not gold:
        raise ValueError(f"accuracy needs equally long non-empty lists, got {len(gold)} and {len(predicted)}")
    return sum(g == p for g, p in zip(gold, predicted)) / len(gold)
