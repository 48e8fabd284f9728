"""Read a TrainingEngine checkpoint's weights for inference: `load_weights(folder, map_location, ema=False)`.

TrainingEngine saves and resumes through the shared `phalanx.checkpoint.checkpointer.Checkpointer`
(staged, fsynced, renamed and marked committed by rank 0, exactly like `phalanx train`):

  model.safetensors        the unwrapped model's state_dict (no DDP "module." prefix; SyncBatchNorm
                           and BatchNorm share key names, so it loads into the plain model)
  ema.pt                   EMA weights and update count, when EMA is on ({"module": state_dict, ...})
  optimizer.pt, scheduler.pt, precision.pt (GradScaler)      plain tensors: checkpoint.safe_load.load_state_file
  rng_state_{rank}.pt      every rank's RNG
  trainer_state.json       epochs done, best metric, history
  phalanx_checkpoint.json  commit marker, written last
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from safetensors.torch import load_file

from phalanx.checkpoint.commit import is_committed
from phalanx.checkpoint.layout import EMA, WEIGHTS, state_file
from phalanx.checkpoint.safe_load import load_state_file
from phalanx.errors import PhalanxError


def load_weights(folder: Union[str, Path], map_location: Union[str, torch.device] = "cpu", ema: bool = False) -> dict:
    """The saved state_dict on `map_location` (a device or device string), ready for model.load_state_dict.

    `ema=True` returns the EMA weights instead (the ones validation used when EMA was on).
    """
    folder = Path(folder)
    if not is_committed(folder):
        raise PhalanxError(f"{folder} is not a committed phalanx checkpoint (no phalanx_checkpoint.json)")
    if ema:
        if not (folder / state_file(EMA)).is_file():
            raise PhalanxError(f"{folder} holds no EMA weights ({state_file(EMA)}); it was saved with use_ema=False")
        return load_state_file(folder / state_file(EMA), map_location)["module"]
    return load_file(str(folder / WEIGHTS), device=str(torch.device(map_location)))
