"""AdamW and its learning-rate schedule (warm-up, then linear, cosine or constant)."""

from __future__ import annotations

import math

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
