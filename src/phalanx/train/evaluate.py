"""Evaluation: token-weighted loss over every rank's shard, not rank 0's alone."""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.runtime.dist import all_reduce_sum
from phalanx.train.loss import count_target_tokens, token_loss_sum


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, autocast) -> dict:
    """Mean loss per target token over all ranks' batches (ranks may hold different counts), and perplexity."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, target tokens]
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss_sum = token_loss_sum(model, batch)
        totals[0] += loss_sum.double()
        totals[1] += count_target_tokens(batch["labels"])
    all_reduce_sum(totals)
    model.train(was_training)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(totals[1].item())}
