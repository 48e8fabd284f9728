"""Metrics of the engine, reduced over ranks by counts: sums and counts travel, means are taken last.

A mean of per-rank means is wrong as soon as ranks hold different numbers of samples (an
uneven last batch, a validation shard that does not divide evenly); summing
`loss * samples`, correct predictions and counts over ranks, then dividing, is exact.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.runtime.dist import all_reduce_sum


def reduce_tensor(tensor: torch.Tensor, average: bool = True) -> torch.Tensor:
    """A copy of `tensor` summed over ranks, divided by the world size when `average` (seed 004's `_reduce_tensor`).

    Every rank's value weighs the same: right for quantities that are already global or
    per-rank by nature. For per-sample metrics over shards of different sizes, sum the
    numerator and the count separately (`weighted_mean`). Without a process group the
    value comes back unchanged.
    """
    import torch.distributed as dist

    out = tensor.detach().clone()
    if not (dist.is_available() and dist.is_initialized()):
        return out
    all_reduce_sum(out)
    return out / dist.get_world_size() if average else out


def weighted_mean(total: float | torch.Tensor, count: float | torch.Tensor) -> float:
    """sum(total over ranks) / sum(count over ranks): the mean over every sample of every rank."""
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    device = (
        torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    )  # NCCL reduces GPU tensors only
    pair = torch.tensor([float(total), float(count)], dtype=torch.float64, device=device)
    all_reduce_sum(pair)
    return (pair[0] / pair[1]).item() if pair[1] > 0 else float("nan")


def is_classification(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Class scores [N, C, ...] against integer labels [N, ...]: accuracy is meaningful."""
    return (
        outputs.dim() >= 2
        and outputs.shape[1] > 1
        and not targets.is_floating_point()
        and targets.dim() == outputs.dim() - 1
        and targets.shape[0] == outputs.shape[0]
        and targets.shape[1:] == outputs.shape[2:]
    )


class MetricTotals:
    """Running sums of one epoch on this rank: loss * samples, samples, correct labels, labels, classification seen."""

    def __init__(self, device: torch.device):
        # float64: sums of thousands of fp32 losses must not drift before they are divided
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, outputs: Any, targets: torch.Tensor) -> None:
        """`loss` is the batch's mean loss (the criterion's usual reduction), so it weighs by the batch's samples.
        `outputs` may be anything the model returns (a dict, a tuple): accuracy is counted for class scores only."""
        scores = isinstance(outputs, torch.Tensor)
        samples = targets.shape[0] if targets.dim() > 0 else (outputs.shape[0] if scores else 1)
        self.sums[0] += loss.detach().double() * samples
        self.sums[1] += samples
        if scores and is_classification(outputs, targets):
            self.sums[4] = 1
            self.sums[2] += (outputs.detach().argmax(dim=1) == targets).sum()
            self.sums[3] += targets.numel()

    def reduce(self) -> dict:
        """Means over every rank's samples; every rank gets the same numbers (accuracy only for classification)."""
        totals = all_reduce_sum(self.sums.clone()).tolist()  # one collective for all five sums
        out = {"loss": totals[0] / totals[1] if totals[1] else float("nan"), "samples": int(totals[1])}
        if totals[4] > 0 and totals[3] > 0:
            out["accuracy"] = totals[2] / totals[3]
        return out
