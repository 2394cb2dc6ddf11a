"""Every request field of `ringattn serve` is honoured or refused, and the tokenizer routes.

- The logit changes (logit_bias, presence/frequency/repetition penalties) against an independent
  one-process reference: transformers' forward of the tiny model, the OpenAI/vLLM formulas
  written out here, greedy argmax; each option must change the reference's answer (so an
  ignored field fails), and the server's answer must be the reference's, token for token.
- top_k and min_p: top_k 1 and min_p 1 keep the most likely token only, so a sampled answer is
  the greedy one; min_p's cut against its definition (p >= min_p x p_max) in next_token.
- An unknown field, top level or nested, is a 400 that names it and never reaches the ranks; the
  harmless fields (user, metadata, store, service_tier) change nothing; the OpenAPI document
  lists exactly the fields honoured, and no others (additionalProperties false).
- /tokenize, /detokenize and /tokenizer_info in vLLM's shapes, equal to the tokenizer's own
  answers and to the prompt a chat request runs. lm-eval through them: test_serve_lm_eval.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ringattn.inference.sampling import Sampling, next_token
from ringattn.serve.api.bodies import HARMLESS
from ringattn.serve.worker import SAMPLING
from serve_model import InProcess, served_tiny

HELLO = [{"role": "user", "content": "hello world"}]
PROMPT = "the quick brown"
COMMON = {"model", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "response_format", *HARMLESS}  # fmt: skip
CHAT = COMMON | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                 "tools", "tool_choice", "parallel_tool_calls"}  # fmt: skip
COMPLETION = COMMON | {"prompt", "max_tokens", "echo", "logprobs"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny(tmp_path_factory) as served:
        yield served


def reference(model, ids: list[int], new: int, bias=None, presence=0.0, frequency=0.0,
              repetition=1.0) -> list[int]:  # fmt: skip
    """Greedy tokens after the logit changes, as OpenAI and vLLM define them, one process."""
    out = []
    for _ in range(new):
        with torch.no_grad():
            x = model(torch.tensor([ids + out])).logits[0, -1].double()
        for token, value in (bias or {}).items():
            x[token] += value
        for token in set(ids) | set(out):  # repetition: prompt and output tokens
            x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
        for token in set(out):  # frequency and presence: output tokens only
            x[token] -= frequency * out.count(token) + presence
        out.append(int(x.argmax()))
    return out


def test_logit_bias_and_penalties_follow_the_reference(served):
    _, client, model, tok, _ = served
    ids = tok(PROMPT)["input_ids"]
    plain = reference(model, ids, 12)
    top = plain[1]  # biased up, it comes first and repeats; each penalty stops it its own way
    cases = [
        ({"logit_bias": {str(top): 1.0}}, {"bias": {top: 1.0}}),
        ({"logit_bias": {str(top): 1.0}, "presence_penalty": 2.0},
         {"bias": {top: 1.0}, "presence": 2.0}),
        ({"logit_bias": {str(top): 1.0}, "frequency_penalty": 0.5},
         {"bias": {top: 1.0}, "frequency": 0.5}),
        ({"logit_bias": {str(top): -100}}, {"bias": {top: -100.0}}),
        ({"repetition_penalty": 1.8}, {"repetition": 1.8}),
        ({"repetition_penalty": 0.5}, {"repetition": 0.5}),
    ]  # fmt: skip
    answers = set()
    for fields, options in cases:
        want = reference(model, ids, 12, **options)
        assert want != plain, fields  # the field matters here: ignoring it would fail
        answers.add(tuple(want))
        reply = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                          logprobs=0, extra_body=fields)  # fmt: skip
        got = reply.choices[0].logprobs.tokens
        assert got == [tok.decode([t]) for t in want], fields
    assert len(answers) == len(cases)  # each case decodes differently


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    probs = torch.softmax(logits, 0)
    for min_p in (0.2, 0.5, 1.0):
        keep = {i for i in range(5) if probs[i] >= min_p * probs.max()}
        draws = {next_token(logits, Sampling(temperature=1.0, min_p=min_p),
                            torch.Generator().manual_seed(s)) for s in range(60)}  # fmt: skip
        assert draws == keep, (min_p, draws, keep)
    with pytest.raises(ValueError, match="min_p must be in"):
        Sampling(min_p=1.5).check()


@pytest.mark.skipif(not SAMPLING, reason="this build decodes greedily only")
def test_top_k_1_and_min_p_1_sample_the_greedy_answer(served):
    _, client, *_ = served
    greedy = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10,
                                            temperature=0).choices[0].message.content  # fmt: skip
    free = (
        client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=10, temperature=1.5, seed=1
        )
        .choices[0]
        .message.content
    )
    assert free != greedy  # sampled at 1.5 it wanders, unless top_k or min_p cut it
    for fields in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": -1, "min_p": 1.0}):
        reply = client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=10, temperature=1.5, seed=1, extra_body=fields
        )
        assert reply.choices[0].message.content == greedy, fields


def test_unknown_fields_are_refused_by_name_and_harmless_ones_accepted(served):
    server, client, *_ = served
    before = server.jobs.puts
    cases = [
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                      extra_body=fields)  # fmt: skip
        error = info.value.body
        assert error["param"] == param and param.split(".")[-1] in error["message"], error
        if param in ("best_of", "suffix"):
            assert error["code"] == "unknown_field" and "remove it" in error["message"]
    for bad in ({"foo": 1}, {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}):
        with pytest.raises(openai.BadRequestError, match="unknown field"):
            client.chat.completions.create(
                model="tiny", max_tokens=2, messages=HELLO, extra_body=bad
            )
    assert server.jobs.puts == before  # nothing reached the ranks
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    tagged = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       user="u1", extra_body={"metadata": {"a": "b"},
                                       "store": False, "service_tier": "auto"})  # fmt: skip
    assert tagged.choices[0].text == plain.choices[0].text


def test_the_openapi_document_lists_exactly_the_fields_honoured(served):
    server, *_ = served
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/openapi.json") as r:
        schemas = json.load(r)["components"]["schemas"]
    for name, fields in (("ChatBody", CHAT), ("CompletionBody", COMPLETION)):
        assert set(schemas[name]["properties"]) == fields, name
        assert schemas[name]["additionalProperties"] is False
    for name in ("TokenizeCompletionBody", "TokenizeChatBody", "DetokenizeBody"):
        assert schemas[name]["additionalProperties"] is False
    for field in HARMLESS:
        assert "cannot change the output" in schemas["ChatBody"]["properties"][field]["description"]


def call(server, method: str, path: str, body: dict | None = None, key: str | None = None):
    """(status, JSON) of a request to the server's root."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data,
                                 headers=headers, method=method)  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenizer_routes_in_vllms_shapes(served):
    server, client, _, tok, _ = served
    text = "hello world, how are you"
    status, got = call(server, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    ids = tok(text)["input_ids"]
    assert status == 200 and got == {"count": len(ids), "max_model_len": server.limits.context,
                                     "tokens": ids,
                                     "token_strs": tok.convert_ids_to_tokens(ids)}  # fmt: skip
    assert call(server, "POST", "/tokenize", {"prompt": text, "model": "tiny"})[1]["tokens"] == ids
    status, got = call(server, "POST", "/tokenize", {"messages": HELLO})
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    assert status == 200 and got["count"] == reply.usage.prompt_tokens
    assert got["tokens"] == list(tok.apply_chat_template(HELLO, add_generation_prompt=True,
                                                         return_dict=False))  # fmt: skip
    last = call(server, "POST", "/tokenize", {"messages": HELLO, "add_generation_prompt": False,
                                              "continue_final_message": True})[1]  # fmt: skip
    assert tok.decode(last["tokens"]).endswith("hello world")
    assert call(server, "POST", "/detokenize", {"tokens": ids}) == (200, {"prompt": text})
    status, info = call(server, "GET", "/tokenizer_info")
    assert status == 200 and info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["chat_template"]) == (tok.eos_token, tok.chat_template)
    assert not any(k.endswith("_file") for k in info)
    for path, body, param in [
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/tokenize", {"prompt": text, "bogus": 1}, "bogus"),
        ("/tokenize", {"messages": HELLO, "add_generation_prompt": True,
                       "continue_final_message": True}, "continue_final_message"),
    ]:  # fmt: skip
        status, error = call(server, "POST", path, body)
        assert status == 400 and error["error"]["param"] == param, error
    assert call(server, "POST", "/tokenize", {"prompt": text, "model": "gpt-9"})[0] == 404


@pytest.mark.slow
def test_tokenizer_routes_need_the_api_key_when_set(served):
    _, _, _, _, directory = served
    keyed = InProcess(directory, api_key="s3cret")
    try:
        for method, path, body in [("POST", "/tokenize", {"prompt": "hi"}),
                                   ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None)]:  # fmt: skip
            assert call(keyed, method, path, body)[0] == 401
            assert call(keyed, method, path, body, key="s3cret")[0] == 200
    finally:
        keyed.close()
