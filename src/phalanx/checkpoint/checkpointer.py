"""Checkpointer: every checkpoint decision of a run in one component.

It owns when a step saves (cadence), which checkpoint is the best so far (checkpoint-best by a
metric), the one save that may be in flight in the background (committed before the next save and
before the run ends), retention (the oldest checkpoint-{step} folders beyond a limit), and resume
(loading a committed folder back into the run's objects). `phalanx train`'s loop calls it once per
step (`maybe_save`); TrainingEngine uses the same component for checkpoint-last and checkpoint-best.

What a checkpoint holds is handed over once, when the Checkpointer is made: the model, and a dict of
stateful objects (optimizer, scheduler, GradScaler, EMA: anything with state_dict/load_state_dict),
each saved by rank 0 as {name}.pt; plus the run's counters as a callable returning trainer_state.json's
content (it holds the sampler's position). How the folder is written and committed, synchronously or
in the background, is checkpoint/io.py's and checkpoint/commit.py's; the names are layout.py's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from phalanx.checkpoint.commit import apply_retention, committed_step_checkpoints
from phalanx.checkpoint.io import PendingCheckpoint, PlainWeights, load_checkpoint, save_checkpoint
from phalanx.checkpoint.layout import BEST, step_dir
from phalanx.runtime import dist as rt
from phalanx.runtime.watch import set_phase


@dataclass
class CheckpointPolicy:
    """When and how a Checkpointer saves."""

    every: Optional[int] = None  # save checkpoint-{step} every this many optimizer steps (None: only when asked)
    keep: Optional[int] = None  # keep at most this many committed checkpoint-{step} folders (None: all of them)
    asynchronous: bool = False  # write in the background; training waits only for the copy to CPU memory
    save_best: bool = True  # write checkpoint-best at each new best metric (the best is tracked either way)

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"CheckpointPolicy.every = {self.every}: use a positive number of steps, or None")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"CheckpointPolicy.keep = {self.keep}: use a positive number of folders, or None")


class BestMetric:
    """The best value of a metric so far and the step it came at, stored as attributes of the object whose counters
    are checkpointed (`phalanx train`: TrainerState.best_eval_loss / best_step; TrainingEngine: best_metric), so that
    trainer_state.json records it and a resume restores it with the other counters."""

    def __init__(self, holder: Any, value_attr: str, step_attr: Optional[str] = None):
        self.holder, self.value_attr, self.step_attr = holder, value_attr, step_attr

    @property
    def value(self) -> Optional[float]:
        return getattr(self.holder, self.value_attr)

    def improves(self, value: float, lower_is_better: bool = True) -> bool:
        """A NaN never improves (and never becomes the best, which nothing could then beat)."""
        if math.isnan(value):
            return False
        best = self.value
        return best is None or (value < best if lower_is_better else value > best)

    def update(self, value: float, step: int) -> None:
        setattr(self.holder, self.value_attr, value)
        if self.step_attr is not None:
            setattr(self.holder, self.step_attr, step)


class Checkpointer:
    """Saves and restores one run's checkpoints in `output_dir`. Every rank makes one and calls the same methods at
    the same steps (saves hold barriers and, under sharding, collectives).

    model: the (unwrapped) model or adapter; saved with save_pretrained, or, `plain_weights`, its state_dict as
        model.safetensors (any nn.Module: TrainingEngine). Loaded back by `load` as `finetune` says ('lora', 'full').
    states: name -> object with state_dict()/load_state_dict(), written by rank 0 as {name}.pt.
    trainer_state: returns trainer_state.json's content (counters, the sampler's position, the config).
    strategy: the parallel Strategy, when it gathers the model for saving or writes sharded state per rank.
    tokenizer: saved beside the model (from_pretrained folders).
    best: where the best metric is kept (see BestMetric); `maybe_save_best` needs one.
    after_save: called on every rank after each save (phalanx train: rank 0 rewrites training_info.json); the
        ranks then wait for each other.
    reporter: when given, each save is logged as kind 'save' (blocked_s, waited_for_previous_s, async).
    """

    def __init__(
        self,
        output_dir: Path,
        rank: rt.RankInfo,
        *,
        model: nn.Module,
        states: dict[str, Any],
        trainer_state: Callable[[], dict],
        policy: Optional[CheckpointPolicy] = None,
        strategy: Any = None,
        tokenizer: Any = None,
        finetune: str = "full",
        plain_weights: bool = False,
        best: Optional[BestMetric] = None,
        after_save: Optional[Callable[[], None]] = None,
        reporter: Any = None,
    ):
        self.output_dir, self.rank = Path(output_dir), rank
        self.model, self.states, self.trainer_state = model, states, trainer_state
        self.policy = policy or CheckpointPolicy()
        self.strategy, self.tokenizer, self.finetune, self.plain_weights = strategy, tokenizer, finetune, plain_weights
        self.best, self.after_save, self.reporter = best, after_save, reporter
        self.pending: Optional[PendingCheckpoint] = None  # the save being written in the background

    # ---- decisions ----------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` saves checkpoint-{step} by the cadence."""
        return self.policy.every is not None and step % self.policy.every == 0

    def maybe_save(self, step: int, *, stopping: bool = False) -> Optional[Path]:
        """The loop's one call per step: save checkpoint-{step} when the cadence says so, or when the run is
        `stopping` (preempted; NaN with nan_policy stop): then synchronously, committed before this returns.
        Returns the folder saved, None when the step does not save."""
        if not (stopping or self.due(step)):
            return None
        return self.save(step_dir(step), wait=stopping)

    def maybe_save_best(self, value: float, step: int, *, lower_is_better: bool = True) -> Optional[Path]:
        """Record `value` when it beats the best so far and, with policy.save_best, commit checkpoint-best.
        Returns checkpoint-best's folder when it was saved, else None."""
        if self.best is None:
            raise ValueError("this Checkpointer was made without `best`: it has nowhere to keep the best metric")
        if not self.best.improves(value, lower_is_better):
            return None
        self.best.update(value, step)
        return self.save(BEST) if self.policy.save_best else None

    # ---- saving -------------------------------------------------------------------------------------

    def save(self, name: str, *, wait: bool = False, trainer_state: Optional[dict] = None) -> Path:
        """Commit output_dir/name atomically; every rank calls it. A save still in flight is committed first (one at a
        time). With policy.asynchronous the files are written in the background and committed once complete, unless
        `wait` (the run is about to stop). `trainer_state` replaces the callable's content for this save only.
        After the commit, retention deletes the oldest checkpoint-{step} folders beyond policy.keep (never
        checkpoint-best, never this one)."""
        folder = self.output_dir / name
        set_phase(self.rank.rank, f"saving {name}")
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        background = self.policy.asynchronous and not wait
        strategy = self.strategy
        # A full fine-tune's sharded state holds every weight: checkpoint-{step} skips gathering them to rank 0
        # (checkpoint-best and the final model are complete from_pretrained folders).
        weights = name == BEST or not getattr(strategy, "sharded_state_holds_model", False)
        gather = weights and strategy is not None and not self.plain_weights
        counters = self.trainer_state() if trainer_state is None else trainer_state
        self.pending = save_checkpoint(
            folder,
            rank=self.rank,
            model=PlainWeights(self.model) if self.plain_weights else self.model,
            tokenizer=self.tokenizer,
            stateful=self.states,
            trainer_state=counters,
            model_state=strategy.model_state_for_saving() if gather else None,
            model_files=weights,
            sharded=strategy if getattr(strategy, "shards_state", False) else None,
            asynchronous=background,
            after_commit=partial(apply_retention, self.output_dir, self.policy.keep, {self.output_dir / BEST, folder}),
        )
        if self.after_save is not None:
            self.after_save()
            rt.barrier()
        if self.reporter is not None:
            self.reporter.log(
                counters.get("global_step"),
                {
                    "name": name,
                    "async": background,
                    "waited_for_previous_s": waited,
                    "blocked_s": time.perf_counter() - started,
                },
                kind="save",
            )
        return folder

    def wait(self) -> None:
        """Block until a checkpoint still being written in the background is complete and committed (rank 0 commits;
        every rank's part is on disk); raise what failed. Call it before the process ends."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            set_phase(self.rank.rank, f"finishing the background write of {pending.final.name}")
            pending.wait()

    # ---- resuming -----------------------------------------------------------------------------------

    def latest(self) -> Optional[Path]:
        """The newest committed checkpoint-{step} in output_dir, None when there is none."""
        found = committed_step_checkpoints(self.output_dir)
        return found[-1][1] if found else None

    def load(self, folder: Path) -> dict:
        """Restore the model (or each rank's shards), every stateful object and this rank's RNG from a committed
        folder (or the committed copy a cut-short replacement of it left); returns trainer_state.json's content."""
        sharded = self.strategy if getattr(self.strategy, "shards_state", False) else None
        return load_checkpoint(
            Path(folder),
            rank=self.rank,
            model=self.model,
            stateful=self.states,
            finetune=self.finetune,
            sharded=sharded,
        )
