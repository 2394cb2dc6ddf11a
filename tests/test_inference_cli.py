"""`ringattn generate --nproc W`: launched ranks, a sharded cache, streamed tokens, the figures.

One launch (W = 2 processes through ringattn.runtime.launch) from a checkpoint trained here for
two steps; the streamed tokens must equal the decoder without a cache on one process.
"""

from __future__ import annotations

import re

import pytest

from ringattn.cli.main import main
from ringattn.inference.generate import generate, load_model
from ringattn.train.data import render


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate")
    argv = ["train", "--nproc", "1", "--model", "tiny", "--dim", "32", "--seq-len", "64",
            "--keys", "3", "--copies", "2", "--steps", "2", "--warmup", "1", "--quiet",
            "--out-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out / "checkpoints"


@pytest.mark.slow
def test_generate_on_two_ranks_streams_the_single_process_tokens(checkpoint, tmp_path, capfd):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes(b"a prompt of 29 bytes, not 2W")
    argv = ["generate", "--nproc", "2", "--checkpoint", str(checkpoint), "--prompt-file",
            str(prompt_file), "--max-new-tokens", "6", "--merge", "allreduce"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    model, _ = load_model(str(checkpoint))
    want = generate(model, list(prompt_file.read_bytes()), 6)
    assert out.strip().splitlines()[-1] == "a prompt of 29 bytes, not 2W|" + render(want)
    assert "[prefill] layer 2/2" in err
    figures = re.search(
        r"time to first token ([\d.]+) ms .* decode ([\d.]+) tokens/s; KV cache per rank: "
        r"([\d.]+), ([\d.]+) MB", err)  # fmt: skip
    assert figures, err
    # 29 prompt + 5 fed tokens, 2 layers x (k, v) x 2 heads x 8 dims x 4 bytes, split over 2
    total_mb = 34 * 2 * 2 * 2 * 8 * 4 / 2**20
    assert float(figures[3]) + float(figures[4]) == pytest.approx(total_mb, abs=2e-3)


@pytest.mark.slow
def test_generate_offload_kv_streams_the_same_tokens(checkpoint, capfd):
    """--offload-kv (host-resident shards, the next layer prefetched; CPU: plain copies)."""
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "offloaded prompt",
            "--max-new-tokens", "5", "--offload-kv"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    model, _ = load_model(str(checkpoint))
    want = generate(model, list(b"offloaded prompt"), 5)
    assert out.strip().splitlines()[-1] == "offloaded prompt|" + render(want)
    assert "(host memory: --offload-kv)" in err


@pytest.mark.slow
def test_generate_rejects_bad_flags(checkpoint, tmp_path, capfd):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    for argv, needle in [
        (["--prompt-file", str(empty)], "the prompt is empty"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", "x", "--prompt-file", str(empty)], "not both"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["generate", "--checkpoint", str(checkpoint), *argv])
        assert info.value.code == 2
        assert needle in capfd.readouterr().err
