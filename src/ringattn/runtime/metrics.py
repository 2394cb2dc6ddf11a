"""TensorBoard event files of a training run: every numeric field of a step's JSON record.

    record {"step": 12, "loss": 2.1, "lr": 3e-3, "grad_norm": 0.8, "tokens_per_s": 9100.0,
            "mfu": 0.012, "peak_mb": [61, 60], ...}
      -> scalars  loss, lr, grad_norm, tokens_per_s, mfu, ...   at global step 12
                  peak_mb/rank0, peak_mb/rank1                   (one curve per rank)

The tags are the JSON log's keys, so the log and the event files carry the same fields; None
(an MFU with no known peak) and booleans are left out. The writer is
`torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package: an optional extra,
`pip install 'ringattn[tensorboard]'`, installed by scripts/setup.sh); only rank 0 writes, under
OUT_DIR/tensorboard, so `tensorboard --logdir OUT_DIR` shows the run. A resumed run appends a new
event file beside the old ones; TensorBoard joins them by step.
"""

from __future__ import annotations

from ringattn.runtime.extras import require

__all__ = ["TensorBoard", "check_tensorboard"]

_SKIP = ("step", "event")


def check_tensorboard() -> None:
    """MissingExtra (a ValueError) with the fix when the optional `tensorboard` is missing."""
    require("tensorboard", "ringattn train --tensorboard")


class TensorBoard:
    """Scalars of each step record, written to event files under `log_dir`."""

    def __init__(self, log_dir: str):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard package

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key in _SKIP or isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, (list, tuple)):
                for rank, item in enumerate(value):
                    if isinstance(item, (int, float)) and not isinstance(item, bool):
                        self.writer.add_scalar(f"{key}/rank{rank}", item, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
