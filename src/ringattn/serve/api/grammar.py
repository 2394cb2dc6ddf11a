"""Structured outputs on rank 0: a request's grammar, compiled once, masks every sampled token.

    admission (the HTTP side: this module)         every step (rank 0: serve/logits.py)
    ---------------------                          ------------------------------------
    response_format json_object   -> {"type": "object"}   allowed = the matcher's bitmask
    response_format json_schema   -> its schema            logits[~allowed] = -inf, then sample
    tool_choice required / named  -> Lark: Hermes blocks   matcher.consume_token(token)
        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the arguments by the
        tool's parameters (one block, or several unless parallel_tool_calls is false)
    compiled by llguidance's LLMatcher; a schema it cannot compile is a 400 naming the field

The library is llguidance (guidance-ai; vLLM's and SGLang's `guidance` backend): one abi3 wheel
with no Python dependencies, a grammar compiled lazily in milliseconds (no per-schema
precomputation over the vocabulary) and a mask computed per step on the CPU in tens of
microseconds. xgrammar (the other maintained choice) pulls in triton, numpy and apache-tvm-ffi,
which would move the pinned triton of the test tools. llguidance is an optional dependency (the
`structured` extra): without it a request that needs a grammar is a 400 that says so.

The matcher's end-of-sequence tokens are the server's (generation_config's and the tokenizer's):
once the grammar is complete only those are allowed, so the answer ends there ("stop"). Each
choice of a request decodes with its own copy of the request's compiled matcher.
"""

from __future__ import annotations

import json

from ringattn.serve.api.errors import APIError

__all__ = ["Grammars", "available"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # text.ToolCalls parses the same blocks
# JSON as json.dumps (and Jinja's tojson, which chat templates write tool calls with) lays it
# out: ", " and ": ", no other whitespace, so a small model cannot loop on blank lines
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiles requests' grammars against the served tokenizer (built once, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos)
        self._lltokenizer = None

    def _ll(self, param: str):
        """llguidance's tokenizer (about a second for a large vocabulary: once, lazily)."""
        if not available():
            raise APIError(f"{param} needs constrained decoding, which needs the llguidance "
                           f"package on the server (pip install 'ringattn[structured]'); "
                           f"without it, drop {param}", param=param)  # fmt: skip
        if self._lltokenizer is None:
            import llguidance.hf

            try:
                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None
                )
            except ValueError as err:  # a slow (Python) tokenizer
                raise APIError(f"{param}: the model's tokenizer cannot be used for constrained "
                               f"decoding ({err})", param=param) from None  # fmt: skip
        return self._lltokenizer

    def compile(self, grammar: str, param: str):
        """An llguidance LLMatcher for `grammar` (llguidance's grammar text), or APIError 400
        naming `param` with the library's message."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll(param), grammar, log_level=0)
        if matcher.is_error():
            raise APIError(f"{param} cannot be compiled to a grammar: {matcher.get_error()}",
                           param=param)  # fmt: skip
        return matcher

    def json_schema(self, schema: dict, param: str):
        """Answers that are JSON following `schema`, laid out as LAYOUT (a schema's
        "x-guidance" key may change that)."""
        self._ll(param)
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=LAYOUT
            )
        except ValueError as err:
            raise APIError(f"{param} is not a JSON schema: {err}", param=param) from None
        return self.compile(grammar, param)

    def tool_calls(self, tools: list[dict], several: bool, param: str = "tool_choice"):
        """Answers that are Hermes tool-call blocks only: one, or one or more when `several`,
        each calling one of `tools` ({"name", "parameters"}) with arguments that follow its
        parameters."""
        self._ll(param)
        import llguidance

        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["name"]},
                                 "arguments": t.get("parameters") or {"type": "object"}}}
                 for t in tools]  # fmt: skip
        call = {"anyOf": calls} if len(calls) > 1 else calls[0]
        call = json.dumps({**call, "x-guidance": LAYOUT})  # (its options: at the top level)
        blocks = 'call ("\\n" call)*' if several else "call"
        opened, closed = self._tag(OPEN), self._tag(CLOSE)
        lark = f'start: {blocks}\ncall: {opened} "\\n"? %json {call} "\\n"? {closed}\n'
        return self.compile(llguidance.LLMatcher.grammar_from_lark(lark), param)

    def _tag(self, tag: str) -> str:
        """A Lark item for `tag`: its text, or the token the tokenizer has for it (an added
        token, such as Qwen's <tool_call>, is one token to llguidance, not its characters)."""
        token = self.tokenizer.convert_tokens_to_ids(tag)
        if isinstance(token, int) and token != self.tokenizer.unk_token_id:
            return f'("{tag}" | <[{token}]>)'
        return f'"{tag}"'
