"""The request bodies the server takes: every field it honours, and nothing else.

Each model forbids fields it does not declare (pydantic `extra="forbid"`): an unknown field is a
400 that names it (schema.parse), never silently ignored. A declared field either changes the
answer as the OpenAI API (or vLLM, for the fields OpenAI lacks) says, or is one of HARMLESS:
fields that cannot change the output (`user`, `metadata`, `store`, `service_tier`), accepted and
otherwise unused. The field descriptions are what GET /openapi.json shows.

Sampling, on rank 0 (serve/logits.py, inference/sampling.py), in vLLM's order:
    logits -> + logit_bias -> repetition_penalty (tokens of the prompt and the output)
           -> - frequency_penalty x count - presence_penalty x (count > 0)  (output tokens)
           -> the grammar's mask (response_format, tool_choice)
           -> greedy argmax, or / temperature, min_p, top_k, top_p, one draw
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HARMLESS", "ChatBody", "CompletionBody", "Message", "ResponseFormat", "Tool"]

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound, vLLM's max_logprobs)
MAX_N = 16  # choices per prompt
SEED_LIMIT = 2**63
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
HARMLESS = ("user", "metadata", "store", "service_tier")  # accepted, cannot change the output


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = Field(None, description="true: the arguments of every call follow "
                                "`parameters` (a grammar), with tool_choice 'auto' too, where "
                                "the model may still answer in text; with 'required' or a named "
                                "function they always do")  # fmt: skip
    arguments: str | None = None  # an assistant's call: its arguments as a JSON string


class Tool(_Strict):
    """A tool the model may call (`tools`), or an assistant's call of one (`tool_calls`)."""

    type: Literal["function"] = "function"
    function: Function
    id: str | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Tool] | None = None
    tool_call_id: str | None = None
    # an answer's own fields, sent back by clients that replay a reply as a message: not rendered
    refusal: str | None = Field(None, description="accepted, not given to the template")
    annotations: list | None = Field(None, description="accepted, not given to the template")


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchema(_Strict):
    name: str = Field(description="the schema's name (not used in decoding)")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema the answer "
                                 "follows (absent: any JSON object)")  # fmt: skip
    strict: bool | None = Field(None, description="the schema is always enforced")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


def _harmless(what: str):
    return Field(None, description=f"{what}; accepted, cannot change the output, not used")


class _Common(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(
        None, ge=-1, lt=2**31, description="keep the k most likely tokens; 0 or -1: all (vLLM)"
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="drop tokens less likely than min_p x the most likely one, after "
        "temperature (vLLM)",
    )
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        description="subtracted from the logit of every token the output already holds",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        description="x each token's count in the output, subtracted from its logit",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=2,
        description="a token of the prompt or the output: its logit divided by this when "
        "positive, multiplied when not (vLLM, CTRL)",
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> a bias in [-100, 100] added to its logit"
    )
    response_format: ResponseFormat | None = Field(None, description="json_object or "
                                                   "json_schema: decoding is constrained by a "
                                                   "grammar (llguidance)")  # fmt: skip
    user: str | None = _harmless("an end-user id")
    metadata: dict[str, str] | None = _harmless("tags")
    store: bool | None = _harmless("OpenAI's storage of the answer")
    service_tier: str | None = _harmless("OpenAI's latency tier")


class ChatBody(_Common):
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | Tool | None = Field(
        None, description="'required' or a named function: the answer is Hermes <tool_call> "
        "blocks whose JSON follows the tools' parameters (a grammar); 'auto' (the default with "
        "tools): text or calls, and with a strict tool, parallel_tool_calls false or a "
        "response_format, every call the model opens follows its parameters (a grammar)",
    )  # fmt: skip
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most (a "
                                             "grammar)")  # fmt: skip


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
