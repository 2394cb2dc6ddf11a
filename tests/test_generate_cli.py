"""`ringattn generate --hf DIR` with --tp, --chat, --offload-kv and sampling.

A tiny random Llama saved in tmp_path (test_generate_hf.py's); the ids must be transformers'
own greedy `model.generate` on this process: with --nproc 2 --tp 2, with
--offload-kv, and with --chat (the prompt through the tokenizer's chat template).
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.cli.main import main
from test_generate_hf import _reference, _save_llama, _tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip


def _ids(out: str) -> list[int]:
    return [int(t) for t in out.strip().splitlines()[-1].split(":")[1].split()]


@pytest.mark.slow
def test_cp_times_tp_and_offload_stream_model_generate(tmp_path, capfd):
    _save_llama(tmp_path / "llama", vocab_size=100)
    config = transformers.LlamaConfig.from_pretrained(tmp_path / "llama")
    config.num_key_value_heads = 2  # tp 2 splits 2 query and 2 K/V heads
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "llama")
    prompt = "a prompt of 21 bytes."
    want = _reference(model, [b % 100 for b in prompt.encode()], 6)
    base = ["generate", "--hf", str(tmp_path / "llama"), "--prompt", prompt, "--max-new-tokens",
            "6"]  # fmt: skip
    assert main([*base, "--nproc", "2", "--tp", "2"]) == 0
    out, err = capfd.readouterr()
    assert _ids(out) == want and "on cp 1 x tp 2" in err, err
    per_rank = re.search(r"KV cache per rank: ([\d., ]+) MB", err)[1].split(", ")
    # 21 + 5 tokens, 2 layers x (k, v) x 2 heads x 8 dims x 4 bytes: one K/V head per tp rank
    assert [float(x) for x in per_rank] == [pytest.approx(26 * 2 * 2 * 8 * 4 / 2**20, abs=1e-3)] * 2
    assert main([*base, "--offload-kv"]) == 0
    out, err = capfd.readouterr()
    assert _ids(out) == want and "(host memory: --offload-kv)" in err
    # prefill progress: one line, updated in place
    assert err.count("[prefill]") == 2 and "\r[prefill] layer 2/2\n" in err


@pytest.mark.slow
def test_chat_wraps_the_prompt_in_the_template_and_sampling_runs(tmp_path, capfd):
    tokenizer = _tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = _save_llama(tmp_path / "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "llama")
    text = "hello there"
    argv = ["generate", "--hf", str(tmp_path / "llama"), "--prompt", text, "--chat",
            "--max-new-tokens", "4"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    chat = "<s>user: hello there.assistant: "
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    want = _reference(model, ids, 4)
    assert out.strip().splitlines()[-1] == chat + "|" + tokenizer.decode(want), out
    assert "--chat" in err
    sampled = ["generate", "--hf", str(tmp_path / "llama"), "--prompt", text,
               "--max-new-tokens", "5", "--temperature", "1.0", "--seed", "9"]  # fmt: skip
    assert main([*sampled, "--nproc", "2"]) == 0
    first = capfd.readouterr().out.strip().splitlines()[-1]
    assert main([*sampled, "--nproc", "1"]) == 0  # the same seed, the same text on one process
    assert capfd.readouterr().out.strip().splitlines()[-1] == first


def test_single_node_launches_bind_nccl_and_gloo_to_loopback(monkeypatch, tmp_path):
    import os
    import sys

    from ringattn.runtime import launch

    for name in launch._SAVED_ENV:
        monkeypatch.setenv(name, "x")  # recorded: restored after the test
        monkeypatch.delenv(name)
    launch._child_env(2, str(tmp_path))
    if sys.platform == "linux" and os.path.exists("/sys/class/net/lo"):
        assert os.environ["NCCL_SOCKET_IFNAME"] == "lo" == os.environ["GLOO_SOCKET_IFNAME"]
