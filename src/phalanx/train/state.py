"""The loop's counters, checkpointed as plain JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass
class TrainerState:
    global_step: int = 0
    epoch: int = 0
    tokens_seen: int = 0  # target tokens trained on, over all ranks
    best_eval_loss: Optional[float] = None
    best_step: Optional[int] = None
    last_eval_loss: Optional[float] = None
    skipped_steps: int = 0  # steps whose global loss was NaN/Inf and whose update was dropped

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)
