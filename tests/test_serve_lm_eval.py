"""lm-evaluation-harness scores a model behind `ringattn serve --nproc 2` as its `hf` backend does.

Two small local tasks (JSON files and task YAMLs written here, read with `datasets`' json
builder: nothing is downloaded), on the tiny chat model of serve_model.py:
  - tiny_mc, `multiple_choice`: through `local-completions` with token-id requests, several
    prompts per request (lm-eval's loglikelihood shape: echo, logprobs 1, max_tokens 1);
  - tiny_gen, `generate_until`: through `local-completions` (token ids) and, with the chat
    template, through `local-chat-completions`.
Then `local-completions` once more with no tokenizer at all: lm-eval finds the server's
/tokenizer_info and /tokenize (vLLM's shapes) and tokenizes through them ("remote"), with the
model named by the directory's basename, which lm-eval could not load a tokenizer from.
The server (cp 2, prompts in chunks of 8 tokens) must give the same scores as lm-eval's `hf`
backend on the same weights, every continuation's loglikelihood within 1e-3 and the same
is_greedy, and every generation the same text. The model is named as the server was launched
(--hf's path: vLLM's convention). lm-eval is a test dependency (scripts/setup.sh), not one of
ringattn: without it this file skips.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models (its `api` extra)

from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from serve_model import Server, save_chat_model

DOCS = [
    {"question": "the quick brown", "choices": [" fox", " dog", " ring"], "answer": 0},
    {"question": "ring attention passes", "choices": [" keys", " hello"], "answer": 1},
    {"question": "hello world, how", "choices": [" are you", " fine", " lazy dog"], "answer": 0},
    {"question": "a long context needs", "choices": [" its attention", " a fox"], "answer": 0},
    {"question": "the lazy", "choices": [" dog", " ranks", " world"], "answer": 2},
]
MC = """task: tiny_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
GEN = """task: tiny_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 8, do_sample: false, temperature: 0}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
"""


def tasks(directory) -> TaskManager:
    directory.mkdir()
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, text in (("tiny_mc", MC), ("tiny_gen", GEN)):
        (directory / f"{name}.yaml").write_text(text.format(data=data, cache=directory / "cache"))
    return TaskManager(include_path=str(directory))


def evaluate(manager: TaskManager, model, args: dict, names: list[str], chat: bool) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=args, tasks=names, log_samples=True,
                                   task_manager=manager, apply_chat_template=chat)  # fmt: skip


def check_same(served: dict, reference: dict, name: str) -> None:
    """Same scores, loglikelihoods within 1e-3 with the same is_greedy, the same generations."""
    for key, value in reference["results"][name].items():
        if key.endswith(",none") and "stderr" not in key:
            assert served["results"][name][key] == value, (name, key)
    for ours, theirs in zip(served["samples"][name], reference["samples"][name], strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        for got, want in zip(ours["resps"], theirs["resps"], strict=True):
            if isinstance(want[0], tuple):  # (loglikelihood, is_greedy)
                assert abs(got[0][0] - want[0][0]) < 1e-3 and got[0][1] == want[0][1], name
            else:
                assert got == want, name


@pytest.mark.slow
def test_lm_eval_scores_the_server_as_its_hf_backend(tmp_path):
    directory = tmp_path / "tiny"
    save_chat_model(directory)
    manager = tasks(tmp_path / "tasks")
    hf = {"pretrained": str(directory), "dtype": "float32", "device": "cpu"}
    plain = evaluate(manager, "hf", hf, ["tiny_mc", "tiny_gen"], chat=False)
    chat = evaluate(manager, "hf", hf, ["tiny_gen"], chat=True)
    server = Server(directory, 2, "--max-batch-tokens", "8", "--kv-block-size", "4")
    try:
        common = {"model": str(directory), "max_retries": 1, "num_concurrent": 2}
        completions = {**common, "base_url": f"{server.url}/completions", "batch_size": 4,
                       "tokenizer_backend": "huggingface", "tokenizer": str(directory),
                       "tokenized_requests": True}  # fmt: skip
        served = evaluate(manager, "local-completions", completions, ["tiny_mc", "tiny_gen"],
                          chat=False)  # fmt: skip
        chatted = evaluate(manager, "local-chat-completions",
                           {**common, "base_url": f"{server.url}/chat/completions"},
                           ["tiny_gen"], chat=True)  # fmt: skip
        remote = get_model("local-completions")(
            **{**common, "model": directory.name, "base_url": f"{server.url}/completions",
               "batch_size": 4})  # fmt: skip
        assert remote.tokenizer_backend == "remote"  # auto-detected: no local tokenizer
        remotely = evaluate(manager, remote, {}, ["tiny_mc", "tiny_gen"], chat=False)
    finally:
        server.stop()
    check_same(served, plain, "tiny_mc")
    check_same(served, plain, "tiny_gen")
    check_same(remotely, plain, "tiny_mc")
    check_same(remotely, plain, "tiny_gen")
    check_same(chatted, chat, "tiny_gen")
    assert len(plain["samples"]["tiny_mc"]) == len(DOCS)
