"""DistributedDataParallel: a full replica per rank, gradients averaged by all-reduce."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, ContextManager

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx.parallel.base import Precision, Strategy, quantized_parameter_names
from phalanx.runtime.dist import RankInfo

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def group_ddp_can_log() -> dist.ProcessGroup | None:
    """The process group DDP all-reduces over; None: the default one.

    Under TORCH_DISTRIBUTED_DEBUG=DETAIL (seed 001's advice for debugging) torch wraps every group in a checker of
    collectives, and DDP's constructor, logging the gloo group's thread count, reads that wrapper as the gloo group
    itself: every CPU rank died of SIGSEGV in c10d::Logger::set_env_variables (torch 2.13). There DDP gets a gloo group
    of its own, made without the checker; every other collective (the loss, evaluation, checkpoints) keeps it.
    NCCL ranks are not affected (the logger reads no NCCL group)."""
    if dist.get_backend() != "gloo" or dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return None
    if dist.get_rank() == 0:
        print(
            "note: TORCH_DISTRIBUTED_DEBUG=DETAIL: DDP's gradient all-reduce runs on a gloo group without DETAIL's "
            "checks (torch's DDP crashes with them on gloo); every other collective is checked",
            file=sys.stderr,
            flush=True,
        )
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        return dist.new_group(backend="gloo")
    finally:
        dist.set_debug_level(dist.DebugLevel.DETAIL)


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(
        self, rank: RankInfo, precision: Precision, comm_hook: str = "none", *, broadcast_buffers: bool = False
    ):
        super().__init__(rank, precision)
        self.comm_hook = comm_hook
        # Models with running statistics (BatchNorm) want rank 0's buffers on every rank before each forward.
        self.broadcast_buffers = broadcast_buffers

    @classmethod
    def from_config(cls, rank: RankInfo, precision: Precision, cfg: RunConfig) -> Strategy:
        """distributed.ddp_comm_hook; one process has nothing to synchronise and trains plainly (base Strategy)."""
        if not rank.distributed:
            return Strategy(rank, precision)
        return cls(rank, precision, cfg.distributed.ddp_comm_hook)

    def wrap(self, model: nn.Module) -> nn.Module:
        on_cuda = self.rank.device.type == "cuda"
        # Causal LMs hold no running statistics; skipping the per-forward buffer broadcast saves a collective.
        # Broadcasting is DDP's default, so it is asked for by saying nothing (torch >= 2.13 deprecates the flag).
        buffers = {} if self.broadcast_buffers else {"broadcast_buffers": False}
        quantized = quantized_parameter_names(model)
        if quantized:
            # DDP broadcasts rank 0's parameters at start; every rank quantized the same base file identically, and
            # a broadcast would copy the packed 4-bit bytes without their scales (QLoRA's base stays out of DDP).
            DDP._set_params_and_buffers_to_ignore_for_model(model, quantized)
        # Adapter first, DDP second: only the trainable (LoRA) weights get gradient buckets, so no unused-parameter search.
        # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce bucket instead of a second copy of it
        # (full fine-tuning of 1.5B parameters: 6.2 GB less per rank); optimizer and clipping see the same tensors.
        ddp = DDP(
            model,
            device_ids=[self.rank.device.index] if on_cuda else None,
            output_device=self.rank.device.index if on_cuda else None,
            find_unused_parameters=False,
            gradient_as_bucket_view=True,
            process_group=group_ddp_can_log(),
            **buffers,
        )
        if self.comm_hook != "none":
            ddp.register_comm_hook(None, COMM_HOOKS[self.comm_hook])
        return ddp

    def unwrap(self) -> nn.Module:
        assert self.model is not None, "prepare() first"
        return self.model.module

    def micro_step(self, sync_gradients: bool) -> ContextManager:
        # no_sync must cover the forward too: DDP decides at forward time whether backward all-reduces.
        return contextlib.nullcontext() if sync_gradients else self.model.no_sync()
