"""Token ids to streamed text, with stop strings, the same on every rank.

Decoding is incremental (inference/detokenize.py: O(1) per token, the pieces add up to the
decode of the whole continuation), with `skip_special_tokens`, so an end-of-turn token adds no
text. Nothing is shown while:
  - the text ends with U+FFFD: a multi-byte character still incomplete;
  - it is among the last (longest stop string - 1) characters: they may start a stop string.
When a stop string appears the text ends just before it, and generation stops. Every rank runs
this on the same tokens with the same tokenizer, so every rank stops at the same token without
any extra communication. At the end, `flush` shows the rest, an incomplete character included.

ToolCalls (rank 0's HTTP side) then splits a request's text into content and tool calls.
"""

from __future__ import annotations

import json
import uuid

from ringattn.inference.detokenize import Detokenizer

__all__ = ["TextStream", "ToolCalls"]


class TextStream:
    """Feed token ids with `push`; it returns the text that may be shown now."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.decoder = Detokenizer(tokenizer)
        self.pieces: list[str] = []  # the text shown so far
        self.buffer = ""  # decoded, not shown yet: the last `hold` characters at most
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (cut before a stop string once stopped)."""
        return "".join(self.pieces) + self.buffer

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

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
        new = self.decoder.push(token)
        if not new:
            return ""
        self._add(new)
        if self.stopped:
            return self.flush()
        return self._show(max(0, len(self.buffer) - self.hold))

    def flush(self) -> str:
        """The rest of the text (at the end of generation)."""
        pending = self.decoder.flush()
        if not self.stopped and pending:
            self._add(pending)
        return self._show(len(self.buffer))


class ToolCalls:
    """Tool calls out of streamed text, in the Hermes / Qwen convention: the model writes each
    call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. `push` returns the text
    that is content (outside the blocks; a tail that may start `<tool_call>` is held back) and
    the calls whose block has closed, each {id, type: "function", function: {name, arguments
    (a JSON string)}}. A block that is not such JSON stays content, as written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer, self.inside = "", False

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    hold = next((k for k in range(len(self.OPEN) - 1, 0, -1)
                                 if self.buffer.endswith(self.OPEN[:k])), 0)  # fmt: skip
                    cut = len(self.buffer) - hold
                    content.append(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return "".join(content), calls
                content.append(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(self.OPEN) :], True
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                return "".join(content), calls
            block, self.buffer = self.buffer[:at], self.buffer[at + len(self.CLOSE) :]
            self.inside = False
            call = _call(block)
            if call is None:
                content.append(self.OPEN + block + self.CLOSE)
            else:
                calls.append(call)

    def flush(self) -> str:
        """The text held back at the end: a tail, or an unclosed block as written."""
        rest = (self.OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return rest


def _call(block: str) -> dict | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}  # fmt: skip
