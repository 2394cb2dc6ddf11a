"""The tokenizer routes, in vLLM's request and response shapes (rank 0, the served tokenizer).

    POST /tokenize        {"prompt": text, "add_special_tokens": true, "return_token_strs": false}
                          or {"messages": [...], "tools", "add_generation_prompt": true,
                          "continue_final_message": false, "add_special_tokens": false, ...}
                          -> {"count", "max_model_len", "tokens": [ids], "token_strs": [...] | null}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the tokenizer's configuration (tokenizer_config.json's keys, tokens as
                          strings, file paths left out) with "tokenizer_class", "chat_template"
                          and the special tokens: lm-eval's `local-completions` tokenizes
                          through the server with it ("remote" tokenizer), no local copy needed

Chat messages go through the same template as /v1/chat/completions (schema.template_ids), so
/tokenize counts exactly the prompt a chat request would run. Every body may name the model
(404 for another); unknown fields are a 400, as on the other routes. The routes sit at the root
as vLLM's do (lm-eval strips /v1/completions from its base_url to find them); with --api-key
they need the key like the /v1 routes.
"""

from __future__ import annotations

import json

from pydantic import Field

from ringattn.serve.api.bodies import Message, Tool, _Strict
from ringattn.serve.api.errors import APIError
from ringattn.serve.api.schema import Limits, check_chars, parse, template_ids

__all__ = ["DetokenizeBody", "TokenizeChatBody", "TokenizeCompletionBody", "detokenize",
           "tokenize", "tokenizer_info"]  # fmt: skip


class TokenizeCompletionBody(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="the tokenizer's own (a BOS) around it")
    return_token_strs: bool | None = False


class TokenizeChatBody(_Strict):
    model: str | None = None
    messages: list[Message]
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = Field(False, description="beyond what the template writes")
    return_token_strs: bool | None = False


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int]


def tokenize(raw: bytes, tokenizer, limits: Limits) -> tuple[str | None, dict]:
    """(the model named, vLLM's TokenizeResponse) for a /tokenize body: a chat one when it has
    `messages`, else a completion one."""
    try:
        data = json.loads(raw)
    except ValueError:  # not JSON: parse says so
        data = None
    chat = isinstance(data, dict) and "messages" in data
    body = parse(raw, TokenizeChatBody if chat else TokenizeCompletionBody)
    if isinstance(body, TokenizeChatBody):
        if body.add_generation_prompt and body.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be "
                           "true", param="continue_final_message")  # fmt: skip
        tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                 for t in body.tools or []] or None  # fmt: skip
        ids = template_ids(body.messages, tools, tokenizer, limits,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           add_special_tokens=body.add_special_tokens)  # fmt: skip
    else:
        check_chars(len(body.prompt), limits, "prompt")
        ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    ids = [int(t) for t in ids]
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return body.model, {"count": len(ids), "max_model_len": limits.context, "tokens": ids,
                        "token_strs": strs}  # fmt: skip


def detokenize(raw: bytes, tokenizer, limits: Limits) -> tuple[str | None, dict]:
    """(the model named, vLLM's DetokenizeResponse) for a /detokenize body."""
    body = parse(raw, DetokenizeBody)
    bad = [t for t in body.tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(f"tokens must be ids in [0, {limits.vocab_size}), got {bad[:4]}",
                       param="tokens")  # fmt: skip
    return body.model, {"prompt": tokenizer.decode(body.tokens)}


def _plain(value):
    """A tokenizer_config value as JSON: an AddedToken as its text; None if not JSON-like."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return None if any(items[str(k)] is None and v is not None
                           for k, v in value.items()) else items  # fmt: skip
    return None


def tokenizer_info(tokenizer, limits: Limits) -> dict:
    """vLLM's TokenizerInfoResponse: tokenizer_class and the configuration, as JSON."""
    info = {
        k: _plain(v)
        for k, v in tokenizer.init_kwargs.items()
        if not k.endswith("_file") and k != "name_or_path" and _plain(v) is not None
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["model_max_length"] = limits.context
    return {"tokenizer_class": type(tokenizer).__name__, **info}
