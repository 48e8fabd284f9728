"""Engine checkpoints (checkpoint-best/, checkpoint-last/) through the shared checkpoint component.

The folders are written by `phalanx.checkpoint.io.save_checkpoint`, i.e. staged, fsynced,
renamed and marked committed by rank 0, exactly like `phalanx train`'s:

  model.safetensors        the unwrapped model's state_dict (no DDP "module." prefix; SyncBatchNorm
                           and BatchNorm share key names, so it loads into the plain model)
  ema.pt                   EMA weights and update count, when EMA is on ({"module": state_dict, ...})
  optimizer.pt, scheduler.pt, precision.pt (GradScaler)      plain tensors: checkpoint.io.load_state_file
  rng_state_{rank}.pt      every rank's RNG
  trainer_state.json       epochs done, best metric, history
  phalanx_checkpoint.json  commit marker, written last

`load_weights(folder, map_location)` reads the weights alone onto any device, for inference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from phalanx.checkpoint.commit import is_committed
from phalanx.checkpoint.io import load_checkpoint, save_checkpoint
from phalanx.checkpoint.safe_load import load_state_file
from phalanx.errors import PhalanxError
from phalanx.runtime.dist import RankInfo

WEIGHTS = "model.safetensors"
EMA = "ema.pt"


class _PlainWeights:
    """Gives any nn.Module the `save_pretrained` the checkpoint component calls: one safetensors file."""

    def __init__(self, module: nn.Module):
        self.module = module

    def save_pretrained(self, folder: Path, safe_serialization: bool = True) -> None:
        # Own CPU copies: safetensors refuses tensors that share storage (tied weights).
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.module.state_dict().items()}
        save_file(state, str(Path(folder) / WEIGHTS), metadata={"format": "pt", "saved_by": "phalanx.engine"})


def save_engine_checkpoint(folder: Path, *, rank: RankInfo, model: nn.Module, stateful: dict[str, Any],
                           trainer_state: dict) -> None:
    """Every rank calls this (it holds barriers); rank 0 writes and commits."""
    save_checkpoint(folder, rank=rank, model=_PlainWeights(model), tokenizer=None, stateful=stateful,
                    trainer_state=trainer_state)


def load_engine_checkpoint(folder: Path, *, rank: RankInfo, model: nn.Module, stateful: dict[str, Any]) -> dict:
    """Weights into `model` (on whatever device it lives), stateful objects, this rank's RNG; returns trainer_state."""
    missing = [name for name in stateful if not (Path(folder) / f"{name}.pt").is_file()]
    if is_committed(Path(folder)) and missing:
        raise PhalanxError(f"{folder} has no {', '.join(f'{m}.pt' for m in missing)}: it was saved by a run "
                           "configured differently (e.g. without EMA, or without a scheduler)")
    return load_checkpoint(Path(folder), rank=rank, model=model, stateful=stateful, finetune="full")


def load_weights(folder: Union[str, Path], map_location: Union[str, torch.device] = "cpu", ema: bool = False) -> dict:
    """The saved state_dict on `map_location` (a device or device string), ready for model.load_state_dict.

    `ema=True` returns the EMA weights instead (the ones validation used when EMA was on).
    """
    folder = Path(folder)
    if not is_committed(folder):
        raise PhalanxError(f"{folder} is not a committed phalanx checkpoint (no phalanx_checkpoint.json)")
    if ema:
        if not (folder / EMA).is_file():
            raise PhalanxError(f"{folder} holds no EMA weights ({EMA}); it was saved with use_ema=False")
        return load_state_file(folder / EMA, map_location)["module"]
    return load_file(str(folder / WEIGHTS), device=str(torch.device(map_location)))
