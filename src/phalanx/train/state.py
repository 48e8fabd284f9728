"""The loop's counters, checkpointed as plain JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
    # The running sum behind the epoch's mean loss: checkpointed, so a run resumed mid-epoch reports the mean over
    # the whole epoch (the same float, summed in the same order), not over the steps since the resume.
    epoch_loss_sum: float = 0.0
    epoch_loss_steps: int = 0
    # Likewise the steps since the last train log line: a resume between two log steps still logs their mean.
    log_loss_sum: float = 0.0
    log_loss_steps: int = 0
    # What the run's local data files held (data.prepare.PreparedData.sources): a resume compares it with the data
    # it finds (train.run.check_same_data).
    data_sources: dict[str, str] = field(default_factory=dict)

    def add_loss(self, loss: float) -> None:
        """A finished step's global loss, into the epoch's mean and the next log line's."""
        self.epoch_loss_sum += loss
        self.epoch_loss_steps += 1
        self.log_loss_sum += loss
        self.log_loss_steps += 1

    def take_log_mean(self) -> float:
        """The mean step loss since the last log line; the sums start over."""
        mean = self.log_loss_sum / max(self.log_loss_steps, 1)
        self.log_loss_sum, self.log_loss_steps = 0.0, 0
        return mean

    def end_epoch(self) -> float:
        """The epoch's mean step loss; the sums start over and the epoch counter advances."""
        mean = self.epoch_loss_sum / max(self.epoch_loss_steps, 1)
        self.epoch_loss_sum, self.epoch_loss_steps = 0.0, 0
        self.epoch += 1
        return mean

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)
