"""Token ids to text one token at a time, at a cost that does not grow with the text.

Re-decoding the whole continuation at every token costs O(n) per token, O(n^2) in all (12 s of
decoding for 8k tokens). Instead (the way vLLM and transformers' TextStreamer do it) each token
decodes a short window, from the token before the last emitted piece to the end; the new text
is what the window decodes to beyond its already-read part:

    ids      t0 t1 ... t(p) ... t(r) ... t(n-1)
                       prefix   read          new text = decode(ids[p:]) - decode(ids[p:r])

A tokenizer's text depends on earlier tokens only within such a window (the leading space
SentencePiece drops at a window's start is dropped from both decodes alike), so the pieces add
up to the decode of the whole continuation. The window moves only past tokens that gave text: a
read part of special tokens alone would decode to "" and let a decoder that strips the text's
first space (SentencePiece's) strip a space the whole decode keeps. While the window's text ends
with U+FFFD (a multi-byte character not complete yet) nothing is emitted; `pending` holds that
text and `flush` gives it at the end.
"""

from __future__ import annotations

__all__ = ["Detokenizer"]


class Detokenizer:
    """`push(token)` -> the new text (maybe ""); `flush()` -> the incomplete rest."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window is ids[prefix:], read up to ids[read]
        self.pending = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        self.ids.append(token)
        window = self._decode(self.ids[self.prefix :])
        read = self._decode(self.ids[self.prefix : self.read])
        new = window[len(read) :]
        if window.endswith("\ufffd"):  # wait for the rest of the character
            self.pending = new
            return ""
        if new:  # the window moves on only past text: its read part must never decode to ""
            self.prefix, self.read, self.pending = self.read, len(self.ids), ""
        return new

    def flush(self) -> str:
        piece, self.pending = self.pending, ""
        return piece
