"""ringattn.hf: transformers models under context parallelism equal the same model on one process.

For Llama, Qwen2 (attention bias), Qwen3 (q/k norms), Mistral (sliding window), Gemma 3
(local/global layers), gpt-oss (attention sinks, MoE) and Gemma 2 (attention logit softcapping,
local/global layers), tiny random-weight models: the loss summed
over the CP group equals the single-device loss (relative 1e-5) and the summed gradients equal the
single-device gradients (1e-4 of each tensor's largest entry), in float32, for CP = 2, 3, 4, every
layout, the ring and all-gather strategies (and Ulysses at CP = 2), a dense sequence and packed
documents (position_ids restarting at 0, and cu_seqlens), at a length (37) that no 2W divides. The
single-device side is transformers' own eager attention; the windows are shorter than the
documents, so they matter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import ringattn.hf
from ringattn.layout import LAYOUTS
from tiers import SLOW

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_oss", "gemma2"]
WORLD_SIZES = [2, 3, 4]
STRATEGIES = ["ring", "allgather"]
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _cases(world_size):
    cases = [(lay, s, kind) for lay in LAYOUTS for s in STRATEGIES for kind in ("dense", "packed")]
    cases += [("zigzag", "ring", "cu_seqlens"), ("striped", "allgather", "cu_seqlens")]
    if world_size == 2:  # Ulysses splits the 2 K/V heads: W = 2 only
        cases += [("zigzag", "ulysses", "packed"), ("striped", "ulysses", "dense")]
    return cases


# the fast tier: every architecture at W = 2 (tests/tiers.py)
@pytest.mark.parametrize(
    "world_size", [w if w == 2 else pytest.param(w, marks=SLOW) for w in WORLD_SIZES]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_single_device(pools, arch, world_size):
    cases = _cases(world_size)
    rows = pools(world_size).run("workers_hf:compare_cases", arch=arch, cases=cases)[0]
    assert [row[0] for row in rows] == cases
    failures = []
    for case, loss_error, grad_error, name, logits_shape, smallest in rows:
        if not loss_error <= LOSS_RTOL:
            failures.append(f"{case}: loss relative error {loss_error:.3g}")
        if not grad_error <= GRAD_RTOL:
            failures.append(f"{case}: gradient {name} error {grad_error:.3g} of its max entry")
        # each rank holds its own tokens only: about S / W of them (plus layout padding)
        assert logits_shape[1] < 37 * 2 / world_size + 4, (case, logits_shape)
        if arch != "gpt_oss":  # gpt-oss: an expert that no token picks has a zero gradient
            assert smallest > 0, f"{case}: a reference gradient is all zeros"
    assert not failures, f"{arch} at CP = {world_size}:\n" + "\n".join(failures)


def test_sliding_window_matters(pools):
    """The window is shorter than the sequence: dropping it changes the single-device loss."""
    with_window, without = pools(2).run("workers_hf:window_matters")[0]
    assert abs(with_window - without) > 1e-4 * abs(without)


@pytest.mark.parametrize(
    ("arch", "overrides", "mode", "extra", "match"),
    [
        ("llama", {"attention_dropout": 0.1}, "train", None, r"config\.attention_dropout"),
        ("llama", {}, "train", "mask_on_rank0", r"attention_mask has zeros"),
        ("llama", {}, "train", "no_shard_batch", r"ringattn\.hf\.shard_batch"),
    ],
    ids=["dropout", "padding-mask", "no-shard-batch"],
)
def test_unsupported_raises_on_every_rank(pools, arch, overrides, mode, extra, match):
    pools(2).run_expect_error(
        "workers_hf:unsupported",
        arch=arch,
        overrides=overrides,
        mode=mode,
        batch_extra=extra,
        match=match,
        exc_type=ValueError,
    )


def test_softcapping_matters(pools):
    """Gemma 2's attention logit softcapping changes the single-device loss: the CP cases above
    can only match it by capping the scores."""
    with_cap, without = pools(2).run("workers_hf:softcap_matters")[0]
    assert abs(with_cap - without) > 1e-3 * abs(without)


def test_dropout_is_fine_in_eval(pools):
    """Attention dropout only matters in training: eval mode runs (no error)."""
    results = pools(2).run(
        "workers_hf:unsupported", arch="llama", overrides={"attention_dropout": 0.1}, mode="eval"
    )
    assert results == [None, None]


def test_deepcopy_of_parallelized_model(pools):
    for loss, copied in pools(2).run("workers_hf:deepcopy_parallelized"):
        assert loss == copied


def test_shard_batch_single_process():
    """One process: global shift, document ends unsupervised, padding rows, the global count."""
    ids = torch.arange(10, 17).unsqueeze(0)  # 7 tokens: zigzag on 1 rank pads to 8
    labels = ids.clone()
    labels[0, 0] = -100
    batch = ringattn.hf.shard_batch(
        {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor([0, 4, 7])}
    )
    index = ringattn.positions(7, cu_seqlens=[0, 4, 7])
    real = index >= 0
    assert batch["input_ids"][0, real].tolist() == ids[0, index[real]].tolist()
    expected = {0: 11, 1: 12, 2: 13, 3: -100, 4: 15, 5: 16, 6: -100}  # token -> label it predicts
    got = dict(zip(index[real].tolist(), batch["shift_labels"][0, real].tolist()))
    assert got == expected
    assert (batch["labels"][0, ~real] == -100).all()
    assert batch["position_ids"][0, real].tolist() == [
        [0, 1, 2, 3, 0, 1, 2][t] for t in index[real]
    ]
    assert int(batch["num_items_in_batch"]) == 5
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 7] and batch["use_cache"] is False


def test_shard_batch_documents_from_position_ids():
    ids = torch.arange(9).unsqueeze(0)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    batch = ringattn.hf.shard_batch({"input_ids": ids, "position_ids": pos}, layout="contiguous")
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9]
    assert "labels" not in batch


def test_shard_batch_mrope_positions_are_not_documents():
    """3-D M-RoPE position_ids (3, 1, S) are sharded, never read as packed documents."""
    ids = torch.arange(8).unsqueeze(0)
    pos = torch.stack([torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6]])] * 3)  # (3, 1, 8), not increasing
    batch = ringattn.hf.shard_batch({"input_ids": ids, "position_ids": pos}, layout="contiguous")
    assert batch["cu_seq_lens_q"].tolist() == [0, 8]
    assert batch["position_ids"].tolist() == pos.tolist()


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, r"\(1, S\) tensor, got \(2, 8\)"),
        (
            {
                "input_ids": torch.zeros(1, 8, dtype=torch.long),
                "attention_mask": torch.tensor([[1] * 6 + [0] * 2]),
            },
            "attention_mask has zeros",
        ),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "token_type_ids": None},
            "token_type_ids",
        ),
        (
            {
                "input_ids": torch.zeros(1, 8, dtype=torch.long),
                "labels": torch.zeros(1, 7, dtype=torch.long),
            },
            "labels has 7 tokens but input_ids has 8",
        ),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": [0, 3, 9]},
            "cu_seqlens ends at 9",
        ),
    ],
    ids=["batch-2", "padding-mask", "unknown-key", "label-length", "cu_seqlens-end"],
)
def test_shard_batch_errors(batch, match):
    with pytest.raises(ValueError, match=match):
        ringattn.hf.shard_batch(batch)


def test_parallelize_errors():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="unknown layout"):
        ringattn.hf.parallelize(model, layout="diagonal")
    with pytest.raises(ValueError, match="unknown strategy"):
        ringattn.hf.parallelize(model, strategy="tree")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        ringattn.hf.parallelize(torch.nn.Linear(2, 2))
    config.attention_chunk_size = 8
    with pytest.raises(ValueError, match=r"config\.attention_chunk_size=8"):
        ringattn.hf.parallelize(model)
    config.attention_chunk_size = None
    assert ringattn.hf.parallelize(model) is model
    assert model.config._attn_implementation == "ringattn"


@pytest.mark.slow
def test_import_ringattn_does_not_import_transformers():
    code = "import sys, ringattn; assert 'transformers' not in sys.modules, 'imported'"
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("differ", "fields"),
    [("input_ids", "'input_ids'"), ("labels", "'labels'"),
     ("documents", "'cu_seqlens', 'position_ids'")],
)  # fmt: skip
def test_shard_batch_refuses_different_sequences(pools, differ, fields):
    """A CP rank given another sequence of the same length (the shapes all agree) raises on every
    rank, naming the ranks and what differs; the same sequence passes."""
    pools(2).run_expect_error(
        "workers_hf:different_sequences", differ=differ, exc_type=ValueError,
        match=rf"ranks \[1\] differ from ranks \[0\] in \[{fields}\]; every rank of a CP group "
              rf"must pass the same full sequence",
    )  # fmt: skip
    same = pools(2).run("workers_hf:different_sequences", differ="none")
    assert same[0].shape == same[1].shape and not torch.equal(same[0], same[1])


def test_batch_digest():
    """The digest behind that check: a swap or a one-token change alters it, int64 never
    overflows (ids near 2^62, many tokens), float tensors compare by their bits."""
    from ringattn.integrations.hf.agreement import digest

    ids = torch.randint(0, 2**62, (1, 5000), generator=torch.Generator().manual_seed(0))
    swapped = ids.clone()
    swapped[0, [7, 4000]] = swapped[0, [4000, 7]]
    changed = ids.clone()
    changed[0, 4999] += 1
    digests = [digest(x).tolist() for x in (ids, swapped, changed)]
    assert digests[0][0] == 5000 and all(0 <= s < 5000 * 2**31 for s in digests[0][1:])
    assert len({tuple(d) for d in digests}) == 3
    assert digest(ids).tolist() == digest(ids.clone()).tolist()
    pixels = torch.randn(3, 4, dtype=torch.bfloat16)
    assert digest(pixels).tolist() == digest(pixels.clone()).tolist()
    assert digest(pixels).tolist() != digest(-pixels).tolist()
