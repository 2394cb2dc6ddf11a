"""`ringattn plan --lengths`: a distribution of document lengths, drawn into training windows.

Two forms:

    lognormal:MEAN,SIGMA,MIN,MAX   lengths lognormal with that mean and sigma (of the log),
                                   clipped to [MIN, MAX]: train's `--data docs:MEAN,SIGMA,MIN,MAX`
    FILE                           a corpus's lengths, one integer per line or a JSON list;
                                   each document's length is drawn uniformly from them

Either way window i of --seq-len tokens is filled exactly as train's `docs:` source fills it
(documents.py): draw a length, cut it where the window ends, repeat until the
window is full; the generator is seeded by (seed, i), so window i is the same in every run and
the lognormal form gives the very windows `ringattn train --data docs:...` reads at that seed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ringattn.planner.dynamic_cp.documents import DocumentTask, _generator

__all__ = ["FileLengths", "parse_lengths", "window_lengths"]

PREFIX = "lognormal:"


@dataclass(frozen=True)
class FileLengths:
    """Windows of `seq_len` tokens packed with lengths drawn uniformly from `pool`."""

    seq_len: int
    pool: tuple[int, ...]
    seed: int = 0

    def lengths(self, index: int) -> list[int]:
        """The document lengths of window `index` (they sum to seq_len)."""
        gen = _generator(self.seed, index)
        out, left = [], self.seq_len
        while left > 0:
            pick = int(torch.randint(len(self.pool), (1,), generator=gen, device="cpu"))
            out.append(min(self.pool[pick], left))
            left -= out[-1]
        return out


def _read_file(path: str) -> tuple[int, ...]:
    """A file's lengths: a JSON list of integers, or one integer per line (blank lines skipped)."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--lengths {path}: not a JSON list of integers ({err})") from None
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise ValueError(f"--lengths {path}: the JSON list holds non-integers, e.g. {bad[:3]}")
    else:
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                values.append(int(line))
            except ValueError:
                raise ValueError(
                    f"--lengths {path}, line {number}: {line.strip()!r} is not an "
                    "integer (give one document length per line)"
                ) from None
    if not values:
        raise ValueError(
            f"--lengths {path}: no lengths in the file (one integer per line, or a JSON list)"
        )
    small = [v for v in values if v < 1]
    if small:
        raise ValueError(f"--lengths {path}: lengths must be >= 1, got {small[:5]}")
    return tuple(values)


def parse_lengths(spec: str, seq_len: int, seed: int = 0) -> DocumentTask | FileLengths:
    """`lognormal:MEAN,SIGMA,MIN,MAX` or a file's path -> a source of windows (`.lengths(i)`);
    a ValueError naming the spec, the values and the form otherwise."""
    if seq_len < 1:
        raise ValueError(f"--lengths needs --seq-len >= 1, got {seq_len}")
    if not spec.startswith(PREFIX):
        if not os.path.isfile(spec):
            raise ValueError(
                f"--lengths {spec!r}: neither lognormal:MEAN,SIGMA,MIN,MAX (e.g. "
                "lognormal:1024,1.5,128,8192) nor an existing file of lengths"
            )
        return FileLengths(seq_len, _read_file(spec), seed)
    parts = spec[len(PREFIX) :].split(",")
    try:
        if len(parts) != 4:
            raise ValueError
        mean, sigma, low, high = float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        raise ValueError(
            f"--lengths {spec!r}: expected lognormal:MEAN,SIGMA,MIN,MAX (MIN and "
            "MAX integers), e.g. lognormal:1024,1.5,128,8192"
        ) from None
    if not mean > 0:
        raise ValueError(f"--lengths {spec!r}: MEAN must be > 0, got {mean:g}")
    if not sigma > 0:
        raise ValueError(
            f"--lengths {spec!r}: SIGMA must be > 0, got {sigma:g} (for documents "
            "of one length give a file holding that length)"
        )
    if low < 1 or low > high:
        raise ValueError(f"--lengths {spec!r}: need 1 <= MIN <= MAX, got MIN={low}, MAX={high}")
    return DocumentTask(seq_len, mean, sigma, low, high, seed)


def window_lengths(
    source: DocumentTask | FileLengths, step: int, windows: int
) -> tuple[list[int], list[int]]:
    """The lengths of step `step`'s global batch of `windows` windows (dp x batch size), in
    window order, and each document's window index within the step (what the loader reads)."""
    lengths, window = [], []
    for w in range(windows):
        got = source.lengths(step * windows + w)
        lengths += got
        window += [w] * len(got)
    return lengths, window
