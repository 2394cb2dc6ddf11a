"""The applications on a GPU, for scripts/gpu_bench.sh's `apps` stage: each command that the
issues call CUDA-only-unverified, once, at a size that runs in seconds, with its output kept.

    python scripts/bench/gpu_apps.py OUT_DIR [--dry-run]

Runs, one subprocess each (under its own time limit; a failure is recorded and the next runs):
    train_compile   ringattn train --model tiny --compile, 1 process, a few steps
    train_hf_bf16   ringattn train --hf (a tiny Llama from a config.json written here, random
                    init) --dtype bfloat16 on packed text, 1 process
    generate_hf     ringattn generate --hf (the same model) on the GPU, greedy
    generate_ckpt   ringattn generate --checkpoint (train_compile's), with and without
                    --offload-kv (pinned host cache, side-stream copies)
OUT_DIR/apps.json lists each command, its exit code, seconds and the last lines it printed.
Nothing is downloaded: the model is a config.json, the text is written here. --dry-run runs the
same commands on the CPU (to check this script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def _run(name: str, cmd: list[str], limit_s: int, out_dir: str) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, check=False)
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        rc, text = 124, f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT after {limit_s} s"
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, f"apps_{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + (text if isinstance(text, str) else str(text)))
    tail = str(text).splitlines()[-12:]
    print(f"{name}: rc={rc} {seconds:.1f}s\n  " + "\n  ".join(tail), flush=True)
    return {"name": name, "command": cmd, "rc": rc, "seconds": round(seconds, 2), "tail": tail}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--dry-run", action="store_true", help="CPU, to check the script")
    args = p.parse_args()
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    model_dir, text_dir = os.path.join(out, "tiny-llama"), os.path.join(out, "text")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(text_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA, f)
    for i in range(8):
        with open(os.path.join(text_dir, f"doc{i}.txt"), "w") as f:
            f.write(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    ra = [sys.executable, "-m", "ringattn"]
    steps = "2" if args.dry_run else "5"
    runs = [
        ("train_compile", ra + ["train", "--model", "tiny", "--compile", "--nproc", "1",
                                "--steps", steps, "--seq-len", "512", "--quiet",
                                "--out-dir", os.path.join(out, "run_compile")], 240),
        ("train_hf_bf16", ra + ["train", "--hf", model_dir, "--data", f"text:{text_dir}",
                                "--dtype", "bfloat16", "--nproc", "1", "--steps", steps,
                                "--seq-len", "256", "--quiet",
                                "--out-dir", os.path.join(out, "run_hf")], 120),
        ("generate_hf", ra + ["generate", "--hf", model_dir, "--prompt", "the quick brown",
                              "--max-new-tokens", "8"], 90),
        ("generate_ckpt", ra + ["generate", "--checkpoint",
                                os.path.join(out, "run_compile", "checkpoints"),
                                "--prompt", "the quick", "--max-new-tokens", "8"], 60),
        ("generate_offload", ra + ["generate", "--checkpoint",
                                   os.path.join(out, "run_compile", "checkpoints"),
                                   "--prompt", "the quick", "--max-new-tokens", "8",
                                   "--offload-kv"], 60),
    ]  # fmt: skip
    env_note = "cpu (dry run)" if args.dry_run else "cuda"
    results = [_run(name, cmd, limit, out) for name, cmd, limit in runs]
    with open(os.path.join(out, "apps.json"), "w") as f:
        json.dump({"device": env_note, "runs": results}, f, indent=1)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
