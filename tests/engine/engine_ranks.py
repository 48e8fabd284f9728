"""Models, data and rank functions for the TrainingEngine tests (importable by spawned ranks as engine.engine_ranks).

The same functions train the one-process reference in the test process and the ranks in
spawned children, so the two sides differ only in world size and per-rank batch.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def mlp() -> nn.Module:
    """No BatchNorm: plain DDP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def bn_cnn() -> nn.Module:
    """BatchNorm2d and BatchNorm1d: synchronised when distributed."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


def dataset(kind: str, rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 10, generator=g) if kind == "mlp" else torch.randn(rows, 1, 6, 6, generator=g) * 2 + 0.5
    y = torch.randint(0, 3, (rows,), generator=g)
    return TensorDataset(x, y)


def sgd(params, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


CASES = {  # kind -> (model, train rows, val rows, per-rank batch with 2 ranks)
    "mlp": (mlp, 64, 13, 8),
    "bn": (bn_cnn, 48, 13, 6),
}


def train_case(kind: str, rank: int, world: int, out_dir: str, epochs: int = 3) -> dict:
    """Method 1 of seed 004: the caller builds samplers and loaders, the engine trains. Batch 2b // world per rank."""
    from phalanx import TrainingEngine

    model_fn, train_rows, val_rows, batch = CASES[kind]
    train_set, val_set = dataset(kind, train_rows, 1), dataset(kind, val_rows, 2)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=batch * 2 // world, sampler=sampler)
    # Validation split without padding: rank 0 holds 7 rows (batches 4+3), rank 1 6 rows (4+2).
    val_loader = DataLoader(Subset(val_set, range(rank, val_rows, world)), batch_size=4)
    engine = TrainingEngine(
        model_fn(),
        "cpu",
        distributed=world > 1,
        local_rank=rank,
        world_size=world,
        use_ema=kind == "mlp",
        ema_decay=0.9,
        experiment_name=kind,
        output_dir=out_dir,
        progress_bar=False,
        tensorboard=False,
    )
    optimizer = sgd(engine.unwrapped_model.parameters())
    history = engine.train(train_loader, val_loader, optimizer, nn.CrossEntropyLoss(), num_epochs=epochs)
    out = {
        "history": history,
        "weights": {k: v.clone() for k, v in engine.unwrapped_model.state_dict().items()},
        "bn_layers": sorted(
            {type(m).__name__ for m in engine.unwrapped_model.modules() if "BatchNorm" in type(m).__name__}
        ),
    }
    if engine.ema is not None:
        out["ema"] = {k: v.clone() for k, v in engine.ema.module.state_dict().items()}
    return out


def uneven_metrics(rank: int, world: int) -> dict:
    """Rank 0 holds 5 samples (batches of 3 and 2), rank 1 holds 2: counts must weigh the reduction."""
    from phalanx.engine.metrics import MetricTotals, weighted_mean

    g = torch.Generator().manual_seed(10 + rank)
    sizes = [3, 2] if rank == 0 else [2]
    totals = MetricTotals(torch.device("cpu"))
    rows = []
    for n in sizes:
        outputs, targets = torch.randn(n, 4, generator=g), torch.randint(0, 4, (n,), generator=g)
        loss = nn.functional.cross_entropy(outputs, targets)
        totals.add(loss, outputs, targets)
        rows.append((outputs, targets))
    reduced = totals.reduce()
    per_sample = torch.cat([nn.functional.cross_entropy(o, t, reduction="none") for o, t in rows])
    return {
        "reduced": reduced,
        "outputs": torch.cat([o for o, _ in rows]),
        "targets": torch.cat([t for _, t in rows]),
        "weighted_mean": weighted_mean(per_sample.sum(), len(per_sample)),
    }


def rank_checks(rank: int, world: int, out_dir: str) -> dict:
    """Everything one 2-rank launch checks: both equivalence cases, uneven metrics, reduce_tensor."""
    from phalanx import TrainingEngine

    torch.set_num_threads(1)  # two ranks on two cores
    results = {kind: train_case(kind, rank, world, out_dir) for kind in CASES}
    results["uneven"] = uneven_metrics(rank, world)
    engine = TrainingEngine(
        mlp(),
        "cpu",
        distributed=True,
        local_rank=rank,
        world_size=world,
        progress_bar=False,
        tensorboard=False,
        experiment_name="reduce",
        output_dir=out_dir,
    )
    value = torch.tensor([float(rank + 1), 10.0])
    results["reduce_mean"] = engine._reduce_tensor(value)
    results["reduce_sum"] = engine.reduce_tensor(value, average=False)
    results["value_untouched"] = value
    return results


def worker_config(out_dir: str, batch: int) -> dict:
    """Seed 004's Method 2 config; everything pickles, so launch_distributed_training spawns."""
    return {
        "model_fn": bn_cnn,
        "train_dataset": dataset("bn", 48, 1),
        "val_dataset": dataset("bn", 13, 2),
        "batch_size": batch,
        "num_workers": 0,
        "optimizer_fn": functools.partial(sgd, lr=0.05),
        "criterion_fn": nn.CrossEntropyLoss,
        "scheduler_fn": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        "engine_kwargs": {
            "use_ema": True,
            "ema_decay": 0.9,
            "experiment_name": "worker",
            "output_dir": out_dir,
            "progress_bar": False,
            "tensorboard": False,
        },
        "train_kwargs": {"num_epochs": 2, "save_best": True, "save_last": True},
    }


def fail_on_rank_one(rank: int, world_size: int) -> None:
    """Rank 1 raises after joining the group; rank 0 waits in a collective and must be stopped, not left hanging."""
    from phalanx import TrainingEngine

    TrainingEngine.setup_distributed(rank, world_size)  # the launcher's default backend: gloo on CPU
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    dist.barrier()


class RecordingLoss(nn.Module):
    """Cross-entropy that appends each training step's loss to `prefix`.rank{r} (repr: the exact float)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(outputs, targets)
        if torch.is_grad_enabled():  # training, not validation
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(f"{self.prefix}.rank{rank}", "a", encoding="utf-8") as f:
                f.write(f"{loss.item()!r}\n")
        return loss


def dropout_mlp() -> nn.Module:
    """Dropout makes every step depend on each rank's RNG: an exact resume must restore it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def resume_config(out_dir: str, losses: str, **train_kwargs) -> dict:
    """2 ranks x batch 8 over 64 rows: 4 steps per epoch, 3 epochs; checkpoint-last every 3 steps and per epoch.
    AdamW, a per-step schedule, EMA, dropout, and a DataLoader worker (which reads ahead of the training)."""
    return {
        "model_fn": dropout_mlp,
        "train_dataset": dataset("mlp", 64, 1),
        "val_dataset": dataset("mlp", 13, 2),
        "batch_size": 8,
        "num_workers": 1,
        "optimizer_fn": functools.partial(torch.optim.AdamW, lr=1e-2),
        "criterion_fn": functools.partial(RecordingLoss, losses),
        "scheduler_fn": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
        "engine_kwargs": {
            "use_ema": True,
            "ema_decay": 0.9,
            "experiment_name": "resume",
            "output_dir": out_dir,
            "progress_bar": False,
            "tensorboard": False,
        },
        "train_kwargs": {"num_epochs": 3, "save_steps": 3, "scheduler_interval": "step", **train_kwargs},
    }
