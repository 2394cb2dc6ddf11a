"""`ringattn plan` for hybrid models: recurrent mixer layers (gated DeltaNet, Mamba2/SSD, Mamba1,
short convolution) priced beside attention: FLOPs against hand counts, CP traffic per scheme
(flat in S for state passing, linear in S and equal to the library's own counts for gather and
heads), `auto` picking what the library runs, the HF config families' layer patterns, and
unknown layer kinds refused. Configs are written here (no download).
"""

from __future__ import annotations

import json

import pytest

from ringattn.cli.main import main
from ringattn.planner.cost import PlanSpec, step_time
from ringattn.planner.hardware import get_hardware
from ringattn.planner.memory import memory_bytes
from ringattn.planner.models import MixerShape, ModelSpec, get_model
from ringattn.planner.search import model_flops_per_token
from ringattn.planner.work import mixer_work, resolve_mixer_scheme

# Qwen3.5-style: 32 layers, layer_types 3 linear : 1 full, gated DeltaNet 16 key / 32 value heads
QWEN35 = {"model_type": "qwen3_5_text", "hidden_size": 4096, "num_hidden_layers": 32,
          "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
          "intermediate_size": 12288, "vocab_size": 248320, "linear_num_key_heads": 16,
          "linear_num_value_heads": 32, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
          "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8}  # fmt: skip
BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 256,
        "intermediate_size": 128}  # fmt: skip


def _write(tmp_path, cfg: dict, name: str = "m") -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return str(path)


def _spec(model: ModelSpec, cp: int, seq_len: int, scheme: str, layout: str = "zigzag"):
    return PlanSpec(model, get_hardware("h100"), seq_len, 1, 8 // cp, cp, 1, 1, "ring", layout,
                    mixer_scheme=scheme)  # fmt: skip


def test_gated_deltanet_flops_against_a_hand_count():
    # 2 value heads of dv 4, 1 key head of dk 4, conv 4, chunk 8, hidden 16
    mx = MixerShape("gated_deltanet", heads=2, head_dim=4, state_dim=4, groups=1, chunk=8)
    # in_proj_qkvz 16 x (4 + 4 + 8 + 8), in_proj_ba 16 x 4, out_proj 8 x 16
    assert mx.matmul_params(16) == 16 * 24 + 16 * 4 + 8 * 16 == 576
    assert mx.conv_channels == 4 + 4 + 8  # q, k, v
    # per value head: 6 C dk + 4 C dv + 6 dk dv + 2 C^2 / 3 = 192 + 128 + 96 + 128 / 3
    recurrence = 2 * (192 + 128 + 96 + 128 / 3)
    assert mx.recurrence_flops() == pytest.approx(recurrence)
    assert mx.flops(16) == pytest.approx(2 * 576 + 2 * 4 * 16 + recurrence)
    assert mx.state_bytes() == 2 * 4 * 4 * 4  # heads x dk x dv float32
    assert mx.summary_bytes() == 2 * 4 * 4 * 4 + 2 * 4 * 4 * 4  # + a dk x dk transition per head


def test_ssd_and_mamba1_flops_against_hand_counts():
    # Mamba2: 4 heads of P 8, N 16, 2 groups, chunk 32, hidden 16 (d_inner 32)
    ssd = MixerShape("mamba2", heads=4, head_dim=8, state_dim=16, groups=2, chunk=32)
    # groups 2 C N + heads (2 C P + 4 N P) = 2 * 1024 + 4 * (512 + 512)
    assert ssd.recurrence_flops() == 2 * 1024 + 4 * 1024
    assert ssd.conv_channels == 32 + 2 * 2 * 16  # x, B, C
    assert ssd.matmul_params(16) == 16 * (32 + 96 + 4) + 32 * 16  # in_proj (z, xBC, dt), out
    assert ssd.summary_bytes() == 4 * (4 * 16 * 8) + 4 * 4  # a scalar decay per head
    jamba = MixerShape("mamba1", heads=32, head_dim=1, state_dim=16, conv_kernel=4, dt_rank=1)
    assert jamba.recurrence_flops() == 9 * 32 * 16


def test_state_passing_traffic_is_flat_in_s_and_gather_linear():
    m = get_model("llama3-8b")
    mx = MixerShape("gated_deltanet", 32, 128, 128, 16)
    short, long = (mixer_work(mx, "state_passing", "zigzag", m.dim, s, 1, 4)
                   for s in (2**15, 2**17))  # fmt: skip
    assert short.sent == long.sent and short.sent[0] > 0
    # 2 runs x (state + dk x dk transition) from each of the 3 other ranks, + 2 conv halos
    halo = 2 * 3 * mx.conv_channels * 2
    assert short.sent[0] == 3 * 2 * mx.summary_bytes() + halo
    short, long = (mixer_work(mx, "gather", "zigzag", m.dim, s, 1, 4) for s in (2**15, 2**17))
    assert long.sent[0] == 4 * short.sent[0] == 4 * 3 * 2**15 // 4 * m.dim * 2
    assert long.sent[1] == long.sent[0]  # backward reduce-scatters the input gradient
    assert long.rows == 2**17  # the whole sequence on every rank
    # integrations/hf/mixers/hooks.py counts 2 x (W-1)/W x S x hidden x bytes per call
    assert sum(long.sent) == 2 * 3 / 4 * 2**17 * m.dim * 2


@pytest.mark.parametrize("w", [2, 4, 8])
def test_heads_divides_the_compute_by_w_and_sends_the_library_bytes(w):
    dim, mx = 4096, MixerShape("gated_deltanet", 32, 128, 128, 16)
    gather, heads = (mixer_work(mx, s, "zigzag", dim, 2**16, 2, w) for s in ("gather", "heads"))
    one = mixer_work(mx, "gather", "zigzag", dim, 2**16, 2, 1)  # one process, the whole sequence
    assert heads.rows == gather.rows == one.rows == 2 * 2**16  # every rank runs all S rows
    for key in ("matmul_flops", "recurrence_flops", "elementwise_elems"):
        assert getattr(heads, key) == pytest.approx(getattr(one, key) / w)
        assert getattr(gather, key) == pytest.approx(getattr(one, key))  # replicated
    # all-gather in + reduce-scatter out; backward the same in reverse (mixers/comm.py):
    # mixers/hooks.py's 4 x (W-1)/W x S x hidden x bytes per call (per sequence)
    assert heads.sent == pytest.approx((2 * (w - 1) / w * 2 * 2**16 * dim * 2,
                                        2 * (w - 1) / w * 2 * 2**16 * dim * 2))  # fmt: skip
    assert sum(heads.sent) == pytest.approx(2 * sum(gather.sent))
    assert heads.messages == (2 * (w - 1), 2 * (w - 1))
    longer = mixer_work(mx, "heads", "zigzag", dim, 2**18, 2, w)
    assert longer.sent == pytest.approx(tuple(4 * x for x in heads.sent))  # linear in S
    with pytest.raises(ValueError, match="cp=3 to divide the 16 key heads"):
        mixer_work(mx, "heads", "zigzag", dim, 3 * 2**12, 1, 3)
    with pytest.raises(ValueError, match="cp=2 to divide the 1 key heads"):  # Mamba2: groups
        mixer_work(MixerShape("mamba2", 4, 8, 16, 1), "heads", "zigzag", 16, 64, 1, 2)
    with pytest.raises(ValueError, match="splits gated_deltanet and mamba2 layers, not mamba1"):
        mixer_work(MixerShape("mamba1", 64, 1, 16), "heads", "zigzag", 16, 64, 1, 2)


def test_auto_prices_state_passing_where_the_library_has_it():
    """auto is what the library runs: state passing for Mamba2, gated DeltaNet and short
    convolutions at any cp; a kind without a program (mamba1) heads where it splits, else gather;
    the library's names are accepted for the planner's."""
    from ringattn.planner.work import resolve_mixer_scheme

    nemotron = MixerShape("mamba2", 8, 48, 64, 2, head_parallel=True)
    for cp in (1, 2, 3, 4):
        assert resolve_mixer_scheme(nemotron, "auto", cp) == "state_passing"
    assert resolve_mixer_scheme(nemotron, "heads", 2) == "heads"
    assert resolve_mixer_scheme(nemotron, "state", 4) == "state_passing"
    assert resolve_mixer_scheme(nemotron, "whole", 4) == "gather"
    jamba = MixerShape("mamba1", 64, 1, 16)
    assert resolve_mixer_scheme(jamba, "auto", 2) == "gather"


def test_auto_prices_what_the_library_runs(tmp_path, capsys):
    path = _write(tmp_path, {**QWEN35, "linear_num_key_heads": 4, "linear_num_value_heads": 8})
    m = get_model(path)
    assert m.mixer.head_parallel and m.mixer.groups == 4
    base = ["plan", "--model", path, "--hardware", "h100", "--seq-len", "24576", "--tp", "1",
            "--pp", "1", "--strategy", "ring", "--layout", "zigzag", "--json"]  # fmt: skip
    for cp in (2, 3, 4):
        assert main([*base, "--gpus", str(cp), "--cp", str(cp)]) == 0
        (plan,) = json.loads(capsys.readouterr().out)["plans"]
        assert plan["mixer_scheme"] == "auto"
        assert plan["mixer_schemes"] == {"gated_deltanet": "state_passing"}, cp
        mixer = plan["breakdown"]["mixer"]
        assert mixer["scheme"] == mixer["library_scheme"] == "state_passing"
        assert plan["train_note"] is None  # the trainer runs what was priced
        assert "--mixer-scheme state" in plan["train_command"]
        spec = _spec(m, cp, 24576, "auto")
        assert spec.mixer_run == "state_passing"
        assert step_time(spec) == step_time(_spec(m, cp, 24576, "state_passing"))
    # another scheme is priced and passed on to the trainer
    assert main([*base, "--gpus", "4", "--cp", "4", "--mixer-scheme", "gather"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert plan["mixer_schemes"] == {"gated_deltanet": "gather"}
    assert plan["train_note"] is None and "--mixer-scheme whole" in plan["train_command"]
    with pytest.raises(SystemExit):
        main([*base, "--gpus", "3", "--cp", "3", "--mixer-scheme", "heads"])
    assert "no plan can run: the heads mixer scheme needs cp=3 to divide the 4 key heads" in (
        capsys.readouterr().err)  # fmt: skip
    olmo = get_model(_write(tmp_path, {**QWEN35, "model_type": "olmo_hybrid"}, "olmo"))
    assert not olmo.mixer.head_parallel
    assert resolve_mixer_scheme(olmo.mixer, "auto", 4) == "state_passing"
    assert resolve_mixer_scheme(olmo.mixer, "heads", 4) == "heads"  # a what-if


def test_a_state_what_if_for_mamba1_is_noted(tmp_path, capsys):
    path = _write(tmp_path, {**BASE, "model_type": "jamba", "attn_layer_period": 2,
                             "attn_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
                             "mamba_expand": 2})  # fmt: skip
    argv = ["plan", "--model", path, "--hardware", "h100", "--gpus", "2", "--cp", "2",
            "--seq-len", "8192", "--tp", "1", "--pp", "1", "--strategy", "ring", "--layout",
            "zigzag", "--json"]  # fmt: skip
    assert main([*argv, "--mixer-scheme", "state"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert plan["train_note"] == (
        "state mixer scheme: a what-if for mamba1, which the library runs whole at cp 2"
    )


def test_qwen35_prices_three_quarters_of_its_layers_as_mixers(tmp_path, capsys):
    m = get_model(_write(tmp_path, QWEN35))
    assert (m.n_layers, m.mixer_layers, m.attention_layers) == (32, 24, 8)
    assert m.mixer == MixerShape("gated_deltanet", 32, 128, 128, 16, 4, 64, head_parallel=True)
    dense = get_model(_write(tmp_path, {k: v for k, v in QWEN35.items()
                                        if not k.startswith("linear")
                                        and k != "layer_types"}, "dense"))  # fmt: skip
    assert dense.mixer_layers == 0 and dense.layer_kinds == ()
    # the default pattern (no layer_types): every 4th layer is attention
    default = get_model(_write(tmp_path, {k: v for k, v in QWEN35.items() if k != "layer_types"},
                               "default"))  # fmt: skip
    assert default.layer_kinds == m.layer_kinds
    seq = 131072
    spec = _spec(m, 4, seq, "gather")
    # attention FLOPs shrink to 8 layers; the recurrence is linear in S
    assert model_flops_per_token(spec) < model_flops_per_token(_spec(dense, 4, seq, "gather"))
    schemes = ("gather", "heads", "state_passing")
    times = {s: step_time(_spec(m, 4, seq, s)) for s in schemes}
    passing, gather, heads = (times[s]["mixer_bytes_per_layer"] for s in
                              ("state_passing", "gather", "heads"))  # fmt: skip
    assert 0 < passing < gather < heads == pytest.approx(2 * gather)
    assert times["state_passing"]["mixer_s"] < times["gather"]["mixer_s"]  # gather replicates
    assert times["heads"]["mixer_s"] < times["gather"]["mixer_s"]
    mems = {s: memory_bytes(_spec(m, 4, seq, s)) for s in schemes}
    assert mems["state_passing"]["activations"] < mems["heads"]["activations"]
    assert mems["heads"]["activations"] < mems["gather"]["activations"]
    argv = ["plan", "--model", str(tmp_path / "m" / "config.json"), "--hardware", "h100",
            "--gpus", "8", "--seq-len", str(seq), "--cp", "4", "--tp", "1", "--pp", "1",
            "--strategy", "ring", "--layout", "zigzag", "--json"]  # fmt: skip
    assert main(argv) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    mixer = plan["breakdown"]["mixer"]
    assert plan["mixer_scheme"] == "auto"  # the library passes states
    assert mixer["scheme"] == "state_passing"
    assert plan["mixer_schemes"] == {"gated_deltanet": "state_passing"}
    assert mixer["layers"] == 24 and mixer["kind"] == "gated_deltanet"
    for key in ("time_share", "memory_share", "traffic_share"):
        assert 0 < mixer[key] < 1, (key, mixer)
    assert main(argv[:-1] + ["--mixer-scheme", "heads"]) == 0
    out = capsys.readouterr().out
    assert "24 of 32 layers gated_deltanet (mixer scheme heads" in out
    assert "mix t" in out and "heads" in out.splitlines()[2]  # the mixer column
    assert "--mixer-scheme heads" in out


@pytest.mark.parametrize(
    "extra, kinds, mixer",
    [
        ({"hybrid_override_pattern": "M-M*-", "mamba_num_heads": 8, "mamba_head_dim": 16,
          "ssm_state_size": 32, "n_groups": 2}, ("mamba2", "mamba2", "attention"), "mamba2"),
        ({"layers_block_type": ["mamba", "attention", "mamba", "mamba"], "mamba_n_heads": 8,
          "mamba_d_head": "auto", "mamba_d_state": 32}, ("mamba2", "attention", "mamba2",
                                                           "mamba2"), "mamba2"),
        ({"attn_layer_indices": [1], "mamba_n_heads": 8}, ("mamba2", "attention", "mamba2",
                                                           "mamba2"), "mamba2"),
        ({"model_type": "falcon_h1", "mamba_d_ssm": 128, "mamba_n_heads": 8},
         ("attention+mamba2",) * 4, "mamba2"),
        ({"model_type": "jamba", "attn_layer_period": 2, "attn_layer_offset": 1,
          "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2},
         ("mamba1", "attention", "mamba1", "attention"), "mamba1"),
        ({"layer_types": ["conv", "conv", "full_attention", "conv"], "conv_L_cache": 3},
         ("short_conv", "short_conv", "attention", "short_conv"), "short_conv"),
    ],
)  # fmt: skip
def test_hybrid_families_layer_patterns(tmp_path, extra, kinds, mixer):
    m = get_model(_write(tmp_path, {**BASE, **extra}))
    assert m.layer_kinds == kinds and m.mixer.kind == mixer
    plan = step_time(_spec(m, 2, 4096, "state_passing"))
    assert plan["mixer_s"] > 0 and plan["mixer_bytes_per_layer"] > 0


def test_unknown_layer_kind_is_refused_naming_it(tmp_path):
    cfg = {**BASE, **{k: v for k, v in QWEN35.items() if k.startswith("linear_")}}
    path = _write(tmp_path, {**cfg, "layer_types": ["linear_attention", "rwkv7", "x", "y"]})
    with pytest.raises(ValueError, match="unknown layer kind 'rwkv7'"):
        get_model(path)
    with pytest.raises(ValueError, match="unknown layer kind 'retention'"):
        ModelSpec("m", 64, 2, 4, 4, 128, 256, layer_kinds=("attention", "retention"))
    # a mixer layer name without any mixer fields in the config is refused too
    with pytest.raises(ValueError, match="unknown layer kind 'linear_attention'"):
        get_model(_write(tmp_path, {**BASE, "layer_types": ["linear_attention"] * 4}, "bare"))
    with pytest.raises(ValueError, match="unknown mixer scheme 'ulysses'"):
        mixer_work(MixerShape("mamba2", 4, 8, 16, 1), "ulysses", "zigzag", 16, 64, 1, 2)
