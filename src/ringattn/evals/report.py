"""What `ringattn eval niah` leaves behind: the JSON, the length x depth table, the heatmap.

niah.json   {"model", "task", "lengths", "depths", "nproc", "tp", "seed", "chat", "haystack",
             "tokenized_by", "results": [{"length", "depth", "correct", "score", "answer",
             "expected", "ttft_s", "prompt_tokens"}, ...], "accuracy"}
            depth in percent (0: the needle opens the haystack, 100: it closes it);
            correct: every expected string is in the answer; score: the fraction that is;
            expected: the value (niah, multikey) or the list of values (multivalue,
            vartrack); accuracy: the mean of correct over the grid
table       one row per depth, one column per length, the score as a percentage
niah.png    the familiar heatmap: length on x, depth on y, score from red (0) to green (1);
            needs matplotlib (the `plot` extra): without it the JSON and the table are
            written and the plot is said to be skipped
"""

from __future__ import annotations

import json
import math
import os

__all__ = ["accuracy", "heatmap", "summary", "table", "write_json"]


def accuracy(results: list[dict]) -> float:
    return sum(bool(r["correct"]) for r in results) / len(results) if results else 0.0


def summary(meta: dict, results: list[dict]) -> dict:
    """The JSON document: the run's settings, each cell's result, the accuracy."""
    return {**meta, "results": results, "accuracy": accuracy(results)}


def write_json(document: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _grid(results: list[dict]) -> tuple[list[int], list[float], dict]:
    lengths = sorted({r["length"] for r in results})
    depths = sorted({r["depth"] for r in results})
    cells = {(r["length"], r["depth"]): r["score"] for r in results}
    return lengths, depths, cells


def table(results: list[dict], title: str = "") -> str:
    """The grid as text: depth rows, length columns, each cell's score in percent."""
    lengths, depths, cells = _grid(results)
    width = max(7, *(len(str(n)) + 1 for n in lengths))
    lines = [title] if title else []
    lines.append("depth \\ length" + "".join(f"{n:>{width}}" for n in lengths))
    for depth in depths:
        row = "".join(
            f"{100 * cells[(n, depth)]:>{width - 1}.0f}%" if (n, depth) in cells else " " * width
            for n in lengths
        )
        lines.append(f"{depth:>13g}%" + row)
    means = []
    for n in lengths:
        column = [cells[(n, d)] for d in depths if (n, d) in cells]
        means.append(f"{100 * sum(column) / len(column):>{width - 1}.0f}%")
    lines.append(f"{'mean':>14}" + "".join(means))
    return "\n".join(lines)


def heatmap(results: list[dict], path: str, title: str) -> str | None:
    """Write the heatmap PNG (length on x, depth on y, red to green); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
    except ImportError:
        return None
    lengths, depths, cells = _grid(results)
    grid = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
    colors = LinearSegmentedColormap.from_list("ruler", ["#d7301f", "#fee08b", "#1a9850"])
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(lengths), 1.4 + 0.5 * len(depths)))
    image = ax.imshow(grid, cmap=colors, vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):
                ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
