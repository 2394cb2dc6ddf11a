"""Structured outputs on rank 0: a request's grammar, compiled once, masks every sampled token.

    admission (the HTTP side: this module)         every step (rank 0: serve/logits.py)
    ---------------------                          ------------------------------------
    response_format json_object   -> {"type": "object"}   allowed = the matcher's bitmask
    response_format json_schema   -> its schema            logits[~allowed] = -inf, then sample
    tool_choice required / named  -> Lark: Hermes blocks   matcher.consume_token(token)
        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the arguments by the
        tool's parameters (one block, or several unless parallel_tool_calls is false)
    tool_choice auto with a strict    -> Lark: free text (or the JSON answer), and from each
      tool, parallel_tool_calls false    <tool_call> on, a block as above
      or a response_format               (text_or_tool_calls: a lazy opening)
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
        blocks = 'opened call ("\\n" opened call)*' if several else "opened call"
        return self._calls(f"start: {blocks}\nopened: {self._tag(OPEN)}", tools, param)

    def text_or_tool_calls(self, tools: list[dict], several: bool, answer: dict | None = None,
                           param: str = "tools"):  # fmt: skip
        """Answers of free text that may call tools (tool_choice "auto"): the text is free until
        it writes OPEN (or the tokenizer's OPEN token); from there a block follows, as in
        tool_calls, then free text again (no further call unless `several`). With `answer` (a
        response_format's schema) a text answer is JSON that follows it instead, and text
        that does not start with "{" must go on to call.

            start:  (opened call)* TEXT?        [(opened call)? TEXT? when not several]
                    answer | (opened call)+ TEXT?                          [with `answer`]
            opened: lazily, any text up to the first OPEN   |   PRE? the OPEN token
            TEXT, PRE: any text that does not contain OPEN (PRE: nor start with "{" when
                   there is an answer, so a JSON answer and a call's preamble never overlap)

        `opened` is lazy (it ends at the first OPEN) and TEXT cannot contain OPEN, so once a
        call opens no parse is left but its block. (A greedy `TEXT OPEN` would not do: the
        lexer extends TEXT through "<tool_call" and then refuses the ">".) Special tokens are
        not text, so the OPEN token, where there is one, opens a call as its text does."""
        text, token = "(.|\\n)", self._token(OPEN)  # any character
        first = text if answer is None else "[^{]"  # (an answer's JSON starts with "{")
        if answer is None:
            start = f"(opened call){'*' if several else '?'} TEXT?"
        else:
            start = f"answer | {'(opened call)+' if several else 'opened call'} TEXT?"
        no_open = f"~/{text}*{OPEN}{text}*/"
        rules = [f"start: {start}",
                 "opened: prefix" + (f" | PRE? <[{token}]>" if token is not None else ""),
                 f"prefix[lazy]: /({first}{text}*)?{OPEN}/",
                 f"TEXT: /{text}+/ & {no_open}",
                 f"PRE: /{first}{text}*/ & {no_open}"]  # fmt: skip
        if answer is not None:  # laid out as LAYOUT unless the schema says otherwise
            rules.append(f"answer: %json {json.dumps({'x-guidance': LAYOUT, **answer})}")
        lark = "\n".join(rules)
        return self._calls(lark, tools, param)

    def _calls(self, head: str, tools: list[dict], param: str):
        """`head` (Lark rules that use `call`) with `call`: one block's JSON and its close."""
        self._ll(param)
        import llguidance

        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["name"]},
                                 "arguments": t.get("parameters") or {"type": "object"}}}
                 for t in tools]  # fmt: skip
        call = {"anyOf": calls} if len(calls) > 1 else calls[0]
        call = json.dumps({**call, "x-guidance": LAYOUT})  # (its options: at the top level)
        lark = f'{head}\ncall: "\\n"? %json {call} "\\n"? {self._tag(CLOSE)}\n'
        return self.compile(llguidance.LLMatcher.grammar_from_lark(lark), param)

    def _tag(self, tag: str) -> str:
        """A Lark item for `tag`: its text, or the token the tokenizer has for it (an added
        token, such as Qwen's <tool_call>, is one token to llguidance, not its characters)."""
        token = self._token(tag)
        return f'("{tag}" | <[{token}]>)' if token is not None else f'"{tag}"'

    def _token(self, tag: str) -> int | None:
        """The id of the token that is `tag` whole, or None."""
        token = self.tokenizer.convert_tokens_to_ids(tag)
        if isinstance(token, int) and token != self.tokenizer.unk_token_id:
            return token
        return None
