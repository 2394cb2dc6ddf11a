"""`ringattn serve --nproc 2` of a hybrid model (Nemotron-H: Mamba2, attention and MLP blocks).

Prompts go in chunks of 8 tokens (each chunk continues the sequence's Mamba2 states), concurrent
requests share steps (their decode tokens beside other prompts' chunks), and every answer equals
transformers' greedy `model.generate` of that prompt alone. Prefix reuse is off for such a model,
and the server says so. Echo and logprobs with n = 2 equal one process's log_softmax.
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

PROMPTS = ["hello world", "the lazy dog jumps over", "ring attention passes keys"]


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
        assert "prefix reuse is off: NemotronHForCausalLM has recurrent" in server.log()
        # prompt and token logprobs through the chunks' Mamba2 states, n = 2 without prefix reuse
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        scored = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=2,
                                           max_tokens=2, temperature=0, n=2)  # fmt: skip
        assert [c.index for c in scored.choices] == list(range(2 * len(PROMPTS)))
        for i, choice in enumerate(scored.choices):
            assert check_completion(model, tok, prompts[i // 2], choice, 2) == 2
    finally:
        server.stop()
