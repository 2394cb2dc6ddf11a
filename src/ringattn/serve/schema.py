"""The OpenAI request bodies, checked, and turned into a `Request` the ranks can run.

    body (JSON bytes) --pydantic, strict types--> ChatBody / CompletionBody
      --admit--> checks the API would refuse (empty messages, unknown roles, n != 1, too many
                 or too long stop strings), a prompt too long in characters to fit however it
                 tokenizes (refused before the template and the tokenizer run), the chat
                 template (tokenizer.apply_chat_template), the context limit (prompt +
                 max_tokens <= the model's max_position_embeddings)
      --> Request (token ids, max_new_tokens, temperature, top_p, seed, stop)

Every field is bounded: max_tokens by the context, temperature [0, 2], top_p (0, 1], seed
[0, 2^63), stop (up to MAX_STOP strings of up to MAX_STOP_CHARS), the prompt (its characters,
then its tokens); the body's bytes are bounded before it is parsed (app.py: 413). Every refusal
is an `APIError` (HTTP 400 with the API's error body: message, type, param, code), raised on
rank 0 before anything is sent to the other ranks. Completions tokenize text with the
tokenizer's special tokens (a BOS where the model has one), as the model was trained.

Sampling defaults: an omitted `temperature`/`top_p` takes the model's generation_config when it
samples (do_sample), else greedy, as vLLM does; `temperature: 0` is greedy. A sampled request
without a `seed` gets one drawn here, so every rank draws the same tokens.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ringattn.serve.protocol import Request

__all__ = ["APIError", "ChatBody", "CompletionBody", "Limits", "admit", "parse"]

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4
MAX_STOP_CHARS = 256  # a stop string holds back as many characters of the stream
SEED_LIMIT = 2**63


class APIError(Exception):
    """A refused request: HTTP `status` with the API's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


class ChatBody(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False


@dataclass(frozen=True)
class Limits:
    """What admission needs to know about the model."""

    context: int  # max_position_embeddings: prompt + completion tokens
    vocab_size: int
    sampling: bool  # ringattn.hf.generate samples (do_sample=...); else greedy only
    default_temperature: float = 0.0  # from generation_config when it samples
    default_top_p: float = 1.0
    max_prompt_chars: int | None = None  # more characters cannot fit the context (None: no bound)
    max_body_bytes: int = 16 << 20  # a bigger body is refused unread (413)


def parse(raw: bytes, body_type: type[_Common]) -> _Common:
    """The JSON body as `body_type`; APIError naming the first wrong field."""
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not isinstance(p, str) or p not in
                         ("str", "list[int]", "list[str]", "list[TextPart]"))  # fmt: skip
        param = where or None
        raise APIError(f"invalid request body: {where or 'body'}: {first['msg']}"
                       f" ({err.error_count()} error(s))", param=param) from None  # fmt: skip


def _text(message: Message, index: int) -> str:
    if isinstance(message.content, list):
        return "".join(part.text for part in message.content)
    if message.content is None:
        if message.role == "assistant":
            return ""
        raise APIError(f"messages[{index}].content is required for role {message.role!r}",
                       param=f"messages.{index}.content")  # fmt: skip
    return message.content


def _check_chars(chars: int, limits: Limits, where: str) -> None:
    """Refuse a prompt whose text cannot fit the context however it tokenizes (no token covers
    more characters than the vocabulary's longest), before the template and tokenizer run."""
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise APIError(
            f"This model's maximum context length is {limits.context} tokens, which holds at "
            f"most {limits.max_prompt_chars} characters of text; the {where} has {chars}. "
            f"Please reduce the length of the {where}.",
            param=where, code="context_length_exceeded",
        )  # fmt: skip


def chat_ids(body: ChatBody, tokenizer, limits: Limits | None = None) -> list[int]:
    """The messages through the tokenizer's chat template, ending with the assistant's turn."""
    if not body.messages:
        raise APIError("messages must hold at least one message", param="messages")
    if limits is not None and len(body.messages) > limits.context:  # each takes a token at least
        raise APIError(f"{len(body.messages)} messages cannot fit the context of "
                       f"{limits.context} tokens", param="messages",
                       code="context_length_exceeded")  # fmt: skip
    messages = []
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise APIError(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                           param=f"messages.{i}.role")  # fmt: skip
        messages.append({"role": m.role, "content": _text(m, i)})
    if limits is not None:
        _check_chars(sum(len(m["content"]) for m in messages), limits, "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError("the model's tokenizer has no chat template; use /v1/completions")
    from jinja2 import TemplateError  # transformers' chat templates are Jinja

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)  # fmt: skip
    except (TemplateError, ValueError, TypeError, KeyError) as err:  # raise_exception, Jinja
        raise APIError(f"the chat template refused the messages: {err}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def completion_ids(body: CompletionBody, tokenizer, limits: Limits) -> list[int]:
    """The prompt's token ids: text through the tokenizer with its special tokens (BOS), or
    the ids as given."""
    prompt, vocab_size = body.prompt, limits.vocab_size
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("the prompt is empty (no tokens)", param="prompt")
        _check_chars(len(prompt), limits, "prompt")
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:4]}",
                           param="prompt")  # fmt: skip
    if not ids:
        raise APIError("the prompt is empty (no tokens)", param="prompt")
    return ids


def admit(body: _Common, tokenizer, limits: Limits) -> Request:
    """The checked `Request` for `body` (ChatBody or CompletionBody), or APIError."""
    if body.n != 1:
        raise APIError(f"n={body.n}: this server returns one choice per request (n=1)",
                       param="n")  # fmt: skip
    if isinstance(body, CompletionBody) and body.echo:
        raise APIError("echo is not supported", param="echo")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise APIError(f"stop takes up to {MAX_STOP} non-empty strings of up to "
                       f"{MAX_STOP_CHARS} characters, got {stop!r:.300}", param="stop")  # fmt: skip
    if isinstance(body, ChatBody):
        ids, where = chat_ids(body, tokenizer, limits), "messages"
        asked = body.max_completion_tokens
        asked = body.max_tokens if asked is None else asked
    else:
        ids, where, asked = completion_ids(body, tokenizer, limits), "prompt", None
        asked = 16 if body.max_tokens is None else body.max_tokens  # the API's default
    room = limits.context - len(ids)
    if room < 1 or (asked is not None and asked > room):
        want = len(ids) + (asked or 1)
        raise APIError(
            f"This model's maximum context length is {limits.context} tokens. However, you "
            f"requested {want} tokens ({len(ids)} in the {where}, {asked or 1} in the "
            f"completion). Please reduce the length of the {where} or the completion.",
            param=where, code="context_length_exceeded",
        )  # fmt: skip
    temperature = limits.default_temperature if body.temperature is None else body.temperature
    top_p = limits.default_top_p if body.top_p is None else body.top_p
    if temperature > 0 and not limits.sampling:
        raise APIError(f"temperature={temperature}: this build decodes greedily only; pass "
                       f"temperature 0", param="temperature")  # fmt: skip
    seed = body.seed
    if temperature > 0 and seed is None:
        seed = secrets.randbits(62)  # drawn once here: every rank samples the same tokens
    return Request(ids, room if asked is None else asked, float(temperature), float(top_p), seed,
                   stop)  # fmt: skip
