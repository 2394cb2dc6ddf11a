"""Tokenize `--data` once into memory-mapped token files that every rank reads.

    --data text:PATH | chat:PATH  --(sources.records: one record at a time)-->  tokenizer
        --> CACHE/KEY.tmpPID/tokens.i32       every document's tokens end to end (int32)
                             starts.i64       where each document starts
                             supervised.u8    chat: 1 on the assistant's tokens
                             meta.json        counts, how the text became tokens
        --> fsync, rename -> CACHE/KEY/       (atomic, durable: checkpoint/durable.py)

    KEY = sha256(format, kind, the files' paths, sizes and mtimes, the tokenizer's files, vocab)

The first process to need a corpus (the launching parent, in the recipe's check) tokenizes it
under an exclusive file lock (fcntl.flock on CACHE/KEY.lock): under torchrun, where every rank
checks, one rank tokenizes and the others wait for the lock and then open the finished files. A
changed file changes the key, so a stale cache is never read. Every file is fsync'ed before the
rename, so a power loss never leaves meta.json over truncated token files; a cache directory
whose files are not as long as its meta.json says (written before that rule, or damaged) is
tokenized again, and a tokenization killed mid-write (its KEY.tmpPID) is removed and redone by
the next process to take the lock: a half-written file is never read. Ranks open the files with
np.memmap (copy-on-write): a window's tokens are paged in when sampled, so a rank's memory does
not grow with the corpus (BENCHMARKS.md: 2 MB and 500 MB of text). Tokenization streams too:
records are encoded in batches of about 8 MiB and appended to the files.

Tokens: the model's tokenizer when its directory has one (text: plus its EOS after each document
that does not end with it; chat: the chat template, chat.py), else every byte mod vocab_size.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ringattn.integrations.hf.source import load_tokenizer
from ringattn.runtime.checkpoint.durable import fsync_tree, publish, write_synced
from ringattn.train.hf.chat import check_chat_tokenizer, render
from ringattn.train.hf.sources import files, records

__all__ = ["Corpus", "default_cache", "load_corpus"]

FORMAT = 1  # bump when the files' meaning changes
_BATCH_BYTES = 8 << 20  # text encoded per tokenizer call


def default_cache() -> str:
    """Where token files go without --token-cache: $XDG_CACHE_HOME/ringattn/tokens."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringattn", "tokens")


@dataclass(frozen=True)
class Corpus:
    """Every document's tokens, end to end, memory-mapped: `tokens` (N,) int32, `starts` (D,)
    int64 their offsets, `supervised` (N,) uint8 for chat (None for text)."""

    tokens: torch.Tensor
    starts: torch.Tensor
    tokenized_by: str
    """How the text became tokens, for the log: the tokenizer's class, or bytes mod vocab."""
    supervised: torch.Tensor | None = None
    directory: str = ""
    """The token files' directory."""

    @property
    def documents(self) -> int:
        return len(self.starts)


def _signature(names: list[str]) -> list:
    return [(os.path.abspath(n), s.st_size, s.st_mtime_ns) for n in names if (s := os.stat(n))]


def _key(kind: str, path: str, tokenizer_dir: str | None, vocab_size: int) -> str:
    tokenizer = _signature(files(tokenizer_dir)) if tokenizer_dir else None
    parts = [FORMAT, kind, _signature(files(path)), tokenizer, vocab_size]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _batches(kind: str, path: str) -> Iterator[list]:
    batch, size = [], 0
    for record in records(kind, path):
        batch.append(record)
        size += len(record) if isinstance(record, bytes) else len(json.dumps(record))
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(kind: str, batch: list, tokenizer: object, vocab_size: int, first: int) -> list:
    """[(ids int32 array, supervised uint8 array or None)] of a batch of records."""
    if tokenizer is None:
        return [((np.frombuffer(d, dtype=np.uint8).astype(np.int32) % vocab_size), None)
                for d in batch]  # fmt: skip
    if kind == "chat":
        out = []
        for i, messages in enumerate(batch):
            ids, supervised = render(tokenizer, messages, first + i)
            out.append((np.asarray(ids, dtype=np.int32), np.asarray(supervised, dtype=np.uint8)))
        return out
    eos = tokenizer.eos_token_id
    texts = [d.decode("utf-8", errors="replace") for d in batch]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # Rust, no offsets: ~20 % faster
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        encoded = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=True)]
    else:
        encoded = tokenizer(texts)["input_ids"]
    return [(np.asarray(ids + ([eos] if eos is not None and (not ids or ids[-1] != eos) else []),
                        dtype=np.int32), None) for ids in encoded]  # fmt: skip


def _build(
    kind: str,
    path: str,
    tokenizer_dir: str | None,
    vocab_size: int,
    out: str,
    fault: Callable[[str], None],
) -> None:
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    if kind == "chat":
        if tokenizer is None:
            raise ValueError(
                f"--data chat:{path} needs the model's tokenizer (with its chat template); "
                f"the --hf directory has none"
            )
        check_chat_tokenizer(tokenizer, tokenizer_dir)
    if tokenizer is None:
        how = f"bytes mod vocab_size {vocab_size} (no tokenizer in the model directory)"
    else:
        how = f"the model's tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens)"
        how += ", its chat template" if kind == "chat" else ""
    os.makedirs(out)
    lengths, top = [], -1
    with open(os.path.join(out, "tokens.i32"), "wb") as tok_f, \
         open(os.path.join(out, "supervised.u8"), "wb") as sup_f:  # fmt: skip
        for batch in _batches(kind, path):
            for ids, supervised in _encode(kind, batch, tokenizer, vocab_size, len(lengths)):
                tok_f.write(ids.tobytes())
                if supervised is not None:
                    sup_f.write(supervised.tobytes())
                lengths.append(len(ids))
                top = max(top, int(ids.max())) if len(ids) else top
            fault("batch")
    if not lengths or sum(lengths) == 0:
        raise ValueError(f"--data {kind}:{path} holds no text (every document is empty)")
    if top >= vocab_size:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir} produced token id {top}, but the model's "
            f"vocab_size is {vocab_size}; use the tokenizer the model was made for, or raise "
            f"vocab_size in config.json"
        )
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = (np.cumsum(lengths) - lengths).tobytes()
    write_synced(os.path.join(out, "starts.i64"), lambda f: f.write(starts))
    meta = {"format": FORMAT, "kind": kind, "data": os.path.abspath(path), "tokens":
            int(lengths.sum()), "documents": len(lengths), "tokenized_by": how}  # fmt: skip
    fault("files")
    write_synced(os.path.join(out, "meta.json"), lambda f: json.dump(meta, f), mode="w")
    fsync_tree(out)  # tokens.i32 and supervised.u8 were streamed: on disk before the rename
    fault("synced")


def _map(name: str, dtype: type, count: int) -> torch.Tensor:
    # copy-on-write: pages are read from the file when touched, shared by every process
    return torch.from_numpy(np.memmap(name, dtype=dtype, mode="c", shape=(count,)))


@functools.lru_cache(maxsize=8)
def _open(directory: str) -> Corpus:
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    n, docs = meta["tokens"], meta["documents"]
    supervised = None
    if meta["kind"] == "chat":
        supervised = _map(os.path.join(directory, "supervised.u8"), np.uint8, n)
    return Corpus(_map(os.path.join(directory, "tokens.i32"), np.int32, n),
                  _map(os.path.join(directory, "starts.i64"), np.int64, docs),
                  meta["tokenized_by"], supervised, directory)  # fmt: skip


def _complete(directory: str) -> bool:
    """The token files of `directory` are all there, as long as meta.json says."""
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        sizes = {"tokens.i32": 4 * meta["tokens"], "starts.i64": 8 * meta["documents"]}
        if meta["kind"] == "chat":
            sizes["supervised.u8"] = meta["tokens"]
        return all(os.path.getsize(os.path.join(directory, n)) == b for n, b in sizes.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _no_fault(point: str) -> None:
    del point


def load_corpus(
    path: str, tokenizer_dir: str | None, vocab_size: int, *, kind: str = "text",
    cache_dir: str = "", fault: Callable[[str], None] | None = None,
) -> Corpus:  # fmt: skip
    """The corpus of `--data kind:path`, tokenized for a model of `vocab_size` ids (once: see the
    module docstring), memory-mapped from `cache_dir` (default: default_cache()). `fault`
    (testing): called at each point of a tokenization ("batch", "files", "synced", "renamed")."""
    cache = cache_dir or default_cache()
    final = os.path.join(cache, _key(kind, path, tokenizer_dir, vocab_size))
    if not _complete(final):
        os.makedirs(cache, exist_ok=True)
        with open(final + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
            if not _complete(final):
                _clear(cache, os.path.basename(final))
                tmp = f"{final}.tmp{os.getpid()}"
                try:
                    _build(kind, path, tokenizer_dir, vocab_size, tmp, fault or _no_fault)
                    publish(tmp, final)  # replaces (then deletes) an incomplete `final`
                    _open.cache_clear()  # never the mapping of a replaced directory's files
                    (fault or _no_fault)("renamed")
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return _open(final)


def _clear(cache: str, key: str) -> None:
    """Under the lock: what a killed tokenization of `key` left (no live writer holds it)."""
    for name in os.listdir(cache):
        if name.startswith(f"{key}.tmp"):
            shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
