"""Rank functions for the Trainer integration (ringattn.hf.with_context_parallel; see harness.py).

`run(rank, world_size, case)` trains one case and returns what the tests compare: the logged
per-step training losses and gradient norms (before clipping), the eval losses, and (rank 0) the
trained parameters (the adapters' only under LoRA). The same function is the reference: called
in the test process with `cp=0` (no ringattn, the plain trainer class) on one process, or on a
pool without CP (plain DDP).

Everything is built here, offline and seeded: a character-level ChatML tokenizer whose template
marks the assistant's turns ({% generation %}, for TRL's assistant_only_loss), tiny chat data, and
tiny float32 models (Llama with GQA, Mistral with a sliding window, Gemma 3 with sliding and global
layers, Qwen3-MoE with its router loss).
"""

from __future__ import annotations

import functools
import os
import string

import torch

CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = string.ascii_lowercase + string.digits + " .,?!\n"


def tokenizer():
    """One id per character plus the ChatML tokens, a fast tokenizer (offsets for the masks)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    out.chat_template = CHATML
    return out


def conversations(n: int, offset: int = 0) -> list[dict]:
    """`n` chats of one or two turns and varied lengths."""
    rows = []
    for i in range(offset, offset + n):
        messages = [{"role": "system", "content": "be brief."}]
        for t in range(1 + i % 2):
            answer = f"it is {i + t}." + " ok" * (i % 4)
            messages += [{"role": "user", "content": f"what is {i} plus {t}?"},
                         {"role": "assistant", "content": answer}]  # fmt: skip
        rows.append({"messages": messages})
    return rows


def model(arch: str, vocab: int):
    """A tiny float32 causal LM from seed 0 (the same weights on every rank and process)."""
    import transformers as tf

    common = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "attn_implementation": "eager",
              "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": None}  # fmt: skip
    if arch == "llama":
        config = tf.LlamaConfig(**common)
    elif arch == "mistral":  # a sliding window shorter than most documents
        config = tf.MistralConfig(sliding_window=6, **common)
    elif arch == "gemma3":  # sliding (6 tokens) and global layers, logit soft-capping
        config = tf.Gemma3TextConfig(sliding_window=6, head_dim=8, query_pre_attn_scalar=8,
                                     layer_types=["sliding_attention", "full_attention"],
                                     final_logit_softcapping=30.0, **common)  # fmt: skip
    elif arch == "qwen3_moe":  # the router load-balancing loss in out.loss
        config = tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   head_dim=8, output_router_logits=True,
                                   router_aux_loss_coef=10.0, **common)  # fmt: skip
    elif arch == "nemotron_h":  # Mamba2 (head-parallel at cp 2) + attention + MLP blocks
        config = tf.NemotronHConfig(head_dim=8, hybrid_override_pattern="M*", mamba_num_heads=4,
                                    mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                                    chunk_size=8, mamba_expand=1, initializer_range=0.1,
                                    **common)  # fmt: skip
    elif arch == "qwen3_5":  # gated DeltaNet (head-parallel at cp 2) + gated attention
        config = tf.Qwen3_5TextConfig(head_dim=8,
                                      layer_types=["linear_attention", "full_attention"],
                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                      linear_conv_kernel_dim=4, initializer_range=0.1,
                                      **common)  # fmt: skip
    elif arch == "zaya":  # CCA projections (no state-passing program): refused by dynamic CP
        config = tf.ZayaConfig(head_dim=8, layer_types=["hybrid_sliding", "hybrid"],
                               sliding_window=6, num_experts=4, moe_intermediate_size=16,
                               cca_time0=3, cca_time1=2, **common)  # fmt: skip
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    torch.manual_seed(0)
    net = tf.AutoModelForCausalLM.from_config(config).float()
    if arch == "qwen3_moe":  # peaked routing: the router loss of a shard is not the sequence's
        with torch.no_grad():
            for layer in net.model.layers:
                layer.mlp.gate.weight.mul_(30.0)
    return net


def _tokenized(tok, rows: list[dict]) -> list[dict]:
    """Plain causal-LM examples (for transformers.Trainer): every token supervised but the
    system prompt's."""
    out = []
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        out.append({"input_ids": ids, "labels": [-100] * 8 + ids[8:]})
    return out


def _env(rank: int, world_size: int) -> None:
    """What accelerate reads to find the (already initialised) process group."""
    if world_size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29500")  # fmt: skip


def _trainer(case: dict, out_dir: str):
    import datasets
    import transformers

    import ringattn.hf

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tok = tokenizer()
    net = model(case.get("arch", "llama"), len(tok))
    if case.get("split_experts"):  # by hand, before the Trainer (which must refuse it)
        import torch.distributed as dist

        ringattn.hf.parallelize(net, expert_group=dist.group.WORLD)
    common = {"output_dir": out_dir, "max_steps": case.get("steps", 5), "learning_rate": 3e-3,
              "per_device_train_batch_size": case.get("batch", 2), "logging_steps": 1,
              "report_to": "none", "use_cpu": True, "seed": 0, "save_strategy": "no",
              "gradient_accumulation_steps": case.get("accumulation", 1), "max_grad_norm": 1.0,
              "disable_tqdm": True, "lr_scheduler_type": "constant", "bf16": False,
              "adam_epsilon": 1e-4}  # fmt: skip
    # AdamW's first step moves each weight by lr * g / (|g| + eps), whose slope in g peaks at
    # lr / (4 eps) where |g| = eps: an element whose gradient cancels to near eps turns a
    # rounding difference in it (cp 2 sums in another order than one process) into a weight
    # difference lr / (4 eps) times larger. With eps 1e-8, 1e-10 in a gradient moved one weight
    # of 41k by 2.7e-5 in 5 steps; with 1e-6, 1.3e-8 (Gemma 3, checkpointed: the gradients
    # agree to 6e-8 under SGD) moved one by 1.01e-5 in one step, past the comparison's 1e-5.
    # With 1e-4 the slope is 7.5 and the largest difference 3.7e-7 (the 5 steps of that case).
    common.update(case.get("args", {}))
    kind = case["kind"]
    if kind == "sft":
        import trl

        args = trl.SFTConfig(packing=case.get("packing", True), max_length=64,
                             assistant_only_loss=True, dataset_num_proc=None, **common)  # fmt: skip
        cls = trl.SFTTrainer
        kwargs = {"train_dataset": datasets.Dataset.from_list(conversations(24)),
                  "processing_class": tok}  # fmt: skip
        if case.get("lora"):
            import peft

            kwargs["peft_config"] = peft.LoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
            )
    else:  # transformers.Trainer on tokenized chats
        args = transformers.TrainingArguments(**common)
        cls = transformers.Trainer
        collator = (transformers.DataCollatorWithFlattening() if case.get("flatten", True) else
                    transformers.DataCollatorForSeq2Seq(tok, padding=True))  # fmt: skip
        kwargs = {"train_dataset": _tokenized(tok, conversations(24)), "data_collator": collator}
        if case.get("eval"):
            kwargs["eval_dataset"] = _tokenized(tok, conversations(6, offset=50))
    if case["cp"]:
        cls = ringattn.hf.with_context_parallel(cls)
        layout, strategy = case.get("layout", "zigzag"), case.get("strategy", "ring")
        kwargs["context_parallel"] = ringattn.hf.ContextParallelConfig(
            cp=case["cp"],
            layout=layout,
            strategy=strategy,
            loss_chunk=case.get("loss_chunk", -1),
            dynamic=case.get("dynamic", False),
            tiled_mlp=case.get("tiled_mlp", 0),
            offload_activations=case.get("offload_activations", False),
        )
    torch.manual_seed(0)  # LoRA's initial A, the same in every process
    return cls(model=net, args=args, **kwargs)


def _history(trainer) -> dict:
    logs = trainer.state.log_history
    return {"losses": [r["loss"] for r in logs if "loss" in r],
            "grad_norms": [r["grad_norm"] for r in logs if "grad_norm" in r],
            "cp_groups": [r["cp_groups"] for r in logs if "cp_groups" in r],
            "eval": [r["eval_loss"] for r in logs if "eval_loss" in r]}  # fmt: skip


def _params(trainer) -> dict[str, torch.Tensor]:
    """The trainable weights, whole (FSDP2's DTensor shards gathered: every rank calls this)."""
    out = {}
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            value = param.detach()
            out[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    return out


def run(rank: int, world_size: int, case: dict, out_dir: str) -> dict:
    """Train `case` (see _trainer), optionally resume or save; rank 0 also returns the weights.
    The environment is restored afterwards: a pool's next task (another test file) must not see
    torchrun's variables (accelerate's state, built once per process, keeps what it read)."""
    from ringattn.integrations.hf.levers import offload

    saved, offload_class = dict(os.environ), offload.ActivationOffload
    if case.get("offload_activations"):  # the tiny model's layer inputs are below the 64 KiB
        offload.ActivationOffload = functools.partial(offload_class, min_bytes=0)  # default
    try:
        return _run(rank, world_size, case, out_dir)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        offload.ActivationOffload = offload_class


def _run(rank: int, world_size: int, case: dict, out_dir: str) -> dict:
    _env(rank, world_size)
    trainer = _trainer(case, out_dir)
    if case.get("construct_only"):
        return {}
    trainer.train(resume_from_checkpoint=case.get("resume"))
    result = _history(trainer)
    from ringattn.integrations.hf.levers.offload import OFFLOAD_ATTR

    offloaded = getattr(trainer.model, OFFLOAD_ATTR, None)  # the last forward's, when offloading
    result["offloaded_bytes"] = offloaded.offloaded_bytes if offloaded is not None else 0
    if case.get("eval"):
        result["final_eval"] = trainer.evaluate()["eval_loss"]
    if case.get("save"):
        trainer.save_model(case["save"])
    params = _params(trainer)
    if rank == 0:
        result["params"] = params
    return result
