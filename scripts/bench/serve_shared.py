"""A burst of chats sharing one long system prompt: the paged KV cache against the copying one.

    python scripts/bench/serve_shared.py --baseline-ref f59c03a   # results/serve_shared_cpu.json
    python scripts/bench/serve_shared.py --hf DIR --chats 32 --system-tokens 4000

Two servers in turn on loopback, the same model and flags (`--kv-cache-gb` sized so that the
copying pool holds about `--copies` chats): `paged` is this checkout's `ringattn serve`,
`copying` the same command from `--baseline-ref` (a git worktree of the commit before the
paged cache, made in a temporary folder). Each gets one chat with the system prompt (its
chunks go into the prefix cache), then `--chats` chats at once, each the system prompt and a
short question of its own, greedy. /metrics is polled meanwhile: the most sequences running at
once (admitted together), the KV blocks used and shared. Targets (issue 49): the burst admits
>= 4x as many chats at once as the copying pool; the shared prompt is held once (used blocks
<= the prompt's blocks plus each chat's own plus one partial block each); every answer is the
same on both. Without --hf, a random-weight Llama (8k positions, a trained byte-level BPE
tokenizer with a ChatML template) is made in a temporary folder: the figures are about
memory and admission, which the weights do not change.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ringattn.bench import record

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from serve_servers import Server, ringattn_ready

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("river", "stone", "quiet", "lantern", "orbit", "velvet", "harbor", "meadow", "signal",
         "copper", "winter", "garden")  # fmt: skip


def make_model(directory: str) -> None:
    """A random-weight Llama (4 layers, 256 wide, 2 KV heads of 64, 8192 positions) and a BPE
    tokenizer trained on seeded words, saved for `ringattn serve --hf`."""
    import random

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(64)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    fast.save_pretrained(directory)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (x.rsplit(" ", 1) for x in lines if x and x[0] != "#")}


def burst(url: str, system: str, chats: int, new: int) -> dict:
    """One warm-up chat, then `chats` at once; answers, peaks from /metrics, seconds."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)

    def chat(i: int) -> str:
        question = f"question {i}: {WORDS[i % len(WORDS)]}?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        name = client.models.list().data[0].id
        out = client.chat.completions.create(model=name, messages=messages, max_tokens=new,
                                             temperature=0)  # fmt: skip
        return out.choices[0].message.content

    chat(-1)  # the system prompt's chunks go into the prefix cache
    peaks, done = {"running": 0, "used": 0, "shared": 0}, threading.Event()

    def poll() -> None:
        while not done.is_set():
            m = scrape(url)
            for key, name in (("running", "ringattn_running_sequences"),
                              ("used", 'ringattn_kv_blocks{state="used"}'),
                              ("shared", "ringattn_kv_blocks_shared")):  # fmt: skip
                peaks[key] = max(peaks[key], m.get(name, 0.0))
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        answers = list(pool.map(chat, range(chats)))
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {"answers": answers, "peaks": peaks, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf", help="a model directory (default: a random-weight Llama)")
    parser.add_argument("--baseline-ref", default="f59c03a",
                        help="the copying pool's commit (the one before the pages)")  # fmt: skip
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--new", type=int, default=16, help="tokens each chat generates")
    parser.add_argument("--copies", type=float, default=3.0,
                        help="size the pool for this many chats of the copying pool")  # fmt: skip
    parser.add_argument("--block", type=int, default=16, help="--kv-block-size")
    parser.add_argument("--out", default="results/serve_shared_cpu.json")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="serve_shared_")
    model = args.hf or os.path.join(work, "model")
    if not args.hf:
        make_model(model)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    config = transformers.AutoConfig.from_pretrained(model)
    ids = tok.encode(" ".join(WORDS[i % 12] for i in range(args.system_tokens)))
    system = tok.decode(ids[: args.system_tokens])
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * heads * dim * 4  # float32 K and V
    chat_tokens = args.system_tokens + 32 + args.new
    gb = args.copies * chat_tokens * token_bytes / (1 << 30)
    base = os.path.join(work, "baseline")
    subprocess.run(["git", "worktree", "add", "--detach", base, args.baseline_ref], check=True,
                   capture_output=True)  # fmt: skip
    flags = ["--kv-cache-gb", f"{gb:.6f}", "--kv-block-size", str(args.block),
             "--max-batch", str(args.chats + 1), "--max-batch-tokens", "512",
             "--max-model-len", str(chat_tokens + 64)]  # fmt: skip
    arms = {}
    try:
        for arm, src in (("paged", os.path.join(os.getcwd(), "src")),
                         ("copying", os.path.join(base, "src"))):  # fmt: skip
            env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(os.cpu_count())}
            argv_ = [sys.executable, "-m", "ringattn", "serve", "--hf", model, "--nproc", "1",
                     "--port", "0", *flags]  # fmt: skip
            server = Server(argv_, env, ringattn_ready)
            try:
                arms[arm] = burst(server.url, system, args.chats, args.new)
            finally:
                server.stop()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], check=False,
                       capture_output=True)  # fmt: skip
    prompt_blocks = -(-args.system_tokens // args.block)
    own = -(-(32 + args.new) // args.block)  # a chat's question and answer, at most
    bound = prompt_blocks + args.chats * (own + 1)
    paged, copying = arms["paged"], arms["copying"]
    result = {
        "config": {**vars(args), "kv_cache_gb": gb, "token_bytes": token_bytes},
        "arms": {k: {"peaks": v["peaks"], "seconds": v["seconds"]} for k, v in arms.items()},
        "admitted_ratio": paged["peaks"]["running"] / max(1.0, copying["peaks"]["running"]),
        "held_once_bound_blocks": bound,
        "held_once": paged["peaks"]["used"] <= bound,
        "same_answers": paged["answers"] == copying["answers"],
        "speed_ratio": copying["seconds"] / paged["seconds"],
    }
    print(f"{'arm':8} {'running at once':>16} {'blocks used':>12} {'shared':>8} {'seconds':>8}")
    for k, v in arms.items():
        p = v["peaks"]
        print(f"{k:8} {p['running']:16.0f} {p['used']:12.0f} {p['shared']:8.0f} "
              f"{v['seconds']:8.2f}")  # fmt: skip
    print(f"admitted at once: {result['admitted_ratio']:.1f}x (target >= 4x); used "
          f"{paged['peaks']['used']:.0f} <= {bound} (prompt {prompt_blocks} + {args.chats} x "
          f"({own} + 1)): {result['held_once']}; same answers: {result['same_answers']}; "
          f"burst time copying/paged {result['speed_ratio']:.2f}x")  # fmt: skip
    record.write(args.out, __file__, sys.argv[1:] if argv is None else argv, result,
                 ("transformers", "openai"))  # fmt: skip
    return result


if __name__ == "__main__":
    main()
