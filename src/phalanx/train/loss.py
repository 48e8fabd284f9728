"""Causal-LM loss as a sum over target tokens, so the caller can divide by the global token count.

Dividing each micro-batch's sum by the number of target tokens in the whole global batch
(all micro-batches, all ranks) makes accumulation and data parallelism exact: 2 ranks x
batch b x accumulation a gives the loss of one process with batch 2ab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss: a label at position t+1 is predicted from position t."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (fp32 logits for a stable softmax)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    shift_logits = logits[:, :-1, :].float()
    shift_labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
