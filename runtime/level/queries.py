"""Labelled held-out queries of one tenant's task, as profiling (runtime.level.profile) uses them:
token ids, the positions a result reports, targets, and the task's scoring counts (classification:
correct answers and queries; tagging: entity hits, predicted and gold entities), summed before
the metric is taken, so any part of the queries is scored alike."""

from __future__ import annotations

import numpy as np


class Queries:
    """Encoded queries of one split: ids, reported positions, targets and a scorer."""

    def __init__(self, encoder, data, kind, labels, max_len):
        from runtime.construct.data import IGNORE, encode_tagging

        x, y = data
        self.kind, self.labels, self.words, self.gold = kind, labels, x, y
        if kind == "classification":
            index = {name: j for j, name in enumerate(labels)}
            self.ids = encoder.tokenize(x, max_len)
            self.positions = [None] * len(x)
            self.targets = [index.get(v, -1) for v in y]
        else:
            y = [[t if t in labels else "O" for t in ts] for ts in y]
            self.gold = y
            self.ids, per_token = encode_tagging(encoder, x, y, labels, max_len)
            self.positions = [[j for j, t in enumerate(ts) if t != IGNORE] for ts in per_token]
            self.targets = [[ts[j] for j in pos] for ts, pos in zip(per_token, self.positions)]

    def __len__(self):
        return len(self.ids)

    def pairs(self):
        return list(zip(self.ids, self.positions))

    def stats(self, probs, q) -> np.ndarray:
        """Scoring counts of query q answered with probs: [correct, 1] or [hits, predicted, gold]."""
        from runtime.construct.data import entity_spans

        if self.kind == "classification":
            return np.array([float(int(np.argmax(probs)) == self.targets[q]), 1.0])
        tags = [self.labels[int(j)] for j in np.asarray(probs).argmax(-1)]
        tags += ["O"] * (len(self.words[q]) - len(tags))  # words lost to max_len
        g, p = entity_spans(self.gold[q]), entity_spans(tags)
        return np.array([len(g & p), len(p), len(g)], dtype=np.float64)

    def metric(self, s):
        """The score of summed counts s; with further axes after the counts' (s[0] the first
        count of every sum), an array of scores (no counts: NaN for accuracy, 0 for F1)."""
        s = np.asarray(s, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            if self.kind == "classification":
                out = s[0] / s[1]
            else:
                out = np.where(s[0] > 0, 2 * s[0] / (s[1] + s[2]), 0.0)
        return float(out) if out.ndim == 0 else out

    def score(self, probs_list) -> float:
        return self.metric(np.sum([self.stats(p, q) for q, p in enumerate(probs_list)], 0))


def read_queries(path, kind: str, encoder, labels, max_len: int) -> Queries:
    """A labelled file (JSON lines {text, label} or CoNLL, as tenant create reads it) as Queries."""
    from runtime.construct.manager import read_task

    data, _ = read_task(path, kind)
    return Queries(encoder, data, kind, list(labels), max_len)
