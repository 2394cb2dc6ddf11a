"""Structured outputs: response_format (json_object, json_schema) and tool_choice ("required", a
named function) constrain every sampled token with llguidance's grammar (api/grammar.py).

The greedy answer must be an independent reference's, token for token: transformers' forward
of the tiny model, masked by llguidance's own per-token logit bias (`compute_logit_bias`, not
the bitmask the server decodes), argmax, one process. Sampled, with n = 3, streamed or not,
every choice parses and follows its schema (the keys it requires, their types, no others).
Tool calls come back as `tool_calls` whose arguments follow the tool's parameters. A schema the
library cannot compile, and every combination the server cannot honour, is a 400 naming the
field. Without llguidance those tests skip, and a request that needs a grammar is a 400 saying
so (tested whether or not it is installed).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ringattn.serve.api import grammar
from ringattn.serve.logits import allowed_tokens
from ringattn.serve.worker import SAMPLING
from serve_model import CALL, WEATHER, InProcess, save_tool_model, served_tiny

needs_llguidance = pytest.mark.skipif(not grammar.available(), reason="llguidance not installed")
HELLO = [{"role": "user", "content": "hello world"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "size", "color", "tag"],
    "additionalProperties": False,
}  # bounded: every answer ends well within max_tokens, even from a random model
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
WHERE = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
         "properties": {"city": {"enum": ["Paris", "Oslo"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": WHERE}},
         {"type": "function", "function": {"name": "alarm", "parameters": {
             "type": "object", "required": ["on"], "additionalProperties": False,
             "properties": {"on": {"type": "boolean"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny(tmp_path_factory) as served:
        yield served


def follows(answer: str, schema: dict = SCHEMA) -> bool:
    """Whether `answer` is JSON with exactly the schema's keys, each of its type and range."""
    value = json.loads(answer)
    kinds = {"boolean": bool, "integer": int, "string": str}
    if not isinstance(value, dict) or set(value) != set(schema["properties"]):
        return False
    for key, rule in schema["properties"].items():
        item = value[key]
        if "enum" in rule and item not in rule["enum"]:
            return False
        if "type" in rule and (type(item) is not kinds[rule["type"]]):
            return False
        if rule.get("type") == "integer" and not rule["minimum"] <= item <= rule["maximum"]:
            return False
        if rule.get("type") == "string" and len(item) > rule["maxLength"]:
            return False
    return True


def reference(model, tok, ids: list[int], schema: dict, new: int) -> list[int]:
    """Greedy tokens under the schema's grammar, one process, llguidance's logit-bias mask."""
    import llguidance
    import llguidance.hf

    vocab = model.config.vocab_size
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=[tok.eos_token_id])
    text = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )  # as json.dumps lays JSON out
    matcher, out = llguidance.LLMatcher(lltok, text, log_level=0), []
    while len(out) < new and not (out and out[-1] == tok.eos_token_id):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        logits = logits.masked_fill(bias[:vocab] == 0, -torch.inf)
        out.append(int(logits.argmax()))
        assert matcher.consume_token(out[-1])
    return out


def test_the_mask_reads_llguidances_bit_order():
    class Bits:  # tokens 0, 9, 33, 40 and 95 (the sign bit of the third word) allowed
        def compute_bitmask(self) -> bytes:
            words = [(1 << 0) | (1 << 9), (1 << 1) | (1 << 8), -(1 << 31)]
            return b"".join(w.to_bytes(4, "little", signed=True) for w in words)

    allowed = allowed_tokens([Bits(), Bits()], 70, torch.device("cpu"))  # logits narrower
    assert allowed.shape == (2, 70)
    assert allowed[1].nonzero().flatten().tolist() == [0, 9, 33, 40]
    allowed = allowed_tokens([Bits()], 100, torch.device("cpu"))  # wider: the rest refused
    assert allowed.shape == (1, 100)
    assert allowed[0].nonzero().flatten().tolist() == [0, 9, 33, 40, 95]


@needs_llguidance
@pytest.mark.slow
def test_greedy_json_schema_is_the_references_answer(served):
    _, client, model, tok, _ = served
    ids = list(tok.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False))
    want = reference(model, tok, ids, SCHEMA, 100)
    assert want[-1] == tok.eos_token_id  # complete, then ended by the grammar
    reply = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": FORMAT},
    )
    answer = reply.choices[0].message.content
    assert answer == tok.decode(want, skip_special_tokens=True) and follows(answer)
    assert reply.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=20,
                                          temperature=0)  # fmt: skip
    assert not free.choices[0].message.content.startswith("{")  # the grammar made the JSON
    text = client.completions.create(
        model="tiny",
        prompt="the quick brown",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": FORMAT},
    )
    assert follows(text.choices[0].text)  # on /v1/completions too


@needs_llguidance
@pytest.mark.skipif(not SAMPLING, reason="this build decodes greedily only")
def test_sampled_choices_streamed_or_not_all_follow_the_schema(served):
    _, client, *_ = served
    options = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "temperature": 1.2,
               "seed": 4, "n": 3, "response_format": FORMAT}  # fmt: skip
    whole = client.chat.completions.create(**options)
    answers = [c.message.content for c in whole.choices]
    assert all(follows(a) for a in answers) and len(set(answers)) > 1
    chunks = list(client.chat.completions.create(**options, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(3)]  # fmt: skip
    assert streamed == answers
    objects = client.chat.completions.create(**{**options, "response_format":
                                                {"type": "json_object"}})  # fmt: skip
    for choice in objects.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still the start of one object
            assert choice.message.content.startswith("{")


@needs_llguidance
def test_tool_choice_required_and_named_give_calls_that_follow_the_parameters(served):
    _, client, *_ = served
    named = {"type": "function", "function": {"name": "forecast"}}
    for choice, parallel in (("required", False), (named, None), ("required", None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80,
                                               temperature=0, tools=TOOLS, tool_choice=choice,
                                               **extra)  # fmt: skip
        first = reply.choices[0]
        calls = first.message.tool_calls
        assert first.finish_reason == "tool_calls" and calls, (choice, first)
        if choice is named or parallel is False:
            assert len(calls) == 1
        for call in calls:
            if choice is named:
                assert call.function.name == "forecast"
            params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            assert follows(call.function.arguments, params[call.function.name])


@needs_llguidance
@pytest.mark.slow
def test_a_forced_call_from_a_model_that_writes_it_anyway_is_its_own_answer(tmp_path):
    """The tool model of serve_model.py writes `<tool_call>CALL</tool_call>` unforced, CALL one
    added token laid out as json.dumps does: forced by tool_choice ("required", or naming the
    function) the grammar allows each of its tokens, so the answer is the same call."""
    directory = tmp_path / "tools"
    save_tool_model(directory)
    server = InProcess(directory)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=60)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("auto", "required", named):
            reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8,
                                                   temperature=0, tools=[WEATHER],
                                                   tool_choice=choice)  # fmt: skip
            calls = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1, choice
            assert calls[0].function.name == "get_weather"
            assert json.loads(calls[0].function.arguments) == json.loads(CALL)["arguments"]
            assert reply.usage.completion_tokens == 4  # <tool_call> CALL </tool_call> end
    finally:
        server.close()


@needs_llguidance
def test_what_cannot_be_honoured_is_a_400_naming_the_field(served):
    server, client, *_ = served
    before = server.jobs.puts
    named = {"type": "function", "function": {"name": "nowhere"}}
    strict = [{"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                     {"type": "foo"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                     {"$ref": "#/nope"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"tools": TOOLS, "tool_choice": named}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ]  # fmt: skip
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, **fields)
        assert info.value.body["param"] == param, (fields, info.value.body)
    assert server.jobs.puts == before
    reply = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=100,
        temperature=0,
        tools=strict,
        tool_choice="required",
    )
    assert reply.choices[0].message.tool_calls[0].function.name == "alarm"  # strict: honoured


def test_without_llguidance_a_grammar_is_refused_and_says_why(served, monkeypatch):
    _, client, *_ = served
    monkeypatch.setattr(grammar, "available", lambda: False)
    for fields in ({"response_format": {"type": "json_object"}},
                   {"tools": TOOLS, "tool_choice": "required"}):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="llguidance"):
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, **fields)
