"""Training progress for humans (an updating line) and for programs (JSON lines).

    step 120/400 [######..............] loss 1.2345 acc 0.45 | 12.3k tok/s | peak MB 210 205 | 45s

On a terminal the line is rewritten in place (`\\r`); otherwise (a log file, a pipe, pytest) one
line is printed every `every` steps and at the last step. `JsonLog` appends one JSON object per
line, so a resumed run continues the same file and a crash loses at most the line being written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TextIO

__all__ = ["JsonLog", "ProgressBar"]


class ProgressBar:
    def __init__(self, total: int, every: int = 10, stream: TextIO | None = None, width: int = 20):
        self.total, self.every, self.width = total, max(1, every), width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._open = False  # a \r line is on screen and needs a newline before other output

    def update(
        self, step: int, loss: float, accuracy: float, tokens_per_s: float, peak_mb: list[float]
    ) -> None:
        """Show the state after `step` steps (1-based)."""
        last = step == self.total
        if not self.tty and step % self.every and not last:
            return
        filled = self.width * step // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        memory = " ".join(f"{m:.0f}" for m in peak_mb)
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} "
            f"acc {accuracy:.2f} | {_si(tokens_per_s)} tok/s | peak MB {memory} | "
            f"{time.perf_counter() - self.start:.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + text + ("\n" if last else ""))
            self._open = not last
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def write(self, text: str) -> None:
        """Print a message line without breaking the bar."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _si(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


class JsonLog:
    """Append-only JSON-lines log (one object per line)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_log(path: str) -> list[dict]:
    """Every record of a JSON-lines log."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
