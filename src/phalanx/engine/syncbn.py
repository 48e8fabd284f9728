"""Synchronised BatchNorm for every device: batch statistics over the global batch of all ranks.

torch's `nn.SyncBatchNorm` runs only on GPUs/XPUs; CPU ranks over gloo need their own. On
CUDA the engine uses torch's (fused kernels); elsewhere `CPUSyncBatchNorm` below, which
all-reduces per-channel sums with autograd, so N ranks with batch b normalise and
back-propagate exactly like one process with batch N*b. In eval mode, or without a
process group, both behave as plain BatchNorm (running statistics, no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum that every rank receives is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics (mean, biased variance) cover every rank's batch."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (batch, channels, ...), got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        synced = use_batch_stats and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not synced:
            track = not self.training or self.track_running_stats
            return F.batch_norm(
                input,
                self.running_mean if track else None,
                self.running_var if track else None,
                self.weight,
                self.bias,
                use_batch_stats,
                factor,
                self.eps,
            )

        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()  # statistics in fp32 whatever the activation dtype
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])])
        totals = _AllReduceSum.apply(local)
        count = totals[-1]
        mean = totals[:-1] / count
        # Two passes (mean first, then squared deviations) keep the variance as accurate as plain BatchNorm's.
        centered = x - mean.view(shape)
        var = _AllReduceSum.apply((centered * centered).sum(dims)) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp(min=1))
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm*d with a synchronised one for `device`, sharing its parameters and buffers."""
    if device.type in ("cuda", "xpu"):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert_cpu(module)


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (CPUSyncBatchNorm, nn.SyncBatchNorm)):
        out = CPUSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        # The same Parameter and buffer objects: an optimizer built on the original model still updates these.
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        if module.track_running_stats:
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())
