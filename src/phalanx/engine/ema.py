"""Exponential moving average of a model's weights, updated after every optimizer step.

Every rank holds its own copy and updates it from the same (all-reduced) weights, so the
copies stay equal without communication; the engine still broadcasts rank 0's buffers
before validating, which covers running statistics of BatchNorm layers that were not
synchronised.

    ema = decay_t * ema + (1 - decay_t) * weights,   decay_t = min(decay, (1 + t) / (10 + t))

where t counts the updates made so far. The warm-up term keeps early averages from being
dominated by the random initial weights (with decay 0.9999 a plain average would take
tens of thousands of steps to forget them); pass `warmup=False` for a constant decay.
Floating-point parameters and buffers are averaged; integer buffers (BatchNorm's batch
counter) are copied.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ModelEMA:
    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.updates = 0
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    def decay_at(self, updates: int) -> float:
        """The decay used for the update that follows `updates` earlier ones."""
        return min(self.decay, (1 + updates) / (10 + updates)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.decay_at(self.updates)
        current = model.state_dict()
        for name, average in self.module.state_dict().items():
            value = current[name].detach()
            if average.is_floating_point():
                average.mul_(d).add_(value.to(average.dtype), alpha=1.0 - d)
            else:
                average.copy_(value)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        self.module.load_state_dict(state["module"])
