"""Per-rank peak memory of `train --hf` with whole logits (--loss-chunk 0) and chunked ones.

    python scripts/bench/hf_memory.py                                   # the issue-21 case, CPU
    python scripts/bench/hf_memory.py --cases 32000x8192x2 128256x8192x2:256,512 --chunks 0,1024

A case is VOCABxTOKENSxCP, optionally :CHUNKS (its own --loss-chunk list, instead of --chunks).

Each case: a random-init Llama (hidden 256, 4 layers, 4 heads, 2 KV heads,
MLP 1024, untied embeddings: 71.5 M parameters at a 128,256-token vocabulary, 1.1 GB of model
states with AdamW) trained for --steps steps on TOKENS tokens split over CP ranks, activation
checkpointing on, bytes mod vocab as the data. Each (case, chunk) is a fresh launch of CP
processes (`ringattn train --hf CONFIG --nproc CP --cp CP --memory-warmup`), measured as
bench/memory.py does: peak RSS above the baseline after one warm-up step of a tiny model (CPU),
or torch.cuda.max_memory_allocated (GPU). Prints a table and writes JSON with the machine, the
versions, the command and every rank's losses, so equal losses across chunk sizes can be read
off.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from ringattn.bench import record
from ringattn.train.config import TrainConfig
from ringattn.train.main import run_train


def _model(directory: str, vocab: int) -> str:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    path = os.path.join(directory, f"llama-v{vocab}")
    config.save_pretrained(path)
    return os.path.join(path, "config.json")


def measure(hf: str, data: str, tokens: int, cp: int, chunk: int, steps: int, out: str) -> dict:
    cfg = TrainConfig(
        hf=hf, data=f"text:{data}", seq_len=tokens, nproc=cp, cp=cp, dp=1, steps=steps,
        warmup=1, lr=1e-3, loss_chunk=chunk, activation_checkpointing=True, memory_warmup=True,
        checkpoint_every=-1, resume=False, quiet=True, out_dir=out,
        token_cache=os.path.join(out, "tokens"),
    )  # fmt: skip
    start = time.perf_counter()
    summary = run_train(cfg)
    history = summary["history"]
    peaks = [max(h["peak_mb"][r] for h in history) for r in range(cp)]
    return {
        "peak_mb_per_rank": peaks, "peak_mb": max(peaks), "losses": [h["loss"] for h in history],
        "wall_seconds": time.perf_counter() - start, "memory_method": summary["memory_method"],
    }  # fmt: skip


def write(path: str, argv: list[str] | None, steps: int, rows: list[dict]) -> None:
    """The JSON of the rows so far (written after every launch: a stopped run keeps them)."""

    record.write(path, __file__, argv, {
        "model": "Llama hidden 256, 4 layers, MLP 1024, 4 heads / 2 KV, untied, random init",
        "activation_checkpointing": True, "steps": steps, "rows": rows,
    }, packages=["transformers"])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["128256x8192x2"], help="VOCABxTOKENSxCP")
    p.add_argument(
        "--chunks",
        default="0,-1",
        help="--loss-chunk values (0 = whole logits, -1 = the default rule)",
    )
    p.add_argument("--steps", type=int, default=1, help="training steps measured")
    p.add_argument("--json", default="results/hf_memory_cpu.json", help="where the results go")
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringattn-hf-memory-") as tmp:
        data = os.path.join(tmp, "corpus.txt")
        with open(data, "wb") as f:  # bytes mod vocab: any bytes are a document
            f.write(bytes(range(32, 127)) * 2000)
        for case in args.cases:
            shape, _, own = case.partition(":")
            vocab, tokens, cp = (int(x) for x in shape.split("x"))
            hf = _model(tmp, vocab)
            for chunk in [int(c) for c in own.split(",")] if own else chunks:
                print(f"[hf-memory] vocab {vocab}, {tokens} tokens, cp {cp}, loss chunk {chunk}",
                      flush=True)  # fmt: skip
                out = os.path.join(tmp, f"{shape}-{chunk}")
                row = {"vocab": vocab, "tokens": tokens, "cp": cp, "loss_chunk": chunk,
                       **measure(hf, data, tokens, cp, chunk, args.steps, out)}  # fmt: skip
                rows.append(row)
                write(args.json, argv, args.steps, rows)
                print(f"  peak per rank {[round(m) for m in row['peak_mb_per_rank']]} MB, "
                      f"losses {row['losses']}", flush=True)  # fmt: skip
    print(f"\n{'vocab':>7} {'tokens':>7} {'cp':>3} {'chunk':>6} {'peak MB/rank':>13}  loss")
    for r in rows:
        print(f"{r['vocab']:>7} {r['tokens']:>7} {r['cp']:>3} {r['loss_chunk']:>6} "
              f"{r['peak_mb']:>13.0f}  {r['losses'][0]:.6f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
