"""The OpenAI request bodies, checked, and turned into a `Request` the ranks can run.

    body (JSON bytes) --pydantic, strict types, unknown fields refused--> ChatBody /
      CompletionBody (bodies.py)
      --admit--> checks the API would refuse (empty messages, unknown roles, too many or too
                 long stop strings, n or logprobs out of bounds), the sampling fields and the
                 grammar of response_format / tool_choice (constraints.py, compiled once per
                 request), a prompt too long in characters to fit however it tokenizes
                 (refused before the template and the tokenizer run), the chat template with
                 the tools (tokenizer.apply_chat_template(tools=...)), the context limit
                 (prompt + max_tokens <= the model's max_position_embeddings)
      --> Requests, one per choice: prompt i's j-th of n is choice i * n + j (token ids,
          max_new_tokens, temperature, top_p, seed + j, stop, logprobs asked, top_k, min_p,
          the penalties and biases, the grammar)

Every field is bounded: max_tokens by the context, temperature [0, 2], top_p (0, 1], seed
[0, 2^63), stop (up to MAX_STOP strings of up to MAX_STOP_CHARS), the prompt (its characters,
then its tokens), the others as bodies.py says; the body's bytes are bounded before it is
parsed (app.py: 413). A field the server does not know is refused, naming it. Every refusal
is an `APIError` (HTTP 400 with the API's error body: message, type, param, code), raised on
rank 0 before anything is sent to the other ranks. Completions tokenize text with the
tokenizer's special tokens (a BOS where the model has one), as the model was trained.

Sampling defaults: an omitted `temperature`/`top_p` takes the model's generation_config when it
samples (do_sample), else greedy, as vLLM does; `temperature: 0` is greedy. A sampled request
without a `seed` gets one drawn here, so every rank draws the same tokens.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from pydantic import ValidationError

from ringattn.serve.api.bodies import SEED_LIMIT, ChatBody, CompletionBody, Message, _Common
from ringattn.serve.api.constraints import grammar_of, shaping
from ringattn.serve.api.errors import APIError
from ringattn.serve.api.grammar import Grammars
from ringattn.serve.protocol import Request

__all__ = ["APIError", "ChatBody", "CompletionBody", "Limits", "admit", "parse"]

MAX_STOP = 4
MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP_CHARS = 256  # a stop string holds back as many characters of the stream


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
    eos: tuple[int, ...] = ()  # end-of-sequence ids: where a grammar lets the answer end


def parse(raw: bytes, body_type: type):
    """The JSON body as `body_type`; APIError naming the first unknown field, else the first
    wrong one."""
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors()
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        first = (unknown or errors)[0]
        where = ".".join(str(p) for p in first["loc"] if not isinstance(p, str) or p not in
                         ("str", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]",
                          "Tool", "literal['none','auto','required']"))  # fmt: skip
        param = where or None
        if unknown:
            known = ", ".join(sorted(body_type.model_fields)) if "." not in where else ""
            raise APIError(f"unknown field {where!r}: this server does not know it, and it would "
                           f"not silently ignore it; remove it"
                           + (f" (the fields of this route: {known})" if known else ""),
                           param=param, code="unknown_field") from None  # fmt: skip
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


def check_chars(chars: int, limits: Limits, where: str) -> None:
    """Refuse a prompt whose text cannot fit the context however it tokenizes (no token covers
    more characters than the vocabulary's longest), before the template and tokenizer run."""
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise APIError(
            f"This model's maximum context length is {limits.context} tokens, which holds at "
            f"most {limits.max_prompt_chars} characters of text; the {where} has {chars}. "
            f"Please reduce the length of the {where}.",
            param=where, code="context_length_exceeded",
        )  # fmt: skip


def _message(m: Message, i: int) -> dict:
    """One message as chat templates take it: an assistant's tool calls with their arguments as
    objects (Hermes / Qwen templates write them with `tojson`), as vLLM passes them."""
    out = {"role": m.role, "content": _text(m, i)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    for j, call in enumerate(m.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as err:
            raise APIError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON "
                           f"({err})", param=f"messages.{i}.tool_calls") from None  # fmt: skip
        function = {"name": call.function.name, "arguments": arguments}
        out.setdefault("tool_calls", []).append({"id": call.id, "type": "function",
                                                 "function": function})  # fmt: skip
    return out


def tools_of(body: ChatBody) -> list[dict] | None:
    """The tools the template is given: none with tool_choice "none" (or no tools)."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in body.tools]  # fmt: skip


def template_ids(messages: list[Message], tools: list[dict] | None, tokenizer,
                 limits: Limits | None = None, *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, add_special_tokens: bool = False,
                 ) -> list[int]:  # fmt: skip
    """The messages (and tools) through the tokenizer's chat template: by default ending with
    the assistant's turn, the special tokens the template writes and no others."""
    if not messages:
        raise APIError("messages must hold at least one message", param="messages")
    if limits is not None and len(messages) > limits.context:  # each takes a token at least
        raise APIError(f"{len(messages)} messages cannot fit the context of "
                       f"{limits.context} tokens", param="messages",
                       code="context_length_exceeded")  # fmt: skip
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    if limits is not None:
        chars = sum(len(m["content"]) for m in rendered) + len(json.dumps(tools or ""))
        check_chars(chars, limits, "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError("the model's tokenizer has no chat template; use /v1/completions")
    from jinja2 import TemplateError  # transformers' chat templates are Jinja

    options = {"tools": tools, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message}  # fmt: skip
    try:
        if add_special_tokens:  # (vLLM's /tokenize option) the text, then the tokenizer's own
            text = tokenizer.apply_chat_template(rendered, tokenize=False, **options)
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(rendered, tokenize=True, return_dict=False,
                                                **options)  # fmt: skip
    except (TemplateError, ValueError, TypeError, KeyError) as err:  # raise_exception, Jinja
        raise APIError(f"the chat template refused the messages: {err}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def chat_ids(body: ChatBody, tokenizer, limits: Limits | None = None) -> list[int]:
    """A chat request's prompt: its messages and tools through the chat template."""
    return template_ids(body.messages, tools_of(body), tokenizer, limits)


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """The prompts of a completions request: one string, strings, token ids or lists of them."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt or len(prompt) > MAX_PROMPTS:
        raise APIError(f"prompt takes 1 to {MAX_PROMPTS} prompts, got {len(prompt)}",
                       param="prompt")  # fmt: skip
    return list(prompt)


def completion_ids(prompt: str | list[int], tokenizer, limits: Limits) -> list[int]:
    """A prompt's token ids: text through the tokenizer with its special tokens (BOS), or
    the ids as given."""
    vocab_size = limits.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("the prompt is empty (no tokens)", param="prompt")
        check_chars(len(prompt), limits, "prompt")
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


def _room(ids: list[int], asked: int | None, limits: Limits, where: str) -> int:
    """The completion tokens the prompt `ids` leaves: `asked`, or the rest of the context
    (at least one). `asked` 0 (echo's prompt logprobs) fits a prompt of the whole context."""
    room = limits.context - len(ids)
    if (room < 1 and asked != 0) or (asked is not None and asked > room):
        want = len(ids) + (1 if asked is None else asked)
        raise APIError(
            f"This model's maximum context length is {limits.context} tokens. However, you "
            f"requested {want} tokens ({len(ids)} in the {where}, "
            f"{1 if asked is None else asked} in the completion). Please reduce the length of "
            f"the {where} or the completion.", param=where, code="context_length_exceeded",
        )  # fmt: skip
    return room if asked is None else asked


def admit(body: _Common, tokenizer, limits: Limits,
          grammars: Grammars | None = None) -> list[Request]:  # fmt: skip
    """The checked `Request`s for `body` (ChatBody or CompletionBody): choice i * n + j is
    prompt i's j-th of n; or APIError. Choice j of a seeded request samples with seed + j.
    `grammars` (api/grammar.Grammars) compiles a response_format's or tool_choice's grammar,
    once for all the choices (each decodes with its own copy)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise APIError(f"stop takes up to {MAX_STOP} non-empty strings of up to "
                       f"{MAX_STOP_CHARS} characters, got {stop!r:.300}", param="stop")  # fmt: skip
    temperature = limits.default_temperature if body.temperature is None else body.temperature
    top_p = limits.default_top_p if body.top_p is None else body.top_p
    if temperature > 0 and not limits.sampling:
        raise APIError(f"temperature={temperature}: this build decodes greedily only; pass "
                       f"temperature 0", param="temperature")  # fmt: skip
    if isinstance(body, ChatBody):
        asked = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        prompts, where = [chat_ids(body, tokenizer, limits)], "messages"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt_logprobs = None
    else:
        asked = 16 if body.max_tokens is None else body.max_tokens  # the API's default
        prompts = [completion_ids(p, tokenizer, limits) for p in prompts_of(body)]
        where, logprobs = "prompt", body.logprobs
        prompt_logprobs = logprobs if body.echo else None
    shaped = shaping(body, limits.vocab_size)
    grammars = grammars or Grammars(tokenizer, limits.vocab_size, list(limits.eos))
    shaped["grammar"] = grammar_of(body, grammars)
    requests = []
    for ids in prompts:
        new = _room(ids, asked, limits, where)
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % SEED_LIMIT
            if temperature > 0 and seed is None:
                seed = secrets.randbits(62)  # drawn once here: every rank samples the same tokens
            requests.append(Request(ids, new, float(temperature), float(top_p), seed, stop,
                                    logprobs, prompt_logprobs, **shaped))  # fmt: skip
    return requests
