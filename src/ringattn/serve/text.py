"""Token ids to streamed text, with stop strings, the same on every rank, O(1) per token.

Decoding is incremental (the way vLLM and transformers' TextStreamer do it): each new token
decodes a short window, from the token before the last emitted piece to the end, and the new
text is what that window decodes to beyond the window's already-read part. A tokenizer's text
depends on the tokens before it only through that window (a leading space that SentencePiece
drops at a window's start is dropped from both decodes alike), so the pieces add up to the
decode of the whole continuation, at a cost that does not grow with its length.

    ids      t0 t1 t2 ... t(p) ... t(r) ... t(n-1)
                          prefix   read      (decode ids[p:] minus decode ids[p:r] = the new text)

`skip_special_tokens`, so an end-of-turn token adds no text. Nothing is shown while:
  - the window's text ends with U+FFFD: a multi-byte character still incomplete;
  - it is among the last (longest stop string - 1) characters: they may start a stop string.
When a stop string appears the text ends just before it, and generation stops. Every rank runs
this on the same tokens with the same tokenizer, so every rank stops at the same token without
any extra communication. At the end, `flush` shows the rest, an incomplete character included.
"""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    """Feed token ids with `push`; it returns the text that may be shown now."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the decode window is ids[prefix:], read up to ids[read]
        self.pieces: list[str] = []  # the text shown so far
        self.buffer = ""  # decoded, not shown yet: the last `hold` characters at most
        self.pending = ""  # an incomplete character's text (U+FFFD), shown by flush only
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (cut before a stop string once stopped)."""
        return "".join(self.pieces) + self.buffer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _add(self, new: str) -> None:
        """Append `new`; a stop string can only end in it and start in the buffer (everything
        before was shown because no stop string could start there), so the buffer is all the
        text searched."""
        buffer = self.buffer + new
        hits = [i for i in (buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            buffer, self.stopped = buffer[: min(hits)], True
        self.buffer = buffer

    def _show(self, upto: int) -> str:
        piece, self.buffer = self.buffer[:upto], self.buffer[upto:]
        if piece:
            self.pieces.append(piece)
        return piece

    def push(self, token: int) -> str:
        """Add one token; the newly showable text (maybe ""). Sets `stopped` at a stop string."""
        self.ids.append(token)
        window = self._decode(self.ids[self.prefix :])
        read = self._decode(self.ids[self.prefix : self.read])
        if window.endswith("\ufffd"):  # wait for the rest of the character
            self.pending = window[len(read) :]
            return ""
        self.prefix, self.read, self.pending = self.read, len(self.ids), ""
        self._add(window[len(read) :])
        if self.stopped:
            return self.flush()
        return self._show(max(0, len(self.buffer) - self.hold))

    def flush(self) -> str:
        """The rest of the text (at the end of generation)."""
        if not self.stopped and self.pending:
            self._add(self.pending)
            self.pending = ""
        return self._show(len(self.buffer))
