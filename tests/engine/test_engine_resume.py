"""TrainingEngine: SIGKILL every rank in the middle of a step, resume, and every later step is bit-identical.

2 gloo ranks, CPU fp32, through launch_distributed_training + distributed_train_worker (phalanx's
sampler, a DataLoader worker reading ahead), with dropout, AdamW, a per-step LR schedule and EMA.
checkpoint-last is committed every 3 steps and at each epoch's end, so the newest one before the kill
(in step 11) is step 9: one step into the third epoch. Resuming must bring back, per rank, the RNG
(dropout masks), the sampler's place inside the epoch, the optimizer moments, the schedule, the EMA
weights and the epoch's running loss sums. (Checked the other way round: with the RNG not put back
after the resumed loader's iterator is made, steps 10-12 differ on both ranks.)
"""

import json
import math
from pathlib import Path

import pytest
import torch

from engine import engine_ranks
from phalanx import distributed_train_worker, launch_distributed_training
from phalanx.engine.checkpoint import load_weights
from phalanx.errors import PhalanxError

pytestmark = pytest.mark.distributed


def step_losses(prefix: Path, rank: int) -> list[float]:
    return [float(line) for line in Path(f"{prefix}.rank{rank}").read_text().split()]


def launch(out: Path, losses: Path, **train_kwargs):
    # Forked ranks: spawning would import torch again in every rank, several times the training's own time.
    return launch_distributed_training(
        distributed_train_worker,
        2,
        backend="gloo",
        start_method="fork",
        **engine_ranks.resume_config(str(out), str(losses), **train_kwargs),
    )


def test_kill_mid_step_then_resume_is_bit_identical(tmp_path, monkeypatch):
    whole = launch(tmp_path / "whole", tmp_path / "whole-loss")
    reference = [step_losses(tmp_path / "whole-loss", r) for r in (0, 1)]
    assert len(reference[0]) == 12 and reference[0] != reference[1]

    monkeypatch.setenv("PHALANX_FAULT", "kill@step=11")
    with pytest.raises(PhalanxError, match="killed by SIGKILL"):
        launch(tmp_path / "run", tmp_path / "killed-loss")
    monkeypatch.delenv("PHALANX_FAULT")
    checkpoint = tmp_path / "run" / "resume" / "checkpoint-last"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 9 and state["epochs_done"] == 2
    assert state["epoch_progress"]["sampler"] == {"epoch": 2, "position": 16, "seed": 0, "world_size": 2}
    for r in (0, 1):  # steps 1-11 ran (11 was killed after its forward)
        assert step_losses(tmp_path / "killed-loss", r) == reference[r][:11]

    resumed = launch(tmp_path / "run", tmp_path / "resumed-loss", resume_from=str(checkpoint))
    for r in (0, 1):
        assert step_losses(tmp_path / "resumed-loss", r) == reference[r][9:], f"rank {r}: steps 10-12"  # float ==
    for key in whole:
        if key != "epoch_time":
            assert resumed[key] == whole[key], key  # the third epoch's loss includes step 9, from before the kill
    for ema in (False, True):
        a = load_weights(tmp_path / "whole" / "resume" / "checkpoint-last", ema=ema)
        b = load_weights(checkpoint, ema=ema)
        assert all(torch.equal(a[k], b[k]) for k in a), f"ema={ema}"
    assert not math.isclose(whole["train_loss"][0], whole["train_loss"][-1]), "the model trains"
