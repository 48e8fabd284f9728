"""Parallel strategies behind one interface (see base.Strategy); one file per strategy.

`STRATEGIES` maps each `distributed.strategy` name to its class; a class builds itself from the run config
(`from_config`), so choosing one is a lookup. Importing this package loads no torch (`phalanx config` and the
config schema stay light): the strategy modules are imported when first asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig
    from phalanx.parallel.base import Precision, Strategy
    from phalanx.runtime.dist import RankInfo

# name -> "module:class", imported on use: a DDP run never imports DeepSpeed.
STRATEGIES: dict[str, str] = {
    "ddp": "phalanx.parallel.ddp:DDPStrategy",
    "fsdp": "phalanx.parallel.fsdp:FSDPStrategy",
    "deepspeed": "phalanx.parallel.deepspeed:DeepSpeedStrategy",
}


def strategy_class(name: str) -> type[Strategy]:
    from phalanx.errors import ConfigError

    if name not in STRATEGIES:
        raise ConfigError(f"distributed.strategy = {name!r}; accepted: {', '.join(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_strategy(
    rank: RankInfo, precision: Precision, comm_hook: Optional[str] = None, *, cfg: Optional[RunConfig] = None
) -> Strategy:
    """The strategy `cfg.distributed.strategy` names (DDP by default), built from `cfg`.

    One process under DDP trains plainly; FSDP2 and DeepSpeed run on one process too (on a one-rank group):
    on a single GPU their CPU offload is what lets a model that does not fit train at all.
    `comm_hook`, when given, stands in for cfg.distributed.ddp_comm_hook (callers without a config).
    """
    from phalanx.config.schema import RunConfig

    cfg = cfg if cfg is not None else RunConfig()
    if comm_hook is not None and comm_hook != cfg.distributed.ddp_comm_hook:
        cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"ddp_comm_hook": comm_hook})})
    return strategy_class(cfg.distributed.strategy).from_config(rank, precision, cfg)


def check_before_launch(cfg: RunConfig, world_size: int, on_gpu: bool) -> None:
    """Refuse, before any rank starts, what every rank would refuse about its strategy: a mixed precision the device
    cannot run, and a DeepSpeed JSON that contradicts the run. Launchers call it; it makes no CUDA call (a context
    in the launcher would hold memory on the first GPU for the whole run). `phalanx plan` calls it too, so it
    refuses what the run would."""
    strategy_class(cfg.distributed.strategy).check_config(cfg, world_size, launch_precision(cfg, on_gpu))


def launch_precision(cfg: RunConfig, on_gpu: bool) -> Precision:
    """The precision the ranks will take, decided without a CUDA call (see check_before_launch)."""
    import torch

    from phalanx.parallel.base import Precision

    mixed = cfg.training.mixed_precision
    if on_gpu:
        # 'auto' picks bf16 or fp16 on the device itself; it is never set explicitly, so it never conflicts below.
        return Precision({"no": None, "fp16": torch.float16}.get(mixed, torch.bfloat16))
    return Precision.choose(mixed, torch.device("cpu"))


def __getattr__(name: str):
    # `from phalanx.parallel import Precision, Strategy` without importing torch for every user of this package.
    if name in ("Precision", "Strategy"):
        from phalanx.parallel import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
