"""The records of `--data` for `train --hf`, streamed one at a time (never the whole corpus).

    text:FILE            one document per blank-line-separated block (read 16 MiB at a time)
    text:DIR             every file under DIR, sorted by path: FILE.jsonl / FILE.parquet give one
                         document per row's `text` column; any other file is one document
    chat:FILE.jsonl      one conversation per line: {"messages": [{"role": ..., "content": ...}]}
    chat:DIR             every .jsonl / .parquet file under DIR, the `messages` column

`records(kind, path)` yields bytes (text) or lists of message dicts (chat). Parquet files are read
row group by row group with pyarrow (`pip install ringattn[data]`, what the `datasets` library
reads them with); JSON lines with the standard library, line by line. `files(path)` lists what a
run depends on (the token cache's key: corpus.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

from ringattn.runtime.extras import require

__all__ = ["KINDS", "files", "records", "split_data"]

KINDS = ("text", "chat")
_BLANK_LINE = re.compile(rb"\r?\n[ \t]*\r?\n")
_PIECE = 16 << 20  # bytes read at a time from a text file
_TABLES = (".jsonl", ".parquet")


def split_data(data: str) -> tuple[str, str]:
    """`text:PATH` / `chat:PATH` -> (kind, path); ValueError naming the forms otherwise."""
    kind, _, path = data.partition(":")
    if kind not in KINDS or not path:
        raise ValueError(
            f"--hf trains on packed text documents: give --data text:PATH (a directory, one "
            f"document per file or per .jsonl/.parquet row's 'text', or a file of "
            f"blank-line-separated documents) or chat:PATH (a .jsonl of one "
            f"{{'messages': [...]}} per line, or a directory of .jsonl/.parquet files with a "
            f"'messages' column), not {data!r}"
        )
    if not os.path.exists(path):
        raise ValueError(f"--data {data}: no such file or directory")
    return kind, path


def files(path: str) -> list[str]:
    """Every file under `path` (sorted), or [path] for a file."""
    if os.path.isdir(path):
        return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    return [path]


def _blocks(name: str) -> Iterator[bytes]:
    """The blank-line-separated blocks of a file, stripped, read a piece at a time."""
    rest = b""
    with open(name, "rb") as f:
        while piece := f.read(_PIECE):
            parts = _BLANK_LINE.split(rest + piece)
            rest = parts.pop()  # may continue in the next piece
            yield from (p.strip() for p in parts)
    yield rest.strip()


def _jsonl(name: str, column: str) -> Iterator[object]:
    with open(name, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name}:{number}: not JSON ({err})") from None
            if not isinstance(row, dict) or column not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{name}:{number}: no '{column}' field (got {keys})")
            yield row[column]


def _parquet(name: str, column: str) -> Iterator[object]:
    require("data", f"ringattn train --data with .parquet files ({name})")
    import pyarrow.parquet as pq  # optional: the data extra

    table = pq.ParquetFile(name)
    if column not in table.schema_arrow.names:
        raise ValueError(f"{name}: no '{column}' column (got {table.schema_arrow.names})")
    for group in range(table.num_row_groups):
        yield from table.read_row_group(group, columns=[column]).column(column).to_pylist()


def _text(value: object, name: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{name}: a 'text' value is {type(value).__name__}, not a string")
    return value.encode("utf-8").strip()


def records(kind: str, path: str) -> Iterator[object]:
    """Documents (bytes, empty ones skipped) or conversations (lists of messages) of `path`."""
    if kind == "chat":
        for name in files(path):
            if name.endswith(".jsonl"):
                yield from _jsonl(name, "messages")
            elif name.endswith(".parquet"):
                yield from _parquet(name, "messages")
            elif not os.path.isdir(path):
                raise ValueError(f"--data chat:{path}: give a .jsonl file or a directory of them")
        return
    for name in files(path):
        if os.path.isdir(path) and name.endswith(_TABLES):
            rows = _jsonl(name, "text") if name.endswith(".jsonl") else _parquet(name, "text")
            docs = (_text(v, name) for v in rows)
        elif os.path.isdir(path):
            with open(name, "rb") as f:
                docs = iter([f.read().strip()])
        else:
            docs = _blocks(name)
        yield from (d for d in docs if d)
