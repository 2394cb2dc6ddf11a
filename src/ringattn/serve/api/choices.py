"""The answers: the events of one HTTP request's jobs (one per choice) in the OpenAI API's shapes.

    jobs: choice i * n + j is prompt i's j-th of n   (schema.admit)
      each emits (index, kind, ...) into one asyncio queue (protocol.Job):
        "prompt"    the prompt's logprobs (echo)     -> the choice's first logprobs
        "logprobs"  a token's logprob                -> waits for the text it belongs with
        "text"      a piece of text                  -> a chunk (or the whole text)
        "done"      finish reason and usage          -> the choice's last chunk
        "error"     the request failed               -> the error body; the others cancelled
    not streamed: every choice gathered, then one body, `usage` summed over the choices
        (each prompt's tokens counted once, as the API does with n > 1)
    streamed:     a chunk per event as it comes, each naming its choice's `index`; after
        every choice's last chunk, the usage chunk (stream_options.include_usage) and [DONE]

Logprobs: completions give {tokens, token_logprobs, top_logprobs (token -> logprob, the chosen
token included, as vLLM), text_offset}; with `echo` the prompt's tokens come first, the first
with null logprobs. Chat gives {content: [{token, logprob, bytes, top_logprobs: [...]}]}.
A logprob is log_softmax of the model's logits (not of the sampling distribution: vLLM's
raw_logprobs). Tool calls: with tools in the request, the text goes through
text.ToolCalls, and `<tool_call>` blocks come out as `tool_calls` (finish_reason "tool_calls").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from ringattn.serve.api.schema import APIError
from ringattn.serve.protocol import Job
from ringattn.serve.text import ToolCalls

__all__ = ["Choice", "event_error", "gather", "stream"]


def event_error(event: tuple) -> APIError:
    """The APIError of an ("error", message, status) event."""
    _, message, status = event
    return APIError(message, status=status, code=None if status < 500 else "server_error",
                    kind="invalid_request_error" if status < 500 else "server_error")  # fmt: skip


class Choice:
    """What one choice has gathered: `take` records each event (and, `streamed`, gives its
    chunk), `whole` gives the choice at the end."""

    def __init__(self, index: int, kind: str, job: Job, tokenizer, tools: bool,
                 echo: str | None = None, streamed: bool = False):  # fmt: skip
        self.index, self.kind, self.job, self.tokenizer = index, kind, job, tokenizer
        self.streamed = streamed
        self.tools = ToolCalls() if tools else None
        self.text: list[str] = [echo] if echo else []
        self.entries: list[tuple] = []  # (token id, logprob or None, [(id, logprob)] or None)
        self.pending: list[tuple] = []  # entries not streamed yet
        self.calls: list[dict] = []
        self.finish: str | None = None
        self.usage: dict | None = None
        self.offset = 0  # text_offset of the next token (completions)
        self.echo = echo

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprobs(self, entries: list[tuple]) -> dict | None:
        if not entries or self.job.request.logprobs is None:
            return None
        if self.kind == "text_completion":
            tokens, values, tops, offsets = [], [], [], []
            for token, value, top in entries:
                text = self._token(token)
                tokens.append(text)
                values.append(value)
                offsets.append(self.offset)
                self.offset += len(text)
                if top is None:
                    tops.append(None)
                    continue
                tops.append({self._token(t): v for t, v in top})
                tops[-1].setdefault(text, value)
            return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                    "text_offset": offsets}  # fmt: skip

        def item(token: int, value: float) -> dict:
            text = self._token(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [{**item(token, value), "top_logprobs": [item(*t) for t in top]}
                            for token, value, top in entries]}  # fmt: skip

    def take(self, kind: str, *event) -> dict | None:
        """Record one event; when streamed, the choice's chunk for it (None: nothing to send
        yet: logprobs wait for the text they belong with, a possible tool call's start for
        the rest of the block)."""
        if kind in ("prompt", "logprobs"):
            entries = event[0]
            if kind == "prompt":  # nothing precedes the prompt's first token: no logprob
                entries = [(self.job.request.ids[0], None, None), *entries[1:]]
            self.entries += entries
            self.pending += entries
            return None
        text, calls = event[0] if kind == "text" else "", []
        if kind == "done":
            self.finish, self.usage = event
        if self.tools is not None:
            text, calls = self.tools.push(text)
            text += self.tools.flush() if kind == "done" else ""
            self.calls += calls
        self.text.append(text)
        if kind == "done" and self.calls and self.finish == "stop":
            self.finish = "tool_calls"
        if not self.streamed or not (text or calls or self.pending or kind == "done"):
            return None
        return self._chunk(text, calls, self.finish)

    def _chunk(self, text: str, calls: list[dict], finish: str | None) -> dict:
        logprobs, self.pending = self._logprobs(self.pending), []
        if self.kind == "text_completion":
            return {"index": self.index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish}  # fmt: skip
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [{"index": len(self.calls) - len(calls) + i, **call}
                                   for i, call in enumerate(calls)]  # fmt: skip
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def whole(self) -> dict:
        """The whole choice (not streamed)."""
        text = "".join(self.text)
        logprobs = self._logprobs(self.entries)
        if self.kind == "text_completion":
            return {"index": self.index, "text": text, "logprobs": logprobs,
                    "finish_reason": self.finish}  # fmt: skip
        message = {"role": "assistant", "content": text}
        if self.calls:
            message = {"role": "assistant", "content": text.strip() or None,
                       "tool_calls": self.calls}  # fmt: skip
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self.finish}  # fmt: skip


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens once per prompt (its first choice's), completion tokens of every choice."""
    prompt = sum(c.usage["prompt_tokens"] for c in choices if c.index % n == 0)
    completion = sum(c.usage["completion_tokens"] for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def cancel(choices: list[Choice]) -> None:
    for c in choices:
        c.job.cancelled = True  # dropped while waiting, else ended at the next step


async def gather(choices: list[Choice], n: int, events: asyncio.Queue, gone: asyncio.Future):
    """Every choice whole, and the usage; or APIError (an error event, or 499 when `gone`, the
    client's disconnect, completes first)."""
    left = len(choices)
    while left:
        event = asyncio.ensure_future(events.get())
        await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not event.done():
            event.cancel()
            cancel(choices)
            raise APIError("the client closed the request", status=499)
        index, *event = event.result()
        if event[0] == "error":
            cancel(choices)
            raise event_error(tuple(event))
        choices[index].take(*event)
        left -= event[0] == "done"
    return [c.whole() for c in choices], usage(choices, n)


async def stream(choices: list[Choice], n: int, events: asyncio.Queue, head: dict,
                 with_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """The server-sent events of the choices (module docstring); a stream closed before its
    end (the client gone) cancels every job."""
    chat = choices[0].kind == "chat.completion"
    kind = "chat.completion.chunk" if chat else "text_completion"

    def sse(parts: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'object': kind, 'choices': parts, **extra})}\n\n"

    ended = False
    try:
        for c in choices:  # chat: the role first; completions with echo: the prompt
            if chat:
                yield sse([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}])  # fmt: skip
            elif c.echo:
                yield sse([{"index": c.index, "text": c.echo, "logprobs": None,
                            "finish_reason": None}])  # fmt: skip
        left = len(choices)
        while left:
            index, *event = await events.get()
            if event[0] == "error":
                ended = True
                cancel(choices)
                yield f"data: {json.dumps(event_error(tuple(event)).body())}\n\n"
                return
            part = choices[index].take(*event)
            left -= event[0] == "done"
            if part is not None:
                yield sse([part])
        ended = True
        if with_usage:
            yield sse([], usage=usage(choices, n))
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            cancel(choices)
