"""Nothing a client sends takes `ringattn serve` down, and what it runs is measured (issue 32).

The in-process server of test_serve_api.py (serve_model.InProcess: the app and one rank's loop
in threads) over the tiny chat model, asked by the official `openai` client:
  - a tiny temperature decodes greedily; an out-of-range seed is a 400 for that request alone;
  - a request whose logits turn NaN (a prompt holding a token whose embedding the test sets to
    inf: crafted weights, no switch in the library) gets a 500, its batch-mate its answer, and
    the server keeps serving; a batch that fails mid-decode (an OOM raised once by a forward
    hook) is rerun one request at a time and every client sees its text exactly once;
  - a closed stream ends its sequence at the next step; /metrics counts what ran;
  - a body over the limit is a 413, a prompt too long in characters a 400 before the template
    runs, the template runs off the event loop (GET /health answers meanwhile), a full queue is a
    503 with Retry-After, /openapi.json documents the routes and their errors.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import ringattn.hf
from ringattn.inference.hf.generate import RESERVE_AHEAD
from ringattn.inference.sampling import Sampling, next_token
from ringattn.integrations.hf.source import load_model, model_source
from ringattn.serve.api.app import build_app, serve_in_thread
from ringattn.serve.config import ServeConfig, bind
from serve_model import InProcess, save_chat_model, served_tiny

HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny(tmp_path_factory) as (server, client, model, tok, directory):
        server.directory = directory
        yield server, client, model, tok


def greedy(model, tok, ids: list[int], max_new: int) -> str:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def chat_ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def scrape(server) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) (\S+)$", text, re.MULTILINE) if m}


def concurrently(*calls) -> list:
    """Run the calls in threads at once; each one's result or the exception it raised."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as err:  # noqa: BLE001 - the test looks at each outcome
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_sampling_is_numerically_safe():
    logits = torch.tensor([1e30, -3.0, 1e30 + 1e15, float("-inf")])  # float32: a near-tie
    generator = torch.Generator().manual_seed(0)
    for t in (1e-310, 1e-6):  # under GREEDY_BELOW: the argmax, no overflow
        assert next_token(logits, Sampling(temperature=t, seed=1), generator) == 0
    huge = torch.tensor([3e38, 1e38, -3e38])  # (l - max) / t stays finite in float64
    assert next_token(huge, Sampling(temperature=1e-3, seed=1), generator) == 0
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must be in"):
            Sampling(temperature=1.0, seed=seed).check()


def test_tiny_temperature_is_greedy_and_a_bad_seed_fails_alone(served):
    _, client, model, tok = served
    want = greedy(model, tok, chat_ids(tok, HELLO), 8)

    def ask(**kw) -> str:
        reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, **kw)
        return reply.choices[0].message.content

    tiny, big_seed, negative, plain = concurrently(
        lambda: ask(temperature=1e-310, seed=3), lambda: ask(temperature=0.5, seed=2**64),
        lambda: ask(temperature=0.5, seed=-1), lambda: ask(temperature=0),
    )  # fmt: skip
    assert tiny == want and plain == want
    for err in (big_seed, negative):
        assert isinstance(err, openai.BadRequestError) and err.body["param"] == "seed", err


def test_nan_logits_fail_that_request_with_500_and_the_server_serves_on(served):
    server, client, model, tok = served
    poison = tok.pad_token_id  # never in a prompt nor generated here (checked below)
    ids = chat_ids(tok, HELLO)
    want = greedy(model, tok, ids, 10)
    assert poison not in tok(want)["input_ids"]
    embed = server.model.get_input_embeddings().weight
    saved = embed[poison].clone()
    before = scrape(server)
    try:
        with torch.no_grad():
            embed[poison] = float("inf")  # RMSNorm(inf) = NaN: NaN logits from this token on
        prompt = [poison, *ids[:4]]
        bad, good = concurrently(
            lambda: client.completions.create(model="tiny", prompt=prompt, max_tokens=4),
            lambda: client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10),
        )
    finally:
        with torch.no_grad():
            embed[poison] = saved
    assert isinstance(bad, openai.InternalServerError) and bad.status_code == 500, bad
    assert bad.body["type"] == "server_error" and "keeps serving" in bad.body["message"]
    assert good.choices[0].message.content == want
    again = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10)
    assert again.choices[0].message.content == want  # the server is still up
    after = scrape(server)
    assert after['ringattn_requests_total{outcome="failed"}'] == (
        before['ringattn_requests_total{outcome="failed"}'] + 1
    )


def test_a_closed_stream_ends_its_sequence_and_metrics_count_it(served):
    server, client, model, tok = served
    ids = tok("the quick brown")["input_ids"]
    new = 150
    full = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    assert full.shape[1] - len(ids) == new  # it would run all the way if nobody stopped it
    before = scrape(server)
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=new, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away after the first chunk
    key = 'ringattn_requests_total{outcome="cancelled"}'
    deadline = time.monotonic() + 60
    while (after := scrape(server))[key] == before[key] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after[key] == before[key] + 1
    generated = "ringattn_generation_tokens_total"
    assert after[generated] - before[generated] < new  # it stopped early
    # a whole request: every counter moves by what it did
    before = scrape(server)
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6)
    after = scrape(server)
    n = reply.usage.completion_tokens
    finish = reply.choices[0].finish_reason

    def delta(k: str) -> float:
        return after[k] - before[k]

    assert delta(f'ringattn_requests_total{{outcome="{finish}"}}') == 1
    assert delta("ringattn_generation_tokens_total") == n
    assert delta("ringattn_prompt_tokens_total") == reply.usage.prompt_tokens
    assert delta("ringattn_time_to_first_token_seconds_count") == 1
    assert delta("ringattn_inter_token_latency_seconds_count") == n - 1
    assert (
        after['ringattn_time_to_first_token_seconds_bucket{le="+Inf"}']
        == (after["ringattn_time_to_first_token_seconds_count"])
    )
    assert after["ringattn_running_sequences"] == 0 and after["ringattn_waiting_requests"] == 0


@pytest.mark.slow
def test_clients_that_leave_while_waiting_are_dropped_from_the_queue(served):
    first, _, _, tok = served
    ids = tok("the quick brown")["input_ids"]
    server = InProcess(first.directory, cfg=ServeConfig(max_batch=1))  # one runs, others wait
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    slow = server.model.register_forward_hook(lambda *_: time.sleep(0.02))  # a torch hook
    key = 'ringattn_requests_total{outcome="cancelled"}'
    try:
        before = scrape(server)
        [running] = concurrently(lambda: _while_running(server, client, ids))
        after = scrape(server)
    finally:
        slow.remove()
        server.close()
    assert after[key] == before[key] + 2  # the non-streamed and the streamed one
    generated = "ringattn_generation_tokens_total"
    assert after[generated] - before[generated] == running.usage.completion_tokens  # nor ran


def _while_running(server, client, ids: list[int]):
    """A long request; while it runs, one that times out and one stream closed at once."""
    result = []
    t = threading.Thread(target=lambda: result.append(
        client.completions.create(model="tiny", prompt=ids, max_tokens=100)))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 60
    while scrape(server)["ringattn_running_sequences"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    impatient = client.with_options(timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="tiny", prompt=ids, max_tokens=5)
    client.completions.create(model="tiny", prompt=ids, max_tokens=5, stream=True).close()
    t.join(120)
    return result[0]


def test_cancel_ends_one_sequence_of_a_batch_and_frees_its_cache(served):
    _, _, model, tok = served
    p0, p1 = torch.tensor(chat_ids(tok, HELLO)), torch.tensor(tok("the quick brown")["input_ids"])
    seen = {0: 0, 1: 0}

    def on_token(i: int, token: int) -> None:
        seen[i] += 1

    outs, stats = ringattn.hf.generate(model, [p0, p1], 8, on_token=on_token,
                                       cancel=lambda i: i == 0 and seen[0] >= 2,
                                       return_stats=True)  # fmt: skip
    alone, alone_stats = ringattn.hf.generate(model, [p1], 8, return_stats=True)
    assert outs[0].shape[1] == p0.numel() + 2 and torch.equal(outs[1], alone[0])
    assert stats.cache_tokens == alone_stats.cache_tokens  # sequence 0's caches are gone


def test_a_long_max_new_tokens_reserves_at_most_reserve_ahead(served):
    _, _, model, tok = served
    prompt = torch.tensor(chat_ids(tok, HELLO))
    text = model.config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * 8 * 4  # K+V, float32
    for new, bound in ((100_000, RESERVE_AHEAD + 64), (20, 20 + 64)):  # 64: doubling's slack
        _, stats = ringattn.hf.generate(model, prompt[None], new, on_token=lambda t: True,
                                        return_stats=True)  # fmt: skip
        assert stats.new_tokens == 1
        assert stats.cache_capacity_bytes <= per_token * (prompt.numel() + bound)
    assert RESERVE_AHEAD * per_token < 100_000 * per_token // 10  # the bound means something


def test_greedy_tokens_and_verdicts_are_rank_0s_on_every_rank(pools):
    tie = [[[0.0, 1.0, 0.0], [5.0, 0.0, 0.0]], [[1.0, 0.0, 0.0], [0.0, 0.0, 5.0]]]
    assert pools(2).run("workers_generate:first_tokens", tie) == [[[1], [0]]] * 2
    nan = [[[float("nan"), 0.0, 0.0], [1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]]
    results = pools(2).run("workers_generate:first_tokens", nan)
    assert [r[0] for r in results] == ["non-finite"] * 2  # rank 1's logits were fine
    assert pools(2).run("workers_generate:first_tokens", tie, True) == [[[], [0]]] * 2


@pytest.mark.slow
def test_a_failed_step_is_recomputed_in_step_on_two_ranks(pools):
    """The scheduler on two ranks (workers_serve.stepped), the 4th forward raising once on every
    rank: the ranks recompute together and every text equals the run that never failed."""
    prompts = ["the quick brown", "hello world, how"]
    cfg = {"max_batch_tokens": 8, "kv_block_size": 4}
    alone, failed = (pools(2).run("workers_serve:stepped", prompts, 8, cfg, at) for at in (None, 4))
    assert [r[1] for r in failed] == [2, 2]  # both ranks ran both requests
    assert failed[0][0] == alone[0][0] and all(alone[0][0])  # rank 0's texts: the same
    assert failed[0][3] > alone[0][3] and failed[0][3] == failed[1][3]  # recomputed, in step


@pytest.mark.slow
def test_a_step_that_fails_on_one_rank_only_ends_the_server_there_at_once(pools):
    """The 4th forward raising on rank 1 alone: rank 0 waits inside the step's collective for
    a rank whose cache no longer matches its own, so rank 1 must end the server, naming itself,
    within the agreement timeout (here 2 s) rather than the process-group timeout. Rank 0 stays
    stuck (the launcher would tear it down), so the pool ends the run 3 s after rank 1's answer."""
    prompts = ["the quick brown", "hello world, how"]
    cfg = {"max_batch_tokens": 8, "kv_block_size": 4}
    with pytest.raises(AssertionError) as caught:
        pools(2).run("workers_serve:stepped", prompts, 8, cfg, 4, [1], 2.0, timeout=120,
                     straggler_s=3.0)  # fmt: skip
    report = str(caught.value)
    assert "ranks [0] did not answer within 3 s of rank 1's answer" in report, report
    found = re.search(r"rank 1: step (\d+) of the server raised on this rank \(OutOfMemoryError: "
                      r"simulated\) but not on every rank.*\[([\d.]+) s after the fault\]",
                      report, re.DOTALL)  # fmt: skip
    assert found and 2.0 <= float(found[2]) < 10.0, report


def test_completions_tokenize_with_the_bos_token(tmp_path):
    from tokenizers import processors

    model, tok = save_chat_model(tmp_path / "bos")
    bos = tok.convert_tokens_to_ids("<|im_start|>")  # a BOS, as Llama's and Gemma's add
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    tok.save_pretrained(tmp_path / "bos")
    server = InProcess(tmp_path / "bos")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="hello world", max_tokens=6)
    finally:
        server.close()
    ids = tok("hello world")["input_ids"]
    assert ids[0] == bos and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].text == greedy(model, tok, ids, 6)


class _Slow:
    """A tokenizer whose chat template waits for `release` (and counts its calls)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        self.release.wait(60)
        return self.tok.apply_chat_template(*args, **kwargs)


def test_admission_is_off_the_loop_and_bounded(served):
    """--max-queue 2 with one job queued (no rank loop takes it): a chat whose template is held
    is in admission; meanwhile GET /health answers and a third request gets 503 at once, its
    body never read nor templated (issue 48: the bound is checked before the body)."""
    server, _, _, tok = served
    slow, jobs = _Slow(tok), queue.Queue()
    jobs.put("a job the ranks have not taken yet")  # no rank loop here: the queue stays full
    sock = bind("127.0.0.1", 0)
    root = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = build_app("tiny", slow, server.limits, jobs, max_queue=2)
    http, _ = serve_in_thread(app, sock)
    client = openai.OpenAI(base_url=root + "/v1", api_key="-", max_retries=0, timeout=60)
    busy = []

    def third() -> None:  # while the second is in admission: 1 queued + 1 admitting = 2
        try:
            client.completions.create(model="tiny", prompt="x" * 1000, max_tokens=2)
        except openai.InternalServerError as err:
            busy.append(err)

    try:
        [stream] = concurrently(lambda: _with_health(slow, root, client, third))
        assert not isinstance(stream, Exception), stream
        stream.close()
        assert len(busy) == 1 and busy[0].status_code == 503, busy
        assert busy[0].response.headers["retry-after"] == "1"
        assert slow.calls == 1 and jobs.qsize() == 2  # the third never reached the template
        while not jobs.empty():
            jobs.get()
        calls = slow.calls
        chars = server.limits.max_prompt_chars
        with pytest.raises(openai.BadRequestError, match=f"at most {chars} characters"):
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": "user", "content": "x" * (chars + 1)}])  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="messages cannot fit the context"):
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": "user", "content": ""}] * (server.limits.context + 1))  # fmt: skip
        assert slow.calls == calls  # both refused before the template ran
        big = json.dumps({"prompt": "x" * server.limits.max_body_bytes}).encode()
        for data in (big, iter([big[: len(big) // 2], big[len(big) // 2 :]])):  # chunked too
            raw = urllib.request.Request(root + "/v1/completions", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(raw, timeout=30)
            assert info.value.code == 413
            assert json.loads(info.value.read())["error"]["code"] == "request_too_large"
        with urllib.request.urlopen(root + "/openapi.json", timeout=30) as r:
            doc = json.load(r)
        chat = doc["paths"]["/v1/chat/completions"]["post"]
        assert {"400", "401", "413", "500", "503"} <= set(chat["responses"]), chat["responses"]
        assert "422" not in chat["responses"]
        body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schemas = doc["components"]["schemas"]
        assert "messages" in schemas[body.rsplit("/", 1)[1]]["properties"]
        assert schemas["ChatBody"]["properties"]["seed"]["anyOf"][0]["exclusiveMaximum"] == 2**63
        assert {"/health", "/metrics", "/v1/models", "/v1/completions"} <= set(doc["paths"])
    finally:
        slow.release.set()
        http.should_exit = True


def _with_health(slow: _Slow, root: str, client, during) -> object:
    """A streamed chat request whose template is held; GET /health must answer meanwhile,
    then `during()` runs, then the template goes on. The stream."""
    done = []

    def health() -> None:
        slow.entered.wait(60)
        with urllib.request.urlopen(root + "/health", timeout=10) as r:
            done.append(json.load(r)["status"])
        during()
        slow.release.set()

    t = threading.Thread(target=health)
    t.start()
    try:
        return client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                              stream=True)  # fmt: skip
    finally:
        t.join(60)
        assert done == ["ok"], "GET /health waited for the chat template"


def test_serve_loads_the_checkpoint_dtype(tmp_path):
    model, tok = save_chat_model(tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    source = model_source(str(tmp_path / "bf16"))
    assert next(load_model(source, dtype="auto").parameters()).dtype == torch.bfloat16
    assert next(load_model(source, dtype="float32").parameters()).dtype == torch.float32
    assert next(load_model(source).parameters()).dtype == torch.float32  # training's default


def test_a_server_whose_pool_cannot_serve_never_says_it_is_listening(tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    """The start-up pool check runs before rank 0 binds its port and prints "listening": a
    pool too small for one sequence of the served context ends start-up with the numbers and
    no line that tells a client (or a test harness) to connect. Before: "listening" came first,
    then the check failed and the server exited."""
    from ringattn.serve.worker import kv_token_bytes, serve_worker

    model, _ = save_chat_model(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    gb = 4 * 4 * kv_token_bytes(model) / (1 << 30)  # 4 blocks of 4 tokens
    cfg = ServeConfig(hf=str(tmp_path), port=0, kv_cache_gb=gb, kv_block_size=4,
                      max_batch_tokens=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"the KV pool holds 4 blocks of 4 tokens.*--kv-cache-gb"):
        serve_worker(cfg)
    err = capsys.readouterr().err
    assert "listening" not in err and "[serve]" not in err, err
