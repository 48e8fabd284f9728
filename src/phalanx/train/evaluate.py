"""Evaluation: token-weighted loss over every rank's shard, not rank 0's alone."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from phalanx.data.collate import batch_counts, to_device
from phalanx.models.graphs import GraphShapes
from phalanx.runtime.dist import all_reduce_sum
from phalanx.train.loss import token_loss_sum


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, autocast, shapes: Optional[GraphShapes] = None) -> dict:
    """Mean loss per target token over all ranks' batches (ranks may hold different counts), and perplexity.

    The same loss path as training (packed or padded batches, target positions only); token counts from the host.
    `shapes`: the graph shapes batches are padded to, as in training (training.cuda_graphs)."""
    was_training = model.training
    model.eval()
    loss_total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for batch in batches:
        tokens += batch_counts(batch)[0]
        if shapes is not None:
            batch = shapes.pad(batch)
            shapes.begin_pass()
        batch = to_device(batch, device)
        with autocast():
            loss_sum = token_loss_sum(model, batch)
        loss_total += loss_sum.double()
    totals = torch.stack(
        [loss_total, torch.tensor(float(tokens), dtype=torch.float64, device=device)]
    )  # [loss sum, target tokens]
    all_reduce_sum(totals)
    model.train(was_training)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(totals[1].item())}
