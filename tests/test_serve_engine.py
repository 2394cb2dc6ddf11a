"""`ringattn serve`'s engine (issue 32, items 1-4 and 7): continuous batching, chunked prefill,
the KV block pool and prefix reuse, asked through the official `openai` client.

The pool's accounting and the chained hashes are checked on their own first (no model). Then
two in-process servers (serve_model.InProcess) over the tiny chat model: `plain` with the
defaults (prompts in one chunk) and `small` with chunks of 8 tokens and a pool of a few blocks
of 4 tokens, where long prompts prefill in chunks, prefixes are reused, and requests wait for
blocks or are preempted. Every answer must equal transformers' greedy `model.generate` of that
prompt alone (no chunks, no cache, no batch).
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
from ringattn.serve.pool import BlockPool, Shares, chunk_hashes
from ringattn.serve.worker import kv_token_bytes
from serve_model import InProcess, served_tiny
from test_serve_robust import chat_ids, concurrently, greedy, scrape

CHUNK, BLOCK, BLOCKS = 8, 4, 32  # the small server: 8-token chunks, 32 blocks of 4 tokens
SYSTEM = "ring attention passes keys and values around a ring of processes"  # 4 chunks


def test_chunk_hashes_chain_and_cover_whole_chunks_only():
    a = chunk_hashes(list(range(20)), 8)
    b = chunk_hashes([*range(16), 99, 98], 8)
    c = chunk_hashes([1, *range(1, 20)], 8)
    assert len(a) == 2 and a == b  # the partial last chunk has no hash
    assert c[0] != a[0] and c[1] != a[1]  # chained: chunk 1's hash covers chunk 0 too
    assert chunk_hashes(list(range(7)), 8) == []


def test_shares_count_the_fullest_ranks_rows():
    shares = Shares("zigzag", 2)
    assert shares.chunk_rows(8) == 4 and shares.chunk_rows(5) == 3  # pieces of ceil(5 / 4) = 2
    assert shares.tokens(21, 8, 3) == 4 + 4 + 3 + 2  # two chunks, a chunk of 5, 3 decoded
    assert Shares("zigzag", 1).tokens(21, 8, 3) == 24


def test_pool_grows_by_blocks_evicts_cached_prefixes_and_refuses_beyond():
    pool = BlockPool(6, 4)
    assert pool.grow(0, 9) and pool.held == {0: 3} and pool.free == 3
    assert pool.keep("h0", 4) and pool.keep("h1", 4) and pool.free == 1
    assert not pool.keep("h2", 8)  # a prefix never evicts another
    assert pool.lookup(["h0", "h1", "hx"]) == ["h0", "h1"] and pool.lookup(["hx", "h1"]) == []
    assert pool.grow(1, 8) and pool.evicted == ["h0"]  # the least recently used went
    assert not pool.grow(1, 9, keep=("h1",))  # h1 is pinned: no room, nothing changed
    assert pool.held[1] == 2 and list(pool.cached) == ["h1"]
    assert pool.grow(1, 9) and pool.free == 0 and pool.evicted == ["h0", "h1"]
    pool.release(0)
    assert pool.free == 3 and pool.used == 3
    chain = BlockPool(4, 4)
    assert chain.keep("c0", 4, 0) and chain.keep("c1", 4, 1) and chain.keep("c2", 4, 2)
    chain.lookup(["c0", "c1", "c2"])
    assert chain.grow(0, 8) and chain.evicted == ["c2"]  # a chain loses its last chunk first


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with served_tiny(tmp_path_factory) as (plain, client, model, tok, directory):
        plain.directory = directory
        gb = BLOCKS * BLOCK * kv_token_bytes(model) / (1 << 30)
        cfg = ServeConfig(max_batch_tokens=CHUNK, kv_block_size=BLOCK, kv_cache_gb=gb)
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
    hits, reused = "ringattn_prefix_cache_hits_total", "ringattn_prefix_cache_hit_tokens_total"
    shared = len(chat_ids(tok, [first[0]]))  # the system turn's tokens: whole chunks of them
    assert after[hits] == middle[hits] + 1 and middle[hits] >= before[hits]
    # whole chunks of the system turn (the pool may have evicted the chain's later ones)
    assert 2 * CHUNK <= after[reused] - middle[reused] <= shared // CHUNK * CHUNK


def test_a_request_too_large_for_the_pool_is_refused_with_the_numbers(servers):
    _, (small, client), _, _ = servers
    before = scrape(small)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hello world", max_tokens=150)
    message = err.value.body["message"]
    assert f"the pool holds {BLOCKS} blocks ({BLOCKS * BLOCK} tokens) per rank" in message
    assert "--kv-cache-gb" in message and "150 completion" in message
    after = scrape(small)
    assert after['ringattn_requests_total{outcome="invalid"}'] == (
        before['ringattn_requests_total{outcome="invalid"}'] + 1
    )


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


def test_a_request_waits_for_blocks_behind_a_bounded_queue_then_answers(servers):
    (plain, _), _, model, tok = servers
    gb = 16 * BLOCK * kv_token_bytes(model) / (1 << 30)  # 16 blocks of 4 tokens
    cfg = ServeConfig(kv_block_size=BLOCK, kv_cache_gb=gb, prefix_cache=False)
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
        == BLOCKS
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


def test_two_ranks_run_the_steps_chunked_and_shared_as_each_alone(pools):
    """rank_loop on two ranks (workers_serve.stepped): chunks of 8, a pool of 40 blocks of 4
    per rank, two prompts sharing a prefix and one not; every text is transformers' greedy.
    Again without the prefix cache in a pool of 8 blocks, where sequences are preempted and
    recompute."""
    from workers_serve import tiny_model

    tok, model = tiny_model()
    prompts = [SYSTEM + " hello world", SYSTEM + " the lazy dog", "how are you today?"]
    gb = 40 * BLOCK * kv_token_bytes(model) / (1 << 30)
    cfg = {"max_batch_tokens": CHUNK, "kv_block_size": BLOCK, "kv_cache_gb": gb}
    results = pools(2).run("workers_serve:stepped", prompts, 12, cfg)
    texts, _, (hits, _), _ = results[0]
    assert [r[1] for r in results] == [len(prompts)] * 2  # both ranks ran every request
    assert texts == [greedy(model, tok, tok(p)["input_ids"], 12) for p in prompts]
    shared = len(tok(SYSTEM)["input_ids"])
    assert 2 * CHUNK <= hits <= shared  # the second started from the first one's chunks
    small = {**cfg, "kv_cache_gb": gb / 5, "prefix_cache": False}
    rerun = pools(2).run("workers_serve:stepped", prompts, 12, small)[0]
    again, served, (hits, preempted), _ = rerun
    assert (again, served, hits) == (texts, 3, 0) and preempted > 0


def test_a_vision_language_model_is_refused_before_any_rank_communicates(tmp_path):
    import serve_model
    import workers_hf_vlm
    from ringattn.serve.worker import serve_worker

    workers_hf_vlm.build("gemma3").save_pretrained(tmp_path)
    serve_model.tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vision-language model .*chunks"):
        serve_worker(ServeConfig(hf=str(tmp_path), port=0))
