"""Corpus/task readers, their errors, WordPiece tag alignment and the metrics on hand-made cases."""

import json

import pytest

from runtime.construct.data import IGNORE, accuracy, encode_tagging, entity_f1, entity_spans, read_classification, read_conll, read_corpus, word_tags
from runtime.model.encoder import load_encoder

CONLL = """-DOCSTART- (1234)

Naloxone\tPROPN\tO\tB-Chemical
reverses\tVERB\tO\tO
clonidine\tNOUN\tO\tI-Chemical
.\tPUNCT\tO\tO

In\tADP\tO\tO
rats\tNOUN\tO\tO
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_corpus_formats(tmp_path):
    assert read_corpus(write(tmp_path, "a.txt", "first doc\n\n  second doc \n")) == ["first doc", "second doc"]
    jsonl = "\n".join(json.dumps({"text": t, "label": "x"}) for t in ["one", "two"])
    assert read_corpus(write(tmp_path, "b.txt", jsonl)) == ["one", "two"]
    assert read_corpus(write(tmp_path, "c.txt", CONLL)) == ["Naloxone reverses clonidine .", "In rats"]
    assert read_corpus(write(tmp_path, "d.txt", "{not json}\n"), fmt="text") == ["{not json}"]


def test_classification_and_conll_readers(tmp_path):
    rows = [{"text": "a b", "label": "pos", "metadata": {}}, {"text": "c", "label": 3}]
    texts, labels = read_classification(write(tmp_path, "t.jsonl", "\n".join(map(json.dumps, rows)) + "\n\n"))
    assert texts == ["a b", "c"] and labels == ["pos", "3"]
    sentences, tags = read_conll(write(tmp_path, "n.txt", CONLL.replace("\t", " ")))
    assert sentences == [["Naloxone", "reverses", "clonidine", "."], ["In", "rats"]]
    assert tags == [["B-Chemical", "O", "I-Chemical", "O"], ["O", "O"]]


def test_reader_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_corpus(tmp_path / "absent.txt")
    with pytest.raises(ValueError, match="empty corpus"):
        read_corpus(write(tmp_path, "e.txt", "\n  \n"))
    with pytest.raises(ValueError, match="empty corpus"):
        read_conll(write(tmp_path, "e2.txt", "-DOCSTART- O\n\n"))
    with pytest.raises(ValueError, match=r"j.txt:2: expected a JSON object with a 'text' field"):
        read_corpus(write(tmp_path, "j.txt", '{"text": "ok"}\n{"txt": "bad"}\n'))
    with pytest.raises(ValueError, match=r"k.txt:1: expected a JSON object with 'text' and 'label'"):
        read_classification(write(tmp_path, "k.txt", '{"text": "no label"}\n'))
    with pytest.raises(ValueError, match=r"c.txt:2: expected a token and a tag"):
        read_conll(write(tmp_path, "c.txt", "a O\nlonely\n"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_corpus(tmp_path / "bin.txt")
    with pytest.raises(ValueError, match="unknown corpus format"):
        read_corpus(write(tmp_path, "f.txt", "x\n"), fmt="xml")


def test_first_sub_token_carries_the_tag():
    encoder = load_encoder()
    tag_names = ["O", "B-Chemical", "I-Chemical"]
    words = [["Naloxone", "reverses", "clonidine"]]
    (ids,), (labels,) = encode_tagging(encoder, words, [["B-Chemical", "O", "I-Chemical"]], tag_names)
    pieces = [encoder.tokenizer.id_to_token(i) for i in ids]
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and len(pieces) > 5  # words split into pieces
    starts = [j for j, p in enumerate(pieces[1:-1], 1) if not p.startswith("##")]
    assert [labels[j] for j in starts] == [1, 0, 2]
    assert all(y == IGNORE for j, y in enumerate(labels) if j not in starts)
    assert word_tags(labels, labels, tag_names, 3) == ["B-Chemical", "O", "I-Chemical"]
    # Truncation drops the last words; they come back as O.
    (_,), (cut,) = encode_tagging(encoder, words, [["B-Chemical", "O", "I-Chemical"]], tag_names, max_len=3)
    assert word_tags(cut, cut, tag_names, 3) == ["B-Chemical", "O", "O"]
    with pytest.raises(ValueError, match="not one of the task's tags"):
        encode_tagging(encoder, words, [["B-Drug", "O", "O"]], tag_names)


def test_spans_bio_and_io():
    assert entity_spans(["B-D", "I-D", "O", "B-D", "B-D", "I-C"]) == {("D", 0, 2), ("D", 3, 4), ("D", 4, 5), ("C", 5, 6)}
    # IO (bc5cdr, sciie): a maximal run of one type, split where the type changes.
    assert entity_spans(["I-E", "I-E", "O", "I-E", "I-M", "I-M"]) == {("E", 0, 2), ("E", 3, 4), ("M", 4, 6)}
    assert entity_spans(["O", "I-D"]) == {("D", 1, 2)}
    with pytest.raises(ValueError, match="B-/I-"):
        entity_spans(["S-D"])


def test_f1_and_accuracy():
    gold = [["B-D", "I-D", "O", "B-C"], ["O", "I-E"]]
    assert entity_f1(gold, gold) == 1.0
    # Predicted: one exact span, one boundary error, one missed -> P = 1/2, R = 1/3, F1 = 0.4.
    pred = [["B-D", "I-D", "O", "O"], ["I-E", "I-E"]]
    assert entity_f1(gold, pred) == pytest.approx(0.4)
    assert entity_f1([["O"]], [["O"]]) == 0.0
    assert accuracy(["a", "b", "c", "d"], ["a", "b", "x", "d"]) == 0.75
    with pytest.raises(ValueError):
        accuracy([], [])
