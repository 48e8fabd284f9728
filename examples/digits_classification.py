"""Train a small CNN with BatchNorm on scikit-learn's bundled 8x8 digits with phalanx's TrainingEngine.

No download: `sklearn.datasets.load_digits` ships with scikit-learn (pip install scikit-learn).

    # one process (GPU if there is one, else CPU)
    python examples/digits_classification.py --epochs 15
    # two ranks (GPUs, or CPU processes over gloo), SyncBatchNorm, per-rank batch 64
    python examples/digits_classification.py --distributed --world-size 2
    # mixed precision (CUDA only; fp32 with a warning on CPU) and EMA weights for validation
    python examples/digits_classification.py --distributed --use-amp --use-ema

Checkpoints and metrics.jsonl go to runs/<experiment-name>/ (checkpoint-best, checkpoint-last).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from phalanx import distributed_train_worker, launch_distributed_training
from phalanx.errors import PhalanxError


class DigitsCNN(nn.Module):
    """conv-BN-ReLU x2, pool, conv-BN-ReLU, global pool, linear: about 93k parameters."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(1, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits_datasets(seed: int = 0, val_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """1,797 images (8x8, 16 grey levels) split into train/validation, stratified by class."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(torch.arange(len(labels)).numpy(), test_size=val_fraction,
                                          random_state=seed, stratify=labels.numpy())
    return (TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[val_idx], labels[val_idx]))


# Module-level factories (not lambdas): spawned ranks receive them by pickling.
def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, nesterov=True)


def make_scheduler(optimizer: torch.optim.Optimizer, epochs: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)


def whole_number(least: int):
    """argparse type: an int of at least `least`, so `--batch-size 0` is named by argparse, not by torch's sampler
    in a traceback."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, at least {least}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--distributed", action="store_true", help="train on --world-size ranks with DDP")
    p.add_argument("--world-size", type=whole_number(0), default=None,
                   help="ranks to start (default: the number of GPUs, or 2 CPU processes without GPUs)")
    p.add_argument("--epochs", type=whole_number(0), default=15)
    p.add_argument("--batch-size", type=whole_number(1), default=64,
                   help="per rank; the effective batch is this x world size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--use-amp", action="store_true", help="mixed precision (bf16, or fp16 with a GradScaler); CUDA only")
    p.add_argument("--use-ema", action="store_true", help="keep EMA weights and validate on them")
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--backend", default=None, help="nccl or gloo (default: nccl on CUDA, gloo on CPU)")
    p.add_argument("--num-workers", type=whole_number(0), default=0, help="DataLoader workers per rank")
    p.add_argument("--experiment-name", default="digits")
    p.add_argument("--output-dir", default="runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    if args.world_size is not None and not args.distributed:
        # Without --distributed the example trains in this process: the ranks asked for would not start.
        p.error(f"--world-size {args.world_size} starts ranks only with --distributed (add it, or leave --world-size out)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    train_set, val_set = digits_datasets(args.seed)
    config = {
        "model_fn": DigitsCNN,
        "train_dataset": train_set,
        "val_dataset": val_set,
        "batch_size": args.batch_size,
        "num_workers": args.num_workers,
        "optimizer_fn": functools.partial(make_optimizer, lr=args.lr, weight_decay=args.weight_decay),
        "criterion_fn": nn.CrossEntropyLoss,
        "scheduler_fn": functools.partial(make_scheduler, epochs=args.epochs),
        "engine_kwargs": {"use_amp": args.use_amp, "use_ema": args.use_ema, "ema_decay": args.ema_decay,
                          "experiment_name": args.experiment_name, "output_dir": args.output_dir,
                          "progress_bar": not args.no_progress_bar},
        "train_kwargs": {"num_epochs": args.epochs, "save_best": True, "save_last": True, "monitor": "val_acc"},
        "seed": args.seed,
    }
    started = time.perf_counter()
    if args.distributed:
        # 0 is a request (launch_distributed_training warns and trains in this process), not 'unset'
        world_size = args.world_size if args.world_size is not None else (torch.cuda.device_count() or 2)
        history = launch_distributed_training(distributed_train_worker, world_size, backend=args.backend, **config)
    else:
        history = distributed_train_worker(0, 1, **config)
    elapsed = time.perf_counter() - started
    best = max(history["val_acc"])
    print(f"✅ Final val accuracy {history['val_acc'][-1]:.2%} (best {best:.2%}) after {len(history['epoch'])} epochs "
          f"in {elapsed:.1f}s; checkpoints in {args.output_dir}/{args.experiment_name}/")
    return history


if __name__ == "__main__":
    try:
        main()
    except PhalanxError as exc:
        # What the engine refuses (a bad --backend, an output folder in use) is the user's to fix: one line and
        # status 2, as phalanx's own commands answer, not a traceback (from every rank, under --distributed).
        print(f"{exc.label}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
