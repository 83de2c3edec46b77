"""A completion's text as its tokens arrive, decoded in the prompt's context (vLLM's incremental
detokenization).

    text = IncrementalText(decoder.decode, prompt_ids)
    for token in completion:
        delta = text.add(token)          # new text ("" while a character is incomplete)
    rest = text.flush()                  # what was held back, once the sequence ends

Decoding the completion's tokens alone loses what only the context gives: most tokenizers'
decoders drop the space before the first word of what they decode (SentencePiece's "▁the",
WordPiece joins words with spaces between them, not before the first), so "The archive is" +
"a string." instead of " a string.". Instead each step decodes a short window that starts at
the text already emitted, with and without the new tokens, and emits the difference; the window
then moves to the new tokens. The first window is the whole prompt, so the deltas concatenate
to decode(prompt + completion) minus decode(prompt)'s length, as vLLM's do.

A delta is held back while the window's text ends in U+FFFD (a byte-level token that ends in
the middle of a UTF-8 character: the next token may complete it) or adds nothing (a special
token the decoder skips); flush() gives it up when nothing follows.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    __slots__ = ("decode", "ids", "start", "read", "window_text")

    def __init__(self, decode, prompt):
        self.decode = decode
        self.ids = list(prompt)
        self.start = 0  # the window: ids[start:read] is text already emitted (or the prompt's)
        self.read = len(self.ids)
        self.window_text = None  # decode(ids[start:read]), computed when first needed

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        if self.window_text is None:
            self.window_text = self.decode(self.ids[self.start:self.read])
        text = self.decode(self.ids[self.start:])
        if not final and (len(text) <= len(self.window_text) or text.endswith(REPLACEMENT)):
            return ""
        delta = text[len(self.window_text):]
        self.start, self.read, self.window_text = self.read, len(self.ids), None
        return delta
