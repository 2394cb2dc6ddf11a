"""Chats sharing a long system prompt on a hybrid: prefix reuse with state snapshots against none.

    python scripts/bench/serve_hybrid_prefix.py          # results/serve_hybrid_prefix_cpu.json

For each `--families` shape (random weights: Nemotron-H's Mamba2 + attention blocks, Qwen3.5's
gated DeltaNet + attention layers), two `ringattn serve --nproc N` in turn, the same flags:
`reuse` (the prefix cache on: each kept chunk carries its mixers' states) and `none`
(`--no-prefix-cache`). Each gets `--chats` chats one after another (streamed, greedy), each the
same `--system-tokens`-token system prompt and a short question of its own. Measured per arm:
each chat's time to first token, the prompt tokens computed (/metrics: prompt tokens less the
prefix cache's hit tokens) and the answers. Targets (issue 59): with reuse, the prompt tokens
computed are at most one system prompt plus every chat's own suffix; chats 2..N's TTFT at most
0.3x the first's; every answer equal to the `none` arm's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from ringattn.bench import record

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from serve_servers import Server, ringattn_ready
from serve_shared import WORDS, make_model, scrape


def make_hybrid(directory: str, family: str, positions: int) -> None:
    """A random-weight hybrid of `family` with serve_shared's tokenizer, saved for --hf."""
    import torch
    import transformers

    make_model(directory)  # the tokenizer (and a Llama, replaced below)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    common = {"vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": positions, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id, "bos_token_id": None}  # fmt: skip
    if family == "nemotron_h":
        config = transformers.NemotronHConfig(
            **common, head_dim=32, num_hidden_layers=6, hybrid_override_pattern="M*-M*-",
            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
            chunk_size=64, mamba_expand=1,
        )  # fmt: skip
    elif family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            **common, head_dim=32, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown family {family!r}; choose nemotron_h or qwen3_5")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)


def chats(url: str, system: str, count: int, new: int) -> dict:
    """`count` chats one after another: TTFT and answer of each, prompt tokens computed."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    name = client.models.list().data[0].id
    before = scrape(url)
    ttft, answers = [], []
    for i in range(count):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}: {WORDS[i % len(WORDS)]}?"},
        ]
        start, first, text = time.perf_counter(), None, []
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=new,
                                                temperature=0, stream=True)  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
        ttft.append(first)
        answers.append("".join(text))
    after = scrape(url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt = delta("ringattn_prompt_tokens_total")
    hit = delta("ringattn_prefix_cache_hit_tokens_total")
    return {"ttft_s": ttft, "answers": answers, "prompt_tokens": prompt, "hit_tokens": hit,
            "computed_tokens": prompt - hit,
            "snapshot_bytes": after.get("ringattn_kv_state_snapshot_bytes", 0.0)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["nemotron_h", "qwen3_5"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--new", type=int, default=8, help="tokens each chat generates")
    parser.add_argument("--chunk", type=int, default=256, help="--max-batch-tokens")
    parser.add_argument("--out", default="results/serve_hybrid_prefix_cpu.json")
    args = parser.parse_args(argv)
    import transformers

    rows = {}
    for family in args.families:
        with tempfile.TemporaryDirectory() as directory:
            make_hybrid(directory, family, 8192)
            tok = transformers.AutoTokenizer.from_pretrained(directory)
            words = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(args.system_tokens))
            ids = tok(words)["input_ids"][: args.system_tokens]
            system = tok.decode(ids)
            suffix = len(tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
                add_generation_prompt=True, return_dict=False)) - len(ids)  # fmt: skip
            arms = {}
            for arm, extra in (("reuse", []), ("none", ["--no-prefix-cache"])):
                argv_ = [sys.executable, "-m", "ringattn", "serve", "--hf", directory, "--nproc",
                         str(args.nproc), "--port", "0", "--max-batch-tokens", str(args.chunk),
                         "--kv-cache-gb", "0.5", *extra]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                server = Server(argv_, env, ringattn_ready)
                try:
                    arms[arm] = chats(server.url, system, args.chats, args.new)
                finally:
                    server.stop()
            reuse = arms["reuse"]
            later = statistics.median(reuse["ttft_s"][1:]) / reuse["ttft_s"][0]
            same = reuse["answers"] == arms["none"]["answers"]
            rows[family] = {**arms, "system_tokens": len(ids), "suffix_tokens_about": suffix,
                            "later_over_first_ttft": later, "same_answers": same}  # fmt: skip
    print(
        f"{args.chats} chats sharing a {args.system_tokens}-token system prompt, "
        f"--nproc {args.nproc}, chunks of {args.chunk}"
    )
    print(f"{'family':12} {'arm':6} {'computed':>9} {'hit':>7} {'TTFT 1st s':>11} "
          f"{'TTFT 2..N median s':>19} {'same answers':>13}")  # fmt: skip
    for family, row in rows.items():
        for arm in ("reuse", "none"):
            r = row[arm]
            print(f"{family:12} {arm:6} {r['computed_tokens']:9.0f} {r['hit_tokens']:7.0f} "
                  f"{r['ttft_s'][0]:11.3f} {statistics.median(r['ttft_s'][1:]):19.3f} "
                  f"{row['same_answers']!s:>13}")  # fmt: skip
        print(
            f"{family:12} later chats' TTFT / the first's (reuse): "
            f"{row['later_over_first_ttft']:.3f}"
        )
    result = {"config": vars(args), "families": rows}
    record.write(args.out, __file__, sys.argv[1:] if argv is None else argv, result,
                 packages=["transformers"])  # fmt: skip
    return result


if __name__ == "__main__":
    main()
