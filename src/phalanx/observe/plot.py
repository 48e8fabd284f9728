"""The loss-curve PNG written next to the model at the end of a run."""

from __future__ import annotations

from pathlib import Path


def plot_loss_curve(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in history if r["kind"] == "train"]
    evals = [(r["step"], r["loss"]) for r in history if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), marker="o", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
