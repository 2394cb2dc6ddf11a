"""Hybrid models under context parallelism: every recurrent mixer exact, or the model refused.

Each family of issue 46 with a tiny random-weight config (initializer range 0.2): gated DeltaNet
(Qwen3.5, Qwen3-Next, OLMo-hybrid), Mamba2/SSD (Nemotron-H, Falcon-H1, Granite 4.0 hybrid,
Bamba, Zamba2, Mamba2), Mamba1 (Jamba, Mamba, FalconMamba, Zamba), short convolutions (LFM2),
lightning attention (MiniMax), Kimi delta attention (Kimi Linear, beside MLA attention whose
value heads are narrower than its key heads) and Zaya's CCA projection (causal convolutions on
queries and keys, values from the previous token). The loss summed over the CP group equals one
process's (relative 1e-5) and the summed gradients its gradients (1e-4 of each tensor's largest
entry), for the three layouts, one document and packed documents (the reference runs each
document alone: the state starts from zero at each document start). A mutation of the mixers'
input is caught, and a module ringattn does not know, or a hybrid model given to KV-cache
decoding, is refused on every rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from ringattn.layout import LAYOUTS
from tiers import stride

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "nemotron_h",
            "falcon_h1", "granitemoehybrid", "bamba", "zamba2", "mamba2", "jamba", "mamba",
            "falcon_mamba", "lfm2", "minimax", "zaya", "deepseek_v4", "kimi_linear",
            "zamba"]  # fmt: skip
# one family per mixer kind at the larger world sizes (each case is a full forward + backward);
# the wide ones split their heads at W = 4 and run whole at W = 3
PER_MIXER = ["qwen3_5_wide", "nemotron_h_wide", "jamba", "lfm2", "minimax", "zaya",
             "deepseek_v4", "kimi_linear"]  # fmt: skip
CASES = [(layout, "ring", kind) for layout in LAYOUTS for kind in ("dense", "packed")]


def _check(rows, label, cases=CASES):
    assert [row[0] for row in rows] == cases
    failures = [
        f"{case}: loss {loss:.3g}, gradient {name} {grad:.3g} of its max entry"
        for case, loss, grad, name in rows
        if not (loss <= LOSS_RTOL and grad <= GRAD_RTOL)
    ]
    assert not failures, f"{label}:\n" + "\n".join(failures)


@pytest.mark.parametrize("arch", stride(FAMILIES, 5, str))
def test_family_exact_at_cp2(pools, arch):
    rows = pools(2).run("workers_hf_hybrid:compare_cases", arch=arch, cases=CASES)[0]
    _check(rows, f"{arch} at CP = 2")


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("arch", PER_MIXER)
@pytest.mark.slow
def test_mixer_exact_at_cp3_and_cp4(pools, arch, world_size):
    rows = pools(world_size).run("workers_hf_hybrid:compare_cases", arch=arch, cases=CASES)[0]
    _check(rows, f"{arch} at CP = {world_size}")


STATE_AT_8 = ["qwen3_5_text", "bamba", "lfm2", "jamba", "minimax", "kimi_linear"]  # one per kind


@pytest.mark.parametrize("arch", STATE_AT_8)
@pytest.mark.slow
def test_state_passing_exact_at_cp8(pools, arch):
    """W = 8: most ranks hold runs of a few tokens of each packed document (shorter than the
    convolution's halo too), so the fold crosses many ranks per document."""
    cases = [("zigzag", "ring", "packed"), ("striped", "ring", "packed"),
             ("contiguous", "ring", "dense")]  # fmt: skip
    rows = pools(8).run("workers_hf_hybrid:compare_cases", arch=arch, cases=cases)[0]
    _check(rows, f"{arch} at CP = 8", cases)


def test_mamba1_entering_state_term_in_blocks(pools):
    """Mamba1's entering-state term computed in blocks (as for runs longer than 512 tokens),
    each recomputed in the backward: exact as in one block."""
    cases = [("zigzag", "ring", "packed"), ("contiguous", "ring", "dense")]
    rows = pools(2).run("workers_hf_hybrid:compare_small_blocks", arch="zamba", cases=cases)[0]
    _check(rows, "zamba, blocks of 5 tokens, at CP = 2", cases)


@pytest.mark.parametrize("world_size", [2, 3])
def test_deepseek_v4_with_its_router_loss(pools, world_size):
    """DeepSeek-V4 with output_router_logits: the load-balancing loss over the whole sequence
    (integrations/hf/moe.py) beside its compressed layers run whole. One document only: a packed
    batch's router loss is over all its tokens, which the per-document reference cannot give."""
    cases = [(layout, "ring", "dense") for layout in LAYOUTS]
    rows = pools(world_size).run(
        "workers_hf_hybrid:compare_cases", arch="deepseek_v4_aux", cases=cases
    )[0]
    _check(rows, f"deepseek_v4 with its router loss at CP = {world_size}", cases)


GDN, SSD, CONV = "gated DeltaNet", "Mamba2 (SSD)", "short causal convolution"
CCA = "CCA projection (causal convolution on q/k, v from the previous token)"
MAMBA1, LIGHTNING, KDA = (
    "Mamba1 (selective scan)",
    "lightning attention",
    "Kimi delta attention (KDA)",
)
MAMBA1_STATE = {f"backbone.layers.{i}.mixer": (MAMBA1, "state") for i in (0, 1)}
ZAMBA_STATE = {f"model.layers.{i}.{'mamba_decoder.' * (i % 2)}mamba": (MAMBA1, "state")
               for i in range(4)}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "world_size", "layout", "scheme", "want"),
    [
        ("qwen3_5_text", 2, "zigzag", "auto", {"model.layers.0.linear_attn": (GDN, "state")}),
        ("qwen3_5_text", 2, "striped", "auto", {"model.layers.0.linear_attn": (GDN, "state")}),
        ("qwen3_5_text", 2, "zigzag", "heads", {"model.layers.0.linear_attn": (GDN, "heads")}),
        ("qwen3_next", 2, "contiguous", "whole", {"model.layers.0.linear_attn": (GDN, "whole")}),
        ("nemotron_h", 2, "zigzag", "auto", {"model.layers.0.mixer": (SSD, "state")}),
        ("qwen3_5_wide", 3, "striped", "heads", {"model.layers.0.linear_attn": (GDN, "state")}),
        ("qwen3_5_wide", 3, "zigzag", "heads", {"model.layers.0.linear_attn": (GDN, "state")}),
        ("bamba", 2, "zigzag", "heads", {"model.layers.0.mamba": (SSD, "state")}),
        ("lfm2", 2, "contiguous", "auto", {"model.layers.0.conv": (CONV, "state")}),
        ("lfm2", 2, "striped", "heads", {"model.layers.0.conv": (CONV, "state")}),
        ("jamba", 2, "zigzag", "auto", {"model.layers.0.mamba": (MAMBA1, "state")}),
        ("mamba", 3, "contiguous", "auto", MAMBA1_STATE),
        ("zamba", 2, "zigzag", "auto", ZAMBA_STATE),
        ("falcon_mamba", 2, "zigzag", "auto", MAMBA1_STATE),
        ("minimax", 2, "zigzag", "auto", {"model.layers.0.self_attn": (LIGHTNING, "state")}),
        ("minimax", 2, "striped", "state", {"model.layers.0.self_attn": (LIGHTNING, "state")}),
        (
            "zaya",
            2,
            "zigzag",
            "state",
            {f"model.layers.{i}.self_attn.qkv_proj": (CCA, "whole") for i in (0, 1)},
        ),
        ("kimi_linear", 2, "zigzag", "auto", {"model.layers.0.self_attn": (KDA, "state")}),
    ],
)
def test_each_mixer_runs_the_scheme_asked_or_the_first_that_is_exact(
    pools, arch, world_size, layout, scheme, want
):
    """state where the class has a program (a striped layout's rows go through runs), else
    heads where W divides the head groups, else whole; one asked for but impossible falls back
    in that order, and `schemes` says which ran."""
    got = pools(world_size).run("workers_hf_hybrid:schemes", arch=arch, layout=layout,
                                scheme=scheme)[0]  # fmt: skip
    assert got == want


@pytest.mark.parametrize("arch", STATE_AT_8)
def test_state_passing_exact_with_runs_cut_into_pieces(pools, arch):
    """Runs cut into pieces of 2 tokens and more (each piece its own batch row and summary):
    the fold over a rank's own pieces and the halos between them stay exact."""
    cases = [("zigzag", "ring", "packed"), ("contiguous", "ring", "dense")]
    rows = pools(2).run("workers_hf_hybrid:compare_cases", arch=arch, cases=cases, piece=2)[0]
    _check(rows, f"{arch}, runs in pieces, at CP = 2", cases)


@pytest.mark.parametrize("scheme", ["heads", "whole"])
@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h"])
def test_the_other_schemes_stay_exact_when_asked_for(pools, arch, scheme):
    cases = [("zigzag", "ring", "packed"), ("contiguous", "ring", "dense")]
    rows = pools(2).run("workers_hf_hybrid:compare_cases", arch=arch, cases=cases, scheme=scheme)[0]
    _check(rows, f"{arch}, {scheme} scheme, at CP = 2", cases)


@pytest.mark.parametrize("what", ["entering_state", "halo"])
@pytest.mark.parametrize(
    "arch", ["qwen3_5_text", "bamba", "lfm2", "jamba", "minimax", "kimi_linear"]
)
def test_a_wrong_entering_state_or_halo_is_caught(pools, arch, what):
    """The state scheme with zero entering states (or zero convolution halos) is far outside
    the gates: the exactness tests would see a scan or halo that went wrong."""
    if arch == "lfm2" and what == "entering_state":
        pytest.skip("a short convolution carries no recurrent state, only its halo")
    if arch == "minimax" and what == "halo":
        pytest.skip("lightning attention has no convolution, only its recurrent state")
    rows = pools(2).run("workers_hf_hybrid:mutated_state_errors", arch=arch, what=what)[0]
    ((_, loss, grad, _),) = rows
    assert loss > 100 * LOSS_RTOL or grad > 100 * GRAD_RTOL, (loss, grad)


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5_text", "bamba", "zaya", "deepseek_v4"])
def test_a_mutated_mixer_input_is_caught(pools, arch):
    """Each token's mixer input taken from the token before: far outside the gates."""
    ((_, loss, grad, _),) = pools(2).run("workers_hf_hybrid:mutated_errors", arch=arch)[0]
    assert loss > 100 * LOSS_RTOL or grad > 100 * GRAD_RTOL, (loss, grad)


DECODED = [f for f in FAMILIES if f not in ("minimax", "zamba2", "zamba", "zaya", "deepseek_v4")]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def _check_generation(result, label):
    assert result["got"] == result["want"], f"{label}: ragged batch"
    assert result["turn"] == result["want_turn"], f"{label}: a follow-up turn (Session)"
    assert result["steps"] == result["want_steps"], f"{label}: the server's packed steps"


@pytest.mark.parametrize("arch", DECODED)
def test_greedy_decoding_equals_transformers_generate_at_cp2(pools, arch):
    """The states of a CP prefill carried into decoding: a ragged batch, a follow-up turn after
    held states, and the server's steps (a prompt in two chunks beside a decode) each equal
    transformers' own greedy generate on one process."""
    result = pools(2).run("workers_hf_hybrid:generate_case", arch=arch, prompts=PROMPTS, new=6)
    _check_generation(result[0], f"{arch} at CP 2")


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5_text", "jamba", "lfm2"])
def test_greedy_decoding_at_cp1_and_cp3(pools, arch, world_size):
    result = pools(world_size).run(
        "workers_hf_hybrid:generate_case", arch=arch, prompts=PROMPTS, new=6
    )
    _check_generation(result[0], f"{arch} at CP {world_size}")


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("user_module", r"UserConv \(layer 1, module 'model.layers.1.mlp'.*not a module ringattn"),
        ("conv_leaf", r"Conv1d \(layer 0, module 'model.layers.0.mlp.extra'\) mixes tokens"),
        ("generate", r"MiniMaxLightningAttention .* keeps its lightning-attention cache"),
        ("generate_zamba2", r"model_type='zamba2'\): its shared attention block"),
        ("generate_zamba", r"model_type='zamba'\): its shared attention block"),
        ("generate_zaya", r"ZayaCCAProjection .* keeps its convolution and delayed-value states"),
        ("generate_deepseek_v4", r"model_type='deepseek_v4'\): its compressed attention layers"),
        ("dropout_deepseek_v4", r"DeepseekV4Attention \(layer 1\): attention dropout 0.1"),
    ],
    ids=[
        "unknown-module",
        "conv-leaf",
        "generate-minimax",
        "generate-zamba2",
        "generate-zamba",
        "generate-zaya",
        "generate-deepseek_v4",
        "dropout-deepseek_v4",
    ],
)
def test_refused_on_every_rank(pools, what, match):
    pools(2).run_expect_error(
        "workers_hf_hybrid:refuse", match=match, exc_type=ValueError, what=what
    )
