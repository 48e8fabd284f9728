"""A resumed run's learning rate follows its own schedule from the first resumed step (train.schedule)."""

import pytest
import torch

from phalanx.config.schema import TrainingConfig
from phalanx.train.schedule import make_optimizer, make_scheduler, take_configured_hyperparameters


def saved_after(steps: int, total_steps: int, cfg: TrainingConfig) -> tuple[dict, dict]:
    """The optimizer's and scheduler's state of a run of total_steps, saved after `steps` optimizer steps."""
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, total_steps)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer.state_dict(), scheduler.state_dict()


def resumed(saved: tuple[dict, dict], total_steps: int, cfg: TrainingConfig):
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, total_steps)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    return optimizer, scheduler


def test_an_extended_run_trains_its_first_resumed_step_on_the_longer_schedule():
    """A finished 6-step run extended to 8 (--max_steps 8 --force) trained step 7 at the 6-step schedule's end,
    0.0, and step 8 on the 8-step one."""
    cfg = TrainingConfig(learning_rate=5e-5)
    optimizer, scheduler = resumed(saved_after(6, 6, cfg), 8, cfg)
    changes = take_configured_hyperparameters(optimizer, scheduler, cfg, 8)
    assert changes == ["learning rate at step 6 0 -> 1.25e-05 (the schedule now runs 8 steps)"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * 2 / 8, rel=1e-12)
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]  # the metrics' lr column says the same
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * 1 / 8, rel=1e-12)

    # A resume on the schedule that saved keeps the saved rate bit for bit, and says nothing.
    cosine = TrainingConfig(learning_rate=5e-5, warmup_ratio=0.3, lr_scheduler="cosine")
    saved = saved_after(4, 10, cosine)
    optimizer, scheduler = resumed(saved, 10, cosine)
    assert take_configured_hyperparameters(optimizer, scheduler, cosine, 10) == []
    assert optimizer.param_groups[0]["lr"] == saved[0]["param_groups"][0]["lr"]
