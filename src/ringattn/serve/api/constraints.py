"""Admission of the fields that change how rank 0 picks tokens: the sampling filters, the logit
penalties and biases, and the grammar of response_format and tool_choice (bodies.py lists them).

    top_k -1 or 0 -> 0 (all), min_p, the penalties          bounds checked by pydantic (bodies.py)
    logit_bias {"id": bias}  -> {id: bias}, each id in [0, vocab) and bias in [-100, 100]
    response_format text -> nothing; json_object / json_schema -> a grammar (api/grammar.py)
    tool_choice required / {"function": {"name"}} -> a grammar of Hermes tool-call blocks
    tool_choice auto (or absent) with tools, and a strict tool, parallel_tool_calls false or a
        response_format -> free text (or the JSON answer) that may open calls, each call's
        block by its grammar (api/grammar.text_or_tool_calls); otherwise no grammar
    tool_choice with no tools, a named function not in tools, response_format with a forced
        tool_choice -> 400 naming the field (nothing is silently ignored)
"""

from __future__ import annotations

from ringattn.serve.api.bodies import MAX_LOGIT_BIAS, ChatBody, Tool, _Common
from ringattn.serve.api.errors import APIError
from ringattn.serve.api.grammar import Grammars

__all__ = ["grammar_of", "shaping"]

BIAS_LIMIT = 100.0


def shaping(body: _Common, vocab_size: int) -> dict:
    """The Request keywords of the body's sampling filters, penalties and biases."""
    out = {
        "top_k": max(0, body.top_k or 0),
        "min_p": float(body.min_p or 0.0),
        "presence_penalty": float(body.presence_penalty or 0.0),
        "frequency_penalty": float(body.frequency_penalty or 0.0),
        "repetition_penalty": float(body.repetition_penalty or 1.0),  # (0 is refused)
    }
    if body.logit_bias:
        if len(body.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens, got "
                           f"{len(body.logit_bias)}", param="logit_bias")  # fmt: skip
        bias = {}
        for key, value in body.logit_bias.items():
            token = int(key) if key.strip().lstrip("-").isdigit() else None
            if token is None or not 0 <= token < vocab_size:
                raise APIError(f"logit_bias keys are token ids in [0, {vocab_size}) as strings, "
                               f"got {key!r:.40}", param="logit_bias")  # fmt: skip
            if not -BIAS_LIMIT <= value <= BIAS_LIMIT:
                raise APIError(f"logit_bias values are in [-100, 100], got {value} for token "
                               f"{token}", param="logit_bias")  # fmt: skip
            bias[token] = float(value)
        out["logit_bias"] = bias
    return out


def _answer(body: _Common) -> tuple[dict, str] | None:
    """The schema a text answer follows (response_format) and the field to name, or None."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise APIError("response_format.json_schema goes with type 'json_schema', not "
                           "'text'", param="response_format.json_schema")  # fmt: skip
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise APIError("response_format.json_schema goes with type 'json_schema', not "
                           "'json_object'", param="response_format.json_schema")  # fmt: skip
        return {"type": "object"}, "response_format"
    if fmt.json_schema is None:
        raise APIError("response_format type 'json_schema' needs json_schema: {name, schema}",
                       param="response_format.json_schema")  # fmt: skip
    schema = fmt.json_schema.schema_
    return ({"type": "object"} if schema is None else schema,
            "response_format.json_schema.schema")  # fmt: skip


def _tool_choice(body: ChatBody, answer: tuple[dict, str] | None, grammars: Grammars):
    """The grammar of the tool calls (with the answer's, under "auto"), or None: free text,
    calls parsed as the model writes them."""
    choice = body.tool_choice
    forced = choice == "required" or isinstance(choice, Tool)
    if choice is not None and choice != "none" and not body.tools:
        raise APIError(f"tool_choice {choice if isinstance(choice, str) else 'a function'!r} "
                       f"needs tools", param="tool_choice")  # fmt: skip
    if not body.tools or choice == "none":
        return None
    tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in body.tools]
    several = body.parallel_tool_calls is not False
    if not forced:  # "auto": text, or calls; a grammar when anything must be enforced
        strict = any(t.function.strict for t in body.tools)
        if not (strict or not several or answer is not None):
            return None
        if answer is not None:  # its own compile first: its errors name its field
            grammars.json_schema(*answer)
        return grammars.text_or_tool_calls(tools, several, None if answer is None else answer[0])
    if answer is not None:
        raise APIError(
            "response_format and tool_choice 'required' (or a named function) each fix the "
            "answer's form; send one of them (with tool_choice 'auto' both apply: the answer "
            "is either JSON that follows response_format or tool calls)",
            param="response_format",
        )
    if isinstance(choice, Tool):
        tools = [t for t in tools if t["name"] == choice.function.name]
        if not tools:
            names = [t.function.name for t in body.tools]
            raise APIError(f"tool_choice names function {choice.function.name!r}, which is not "
                           f"among the tools {names}", param="tool_choice")  # fmt: skip
        return grammars.tool_calls(tools[:1], several=False)
    return grammars.tool_calls(tools, several)


def grammar_of(body: _Common, grammars: Grammars):
    """The request's compiled grammar (an llguidance LLMatcher), or None; APIError when asked
    for one that cannot be built (`grammars`: api/grammar.Grammars)."""
    answer = _answer(body)
    if isinstance(body, ChatBody):
        calls = _tool_choice(body, answer, grammars)
        if calls is not None:
            return calls
    return None if answer is None else grammars.json_schema(*answer)
