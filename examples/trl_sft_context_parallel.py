"""TRL's SFTTrainer with ringattn's context parallelism: packed chats, loss on the assistant's
turns, any sliding window, launched like any Trainer script.

    torchrun --standalone --nproc-per-node 2 examples/trl_sft_context_parallel.py         # cp 2
    torchrun --standalone --nproc-per-node 4 examples/trl_sft_context_parallel.py --cp 2  # 2 x 2
    torchrun --standalone --nproc-per-node 2 examples/trl_sft_context_parallel.py \\
        --model DIR --data chats.jsonl --max-length 32768 --lora                          # yours
    accelerate launch --multi_gpu --num_processes 2 examples/trl_sft_context_parallel.py  # cp 2

By default a tiny Llama (random weights) and tiny chat data are built here, so it runs on a CPU
with gloo in seconds; `--model DIR` is any local causal-LM directory with a chat template in its
tokenizer, `--data FILE` a .jsonl of {"messages": [{"role": ..., "content": ...}, ...]} rows. The
only lines that differ from a plain SFTTrainer script are marked `# ringattn`. Everything else
(DDP or FSDP, gradient accumulation, checkpoints, logging) is the Trainer's.

The loss covers the assistant's turns only. TRL's `assistant_only_loss` needs a chat template that
marks them with `{% generation %}`; most templates (SmolLM2's ChatML, Llama's) have no markers,
so for those each chat becomes one prompt-completion row per assistant turn (the turns before it
are the prompt) and TRL's `completion_only_loss` supervises the completions: the same tokens.
"""

from __future__ import annotations

import argparse
import os
import string

import datasets
import torch
import transformers
import trl

import ringattn.hf

CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_model_and_tokenizer() -> tuple[torch.nn.Module, object]:
    """A character-level ChatML tokenizer and a 2-layer Llama (GQA 4/2) with random weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = string.ascii_lowercase + string.digits + " .,?!\n"
    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHATML,
    )  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=0, eos_token_id=2, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config), tokenizer


def tiny_chats(n: int = 64) -> datasets.Dataset:
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "answer in one line."}]
        for t in range(1 + i % 3):
            messages += [{"role": "user", "content": f"what is {i} plus {t}?"},
                         {"role": "assistant", "content": f"{i} plus {t} is {i + t}."}]  # fmt: skip
        rows.append({"messages": messages})
    return datasets.Dataset.from_list(rows)


def loss_on_assistant_turns(tokenizer, data: datasets.Dataset) -> tuple[datasets.Dataset, dict]:
    """(dataset, SFTConfig keywords) putting the loss on the assistant's turns (see the top)."""
    from trl.chat_template_utils import has_generation_markers

    if has_generation_markers(tokenizer.chat_template or ""):
        return data, {"assistant_only_loss": True}
    rows = [
        {"prompt": messages[:i], "completion": [message]}
        for messages in data["messages"]
        for i, message in enumerate(messages)
        if message["role"] == "assistant" and i > 0
    ]
    if not rows:
        raise ValueError(
            f"none of the {len(data)} chats has an assistant turn after its first message, so "
            f"there is nothing to train on; give chats of user and assistant turns"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            "[example] the chat template has no {% generation %} markers: completion-only loss, "
            f"one prompt-completion row per assistant turn ({len(rows)} rows)",
            flush=True,
        )
    return datasets.Dataset.from_list(rows), {"completion_only_loss": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local causal-LM directory (default: a tiny Llama)")
    parser.add_argument("--data", help=".jsonl of chats {'messages': [...]} (default: tiny chats)")
    parser.add_argument("--cp", type=int, default=0, help="context-parallel ranks per dp group "
                        "(default: every rank)")  # fmt: skip
    parser.add_argument("--layout", default="zigzag", help="zigzag, contiguous or striped")
    parser.add_argument("--strategy", default="ring", help="ring, allgather or ulysses")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows per step and group")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT)")
    parser.add_argument("--out", default="out/trl_sft_cp", help="output directory")
    args = parser.parse_args()

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = tiny_model_and_tokenizer()
    data = (
        datasets.load_dataset("json", data_files=args.data)["train"] if args.data else tiny_chats()
    )
    data, loss = loss_on_assistant_turns(tokenizer, data)
    config = trl.SFTConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        packing=True, max_length=args.max_length, **loss,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
    )  # fmt: skip
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp = ringattn.hf.ContextParallelConfig(  # ringattn
        cp=args.cp or world, layout=args.layout, strategy=args.strategy
    )
    SFTTrainer = ringattn.hf.with_context_parallel(trl.SFTTrainer)  # ringattn
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer,
        peft_config=peft_config, context_parallel=cp,  # ringattn
    )  # fmt: skip
    trainer.train()
    trainer.save_model(args.out)
    if trainer.is_world_process_zero():
        losses = [round(r["loss"], 4) for r in trainer.state.log_history if "loss" in r]
        print(f"[example] world {world} = dp {world // cp.cp} x cp {cp.cp}; losses {losses}; "
              f"saved to {args.out}", flush=True)  # fmt: skip
    trainer.end()


if __name__ == "__main__":
    main()
