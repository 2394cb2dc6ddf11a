"""Bring your own trainer: `ringattn.hf.with_context_parallel` inside transformers.Trainer and
TRL's SFTTrainer (with PEFT's LoRA) equals the same trainer without context parallelism.

Every case trains tiny float32 models built in workers_hf_trainer.py on tiny chat data for 5
optimizer steps and compares the per-step logged losses (1e-5), the logged gradient norms (before
clipping: AdamW clipped at 1 would hide a gradient cp times too large) and the trained weights:
CP = 2 on 2 ranks against one process, dp 2 x cp 2 on 4 ranks against plain DDP on 2; two cases
under SGD without clipping, where the weights move by the gradient itself. The references run
the same function with the plain trainer class (cp=0), in this process or on a pool.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("peft")

from workers_hf_trainer import run

LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
NORM_RTOL = 1e-5


def _reference(case: dict, tmp_path) -> dict:
    return run(0, 1, {**case, "cp": 0}, str(tmp_path / "reference"))


def _same(got: dict, want: dict, what: str) -> None:
    assert len(want["losses"]) == len(got["losses"]) >= 5, (what, got["losses"], want["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"]), 1):
        assert abs(a - b) <= LOSS_ATOL, f"{what}: step {step} loss {a} != {b}"
    # the norm before clipping: clipped steps (AdamW too) hide a gradient scaled by cp
    assert len(got["grad_norms"]) == len(want["grad_norms"]) == len(want["losses"]), what
    for step, (a, b) in enumerate(zip(got["grad_norms"], want["grad_norms"]), 1):
        assert abs(a - b) <= NORM_RTOL * b, f"{what}: step {step} grad_norm {a} != {b}"
    assert got["eval"] == pytest.approx(want["eval"], abs=LOSS_ATOL), what
    assert set(got["params"]) == set(want["params"]), what
    for name, value in want["params"].items():
        error = (got["params"][name] - value).abs().max().item()
        assert error <= WEIGHT_ATOL, f"{what}: {name} differs by {error:.3g}"


def _ranks_agree(results: list[dict]) -> None:
    """Every rank logs the same (global) losses."""
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"]


@pytest.mark.parametrize(
    ("lora", "packing"), [(False, True), (True, True), (False, False)],
    ids=["full", "lora", "padded"],
)  # fmt: skip
@pytest.mark.slow
def test_sft_packing_cp2_equals_one_process(pools, tmp_path, lora, packing):
    """TRL's SFTTrainer, packing=True (padding-free rows of packed chats) or not (right-padded
    rows of chats), assistant-only loss."""
    case = {"kind": "sft", "cp": 2, "lora": lora, "packing": packing}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference(case, tmp_path), f"SFTTrainer lora={lora}")
    if lora:
        assert all("lora_" in name for name in results[0]["params"])


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5"])
@pytest.mark.slow
def test_sft_packing_hybrid_cp2_equals_cp1(pools, tmp_path, arch):
    """SFTTrainer with packing on a hybrid (Mamba2 / gated DeltaNet beside attention): cp 2
    equals the same Trainer at cp 1, under SGD without clipping. The reference is ringattn at
    cp 1, whose mixers restart at every packed document: transformers' own one-process path
    runs Mamba2 across document boundaries and refuses packed gated DeltaNet."""
    # lr 0.01: at 0.05 Qwen3.5's gated DeltaNet turns ill-conditioned by step 5 and amplifies
    # float32 rounding (the summation order differs between cp 1 and cp 2) to 3e-5 in the loss
    case = {"kind": "sft", "cp": 2, "arch": arch, "args": {**SGD, "learning_rate": 0.01}}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    want = pools(1).run("workers_hf_trainer:run", {**case, "cp": 1}, str(tmp_path / "one"),
                        timeout=600)[0]  # fmt: skip
    _same(results[0], want, f"SFTTrainer + packing, {arch}")


@pytest.mark.slow
def test_sft_moe_router_loss_cp2(pools, tmp_path):
    """SFTTrainer's own MoE router loss (Qwen3-MoE, peaked routing, coef 10) over the whole packed
    sequence: without the gathered router logits step 1 is already off by 2.5e-4."""
    case = {"kind": "sft", "cp": 2, "arch": "qwen3_moe"}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference(case, tmp_path), "SFTTrainer + MoE router loss")


@pytest.mark.slow
def test_trainer_flattening_accumulation_eval_cp2(pools, tmp_path):
    """transformers.Trainer + DataCollatorWithFlattening, gradient accumulation 2, an eval set;
    Mistral's sliding window (6 tokens, shorter than the chats) with GQA 4/2; the training loss
    through lm_head 16 rows at a time (chunked.py)."""
    evals = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2}
    case = {"kind": "trainer", "cp": 2, "arch": "mistral", "accumulation": 2, "eval": True,
            "args": evals, "loss_chunk": 16}  # fmt: skip
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    want = _reference(case, tmp_path)
    _same(results[0], want, "Trainer + flattening")
    assert len(want["eval"]) >= 2  # steps 2 and 4, and the last
    assert results[0]["final_eval"] == pytest.approx(want["final_eval"], abs=LOSS_ATOL)


@pytest.mark.slow
def test_trainer_padded_moe_router_loss_cp2(pools, tmp_path):
    """Qwen3-MoE with its router loss in out.loss, padded batches (right padding)."""
    case = {"kind": "trainer", "cp": 2, "arch": "qwen3_moe", "flatten": False, "batch": 3}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference(case, tmp_path), "Trainer + MoE, padded")


@pytest.mark.slow
def test_trainer_gemma3_gradient_checkpointing_cp2(pools, tmp_path):
    """Gemma 3 (a sliding-window layer and a global one, soft-capped logits) through
    transformers.Trainer with gradient_checkpointing=True (attention recomputed in backward, its
    ring exchanges too) and the loss through lm_head 16 rows at a time."""
    case = {"kind": "trainer", "cp": 2, "arch": "gemma3", "loss_chunk": 16,
            "args": {"gradient_checkpointing": True}}  # fmt: skip
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference(case, tmp_path), "Trainer + Gemma 3 + checkpointing")


@pytest.mark.slow
def test_trainer_bf16_autocast_cp2(pools, tmp_path):
    """Trainer(bf16=True): under autocast RoPE leaves q, k float32 beside a bf16 v (our attention
    used to crash on that). The losses stay as close to one float32 process's as one bf16
    process's are."""
    case = {"kind": "trainer", "cp": 2, "args": {"bf16": True}}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    fp32 = run(0, 1, {**case, "cp": 0, "args": {}}, str(tmp_path / "fp32"))["losses"]
    bf16 = run(0, 1, {**case, "cp": 0}, str(tmp_path / "bf16"))["losses"]
    assert len(results[0]["losses"]) == len(fp32) >= 5
    for step, (got, one, want) in enumerate(zip(results[0]["losses"], bf16, fp32), 1):
        assert abs(got - want) <= max(2 * abs(one - want), 1e-2), (step, got, one, want)


@pytest.mark.slow
def test_trainer_fsdp2_cp2_equals_one_process(pools, tmp_path):
    """FSDP2 as the Trainer's own arguments (fsdp="full_shard", fsdp_config version 2) over the
    cp group, on CPU gloo: the losses and the gathered weights equal one plain process's.
    (FSDP1 is refused by accelerate itself on CPU: "no available devices".)"""
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    case = {"kind": "trainer", "cp": 2, "args": fsdp}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference({**case, "args": {}}, tmp_path), "Trainer + FSDP2")


@pytest.mark.slow
def test_dp2_cp2_equals_plain_dp2(pools, tmp_path):
    """4 ranks as 2 data-parallel groups of 2 CP ranks = plain DDP on 2 ranks."""
    case = {"kind": "sft", "cp": 2}
    cp = pools(4).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(cp)
    plain = pools(2).run("workers_hf_trainer:run", {**case, "cp": 0}, str(tmp_path / "dp"),
                         timeout=600)  # fmt: skip
    _same(cp[0], plain[0], "dp 2 x cp 2 vs dp 2")


SGD = {"optim": "sgd", "max_grad_norm": 0.0, "learning_rate": 0.05}
"""No clipping, no per-element normalisation: a step moves each weight by lr x its gradient, so
a gradient off by any factor (cp x, 1 / cp) shows in the weights."""


@pytest.mark.slow
def test_sgd_without_clipping_cp2_equals_one_process(pools, tmp_path):
    """transformers.Trainer under SGD without clipping, 2 accumulation steps: losses, gradient
    norms and the weights after 5 steps equal one process's."""
    case = {"kind": "trainer", "cp": 2, "accumulation": 2, "args": SGD}
    results = pools(2).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(results)
    _same(results[0], _reference(case, tmp_path), "Trainer + SGD")


@pytest.mark.slow
def test_sgd_dp2_cp2_equals_plain_dp2(pools, tmp_path):
    """dp 2 x cp 2 (DDP over 4 ranks averaging, cp summing) = plain DDP on 2, under SGD without
    clipping."""
    case = {"kind": "sft", "cp": 2, "args": SGD}
    cp = pools(4).run("workers_hf_trainer:run", case, str(tmp_path / "cp"), timeout=600)
    _ranks_agree(cp)
    plain = pools(2).run("workers_hf_trainer:run", {**case, "cp": 0}, str(tmp_path / "dp"),
                         timeout=600)  # fmt: skip
    _same(cp[0], plain[0], "dp 2 x cp 2 vs dp 2, SGD")


def test_refusals_name_the_setting(tmp_path):
    """Settings the integration cannot honour raise ValueError naming them (one process)."""
    import ringattn.hf

    with pytest.raises(ValueError, match="label_smoothing_factor"):
        run(0, 1, {"kind": "trainer", "cp": 1, "args": {"label_smoothing_factor": 0.1}},
            str(tmp_path))  # fmt: skip
    with pytest.raises(ValueError, match="compute_metrics"):
        ringattn.hf.Trainer(model=torch.nn.Linear(1, 1), compute_metrics=lambda p: {})
    with pytest.raises(ValueError, match=r"cp=3\) does not divide the world size"):
        run(0, 1, {"kind": "trainer", "cp": 3}, str(tmp_path))
    with pytest.raises(TypeError, match="transformers.Trainer or a subclass"):
        ringattn.hf.with_context_parallel(object)


def test_split_experts_refused_in_the_constructor(pools, tmp_path):
    """A model whose experts parallelize(expert_group=...) split over the ranks: the Trainer's
    DDP would broadcast rank 0's experts over rank 1's and average different experts'
    gradients, so the constructor raises on every rank (before DDP, before any step)."""
    case = {"kind": "trainer", "cp": 2, "arch": "qwen3_moe", "split_experts": True,
            "construct_only": True}  # fmt: skip
    pools(2).run_expect_error(
        "workers_hf_trainer:run", case, str(tmp_path), exc_type=ValueError,
        match=r"the model's experts are split over an expert group \(parallelize\(expert_group="
              r"...\), 2 ranks.*ringattn train --hf DIR --ep E",
    )  # fmt: skip


@pytest.mark.slow
def test_checkpoint_resumes_equal_and_save_model_loads(pools, tmp_path):
    """A Trainer checkpoint at step 2 resumed under cp=2 continues as the uninterrupted run;
    `save_model` writes the whole model, which `from_pretrained` loads in a plain process."""
    import transformers

    out, saved = str(tmp_path / "run"), str(tmp_path / "saved")
    case = {"kind": "trainer", "cp": 2, "args": {"save_strategy": "steps", "save_steps": 2}}
    whole = pools(2).run("workers_hf_trainer:run", {**case, "save": saved}, out, timeout=600)
    resumed = pools(2).run("workers_hf_trainer:run", {**case, "resume": f"{out}/checkpoint-2"},
                           str(tmp_path / "resumed"), timeout=600)  # fmt: skip
    # the resumed log starts with the checkpoint's history (steps 1-2), then steps 3-5
    assert len(whole[0]["losses"]) == len(resumed[0]["losses"]) == 5
    for step, (a, b) in enumerate(zip(resumed[0]["losses"][2:], whole[0]["losses"][2:]), 3):
        assert abs(a - b) <= LOSS_ATOL, f"step {step} after resuming: {a} != {b}"
    for name, value in whole[0]["params"].items():
        assert torch.allclose(resumed[0]["params"][name], value, atol=WEIGHT_ATOL), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved)
    assert loaded.config._attn_implementation != "ringattn"
    state = dict(loaded.named_parameters())
    for name, value in whole[0]["params"].items():
        assert torch.equal(state[name], value), f"saved {name} differs"


def test_chunked_loss_equals_the_models_own():
    """The training loss through lm_head 8 rows at a time (chunked.py): the model's own loss and
    gradients, its signature kept (the Trainer picks dataset columns by it), eval untouched;
    not installed for a MoE model (its forward adds the router loss) or loss_chunk=0."""
    import inspect

    import ringattn.hf
    from ringattn.integrations.hf.trainer.chunked import install_chunked_loss
    from workers_hf_trainer import model

    net = model("gemma3", 40)
    signature = inspect.signature(net.forward)
    assert install_chunked_loss(net, 8)
    assert inspect.signature(net.forward) == signature
    ids = torch.randint(0, 40, (1, 30), generator=torch.Generator().manual_seed(0))
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    batch = {"input_ids": ids, "labels": ids, "shift_labels": shifted,
             "num_items_in_batch": torch.tensor(29)}  # fmt: skip
    grads, losses = [], []
    for forward in (net.forward, net._ringattn_forward):
        net.zero_grad()
        out = forward(**batch)
        out.loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        losses.append(out.loss.item())
        assert (out.logits is None) == (forward == net.forward)
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        assert net(**batch).logits.shape == (1, 30, 40)
    assert not install_chunked_loss(model("qwen3_moe", 40), 8)
    assert not install_chunked_loss(model("llama", 40), 0)
    import transformers

    from ringattn.integrations.hf.trainer.wrap import _own_compute_loss

    class Mine(ringattn.hf.Trainer):  # its own compute_loss may read outputs.logits
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    assert _own_compute_loss(ringattn.hf.Trainer) and not _own_compute_loss(Mine)
    assert not _own_compute_loss(ringattn.hf.with_context_parallel(trl.SFTTrainer))
    assert _own_compute_loss(ringattn.hf.with_context_parallel(transformers.Seq2SeqTrainer))


def test_one_row_turns_batches_into_documents():
    """Right-padded rows become documents with their own positions; padding-free rows keep the
    collator's; left padding and unknown keys are refused."""
    from ringattn.integrations.hf.trainer.batch import one_row

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]], device="cpu")
    mask = (ids != 0).long()
    mask[2] = 1
    row, flags = one_row({"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": 0})
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert row["cu_seqlens"] == [0, 3, 5, 9] and flags == {"use_cache": 0}
    flat = {"input_ids": ids[2:], "position_ids": torch.tensor([[0, 1, 0, 1]], device="cpu")}
    assert one_row(flat)[0]["cu_seqlens"] == [0, 2, 4]
    with pytest.raises(ValueError, match="right padding"):
        one_row({"input_ids": ids[:1], "attention_mask": torch.tensor([[0, 1, 1, 1]])})
    with pytest.raises(ValueError, match="token_type_ids"):
        one_row({"input_ids": ids, "token_type_ids": ids})


def test_one_process_cp1_equals_plain(tmp_path):
    """One process (`accelerate launch --cpu` runs one): cp=1, accelerate's unsharded loader."""
    case = {"kind": "trainer", "cp": 1, "steps": 2}
    got, want = run(0, 1, case, str(tmp_path / "cp1")), _reference(case, tmp_path)
    assert (
        got["losses"] == pytest.approx(want["losses"], abs=LOSS_ATOL) and len(want["losses"]) == 2
    )


# torchrun: test_example_runs_with_a_chatml_template_without_markers launches the same script
# with it (a --model DIR), so each launcher runs the example once (tests/tiers.py's rule)
@pytest.mark.parametrize("launcher", ["accelerate"])
@pytest.mark.slow
def test_example_runs_launched(tmp_path, launcher):
    """examples/trl_sft_context_parallel.py as the docs launch it (2 steps, its built-in model
    whose template marks generations) with `accelerate launch --multi_gpu` (its multi-process
    launcher; on CPU too), then its saved model loads with from_pretrained."""
    import os
    import subprocess
    import sys

    import transformers

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "examples", "trl_sft_context_parallel.py")
    out = str(tmp_path / "out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(root, "src")}
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2"]  # fmt: skip
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port", "0"]  # fmt: skip
    command += [script, "--steps", "2", "--out", out]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[example] world 2 = dp 1 x cp 2; losses [" in proc.stdout, proc.stdout[-2000:]
    transformers.AutoModelForCausalLM.from_pretrained(out)


# SmolLM2's ChatML template, verbatim: no {% generation %} markers, as most templates
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _example_module():
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "trl_sft_context_parallel.py")
    spec = importlib.util.spec_from_file_location("trl_sft_context_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_loss_on_assistant_turns_without_markers():
    """Without markers each assistant turn is one prompt-completion row (the turns before it as
    the prompt) and TRL's completion-only loss is asked for; with markers the chats stay whole."""
    example = _example_module()
    chats = example.tiny_chats(3)  # 1, 2 and 3 assistant turns
    _, tokenizer = example.tiny_model_and_tokenizer()
    marked = example.loss_on_assistant_turns(tokenizer, chats)
    assert marked == (chats, {"assistant_only_loss": True})
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    rows, loss = example.loss_on_assistant_turns(tokenizer, chats)
    assert loss == {"completion_only_loss": True}
    assert len(rows) == 6
    last = chats[2]["messages"]
    assert rows[5]["prompt"] == last[:6] and rows[5]["completion"] == [last[6]]
    assert all(r["completion"][0]["role"] == "assistant" for r in rows)
    with pytest.raises(ValueError, match="none of the 1 chats has an assistant turn"):
        one = [{"messages": [{"role": "user", "content": "hi"}]}]
        example.loss_on_assistant_turns(tokenizer, example.datasets.Dataset.from_list(one))


@pytest.mark.slow
def test_example_runs_with_a_chatml_template_without_markers(tmp_path):
    """--model DIR whose tokenizer has SmolLM2's template (no markers): the example says it falls
    back to completion-only loss, trains 2 steps at cp 2 under torchrun, and what it saves
    loads with from_pretrained."""
    import os
    import subprocess
    import sys

    import transformers

    example = _example_module()
    model, tokenizer = example.tiny_model_and_tokenizer()
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    model_dir, out = str(tmp_path / "model"), str(tmp_path / "out")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(root, "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(root, "examples", "trl_sft_context_parallel.py"),
               "--model", model_dir, "--steps", "2", "--out", out]  # fmt: skip
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "no {% generation %} markers" in line]
    assert said == [
        (
            "[example] the chat template has no {% generation %} markers: completion-only loss, "
            "one prompt-completion row per assistant turn (127 rows)"  # 64 chats of 1-3 turns
        )
    ], proc.stdout[-2000:]
    assert "[example] world 2 = dp 1 x cp 2; losses [" in proc.stdout, proc.stdout[-2000:]
    transformers.AutoModelForCausalLM.from_pretrained(out)  # what it saved loads
