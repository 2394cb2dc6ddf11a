"""Tools under tool_choice "auto" with a grammar (api/grammar.text_or_tool_calls): the model may
answer in text or call; a call it opens follows the tool's parameters. This is what the OpenAI
Agents SDK sends by default (`strict: true` tools, no tool_choice).

The grammar is checked token by token on the tiny tokenizer (what it accepts, what it refuses),
then through the official `openai` client against served tiny models: the tool model of
serve_model.py writes `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>` unforced, which breaks STRICT's parameters; with `strict: true` the same request
gets a call that follows them. The random chat model's greedy text answer is unchanged by a
strict tool (the grammar lets free text through).
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ringattn.serve.api import grammar
from serve_model import InProcess, save_tool_model, served_tiny, tokenizer

pytestmark = pytest.mark.skipif(not grammar.available(), reason="llguidance not installed")
HELLO = [{"role": "user", "content": "hello world"}]
WHERE = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
         "properties": {"city": {"enum": ["Oslo", "Lima"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}  # fmt: skip
STRICT = {"type": "function", "function": {"name": "get_weather", "parameters": WHERE,
                                           "strict": True}}  # fmt: skip
ANSWER = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "maxLength": 8}}}  # fmt: skip


def follows_where(arguments: str) -> bool:
    value = json.loads(arguments)
    return (set(value) == {"city", "days"} and value["city"] in ("Oslo", "Lima")
            and type(value["days"]) is int and 1 <= value["days"] <= 7)  # fmt: skip


def verdicts(matcher, tok, texts: list[str]) -> str:
    """Per text: "A" it is a whole answer (its tokens, then end-of-sequence), "p" only the start
    of one, "-" refused."""
    out = []
    for text in texts:
        m = matcher.deep_copy()
        ok = all(m.consume_token(t) for t in tok.encode(text))
        out.append(("A" if m.consume_token(tok.eos_token_id) else "p") if ok else "-")
    return "".join(out)


def test_the_auto_grammar_lets_text_through_and_holds_every_opened_call_to_its_tool():
    tok = tokenizer()  # no <tool_call> token: the tag is written as characters
    grammars = grammar.Grammars(tok, len(tok), [tok.eos_token_id])
    tools = [{"name": "get_weather", "parameters": WHERE}, {"name": "alarm", "parameters": None}]
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
    good = f"<tool_call>{call}</tool_call>"
    other = '<tool_call>\n{"name": "alarm", "arguments": {}}\n</tool_call>'
    texts = [
        "hello, how are you? <tool_cal> is not a call",  # text, "<" and a near miss included
        "let me look: " + good,  # a preamble, then a call
        good + "\n" + other,  # two calls
        good + " done",  # text after a call
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "nobody", "arguments": {}}</tool_call>',
        '{"answer": "hi"}',  # JSON text
        '{"answer": "hi"} ' + good,
    ]  # fmt: skip
    table = {(several, answer is not None): verdicts(
        grammars.text_or_tool_calls(tools, several, answer), tok, texts)
        for several in (True, False) for answer in (None, ANSWER)}  # fmt: skip
    assert table[(True, False)] == "AAAA---AA"
    assert table[(False, False)] == "AA-A---AA"  # parallel_tool_calls false: one call at most
    # with a response_format: the text answer is the JSON, prose must go on to call
    assert table[(True, True)] == "pAAA---A-"
    assert table[(False, True)] == "pA-A---A-"
    unopened = grammars.text_or_tool_calls(tools, True).deep_copy()
    for t in tok.encode("let me look: <tool_call>"):
        assert unopened.consume_token(t)
    assert not unopened.consume_token(tok.eos_token_id)  # an opened call must be finished


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools") / "tiny"
    save_tool_model(directory)
    server = InProcess(directory)
    try:
        yield openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=60)
    finally:
        server.close()


@pytest.mark.slow
def test_a_strict_tool_under_auto_turns_the_models_invalid_call_into_a_valid_one(tool_server):
    client = tool_server
    loose = {"type": "function", "function": {**STRICT["function"], "strict": False}}
    ask = {"model": "tiny", "messages": HELLO, "max_tokens": 120, "temperature": 0}
    free = client.chat.completions.create(**ask, tools=[loose])  # no grammar: as written
    (call,) = free.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # the model's own call
    assert not follows_where(call.function.arguments)
    reply = client.chat.completions.create(**ask, tools=[STRICT], tool_choice="auto")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and follows_where(call.function.arguments)
    # as the Agents SDK sends it (no tool_choice), streamed: the same call
    chunks = list(client.chat.completions.create(**ask, tools=[STRICT], stream=True))
    streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert [c.function.arguments for c in streamed] == [call.function.arguments]


@pytest.mark.slow
def test_parallel_tool_calls_false_and_a_response_format_under_auto_hold_calls_too(tool_server):
    client = tool_server
    loose = {"type": "function", "function": {**STRICT["function"], "strict": False}}
    ask = {"model": "tiny", "messages": HELLO, "max_tokens": 120, "temperature": 0}
    # a non-strict tool with parallel_tool_calls false: the grammar too (one call, its schema)
    single = client.chat.completions.create(**ask, tools=[loose], parallel_tool_calls=False)
    (call,) = single.choices[0].message.tool_calls
    assert follows_where(call.function.arguments)
    # with a response_format the model may still call (before, the JSON grammar forbade it)
    both = client.chat.completions.create(**ask, tools=[STRICT], response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})  # fmt: skip
    (call,) = both.choices[0].message.tool_calls
    assert follows_where(call.function.arguments)


def test_a_strict_tool_under_auto_leaves_a_text_answer_as_it_was(tmp_path_factory):
    """Token for token the answer without tools, where both are kept to what the grammar's text
    can hold: llguidance matches UTF-8 text, so the random model's lone high bytes (and the
    special tokens, which are not text) are biased away in both requests alike."""
    with served_tiny(tmp_path_factory) as (server, client, _, tok, _):
        special = set(tok.get_added_vocab().values()) - {tok.eos_token_id}
        away = {str(t): -100 for t in range(len(tok))
                if t in special or not tok.decode([t]).isascii()}  # fmt: skip
        ask = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "temperature": 0,
               "logit_bias": away}  # fmt: skip
        plain = client.chat.completions.create(**ask)
        assert (
            plain.usage.completion_tokens > 10
            and "<tool_call>" not in plain.choices[0].message.content
        )
        reply = client.chat.completions.create(**ask, tools=[STRICT])  # (the template ignores them)
        assert reply.choices[0].message.content == plain.choices[0].message.content
        assert not reply.choices[0].message.tool_calls
        assert reply.usage.completion_tokens == plain.usage.completion_tokens
        before = server.jobs.puts
        bad = {"type": "function", "function": {"name": "f", "strict": True,
                                                "parameters": {"type": "foo"}}}  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, tools=[bad])
        assert info.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                **ask,
                tools=[STRICT],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                },
            )
        assert info.value.body["param"] == "response_format.json_schema.schema"
        assert server.jobs.puts == before  # refused before any work
