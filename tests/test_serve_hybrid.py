"""`ringattn serve --nproc 2` of a hybrid model (Nemotron-H: Mamba2, attention and MLP blocks).

Prompts go in chunks of 8 tokens (each chunk continues the sequence's Mamba2 states), concurrent
requests share steps (their decode tokens beside other prompts' chunks), and every answer equals
transformers' greedy `model.generate` of that prompt alone. Chats sharing a system prompt
start from its cached chunks: their K/V blocks and a snapshot of every Mamba2 layer's states at
the chunk's end (prefix reuse for hybrids), and still answer as alone. Echo and logprobs with
n = 2 equal one process's log_softmax.
"""

from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_model import Server, save_chat_model
from test_serve_openai import check_completion
from test_serve_robust import scrape

PROMPTS = ["hello world", "the lazy dog jumps over", "ring attention passes keys"]


@pytest.mark.slow
def test_a_hybrid_serves_each_answer_as_alone(tmp_path):
    directory = tmp_path / "tiny"
    model, tok = save_chat_model(directory, family="nemotron_h")
    server = Server(directory, 2, "--model-name", "tiny", "--max-batch-tokens", "8",
                    "--kv-block-size", "4")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
        answers: dict[str, str] = {}

        def ask(prompt: str) -> None:
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0,
            )  # fmt: skip
            answers[prompt] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        want = {}
        for prompt in PROMPTS:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
            )
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            want[prompt] = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert answers == want
        # chats sharing a system prompt: the first keeps its chunks (K/V and states), the
        # others adopt them whole and compute from the last one's end
        system = {"role": "system", "content": "be brief and answer with the lazy dog"}
        chats = [[system, {"role": "user", "content": p}] for p in PROMPTS]
        before = scrape(server)
        shared = {}
        for chat in chats:
            reply = client.chat.completions.create(model="tiny", messages=chat, max_tokens=6,
                                                   temperature=0)  # fmt: skip
            shared[chat[1]["content"]] = reply.choices[0].message.content
        after = scrape(server)
        for chat in chats:
            ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                                 eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
            assert shared[chat[1]["content"]] == tok.decode(out[0, len(ids) :],
                                                            skip_special_tokens=True)  # fmt: skip
        hits = (
            after["ringattn_prefix_cache_hits_total"] - before["ringattn_prefix_cache_hits_total"]
        )
        reused = (after["ringattn_prefix_cache_hit_tokens_total"]
                  - before["ringattn_prefix_cache_hit_tokens_total"])  # fmt: skip
        assert hits >= 2 and reused >= 2 * 8, (hits, reused)  # whole chunks of 8
        assert after["ringattn_kv_state_snapshot_bytes"] > 0
        # prompt and token logprobs through the chunks' Mamba2 states, n = 2 without prefix reuse
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        scored = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=2,
                                           max_tokens=2, temperature=0, n=2)  # fmt: skip
        assert [c.index for c in scored.choices] == list(range(2 * len(PROMPTS)))
        for i, choice in enumerate(scored.choices):
            assert check_completion(model, tok, prompts[i // 2], choice, 2) == 2
    finally:
        server.stop()


# every family whose decoding the engine runs (test_hf_hybrid.DECODED)
DECODED = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "nemotron_h",
           "falcon_h1", "granitemoehybrid", "bamba", "mamba2", "jamba", "mamba", "falcon_mamba",
           "lfm2"]  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "world_size"),
    [(arch, 2) for arch in DECODED]
    + [("nemotron_h", 1), ("qwen3_5_text", 3), ("lfm2", 4), ("jamba", 4)],
)
def test_a_hybrid_adopting_whole_entries_equals_a_plain_prefill(pools, arch, world_size):
    """A sequence that adopts cached chunks of a hybrid (their K/V blocks and the snapshot of
    every mixer's states at their end) and computes the rest gives a plain prefill's logits,
    at each chunk boundary; adopting the K/V without the states would not
    (workers_serve.hybrid_adopted)."""
    for rank in pools(world_size).run("workers_serve:hybrid_adopted", arch, 8, [8, 16]):
        for cut, error, stateless in rank:
            assert error < 1e-4, (cut, error)
            assert stateless > 100 * max(error, 1e-6), (cut, stateless)
