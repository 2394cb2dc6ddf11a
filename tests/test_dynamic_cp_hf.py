"""Dynamic CP for transformers models: `train --hf --dynamic-cp` equals static CP and one process.

A tiny Llama (testing/tiny_hf.py: GQA 4/2 heads) and a tiny Mistral (its sliding window, 8
tokens, shorter than most documents) are trained 5 SGD steps without clipping by the real
`train --hf` trainer (workers_dynamic_cp_hf.py) on fixed windows whose documents straddle every
group-size threshold (test_dynamic_cp.WINDOWS), and the losses (1e-6 relative) and weights (1e-6)
are compared against static CP on the same mesh and against one process (cp 1, the dp rows'
windows in one batch).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ringattn.testing.tiny_hf import tiny_config
from ringattn.train.config import TrainConfig, validate
from ringattn.train.hf.recipe import HF
from test_dynamic_cp import SEQ, WINDOWS

TEXT = "the quick brown fox jumps over the lazy dog. " * 8


def _model_dir(root, arch: str):
    """A bare tiny config.json (random init, seeded by the trainer) and a text corpus."""
    kinds = {"llama": "LlamaConfig", "mistral": "MistralConfig",
             "nemotron_h": "NemotronHConfig", "lfm2": "Lfm2Config"}  # fmt: skip
    config = tiny_config(getattr(transformers, kinds[arch])())
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    model = root / arch
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config.to_dict()))
    (root / "text.txt").write_text(TEXT)
    return model, config.vocab_size


def _options(model, root, **overrides) -> dict:
    return {"hf": str(model), "data": f"text:{root / 'text.txt'}", "seq_len": SEQ,
            "batch_size": 1, "steps": 5, "warmup": 1, "lr": 1.0, "grad_clip": 1e9,
            "quiet": True, "checkpoint_every": 0, "optimizer": "sgd", **overrides}  # fmt: skip


def _assert_same(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(want["losses"], dtype=torch.float64), rtol=1e-6,
                               atol=0, msg=lambda m: f"{what} losses: {m}")  # fmt: skip
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")  # fmt: skip


@pytest.mark.parametrize(
    "dp, cp, layout, strategy, arch, checkpointing",
    [
        (1, 4, "zigzag", "ring", "llama", False),
        (2, 2, "contiguous", "allgather", "mistral", False),
        # 1 x 4, not 2 x 4: dp 2 x cp 4 on 8 ranks is test_dynamic_cp.py's (the decoder's), and
        # dp rows here are (2, 2)'s; 8 ranks cost 4x as much as 4 on 2 cores
        (1, 4, "striped", "ulysses", "llama", True),
        # hybrids: each piece's Mamba2 / short convolutions by state passing over its sub-group
        (1, 4, "zigzag", "ring", "nemotron_h", False),
        (2, 2, "striped", "allgather", "lfm2", True),
    ],
)
@pytest.mark.slow
def test_train_hf_dynamic_cp_equals_static_and_one_process(
    pools, tmp_path, dp, cp, layout, strategy, arch, checkpointing
):
    """(With --activation-checkpointing: each piece recomputed in backward, its exchanges over
    its sub-group too.)"""
    model, vocab = _model_dir(tmp_path, arch)
    options = _options(model, tmp_path, dp=dp, cp=cp, layout=layout, strategy=strategy,
                       activation_checkpointing=checkpointing)  # fmt: skip
    run = "workers_dynamic_cp_hf:train_hf"
    dynamic = pools(dp * cp).run(run, {**options, "dynamic_cp": True,
                                       "out_dir": str(tmp_path / "d")}, WINDOWS, vocab)  # fmt: skip
    static = pools(dp * cp).run(run, {**options, "out_dir": str(tmp_path / "s")}, WINDOWS, vocab)
    single = {**options, "dp": 1, "cp": 1, "batch_size": dp, "strategy": "ring",
              "out_dir": str(tmp_path / "1")}  # fmt: skip
    one = pools(1).run(run, single, WINDOWS, vocab)[0]
    _assert_same(dynamic[0], one, "dynamic vs one process")
    _assert_same(static[0], one, "static vs one process")
    # each within 1e-6 of one process, so within 2e-6 of each other
    _assert_same(dynamic[0], static[0], "dynamic vs static", atol=2e-6)
    groups = [r["cp_groups"] for r in dynamic[0]["records"]]
    assert any(set(h) - {str(cp)} for h in groups), groups  # pieces below the whole group ran
    assert all(r["imbalance"] >= 1.0 for r in dynamic[0]["records"])
    docs = [sum(h.values()) for h in groups]
    assert docs == [sum(len(WINDOWS[w % len(WINDOWS)]) for w in range(s * dp, (s + 1) * dp))
                    for s in range(5)]  # fmt: skip
    # every supervised token on one rank once (static: the same count, differently spread)
    assert sum(r["real"] for r in dynamic) == sum(r["real"] for r in static) > 0
    # training moved the weights far more than the tolerance
    moved = max(float((v - one["init"][k]).abs().max()) for k, v in one["params"].items())
    assert moved > 1000 * 1e-6


@pytest.mark.slow
def test_train_hf_ranks_without_any_document(pools, tmp_path):
    """Every document on rank 0 alone: ranks 1-3 train a one-token unsupervised document (one
    forward and backward through every parameter, so FSDP2's collectives meet) and nothing
    hangs; the losses and weights equal one process's."""
    model, vocab = _model_dir(tmp_path, "llama")
    options = _options(model, tmp_path, cp=4, steps=3)
    run = "workers_dynamic_cp_hf:train_hf"
    got = pools(4).run(run, {**options, "dynamic_cp": True, "out_dir": str(tmp_path / "d")},
                       WINDOWS, vocab, True)  # fmt: skip
    assert [r["real"] for r in got[1:]] == [0, 0, 0] and got[0]["real"] > 0
    assert all(0 < r["rows"] <= 2 for r in got[1:])  # zigzag pads a one-token document to 2
    one = pools(1).run(run, {**options, "cp": 1, "out_dir": str(tmp_path / "1")}, WINDOWS, vocab)
    _assert_same(got[0], one[0], "all on rank 0")


@pytest.mark.slow
def test_train_hf_dynamic_resumes_exactly(pools, tmp_path):
    """AdamW, stopped after step 2 and resumed: the losses and weights are bitwise those of the
    uninterrupted run (checkpoints hold no schedule; each step's is a function of the step)."""
    model, vocab = _model_dir(tmp_path, "llama")
    run = "workers_dynamic_cp_hf:train_hf"
    base = {**_options(model, tmp_path, cp=2, steps=4, lr=1e-2, dynamic_cp=True)}
    base.pop("optimizer")  # AdamW: what a checkpoint holds
    whole = pools(2).run(run, {**base, "out_dir": str(tmp_path / "a")}, WINDOWS, vocab)[0]
    parts = {**base, "out_dir": str(tmp_path / "b"), "checkpoint_every": 2}
    first = pools(2).run(run, {**parts, "stop_at": 2}, WINDOWS, vocab)[0]
    second = pools(2).run(run, parts, WINDOWS, vocab)[0]
    assert len(first["losses"]) == 2 and len(second["losses"]) == 2
    assert first["losses"] + second["losses"] == whole["losses"]
    assert all(torch.equal(second["params"][k], v) for k, v in whole["params"].items())


# ---- ringattn.hf.Trainer: ContextParallelConfig(dynamic=True) --------------------------------

SGD = {"optim": "sgd", "max_grad_norm": 0.0, "learning_rate": 0.05}
"""No clipping: a step moves each weight by lr x its gradient (a wrong scale shows)."""


def _trainer_same(got: dict, want: dict, what: str) -> None:
    assert len(got["losses"]) == len(want["losses"]) == 5, (what, got["losses"])
    _assert_same(got, want, what)


@pytest.mark.parametrize(
    "dp, cp, layout, checkpointing", [(1, 4, "zigzag", True), (2, 2, "striped", False)]
)
@pytest.mark.slow
def test_trainer_dynamic_equals_static_and_plain(pools, tmp_path, dp, cp, layout, checkpointing):
    """transformers.Trainer + DataCollatorWithFlattening, 4 chats of mixed lengths per dp row,
    5 SGD steps without clipping (at 1 x 4 with gradient checkpointing: each piece's attention
    recomputed in backward over its sub-group): dynamic CP's losses and weights equal static
    CP's on the same ranks and the plain Trainer's (one process at dp 1, DDP on 2 at dp 2)."""
    case = {"kind": "trainer", "cp": cp, "batch": 4, "layout": layout,
            "args": {**SGD, "gradient_checkpointing": checkpointing}}  # fmt: skip
    run = "workers_hf_trainer:run"
    dynamic = pools(dp * cp).run(run, {**case, "dynamic": True}, str(tmp_path / "d"), timeout=600)
    static = pools(dp * cp).run(run, case, str(tmp_path / "s"), timeout=600)
    plain = pools(dp).run(run, {**case, "cp": 0}, str(tmp_path / "p"), timeout=600)
    for result in dynamic[1:]:  # every rank logs the same (global) losses
        assert result["losses"] == dynamic[0]["losses"]
    _trainer_same(dynamic[0], plain[0], "dynamic vs plain")
    _trainer_same(static[0], plain[0], "static vs plain")
    _trainer_same(dynamic[0], static[0], "dynamic vs static")
    groups = dynamic[0]["cp_groups"]
    assert len(groups) == 5 and all(sum(h.values()) == 4 * dp for h in groups), groups
    assert any(set(h) - {str(cp)} for h in groups), groups  # pieces below the whole group ran
    # 1 x 4: pieces over sub-groups too (2 x 2's short chats all run alone, on either dp row)
    assert cp == 2 or any(int(g) > 1 for h in groups for g in h), groups
    assert not static[0]["cp_groups"]


# ---- refusals: by name, before any process group ----------------------------------------------


def _config_dir(root, config, **settings):
    config = tiny_config(config)
    for key, value in settings.items():  # tiny_config keeps the structure, not these flags
        setattr(config, key, value)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config.to_dict()))
    (root.parent / "text.txt").write_text(TEXT)
    return root


@pytest.mark.parametrize(
    "config, settings, message",
    [
        (lambda: transformers.ZayaConfig(), {}, "only run over the cp group's whole sequence"),
        (
            lambda: transformers.Qwen3MoeConfig(),
            {"output_router_logits": True},
            "router load-balancing",
        ),
        (lambda: transformers.Gemma3Config(), {}, "vision-language model"),
    ],
    ids=["hybrid", "router-loss", "vlm"],
)
def test_train_hf_dynamic_refuses_models_it_cannot_make_exact(tmp_path, config, settings,
                                                              message):  # fmt: skip
    model = _config_dir(tmp_path / "model", config(), **settings)
    options = _options(model, tmp_path, cp=4, dynamic_cp=True, out_dir=str(tmp_path / "out"))
    options.pop("optimizer")
    cfg = TrainConfig(**options)
    with pytest.raises(ValueError, match=message):
        validate(cfg, 4, HF.check)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"compile": True}, "--dynamic-cp is not supported with --compile"),
        ({"ep": 4}, "not supported with --ep"),
        ({"strategy": "hybrid", "ulysses": 2}, "--strategy hybrid"),
        ({"data": "docs:16,1.2,1,64"}, "copy-task documents are the decoder's"),
    ],
)
def test_train_hf_dynamic_refuses_flags(tmp_path, overrides, message):
    model, _ = _model_dir(tmp_path, "llama")
    options = _options(model, tmp_path, cp=4, dynamic_cp=True, out_dir=str(tmp_path / "o"))
    options.pop("optimizer")
    with pytest.raises(ValueError, match=message):
        validate(TrainConfig(**{**options, **overrides}), 4, HF.check)


def test_trainer_dynamic_refusals(tmp_path):
    """One process: cp not a power of two, torch_compile, a hybrid model."""
    import ringattn.hf
    from workers_hf_trainer import run

    with pytest.raises(ValueError, match=r"cp=3, dynamic=True.*use cp=2 or 4"):
        ringattn.hf.ContextParallelConfig(cp=3, dynamic=True)
    case = {"kind": "trainer", "cp": 1, "dynamic": True, "steps": 1}
    with pytest.raises(ValueError, match="dynamic=True\\) is not supported with torch_compile"):
        run(0, 1, {**case, "args": {"torch_compile": True}}, str(tmp_path / "a"))
    with pytest.raises(ValueError, match="only run over the cp group's whole sequence"):
        run(0, 1, {**case, "arch": "zaya"}, str(tmp_path / "b"))


# ---- the attention seam, one process ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
def test_attention_by_segments_equals_each_document_alone(arch):
    """`ringattn_segments` in the forward kwargs: pieces of packed documents (W = 1, contiguous)
    give each document's logits and gradients as the plain (eager) model on that document alone,
    float32, with Gemma 3's sliding window and soft-capping and gpt-oss's sinks."""
    import copy

    import ringattn.hf
    from ringattn.integrations.hf.attention import SEGMENTS_KWARG
    from ringattn.models.segments import Segment
    from ringattn.testing.tiny_hf import build

    config = tiny_config(transformers.AutoConfig.for_model(arch))
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    plain = build(config, seed=0)  # float32: gpt-oss's experts run grouped_mm
    model = ringattn.hf.parallelize(copy.deepcopy(plain), layout="contiguous")
    docs = [5, 11, 1, 14, 9]  # pieces: [5, 11] and [1, 14, 9]; windows of 8 tokens inside
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size - 16, (1, sum(docs)), generator=gen, device="cpu")
    positions = torch.cat([torch.arange(n, device="cpu") for n in docs])[None]
    segments = [Segment(0, 16, None, (0, 5, 16)), Segment(16, 40, None, (0, 1, 15, 24))]
    out = model(input_ids=ids, position_ids=positions, use_cache=False,
                **{SEGMENTS_KWARG: segments}).logits  # fmt: skip
    want, at = [], 0
    for n in docs:
        want.append(plain(input_ids=ids[:, at : at + n], use_cache=False).logits)
        at += n
    want = torch.cat(want, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-5)  # the fp32 gates (DESIGN §5)
    dout = torch.randn(out.shape, generator=gen, dtype=out.dtype, device="cpu")
    (out * dout).sum().backward()
    (want * dout).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
    # teeth: the pieces without their document bounds (documents attending to each other) differ
    merged = [Segment(0, 16, None, (0, 16)), Segment(16, 40, None, (0, 24))]
    with torch.no_grad():
        wrong = model(input_ids=ids, position_ids=positions, use_cache=False,
                      **{SEGMENTS_KWARG: merged}).logits  # fmt: skip
    assert (wrong - want).abs().max() > 1e-3
