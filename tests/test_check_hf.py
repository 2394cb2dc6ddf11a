"""`ringattn check --hf`: a model family's config at a tiny width, cp 1 against cp W, one line per
case and the exit code: exact (Llama, 2 launched ranks, every layout), refused (Llama 4's chunked
attention, which parallelize refuses; in this process as a 1-rank torchrun world, no spawn) and
WRONG (a fault injected on rank 1 of 2 through the documented test seam, --inject-fault). About
25 s on 2 cores. Also: the tiny config keeps the layer pattern, refusals are ringattn's own
errors, and bad paths exit 2 before anything is built.
"""

from __future__ import annotations

import json
import re
import socket

import pytest

pytest.importorskip("transformers")

import torch.distributed as dist
import transformers as tf

from ringattn.cli import check_hf
from ringattn.cli.main import main
from ringattn.testing import tiny_hf

ROW = re.compile(r"^cp (\d+)\s+(\w+)\s+(\w+)\s+(exact|refused|WRONG|CRASH)\b(.*)$")


def _rows(out: str) -> list[tuple[str, ...]]:
    return [m.groups() for line in out.splitlines() if (m := ROW.match(line))]


def _save(config, directory) -> str:
    config.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def llama_dir(tmp_path):
    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    config = tf.LlamaConfig(vocab_size=1000, num_attention_heads=8, num_key_value_heads=2, **sizes)
    return _save(config, tmp_path / "llama")


def _as_torchrun_rank_zero(monkeypatch) -> None:
    """Run in this process as rank 0 of a 1-rank torchrun world (cp 1 under ringattn)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RINGATTN_LAUNCHED", raising=False)


def _main_in_process(argv: list[str]) -> int:
    try:
        return main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_llama_is_exact_in_every_layout(llama_dir, capfd):
    code = main(["check", "--hf", llama_dir, "--nproc", "2"])
    out = capfd.readouterr().out
    rows = _rows(out)
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("2", layout, "exact") for layout in ("contiguous", "zigzag", "striped")
    ], out
    assert "same as the documents alone" in out  # Llama's own packed forward keeps them apart
    assert "3 exact, 0 refused, 0 wrong, 0 crashed" in out
    assert code == 0


@pytest.mark.slow
def test_a_hybrid_is_exact_in_every_layout(tmp_path, capfd):
    """Nemotron-H (Mamba2 by groups of heads, attention, MLP blocks), the user's config at a tiny
    width: its mixers exact under CP, not just its attention."""
    config = tf.NemotronHConfig(hybrid_override_pattern="M*-M", num_hidden_layers=4)
    code = main(["check", "--hf", _save(config, tmp_path / "nemotron"), "--nproc", "2"])
    out = capfd.readouterr().out
    assert [(r[0], r[1], r[3]) for r in _rows(out)] == [
        ("2", layout, "exact") for layout in ("contiguous", "zigzag", "striped")
    ], out
    assert code == 0


def test_refused_model_is_reported_not_failed(tmp_path, monkeypatch, capfd):
    path = _save(tf.AutoConfig.for_model("llama4_text"), tmp_path / "llama4")
    _as_torchrun_rank_zero(monkeypatch)
    code = _main_in_process(["check", "--hf", path, "--layouts", "zigzag,striped"])
    out = capfd.readouterr().out
    rows = _rows(out)
    assert [(r[0], r[1], r[3]) for r in rows] == [("1", "zigzag", "refused"),
                                                  ("1", "striped", "refused")], out  # fmt: skip
    assert all("attention_chunk_size" in r[4] for r in rows)  # ringattn's reason, on the line
    assert "0 exact, 2 refused, 0 wrong, 0 crashed" in out
    assert code == 0


@pytest.mark.slow
def test_fault_on_one_rank_is_wrong_and_exits_1(llama_dir, capfd):
    code = main(["check", "--hf", llama_dir, "--nproc", "2", "--layouts", "zigzag",
                 "--inject-fault", "1"])  # fmt: skip
    out = capfd.readouterr().out
    rows = _rows(out)
    assert [(r[0], r[1], r[3]) for r in rows] == [("2", "zigzag", "WRONG")], out
    loss_error = float(re.search(r"loss (\S+)", rows[0][4]).group(1))
    assert loss_error > 1e-5  # logits scaled by 1 + 1e-3 move the loss beyond the gate
    assert "0 exact, 0 refused, 1 wrong, 0 crashed" in out
    assert code == 1


def test_refusals_are_ringattn_own_errors():
    """A ValueError raised in ringattn's code is a refusal; one raised elsewhere (transformers,
    torch, here) is a crash."""
    import ringattn.hf

    with pytest.raises(ValueError) as ours:
        ringattn.hf.shard_batch({"input_ids": None, "pixels": None})
    with pytest.raises(ValueError) as theirs:
        int("not a number")
    assert check_hf._raised_by_ringattn(ours.value)
    assert not check_hf._raised_by_ringattn(theirs.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [([], "no such directory or file"), (["--layouts", "zig"], "unknown layout 'zig'")],
)
def test_bad_input_exits_2_before_building(tmp_path, capsys, extra, message):
    path = tmp_path / "missing" if not extra else _save(tf.LlamaConfig(), tmp_path / "llama")
    with pytest.raises(SystemExit) as info:
        main(["check", "--hf", str(path), *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model_type", "overrides", "key", "expected"),
    [
        ("qwen3_next", {}, "layer_types",
         ["linear_attention"] * 3 + ["full_attention"]),
        ("lfm2", {"layer_types": None, "full_attn_idxs": [2, 5, 8], "num_hidden_layers": 10},
         "full_attn_idxs", [2]),
        # 10 layers to show both kinds: over 8, so one of each instead
        ("bamba", {"attn_layer_indices": [9, 18, 27]}, "attn_layer_indices", [1]),
        ("jamba", {}, "num_hidden_layers", 5),  # attention every 8th layer from the 4th
        ("llama", {"num_hidden_layers": 30}, "num_hidden_layers", 2),
        ("mistral", {}, "sliding_window", tiny_hf.WINDOW),  # shorter than the documents
    ],
)  # fmt: skip
def test_tiny_config_keeps_the_layer_pattern(model_type, overrides, key, expected):
    tiny = tiny_hf.tiny_config(tf.AutoConfig.for_model(model_type, **overrides))
    assert getattr(tiny, key) == expected
    assert tiny.hidden_size == tiny_hf.HIDDEN and tiny.vocab_size == tiny_hf.VOCAB
    assert tiny.initializer_range == tiny_hf.INIT_RANGE
    json.dumps(tiny.to_dict())  # a plain config: it saves and loads like any other


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("gpt2", {"n_embd": tiny_hf.HIDDEN, "n_layer": 2, "n_head": tiny_hf.HEADS}),
        ("bart", {"d_model": tiny_hf.HIDDEN, "encoder_layers": 2, "decoder_layers": 2,
                  "encoder_ffn_dim": tiny_hf.FFN}),
        ("xlnet", {"d_model": tiny_hf.HIDDEN, "d_head": tiny_hf.HEAD_DIM, "n_layer": 2,
                   "d_inner": tiny_hf.FFN}),  # its own check: d_head = d_model / n_head
        ("gemma4_text", {"num_hidden_layers": 6}),  # its per_layer_config keyed "05", "11"...
        ("hunyuan_v1_dense", {"head_dim": tiny_hf.HEAD_DIM}),  # None by default
        # MLA's widths scaled together: qk = nope + rope unlike v as in DeepSeek-V3 (192, 128),
        # equal to v as in GLM-4.7-Flash (256, 256)
        ("deepseek_v3", {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}),
        ("glm4_moe_lite", {"qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 32}),
        ("mimo_v2_flash", {"head_dim": 16, "v_head_dim": 11}),  # 192 vs 128, scaled together
    ],
)  # fmt: skip
def test_tiny_config_shrinks_the_older_field_names(model_type, expected):
    """The names the family survey shrinks too (one shrinker for both): widths that do not say
    _size or _dim, an encoder's layer count, layer-keyed dicts; the tiny config then builds."""
    tiny = tiny_hf.tiny_config(tf.AutoConfig.for_model(model_type))
    assert {key: getattr(tiny, key) for key in expected} == expected
    tiny_hf.build(tiny)
