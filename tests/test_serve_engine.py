"""`ringattn serve`'s engine (issue 32, items 1-4 and 7): continuous batching, chunked prefill,
the KV block pool and prefix reuse, asked through the official `openai` client.

The pool's accounting and the chained hashes are checked on their own in test_serve_prefix.py.
Here in-process servers (serve_model.InProcess) over the tiny chat model: `plain` with the
defaults (prompts in one chunk), `small` with chunks of 8 tokens and a pool of a few blocks
of 4 tokens, where long prompts prefill in chunks, prefixes are reused, and requests wait for
blocks or are preempted, and `roomy` with chunks of 32 and blocks of 4 in a pool that evicts
nothing, where the tokens a prefix hit reuses are exact. Every answer must equal transformers'
greedy `model.generate` of that prompt alone (no chunks, no cache, no batch).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ringattn.serve.config import ServeConfig
from ringattn.serve.worker import kv_token_bytes
from serve_model import InProcess, served_tiny
from test_serve_robust import chat_ids, concurrently, greedy, scrape

CHUNK, BLOCK, BLOCKS = 8, 4, 32  # the small server: 8-token chunks, 32 blocks of 4 tokens
SYSTEM = "ring attention passes keys and values around a ring of processes"  # 4 chunks
HITS, HIT_TOKENS = "ringattn_prefix_cache_hits_total", "ringattn_prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with served_tiny(tmp_path_factory) as (plain, client, model, tok, directory):
        plain.directory = directory
        # one block more: a sequence's decoded tokens start a block of their own (paged.py)
        gb = (BLOCKS + 1) * BLOCK * kv_token_bytes(model) / (1 << 30)
        cfg = ServeConfig(
            max_batch_tokens=CHUNK,
            kv_block_size=BLOCK,
            kv_cache_gb=gb,
            max_model_len=BLOCKS * BLOCK,
        )  # what the pool holds: start-up checks it
        small = InProcess(directory, cfg=cfg)
        small_client = openai.OpenAI(base_url=small.url, api_key="unused", max_retries=0,
                                     timeout=120)  # fmt: skip
        try:
            yield (plain, client), (small, small_client), model, tok
        finally:
            small.close()


def _ask(client, messages, max_tokens: int) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens)
    return reply.choices[0].message.content


@pytest.mark.slow
def test_a_request_joins_a_running_one_and_leaves_first(servers):
    (plain, client), _, model, tok = servers
    long_ids = tok("the quick brown")["input_ids"]
    short = [{"role": "user", "content": "hello world"}]
    slow = plain.model.register_forward_hook(lambda *_: time.sleep(0.01))  # a torch hook
    events: list = []
    try:
        stream = client.completions.create(model="tiny", prompt=long_ids, max_tokens=120,
                                           stream=True)  # fmt: skip

        def read_long() -> str:
            text = "".join(chunk.choices[0].text for chunk in stream)
            events.append("long")
            return text

        reader = threading.Thread(target=lambda: events.append(read_long()))
        reader.start()
        deadline = time.monotonic() + 60
        while scrape(plain)["ringattn_running_sequences"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        answer = _ask(client, short, 4)
        events.append("short")
        reader.join(120)
    finally:
        slow.remove()
    assert events.index("short") < events.index("long")  # it did not wait for the long one
    assert answer == greedy(model, tok, chat_ids(tok, short), 4)
    assert events[-1] == greedy(model, tok, long_ids, 120)


def test_a_long_prompt_prefills_in_chunks_equal_to_one_pass(servers):
    (_, client), (_, small_client), model, tok = servers
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    ids = chat_ids(tok, messages)
    assert len(ids) > 4 * CHUNK  # several chunks, a partial last one
    want = greedy(model, tok, ids, 8)
    assert _ask(small_client, messages, 8) == want  # chunks of 8
    assert _ask(client, messages, 8) == want  # one chunk


def test_a_shared_prefix_is_reused_and_answers_as_without_it(servers):
    _, (small, client), model, tok = servers
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the lazy dog"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello world"}]
    before = scrape(small)
    assert _ask(client, first, 4) == greedy(model, tok, chat_ids(tok, first), 4)
    middle = scrape(small)
    assert _ask(client, second, 4) == greedy(model, tok, chat_ids(tok, second), 4)
    after = scrape(small)
    # the longest prefix cached before: `first`'s, or an earlier test's chat (SYSTEM, "hello")
    earlier = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    shared = max(_common(chat_ids(tok, m), chat_ids(tok, second)) for m in (first, earlier))
    assert after[HITS] == middle[HITS] + 1 and middle[HITS] >= before[HITS]
    # whole blocks of the shared prefix (the pool may have evicted the chain's later chunks)
    reused = after[HIT_TOKENS] - middle[HIT_TOKENS]
    assert 2 * CHUNK <= reused <= shared // BLOCK * BLOCK and reused % BLOCK == 0


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def roomy(servers):
    """Chunks of 32 tokens, blocks of 4 and a pool of 512 blocks: nothing is evicted."""
    (plain, _), _, model, _ = servers
    gb = 512 * BLOCK * kv_token_bytes(model) / (1 << 30)
    server = InProcess(plain.directory, cfg=ServeConfig(max_batch_tokens=32, kv_block_size=BLOCK,
                                                        kv_cache_gb=gb))  # fmt: skip
    client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
    try:
        yield server, client
    finally:
        server.close()


def test_a_prefix_ending_mid_chunk_or_shorter_than_one_is_reused_by_blocks(servers, roomy):
    """Two chats sharing a system turn (42 tokens: a chunk of 32 and 10; then 23, less than a
    chunk) and a follow-up turn of the second: each later one reuses exactly the whole blocks
    of its longest prefix in the cache (the follow-up: from a chunk that was itself computed
    from a cut entry and an extend), and answers as transformers' greedy."""
    _, _, model, tok = servers
    server, client = roomy
    sent: list[list[int]] = []

    def ask(messages: list[dict]) -> tuple[str, int, list[int]]:
        """The answer (checked), the prompt tokens it reused (checked: whole blocks of its
        longest prefix sent before), its longest prefix sent before, its prompt."""
        ids = chat_ids(tok, messages)
        shared = max((_common(ids, earlier) for earlier in sent), default=0)
        before = scrape(server)
        answer = _ask(client, messages, 4)
        after = scrape(server)
        assert answer == greedy(model, tok, ids, 4)
        reused = min(shared, len(ids) - 1) // BLOCK * BLOCK
        assert after[HIT_TOKENS] - before[HIT_TOKENS] == reused
        assert after[HITS] - before[HITS] == (reused > 0)
        sent.append(ids)
        return answer, reused, ids

    for system, longer in ((SYSTEM, True), ("a long context", False)):
        ask([{"role": "system", "content": system}, {"role": "user", "content": "the lazy dog"}])
        second = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
        answer, reused, ids = ask(second)
        assert (reused > 32 and reused % 32) if longer else 4 <= reused < 32
        turn = [{"role": "assistant", "content": answer}, {"role": "user", "content": "fine"}]
        _, again, _ = ask([*second, *turn])
        assert again >= (len(ids) - 1) // BLOCK * BLOCK  # the whole second prompt


def test_a_pool_that_cannot_hold_the_served_context_stops_start_up_with_the_numbers(servers):
    """The small server's pool (33 blocks of 4) holds a 128-token sequence: it serves 128
    tokens (--max-model-len), so a request beyond is a 400 for the context, never a wait for a
    pool it could not fit. Without --max-model-len (the model's 192) rank_loop refuses to
    start, with the numbers and both fixes (issue 48: no request without max_tokens can then be
    refused for the pool)."""
    import queue

    from ringattn.comm import resolve_group
    from ringattn.serve.worker import rank_loop, served_context

    _, (small, client), model, tok = servers
    before = scrape(small)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hello world", max_tokens=150)
    assert "maximum context length is 128 tokens" in err.value.body["message"]
    after = scrape(small)
    assert after['ringattn_requests_total{outcome="invalid"}'] == (
        before['ringattn_requests_total{outcome="invalid"}'] + 1
    )
    gb = (BLOCKS + 1) * BLOCK * kv_token_bytes(model) / (1 << 30)
    cfg = ServeConfig(max_batch_tokens=CHUNK, kv_block_size=BLOCK, kv_cache_gb=gb)
    numbers = (
        f"holds {BLOCKS + 1} blocks of {BLOCK} tokens per rank, but one sequence of the "
        r"served context \(192 tokens: 192 on the fullest of 1 ranks\) needs 49; "
    )
    with pytest.raises(ValueError, match=numbers + ".*--kv-cache-gb.*--max-model-len"):
        rank_loop(model, tok, resolve_group(None), "zigzag", queue.Queue(), None, cfg)
    with pytest.raises(ValueError, match="--max-model-len 193 exceeds the model's context of 192"):
        served_context(model, 193)


def test_requests_beyond_the_pool_wait_or_recompute_and_answer_as_alone(servers):
    _, (small, client), model, tok = servers
    prompts = [tok(p)["input_ids"] for p in ("the quick brown", "hello world, how", "a long")]
    # each needs up to 11 blocks (its prompt and 40 tokens): three cannot all hold theirs
    replies = concurrently(*[
        lambda p=p: client.completions.create(model="tiny", prompt=p, max_tokens=40)
        for p in prompts
    ])  # fmt: skip
    for p, reply in zip(prompts, replies):
        assert not isinstance(reply, Exception), reply
        assert reply.choices[0].text == greedy(model, tok, p, 40)
    after = scrape(small)
    assert after['ringattn_kv_blocks{state="used"}'] == 0


@pytest.mark.slow
def test_a_request_waits_for_blocks_behind_a_bounded_queue_then_answers(servers):
    (plain, _), _, model, tok = servers
    gb = 17 * BLOCK * kv_token_bytes(model) / (1 << 30)  # 16 blocks of 4, 1 for the decoded
    cfg = ServeConfig(
        kv_block_size=BLOCK, kv_cache_gb=gb, prefix_cache=False, max_model_len=16 * BLOCK
    )
    server = InProcess(plain.directory, cfg=cfg, max_queue=1)
    client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
    first = tok("the quick brown")["input_ids"]
    new = 16 * BLOCK - len(first)  # the whole pool, at the end
    second = chat_ids(tok, [{"role": "user", "content": SYSTEM[:40]}])
    assert 16 < len(second) and len(second) + 8 <= 16 * BLOCK  # > 4 blocks at once; it fits
    slow = server.model.register_forward_hook(lambda *_: time.sleep(0.05))
    try:
        threads = []
        long_reply = []
        threads.append(threading.Thread(target=lambda: long_reply.append(
            client.completions.create(model="tiny", prompt=first, max_tokens=new))))  # fmt: skip
        threads[0].start()
        deadline = time.monotonic() + 60
        while scrape(server)['ringattn_kv_blocks{state="used"}'] < 12:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        waiting_reply = []
        threads.append(threading.Thread(target=lambda: waiting_reply.append(
            client.completions.create(model="tiny", prompt=second, max_tokens=8))))  # fmt: skip
        threads[1].start()
        while scrape(server)["ringattn_waiting_requests"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as busy:  # the queue holds one: 503
            client.completions.create(model="tiny", prompt=first, max_tokens=2)
        assert busy.value.status_code == 503 and busy.value.response.headers["Retry-After"]
        for t in threads:
            t.join(120)
    finally:
        slow.remove()
        server.close()
    assert long_reply[0].choices[0].text == greedy(model, tok, first, new)
    assert waiting_reply[0].choices[0].text == greedy(model, tok, second, 8)


def test_a_cancelled_stream_frees_its_blocks(servers):
    _, (small, client), _, tok = servers
    ids = tok("the quick brown")["input_ids"]
    slow = small.model.register_forward_hook(lambda *_: time.sleep(0.01))
    key = 'ringattn_requests_total{outcome="cancelled"}'
    before = scrape(small)
    try:
        stream = client.completions.create(model="tiny", prompt=ids, max_tokens=60, stream=True)
        next(iter(stream))
        assert scrape(small)['ringattn_kv_blocks{state="used"}'] > 0
        stream.close()
        deadline = time.monotonic() + 60
        while (after := scrape(small))[key] == before[key] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        slow.remove()
    assert after[key] == before[key] + 1
    assert after['ringattn_kv_blocks{state="used"}'] == 0
    assert (
        after['ringattn_kv_blocks{state="free"}'] + after['ringattn_kv_blocks{state="cached"}']
        == BLOCKS + 1
    )
    assert torch.is_grad_enabled()  # the loop's no_grad stays in its thread


def test_a_step_that_fails_once_is_recomputed_and_one_that_fails_alone_gets_500(servers):
    (plain, client), _, model, tok = servers
    prompts = [tok(p)["input_ids"] for p in ("the quick brown", "hello world, how")]
    calls = [0]

    def oom_once(module, args, output):  # a documented torch hook: the 3rd forward fails once
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    def ask(p):
        return lambda: client.completions.create(model="tiny", prompt=p, max_tokens=12)

    handle = plain.model.register_forward_hook(oom_once)
    try:
        replies = concurrently(*[ask(p) for p in prompts])
    finally:
        handle.remove()
    assert calls[0] > 3
    for p, reply in zip(prompts, replies):
        assert reply.choices[0].text == greedy(model, tok, p, 12)  # nothing sent twice

    poison = tok.convert_tokens_to_ids("<|im_start|>")  # fails every forward it is in
    assert poison not in prompts[1] and poison != tok.pad_token_id  # (padding rows: token 0)

    def refuse(module, args, kwargs):
        if (kwargs["input_ids"] == poison).any():
            raise torch.OutOfMemoryError("simulated: this request's own failure")

    before = scrape(plain)
    handle = plain.model.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        bad, good = concurrently(ask([poison, *prompts[0]]), ask(prompts[1]))
    finally:
        handle.remove()
    assert isinstance(bad, openai.InternalServerError) and "keeps serving" in bad.body["message"]
    assert good.choices[0].text == greedy(model, tok, prompts[1], 12)
    after = scrape(plain)
    key = 'ringattn_requests_total{outcome="failed"}'
    assert after[key] == before[key] + 1 and after['ringattn_kv_blocks{state="used"}'] == 0


@pytest.mark.slow
def test_two_ranks_run_the_steps_chunked_and_shared_as_each_alone(pools):
    """rank_loop on two ranks (workers_serve.stepped): chunks of 8, a pool of 40 blocks of 4
    per rank, zigzag. The second prompt shares 28 tokens with the first (3 chunks and a block:
    it adopts a cut chunk); the third extends the second (36 tokens: whole chunks, one of them
    computed from a cut entry and an extend, then a block of a chunk kept in the same step);
    the fourth shares nothing. Every text is transformers' greedy. Again without the prefix
    cache in a pool of 8 blocks, where sequences are preempted and recompute."""
    from workers_serve import tiny_model

    tok, model = tiny_model()
    prompts = [SYSTEM + " hello world", SYSTEM + " the lazy dog",
               SYSTEM + " the lazy dog jumps over the fox", "how are you today?"]  # fmt: skip
    ids = [tok(p)["input_ids"] for p in prompts]
    assert _common(ids[0], ids[1]) == 28 and _common(ids[1], ids[2]) == len(ids[1]) == 36
    gb = 40 * BLOCK * kv_token_bytes(model) / (1 << 30)
    cfg = {"max_batch_tokens": CHUNK, "kv_block_size": BLOCK, "kv_cache_gb": gb}
    results = pools(2).run("workers_serve:stepped", prompts, 12, cfg)
    texts, _, (hits, _), _ = results[0]
    assert [r[1] for r in results] == [len(prompts)] * 2  # both ranks ran every request
    assert texts == [greedy(model, tok, p, 12) for p in ids]
    assert hits == 28 + 36  # whole blocks of each one's longest cached prefix
    small = {**cfg, "kv_cache_gb": gb * 9 / 40, "prefix_cache": False, "max_model_len": 60}
    rerun = pools(2).run("workers_serve:stepped", prompts, 12, small)[0]
    again, served, (hits, preempted), _ = rerun
    assert (again, served, hits) == (texts, 4, 0) and preempted > 0


def test_a_vision_language_model_is_refused_before_any_rank_communicates(tmp_path):
    import serve_model
    import workers_hf_vlm
    from ringattn.serve.worker import serve_worker

    workers_hf_vlm.build("gemma3").save_pretrained(tmp_path)
    serve_model.tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vision-language model .*chunks"):
        serve_worker(ServeConfig(hf=str(tmp_path), port=0))


def test_a_short_prompt_starts_beside_a_long_prefill_and_a_longer_one_waits():
    """Rank 0's plans (W = 1, chunks of 16: a short lane of 16 / SHORT_LANE = 4 tokens): while
    a 48-token prompt prefills a chunk per step, a 4-token prompt arriving meanwhile goes in
    whole at the next step beside the long one's chunk; a 5-token one waits for the budget."""
    import queue

    import serve_model
    from ringattn.serve.pool import BlockPool
    from ringattn.serve.scheduler import SHORT_LANE, Scheduler
    from ringattn.serve.shares import Shares

    assert 16 // SHORT_LANE == 4
    tok = serve_model.tokenizer()
    s = Scheduler(queue.Queue(), threading.current_thread(), tok, [], BlockPool(64, 4),
                  Shares("zigzag", 1), 16, 8, prefix_cache=False,
                  make_sink=lambda job: lambda *event: None)  # fmt: skip

    def step() -> tuple[list, list]:
        (plan,) = serve_model.run_plans(s, len(tok), most=1)
        return plan["decode"], [(seq, len(ids)) for seq, ids, _ in plan["chunks"]]

    s.jobs.put(serve_model.PlannedJob(list(range(20, 68))))  # 3 chunks
    assert step() == ([], [(0, 16)])
    s.jobs.put(serve_model.PlannedJob([5, 6, 7, 8]))
    s.jobs.put(serve_model.PlannedJob([5, 6, 7, 8, 9]))
    assert step() == ([], [(0, 16), (1, 4)])  # the lane: the 4-token prompt, whole
    assert step() == ([[1, 0]], [(0, 16)])  # the 5-token one exceeds the lane: it waits
    assert step() == ([[0, 0]], [(2, 5)])  # the long one is in (and the short one done)
