"""`ringattn serve --nproc 2`, launched as a real process tree, asked by the `openai` client.

Two servers start at once (their start-up overlaps): A (cp 2, prompts prefilled in chunks of 8
tokens, concurrent requests joining each other's steps) serves the answers and then loses
a rank to SIGKILL; B splits the model over --tp 2, needs an API key and is stopped with SIGTERM.
Every answer of a two-rank server must equal transformers' greedy `model.generate` of that
prompt alone (a seeded sampled one: the seeded ringattn.hf.generate on one process), also when
requests come concurrently (batched), and when rank 0 shapes the logits (a logit_bias, a
penalty, a JSON schema's grammar) before it samples for the group; a refused request must
leave the ranks' served count (their heartbeat files) unchanged; a stop must end every rank
within seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import ringattn.hf
from ringattn.serve.api import grammar
from serve_model import Server, alive, save_chat_model
from test_serve_fields import reference as fields_reference
from test_serve_openai import TOL, check_completion, log_softmax
from test_serve_structured import FORMAT, SCHEMA, follows
from test_serve_structured import reference as structured_reference

PROMPTS = ["hello world", "the lazy dog", "ring attention passes keys", "how are you today?"]
SAMPLED = {"temperature": 1.2, "top_p": 0.9, "seed": 11}  # PROMPTS[0]'s settings


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "tiny"
    model, tok = save_chat_model(directory)
    started = {}

    def start(name: str, *extra: str) -> None:
        started[name] = Server(directory, 2, *extra)

    b_flags = ("b", "--api-key", "k3y", "--tp", "2", "--model-name", "tiny")
    a_flags = ("a", "--max-batch-tokens", "8", "--kv-block-size", "4")  # prompts in chunks
    threads = [threading.Thread(target=start, args=a_flags),
               threading.Thread(target=start, args=b_flags)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    try:
        assert set(started) == {"a", "b"}, "a server did not start (see the log above)"
        yield started, model, tok, directory
    finally:
        for server in started.values():
            server.stop()


def greedy(model, tok, text: str, max_new: int) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_dict=False)  # fmt: skip
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def sampled(model, tok, text: str, max_new: int, **settings) -> str:
    """The seeded ringattn.hf.generate of one prompt alone, on this one process."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_dict=False)  # fmt: skip
    out = ringattn.hf.generate(model, torch.tensor([ids]), max_new, do_sample=True,
                               eos_token_id=[tok.eos_token_id], **settings)  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def served_count(server: Server, ranks: int = 2, timeout_s: float = 10.0) -> list[int]:
    """Every rank's count of requests run, from its heartbeat file (once all agree)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = server.ranks()
        counts = [records.get(r, {}).get("served", 0) for r in range(ranks)]
        if (len(set(counts)) == 1 and len(records) == ranks) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


@pytest.mark.slow
def test_two_ranks_answer_concurrent_requests_as_each_alone(servers):
    started, model, tok, _ = servers
    client = openai.OpenAI(base_url=started["a"].url, api_key="-", max_retries=0, timeout=120)
    want = {p: greedy(model, tok, p, 10) for p in PROMPTS[1:]}
    want[PROMPTS[0]] = sampled(model, tok, PROMPTS[0], 10, **SAMPLED)
    answers: dict[str, str] = {}

    def ask(prompt: str, stream: bool) -> None:
        settings = SAMPLED if prompt == PROMPTS[0] else {"temperature": 0}
        kwargs = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                  "max_tokens": 10, **settings}  # fmt: skip
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            answers[prompt] = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            answers[prompt] = client.chat.completions.create(**kwargs).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p, i % 2 == 1)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert answers == want
    assert served_count(started["a"]) == [len(PROMPTS)] * 2  # every rank ran every request
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "nobody", "content": "x"}])
    assert served_count(started["a"], timeout_s=2) == [len(PROMPTS)] * 2  # it reached no rank


@pytest.mark.slow
def test_tensor_parallel_with_an_api_key_then_sigterm_ends_every_rank(servers):
    started, model, tok, _ = servers
    b = started["b"]  # --tp 2: heads and MLP over 2 ranks (cp 1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=b.url, api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=b.url, api_key="k3y", max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    reply = good.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=10,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.content == greedy(model, tok, PROMPTS[2], 10)
    ids = tok(PROMPTS[3])["input_ids"]  # logprobs over heads split by tp: as one process
    scored = good.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2,
                                     max_tokens=2, temperature=0)  # fmt: skip
    assert check_completion(model, tok, ids, scored.choices[0], 2) == 2
    assert "cp 1 x tp 2" in b.log()
    pids = [record["pid"] for record in b.ranks().values()]
    assert len(pids) == 2
    b.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert b.wait(30) == 0, b.log()
    assert time.monotonic() - start < 15, b.log()
    assert not any(alive(pid) for pid in pids)
    assert "stopped by SIGTERM: every rank has ended" in b.log()


@pytest.mark.slow
def test_two_ranks_logprobs_echo_and_n_equal_one_process(servers):
    """lm-eval's loglikelihood shape (token-id prompts, echo, logprobs, max_tokens 1 or 0) and
    chat logprobs with n = 2 over cp 2, prompts in chunks of 8: within 1e-5 of log_softmax of
    the model's own logits on one process. A is served as --hf given (no --model-name)."""
    started, model, tok, directory = servers
    client = openai.OpenAI(base_url=started["a"].url, api_key="-", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [str(directory)]
    prompts = [tok(p)["input_ids"] for p in PROMPTS[1:]] + [tok(" ".join(PROMPTS))["input_ids"]]
    for new, k in ((1, 1), (0, 2)):
        reply = client.completions.create(model=str(directory), prompt=prompts, echo=True,
                                          logprobs=k, max_tokens=new, temperature=0)  # fmt: skip
        assert [c.index for c in reply.choices] == list(range(len(prompts)))
        for ids, choice in zip(prompts, reply.choices):
            assert check_completion(model, tok, ids, choice, k) == new
        assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    settings = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2}
    reply = client.chat.completions.create(model="tiny", messages=messages, **settings)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert reply.choices[0].message.content == greedy(model, tok, PROMPTS[2], 6)
    for choice in reply.choices:
        seq = list(ids)
        for item in choice.logprobs.content:
            ref = log_softmax(model, seq)[-1]
            seq.append(int(ref.argmax()))
            assert abs(item.logprob - float(ref[seq[-1]])) < TOL
            top = ref.topk(2).values.tolist()
            assert max(abs(t.logprob - v) for t, v in zip(item.top_logprobs, top)) < TOL


@pytest.mark.slow
def test_two_ranks_shape_logits_and_follow_a_grammar_as_one_process(servers):
    """Rank 0 samples for the group: a logit_bias with a presence penalty, and a JSON schema's
    grammar (with llguidance), over cp 2 give one process's reference answers."""
    started, model, tok, _ = servers
    client = openai.OpenAI(base_url=started["a"].url, api_key="-", max_retries=0, timeout=120)
    ids = tok(PROMPTS[1])["input_ids"]
    top = fields_reference(model, ids, 2)[1]
    want = fields_reference(model, ids, 10, bias={top: 1.0}, presence=2.0)
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                      logprobs=0, extra_body={"logit_bias": {str(top): 1.0},
                                                              "presence_penalty": 2.0})  # fmt: skip
    assert reply.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]
    if not grammar.available():
        return
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    want = structured_reference(model, tok, list(chat), SCHEMA, 100)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=100,
                                           temperature=0, response_format=FORMAT)  # fmt: skip
    assert reply.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert follows(reply.choices[0].message.content)


@pytest.mark.slow
def test_a_dead_rank_ends_the_server_naming_it(servers):
    started, *_ = servers
    a = started["a"]
    records = a.ranks()
    victim = records[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    code = a.wait(60)
    assert code == 1, a.log()
    log = a.log()
    assert "ringattn serve: FAIL" in log and "rank 1 (exit code -9)" in log, log
    assert not alive(records[0]["pid"])
