"""The OpenAI API fields that eval harnesses and agents send, through the official `openai` client
against `ringattn serve`'s app and one rank's loop in this process (serve_model.InProcess).

Logprobs are checked against an independent one-process reference: log_softmax of the tiny
model's own logits (transformers' forward over the whole sequence, float32), at every prompt
position (`echo`) and every generated token, within 1e-5; the alternatives must be the
reference's top k. The server prefills in chunks of 8 tokens with blocks of 4, so a prompt's
logprobs come from several pieces (a first chunk packed with others, then extends). Tool calls
come from a tiny model built to answer with one (serve_model.save_tool_model). The two-rank
server's logprobs are test_serve.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ringattn.serve.config import ServeConfig, model_aliases, model_name
from ringattn.serve.text import ToolCalls
from ringattn.serve.worker import SAMPLING
from serve_model import CALL, CONTEXT, WEATHER, InProcess, save_chat_model, save_tool_model

HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
TOL = 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "tiny"
    model, tok = save_chat_model(directory)
    server = InProcess(directory, cfg=ServeConfig(max_batch_tokens=8, kv_block_size=4))
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    try:
        yield server, client, model, tok
    finally:
        server.close()


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row i is log p(next token | ids[: i + 1]), one process, float32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_completion(model, tok, ids: list[int], choice, k: int) -> int:
    """`choice` (echo, logprobs k) against the reference: the prompt's tokens then the greedy
    tokens generated, each logprob and its k alternatives; how many were generated."""
    lp = choice.logprobs
    new = len(lp.tokens) - len(ids)
    assert new >= 0 and lp.tokens[0] == tok.decode([ids[0]])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    generated = list(ids)
    ref = log_softmax(model, ids)
    for step in range(new):  # greedy: the reference's argmax, fed back
        generated.append(int(ref[-1].argmax()))
        ref = log_softmax(model, generated)
    for i in range(1, len(generated)):
        want = ref[i - 1]
        assert abs(lp.token_logprobs[i] - float(want[generated[i]])) < TOL, i
        top = want.topk(k)
        expected = {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        got = lp.top_logprobs[i]
        assert set(expected) <= set(got) and len(got) <= k + 1, (i, got, expected)
        assert all(abs(got[t] - v) < TOL for t, v in expected.items())
    assert lp.tokens == [tok.decode([t]) for t in generated]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    return new


def test_echo_and_logprobs_of_token_id_prompts_equal_one_process(served):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    _, client, model, tok = served
    prompts = [tok("the quick brown fox jumps over the lazy dog")["input_ids"],
               tok("ring attention passes keys and values")["input_ids"],
               tok("hello")["input_ids"]]  # fmt: skip
    for new, k in ((1, 1), (0, 3), (4, 2)):
        reply = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=k,
                                          max_tokens=new, temperature=0)  # fmt: skip
        assert [c.index for c in reply.choices] == [0, 1, 2]
        for ids, choice in zip(prompts, reply.choices):
            assert check_completion(model, tok, ids, choice, k) == new
            assert choice.text.startswith(tok.decode(ids))
        assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
        assert reply.usage.completion_tokens == new * len(prompts)
        assert all(c.finish_reason == "length" for c in reply.choices)


def test_echo_without_completion_takes_a_prompt_of_the_whole_context(served):
    """Scoring a prompt of exactly the served context (echo, max_tokens 0) is served: it asks
    for no completion token. One more token (or a completion) is a 400 for the context.
    Before: refused at exactly the context."""
    _, client, model, tok = served
    ids = list(torch.randint(3, len(tok), (CONTEXT,), generator=torch.Generator().manual_seed(1)))
    ids = [int(t) for t in ids]
    reply = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1,
                                      max_tokens=0, temperature=0)  # fmt: skip
    assert check_completion(model, tok, ids, reply.choices[0], 1) == 0
    assert reply.usage.prompt_tokens == CONTEXT and reply.usage.completion_tokens == 0
    for prompt, new in ((ids, 1), ([*ids, 5], 0)):
        with pytest.raises(openai.BadRequestError, match="maximum context length is 192"):
            client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1,
                                      max_tokens=new, temperature=0)  # fmt: skip


def test_text_prompts_streamed_logprobs_equal_the_whole_answer(served):
    _, client, model, tok = served
    prompts = ["the lazy dog", "a long context needs"]
    kwargs = {"model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 0,
              "logprobs": 2, "echo": True}  # fmt: skip
    whole = client.completions.create(**kwargs)
    bare = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=5, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=5,
                                       temperature=0, echo=True)  # fmt: skip
    assert echoed.choices[0].text == prompts[0] + bare.choices[0].text
    assert echoed.choices[0].logprobs is None and echoed.usage == bare.usage
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice, text in zip(whole.choices, prompts):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and choice.text.startswith(text)
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in mine:
            for key in merged:
                merged[key] += getattr(c.logprobs, key) if c.logprobs else []
        assert merged == choice.logprobs.model_dump()
        assert mine[-1].finish_reason == choice.finish_reason
        new = check_completion(model, tok, tok(text)["input_ids"], choice, 2)
        assert new == 5 or choice.finish_reason == "stop"


def test_chat_logprobs_streamed_and_not(served):
    _, client, model, tok = served
    ids = list(tok.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False))
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "temperature": 0}
    reply = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6 or content[-1].token == "<|im_end|>"
    seq = list(ids)
    for item in content:
        ref = log_softmax(model, seq)[-1]
        token = int(ref.argmax())
        assert item.token == tok.decode([token]) and abs(item.logprob - float(ref[token])) < TOL
        assert item.bytes == list(item.token.encode())
        top = ref.topk(3)
        assert [t.token for t in item.top_logprobs] == [tok.decode([t]) for t in top.indices]
        assert max(abs(t.logprob - v) for t, v in zip(item.top_logprobs, top.values)) < TOL
        seq.append(token)
    chunks = list(client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3,
                                                 stream=True))  # fmt: skip
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]  # fmt: skip
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is None


def test_n_choices_share_the_prompts_prefill(served):
    server, client, *_ = served
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 2}]
    hits = server.metrics.prefix_hits
    greedy = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                            temperature=0, n=3)  # fmt: skip
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: the same answer
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                         temperature=0)  # fmt: skip
    assert greedy.choices[0].message.content == one.choices[0].message.content
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert server.metrics.prefix_hits >= hits + 2  # choices 1 and 2 adopted choice 0's chunks
    stream = list(client.completions.create(model="tiny", prompt=["hello", "the lazy"], n=2,
                                            max_tokens=3, temperature=0, stream=True))  # fmt: skip
    indices = {c.choices[0].index for c in stream if c.choices}
    assert indices == {0, 1, 2, 3}
    if SAMPLING:
        sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                 temperature=1.5, seed=3, n=3)  # fmt: skip
        texts = [c.message.content for c in sampled.choices]
        assert len(set(texts)) > 1  # choice j samples with seed + j
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               temperature=1.5, seed=4, n=1)  # fmt: skip
        assert again.choices[0].message.content == texts[1]


def test_the_model_id_is_the_path_as_given_and_the_basename_is_accepted():
    cfg = ServeConfig(hf="models/tiny/")
    assert model_name(cfg) == "models/tiny/" and model_aliases(cfg) == ("tiny",)
    named = ServeConfig(hf="models/tiny", model_name="m")
    assert model_name(named) == "m" and model_aliases(named) == ("tiny", "models/tiny")


@pytest.mark.slow
def test_tool_calls_in_the_hermes_convention(tmp_path):
    directory = tmp_path / "tools"
    _, tok = save_tool_model(directory)
    server = InProcess(directory)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    try:
        reply = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER],
                                               max_tokens=8, temperature=0)  # fmt: skip
        want = tok.apply_chat_template(ask, tools=[WEATHER], add_generation_prompt=True,
                                       return_dict=False)  # fmt: skip
        assert reply.usage.prompt_tokens == len(want)  # the tools went through the template
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=ask,
                tools=[WEATHER],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
        )
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the call and its result go back through the template (arguments as an object)
        turn = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
        again = client.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER],
                                               max_tokens=8, temperature=0)  # fmt: skip
        rendered = json.loads(json.dumps(turn))
        rendered[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
        want = tok.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True,
                                       return_dict=False)  # fmt: skip
        assert again.usage.prompt_tokens == len(want)
        plain = client.chat.completions.create(
            model="tiny",
            messages=ask,
            max_tokens=8,
            temperature=0,
            tool_choice="none",
            tools=[WEATHER],
        )
        assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
        assert plain.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
    finally:
        server.close()


def test_tool_call_blocks_split_from_streamed_text_at_any_cut():
    text = f"hi <tool_call>{CALL}</tool_call> and <tool_call>not json</tool_call><tool_c"
    for size in (1, 3, 7, len(text)):
        parser, content, calls = ToolCalls(), [], []
        for at in range(0, len(text), size):
            piece, got = parser.push(text[at : at + size])
            content.append(piece)
            calls += got
        content.append(parser.flush())
        assert "".join(content) == "hi  and <tool_call>not json</tool_call><tool_c", size
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
            == [("get_weather", {"city": "Paris"})]  # fmt: skip
