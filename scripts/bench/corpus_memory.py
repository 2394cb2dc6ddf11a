"""A rank's memory does not grow with the corpus: `train --hf` on 2 MB and on 500 MB of text.

    python scripts/bench/corpus_memory.py                          # 2 MB and 500 MB, CPU, CP 2
    python scripts/bench/corpus_memory.py --sizes-mb 2,50 --tokenizer-mb 8

1. Text: documents of 50-400 random words (a fixed 5,000-word vocabulary), blank-line separated,
   written to one file per size (numpy, a few seconds for 500 MB).
2. Tokenization, timed: the corpus into its memory-mapped token file (train/hf/corpus.py) by the
   byte path (a config without a tokenizer: bytes mod vocab_size), for every size; and by a fast
   Hugging Face tokenizer (a byte-level BPE of 8,192 tokens trained here on the first MB) on the
   first --tokenizer-mb MB, whose rate says how long the whole corpus would take.
3. Memory: a fresh launch of CP ranks per size (`--memory-warmup`, one step of a tiny Llama,
   1,024 tokens), peak RSS above each rank's baseline, and the baseline itself (bench/memory.py's
   method). Equal figures for both sizes are the claim.

Prints a table and writes JSON (machine, versions, command, rates, every rank's figures).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from ringattn.bench import record
from ringattn.train.config import TrainConfig
from ringattn.train.hf.corpus import load_corpus
from ringattn.train.main import run_train


def write_text(path: str, megabytes: float, seed: int = 0) -> int:
    """Random-word documents up to `megabytes` MB; returns the bytes written."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    words = [bytes(rng.choice(letters, rng.integers(2, 10))) for _ in range(5000)]
    target, written = int(megabytes * 1e6), 0
    with open(path, "wb") as f:
        while written < target:
            picks = rng.integers(0, len(words), (2000, 400))
            lengths = rng.integers(50, 400, 2000)
            block = b"\n\n".join(b" ".join(words[w] for w in row[:n]) for row, n in
                                 zip(picks, lengths)) + b"\n\n"  # fmt: skip
            f.write(block[: target - written])
            written += min(len(block), target - written)
    return written


def _tokenizer(directory: str, sample: str) -> None:
    """A byte-level BPE (8,192 tokens) trained on `sample`, saved as a transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<eos>"])
    tok.train([sample], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(directory)


def _config(directory: str, vocab: int) -> None:
    import transformers

    transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"],
    ).save_pretrained(directory)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="2,500", help="corpus sizes in MB (10^6 bytes)")
    p.add_argument("--tokenizer-mb", type=float, default=20, help="MB timed with the BPE")
    p.add_argument("--cp", type=int, default=2, help="ranks per launch")
    p.add_argument("--json", default="results/corpus_memory_cpu.json", help="where results go")
    args = p.parse_args(argv)
    rows, rates = [], {}
    with tempfile.TemporaryDirectory(prefix="ringattn-corpus-") as tmp:
        bytes_model = os.path.join(tmp, "bytes")
        _config(bytes_model, 256)
        for size in (float(s) for s in args.sizes_mb.split(",")):
            text = os.path.join(tmp, f"corpus-{size:g}MB.txt")
            start = time.perf_counter()
            written = write_text(text, size)
            generated = time.perf_counter() - start
            start = time.perf_counter()
            corpus = load_corpus(text, None, 256, cache_dir=os.path.join(tmp, "cache"))
            tokenized = time.perf_counter() - start
            print(f"[corpus] {written / 1e6:.0f} MB: generated in {generated:.1f} s, byte path "
                  f"{tokenized:.1f} s ({written / 1e6 / tokenized:.0f} MB/s), "
                  f"{corpus.documents} documents", flush=True)  # fmt: skip
            cfg = TrainConfig(
                hf=bytes_model, data=f"text:{text}", seq_len=1024, nproc=args.cp, cp=args.cp,
                steps=1, warmup=1, memory_warmup=True, checkpoint_every=-1, resume=False,
                quiet=True, out_dir=os.path.join(tmp, f"run-{size:g}"),
                token_cache=os.path.join(tmp, "cache"),
            )  # fmt: skip
            summary = run_train(cfg)
            peaks = [max(h["peak_mb"][r] for h in summary["history"]) for r in range(args.cp)]
            rows.append({"text_mb": written / 1e6, "documents": corpus.documents,
                         "tokens": len(corpus.tokens), "generate_seconds": generated,
                         "byte_path_seconds": tokenized, "peak_mb_per_rank": peaks,
                         "baseline_rss_mb_per_rank": summary["baseline_mb"],
                         "memory_method": summary["memory_method"]})  # fmt: skip
            print(f"  peak above baseline per rank {[round(m) for m in peaks]} MB, baseline "
                  f"{[round(m) for m in summary['baseline_mb']]} MB", flush=True)  # fmt: skip
            if size == max(float(s) for s in args.sizes_mb.split(",")):
                sample = os.path.join(tmp, "sample.txt")
                with open(text, "rb") as src, open(sample, "wb") as dst:
                    dst.write(src.read(int(args.tokenizer_mb * 1e6)))
                bpe = os.path.join(tmp, "bpe")
                _config(bpe, 8192)
                _tokenizer(bpe, sample)
                start = time.perf_counter()
                load_corpus(sample, bpe, 8192, cache_dir=os.path.join(tmp, "cache"))
                seconds = time.perf_counter() - start
                rates = {"tokenizer": "byte-level BPE, 8,192 tokens (PreTrainedTokenizerFast)",
                         "sample_mb": args.tokenizer_mb, "seconds": seconds,
                         "mb_per_s": args.tokenizer_mb / seconds,
                         "predicted_seconds_for_largest": written / 1e6 / (args.tokenizer_mb /
                                                                           seconds)}  # fmt: skip
                print(f"[corpus] BPE: {args.tokenizer_mb:g} MB in {seconds:.1f} s "
                      f"({rates['mb_per_s']:.2f} MB/s): {written / 1e6:.0f} MB would take "
                      f"{rates['predicted_seconds_for_largest'] / 60:.0f} min",
                      flush=True)  # fmt: skip
    print(f"\n{'text MB':>8} {'documents':>10} {'byte path s':>12} {'peak MB per rank':>20}")
    for r in rows:
        print(f"{r['text_mb']:>8.0f} {r['documents']:>10} {r['byte_path_seconds']:>12.1f} "
              f"{[round(m) for m in r['peak_mb_per_rank']]!s:>20}")  # fmt: skip
    record.write(args.json, __file__, argv, {"rows": rows, "tokenizer_rate": rates},
                 packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
