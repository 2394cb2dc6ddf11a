"""Token ids to streamed text, with stop strings, the same on every rank.

Each new token re-decodes the whole continuation (`skip_special_tokens`, so an end-of-turn token
adds no text) and emits what is new, except:
  - a trailing U+FFFD: a multi-byte character still incomplete, wait for the next token;
  - the last (longest stop string - 1) characters: they may be the start of a stop string.
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
        self.text = ""  # the latest decode (cut before a stop string once stopped)
        self.shown = 0  # characters of `text` already returned
        self.stopped = False

    def _cut(self, text: str) -> None:
        start = max(0, self.shown - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        self.text = text

    def push(self, token: int) -> str:
        """Add one token; the newly showable text (maybe ""). Sets `stopped` at a stop string."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            self.text = text
            return ""
        self._cut(text)
        if self.stopped:
            return self.flush()
        upto = max(self.shown, len(self.text) - self.hold)
        piece, self.shown = self.text[self.shown : upto], upto
        return piece

    def flush(self) -> str:
        """The rest of the text (at the end of generation)."""
        if not self.stopped:
            self._cut(self.text)
        piece, self.shown = self.text[self.shown :], len(self.text)
        return piece
