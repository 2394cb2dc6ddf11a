"""Training curves as a PNG: loss and accuracy over the steps, and each rank's peak memory."""

from __future__ import annotations


def plot(
    history: list[dict],
    path: str,
    title: str,
    *,
    loss_label: str = "loss (answers only)",
    accuracy_label: str = "retrieval accuracy",
) -> str | None:
    """Write the curves of `history` (the trainer's step records) to `path`; None without
    matplotlib (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    ax_loss.plot(steps, [h["loss"] for h in history], color="tab:blue", lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(loss_label, color="tab:blue")
    ax_acc = ax_loss.twinx()
    ax_acc.plot(steps, [h["accuracy"] for h in history], color="tab:orange", lw=1, alpha=0.8)
    ax_acc.set_ylabel(accuracy_label, color="tab:orange")
    ax_acc.set_ylim(0, 1.02)
    ax_loss.set_title(title, fontsize=9)
    peaks = history[-1]["peak_mb"]
    ax_mem.bar([str(r) for r in range(len(peaks))], peaks, color="tab:green")
    ax_mem.set_xlabel("rank")
    ax_mem.set_ylabel("peak memory added by training (MB)")
    ax_mem.set_title("per-rank peak memory", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
