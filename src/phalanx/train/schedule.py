"""AdamW and its learning-rate schedule (warm-up, then linear, cosine or constant)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import get_scheduler

from phalanx.config.schema import TrainingConfig


def make_optimizer(model: nn.Module, cfg: TrainingConfig, fused_on_cuda: bool = True) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # On CUDA the fused kernel updates every tensor in one launch (Trainer's default there too); CPU keeps
    # torch's default. DeepSpeed asks for the unfused one: its offload moves the state to the CPU later.
    fused = fused_on_cuda and bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int):
    name = {"constant": "constant_with_warmup"}.get(cfg.lr_scheduler, cfg.lr_scheduler)
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def take_configured_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: Any, cfg: TrainingConfig, total_steps: int
) -> list[str]:
    """After a resume: the optimizer and its schedule go on at the config's learning rate and weight decay, on the
    schedule of this run's total_steps; returns what changed ("learning_rate 0.01 -> 0.001"), nothing on a plain
    resume (which then stays bit-exact).

    Loading a checkpoint brings back the saved run's param_groups (lr, initial_lr, weight_decay) and the schedule's
    base_lrs, so a resume under --force with another learning_rate or weight_decay, a config diff the user saw and
    accepted, trained on at the old values while the run's record and banner named the new ones (Hugging Face
    Trainer's resume keeps the old ones too). The schedule's position is kept: the new rate takes over at the same
    point of its warm-up and decay.

    The schedule's shape is this run's (make_scheduler's lambdas, which no checkpoint holds), but the first resumed
    step would run at the learning rate the saved run's schedule left in param_groups: a run of 6 steps extended to
    8 (--max_steps 8 --force) trained step 7 at 0.0, the end of the 6-step decay, and step 8 on the 8-step one. So
    the rate at the resumed position is taken from this run's schedule too, and a change is said."""
    old_lr, old_decay = scheduler.base_lrs[0], optimizer.param_groups[0]["weight_decay"]
    changes = [
        f"{name} {old:g} -> {new:g}"
        for name, old, new in (
            ("learning_rate", old_lr, cfg.learning_rate),
            ("weight_decay", old_decay, cfg.weight_decay),
        )
        if old != new
    ]
    base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(base_lrs, scheduler.lr_lambdas)]
    resumed_lrs = [group["lr"] for group in optimizer.param_groups]
    if not changes and lrs != resumed_lrs:
        changes.append(
            f"learning rate at step {scheduler.last_epoch} {resumed_lrs[0]:g} -> {lrs[0]:g} (the schedule now runs "
            f"{total_steps} steps)"
        )
    if changes:
        scheduler.base_lrs = base_lrs
        for group, lr in zip(optimizer.param_groups, lrs):
            group.update(lr=lr, initial_lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        scheduler._last_lr = lrs  # what get_last_lr() reports (the metrics' lr column) until the next step
    return changes
