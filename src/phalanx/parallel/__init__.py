"""Parallel strategies behind one interface (see base.Strategy); one file per strategy."""

from __future__ import annotations

from typing import Any, Optional

from phalanx.parallel.base import Precision, Strategy
from phalanx.runtime.dist import RankInfo


def make_strategy(rank: RankInfo, precision: Precision, comm_hook: str = "none", *, cfg: Optional[Any] = None) -> Strategy:
    """The strategy `cfg.distributed.strategy` names (DDP by default); one process under DDP trains plainly.

    FSDP2 and DeepSpeed run on one process too (on a one-rank group): on a single GPU their CPU offload is
    what lets a model that does not fit train at all.
    """
    kind = cfg.distributed.strategy if cfg is not None else "ddp"
    if not rank.distributed and kind == "ddp":
        return Strategy(rank, precision)
    if kind == "fsdp":
        from phalanx.parallel.fsdp import FSDPStrategy

        d = cfg.distributed
        sharding, offload, param_dtype = d.sharding_strategy, d.offload_param, None
        if d.fsdp_config:  # `phalanx config fsdp` output: its fields decide
            from phalanx.launch.ds_fsdp_config import read_fsdp_config

            import torch

            file = read_fsdp_config(d.fsdp_config)
            sharding, offload = file["sharding_strategy"], file["cpu_offload"] or offload
            param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[file["mixed_precision"]]
        return FSDPStrategy(rank, precision, sharding, offload, cfg.model.finetune, param_dtype)
    if kind == "deepspeed":
        from phalanx.parallel.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(rank, precision, cfg, cfg.model.finetune)
    from phalanx.parallel.ddp import DDPStrategy

    return DDPStrategy(rank, precision, comm_hook)


def check_before_launch(cfg: Any, world_size: int, on_gpu: bool) -> None:
    """Refuse, before any rank starts, what every rank would refuse about its strategy: a mixed precision the device
    cannot run, and a DeepSpeed JSON that contradicts the run. Launchers call it; it makes no CUDA call (a context
    in the launcher would hold memory on the first GPU for the whole run)."""
    import torch

    mixed = cfg.training.mixed_precision
    if on_gpu:
        # 'auto' picks bf16 or fp16 on the device itself; it is never set explicitly, so it never conflicts below.
        precision = Precision({"no": None, "fp16": torch.float16}.get(mixed, torch.bfloat16))
    else:
        precision = Precision.choose(mixed, torch.device("cpu"))
    if cfg.distributed.strategy == "deepspeed" and cfg.distributed.deepspeed_config:
        from phalanx.parallel.deepspeed import build_ds_config

        build_ds_config(cfg, world_size, precision)
