"""TrainingEngine: seed 004's API for training any PyTorch model on one process or many ranks.

Built from the parts `phalanx train` uses, not beside them: the runtime joins the process
group, a Strategy (DDP or single) wraps the model and applies AMP and gradient steps, the
checkpoint component commits best/last folders, the Reporter writes rank-0 metrics and the
progress bar. What is particular to arbitrary models lives next to this file: synchronised
BatchNorm on every device (syncbn.py), EMA weights (ema.py) and count-weighted epoch
metrics (metrics.py).

Batches are `(inputs, targets)` pairs; `model(inputs)` gives outputs and
`criterion(outputs, targets)` a batch-mean loss.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.checkpointer import BestMetric, Checkpointer, CheckpointPolicy
from phalanx.checkpoint.commit import committed_copy, is_committed, recover_replaced
from phalanx.checkpoint.io import load_rng_file
from phalanx.checkpoint.layout import BEST, EMA, LAST, METRICS_FILE, TENSORBOARD_DIR, state_file
from phalanx.checkpoint.resume import crashed_folder, set_aside_ahead
from phalanx.engine.ema import ModelEMA
from phalanx.engine.metrics import MetricTotals, reduce_tensor
from phalanx.engine.syncbn import convert_sync_batchnorm, has_batchnorm
from phalanx.errors import ConfigError, PhalanxError
from phalanx.observe.metrics import Reporter
from phalanx.parallel.base import Precision, Strategy
from phalanx.runtime import dist as rt
from phalanx.runtime.durable import check_can_create
from phalanx.runtime.faults import Fault, kill_self, planned_fault
from phalanx.runtime.output_lock import output_held, training_lock

# launch_distributed_training tells its ranks the backend through this variable, so a train_fn
# that calls TrainingEngine.setup_distributed(rank, world_size) without one gets the launcher's.
BACKEND_ENV = "PHALANX_ENGINE_BACKEND"
DEFAULT_PORT = "12355"  # seed 004's rendezvous port when MASTER_PORT is unset
MONITORS = ("val_loss", "val_acc", "train_loss", "train_acc")  # what checkpoint-best can follow
ONE_ROW = (
    "BatchNorm needs 2 or more rows in training. The epoch's last batch holds len(dataset) % batch_size rows: pass "
    "drop_last=True to the DataLoader, or choose a batch_size that leaves no single row"
)
NEEDS_ROWS = "give it at least one row (an empty epoch trains nothing and reports a loss of nan)"
VAL_NEEDS_ROWS = (
    "give it rows, or pass val_loader=None to validate nothing (val_loss would be nan every epoch and no "
    "checkpoint-best written; without validation, checkpoint-best follows the train_* metric)"
)


class DistributedFallbackWarning(RuntimeWarning):
    """Distributed training was asked for but could not start; the run continues in one process."""


def check_backend(backend: Optional[str]) -> None:
    """Refuse a backend name torch.distributed does not know: a typo would otherwise fail the start-up, which seed
    004's fallback turns into a warning and a one-process run instead of an error."""
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    names = [part.rpartition(":")[2] for part in backend.split(",")] if isinstance(backend, str) else [backend]
    if backend is not None and backend != "auto" and not all(name in known for name in names):
        raise ConfigError(
            f"backend = {backend!r}: not a torch.distributed backend; accepted: None or 'auto' (NCCL on CUDA, gloo "
            f"otherwise), {', '.join(repr(b) for b in known)}, or 'device:backend' pairs such as 'cpu:gloo,cuda:nccl'"
        )


def engine_device(device: Union[str, torch.device, None], local_rank: int) -> torch.device:
    """The engine's device: None is cuda:local_rank where there is a GPU, else the CPU. A CUDA device on a machine
    without one (seed 004 writes torch.device(f'cuda:{rank}')) was torch's "Torch not compiled with CUDA enabled"
    from deep inside the model's .to(); a misspelt one torch's list of every device type there is."""
    if device is None:
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device = {device!r} is not a device; use None (a GPU where there is one, else the CPU), 'cpu', "
            "'cuda' or 'cuda:N'"
        ) from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device = {str(chosen)!r}, but this machine has no CUDA device (torch.cuda.is_available() is False); "
            "pass device=None (a GPU where there is one, else the CPU) or 'cpu'"
        )
    return chosen


def warn_fallback(message: str) -> None:
    warnings.warn(f"⚠️  {message}", DistributedFallbackWarning, stacklevel=3)


def without_ddp(model: nn.Module, say: bool = True) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper, which the engine makes itself. Seed 004's Method 1 imports
    DDP beside the engine, whose checkpoints handled DDP models; a model wrapped already was wrapped again, every
    gradient all-reduced twice, and saved with 'module.' before each key (load_weights into the model then failed)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    if say:  # once, on rank 0
        warnings.warn(
            "TrainingEngine: the model is wrapped in DistributedDataParallel already; the engine trains the module "
            "inside and wraps it itself (pass the model unwrapped: that wrapper's gradient buckets still take memory)",
            RuntimeWarning,
            stacklevel=3,
        )
    return without_ddp(model.module, say=False)


def ranks_asked_by(local_world_size: int) -> Optional[tuple[str, str]]:
    """How this machine's ranks were asked for, as too many of them are named (runtime.dist.check_world_fits): by
    launch_distributed_training (its ranks hold BACKEND_ENV; seed 004's example passes --world-size to it), by the
    user's own processes calling setup_distributed, or (None) by torchrun, named by its --nproc_per_node. Its ranks
    were all told 'torchrun --nproc_per_node 4' before, a command the user never ran."""
    if BACKEND_ENV in os.environ:
        return f"launch_distributed_training's world_size = {local_world_size}", "a world_size of"
    if not rt.launched_by_torchrun():
        return f"TrainingEngine.setup_distributed's world_size = {local_world_size}", "a world_size of"
    return None


class TrainingEngine:
    """Train `model` with DDP across ranks (when `distributed`) or in one process, with optional AMP and EMA.

    Seed 004's arguments keep their meaning; the keyword-only ones are phalanx additions:
    `output_dir` (checkpoints and metrics go to output_dir/experiment_name), `sync_batchnorm`
    (convert BatchNorm layers when distributed), `amp_dtype` ('auto' = bf16 where supported,
    else fp16 with a GradScaler), `ema_warmup` (see ema.py), `progress_bar`, `tensorboard`.
    """

    def __init__(
        self,
        model: nn.Module,
        device: Union[str, torch.device, None] = None,
        distributed: bool = False,
        local_rank: int = 0,
        world_size: int = 1,
        backend: Optional[str] = None,
        use_amp: bool = False,
        use_ema: bool = False,
        ema_decay: float = 0.9999,
        experiment_name: str = "experiment",
        *,
        output_dir: Union[str, Path] = "runs",
        sync_batchnorm: bool = True,
        amp_dtype: str = "auto",
        ema_warmup: bool = True,
        progress_bar: bool = True,
        tensorboard: bool = True,
    ):
        self.device = engine_device(device, local_rank)
        self.backend = backend
        self.fallback_reason: Optional[str] = None
        self.distributed = distributed and self._join_process_group(world_size, backend)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", local_rank if self.distributed else 0)
        self.local_rank = local_rank if self.distributed else 0
        self.rank = self._rank_info()
        self.world_size = self.rank.world_size

        self.strategy = self._make_strategy(use_amp, amp_dtype)
        model = without_ddp(model, say=self.rank.is_main)
        if self.distributed and sync_batchnorm and has_batchnorm(model):
            # Statistics over the global batch: N ranks with batch b normalise like one process with N*b.
            model = convert_sync_batchnorm(model, self.device)
        self.model = self.strategy.setup_model(model)
        self.ema = ModelEMA(self.unwrapped_model, ema_decay, ema_warmup) if use_ema else None
        self.use_amp, self.use_ema = self.strategy.precision.dtype is not None, use_ema

        if not isinstance(experiment_name, str) or not experiment_name:
            raise ConfigError(
                f"experiment_name = {experiment_name!r}; give a non-empty name: outputs go to "
                f"output_dir/experiment_name ({output_dir}/NAME)"
            )
        self.experiment_name = experiment_name
        self.output_dir = Path(output_dir) / experiment_name
        self.progress_bar, self.tensorboard = progress_bar, tensorboard
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler: Any = None
        self.epochs_done = 0
        self.global_step = 0
        self.fault: Optional[Fault] = None
        self._resume: Optional[dict] = None  # where a checkpoint saved inside an epoch left it
        self.best_metric: Optional[float] = None
        self.history: dict[str, list] = {}
        # checkpoint-best and checkpoint-last: the same component `phalanx train` saves with, the model as one
        # model.safetensors; train_epoch sets its cadence (save_steps), attach() its optimizer and scheduler.
        self.checkpointer = Checkpointer(
            self.output_dir,
            self.rank,
            model=self.unwrapped_model,
            plain_weights=True,
            states=self._stateful(),
            trainer_state=self._trainer_state,
            best=BestMetric(self, "best_metric"),
        )

    # ---- distributed set-up (seed 004's static methods) -------------------------------------------

    @staticmethod
    def setup_distributed(
        rank: int, world_size: int, backend: Optional[str] = None, timeout_minutes: float = 10.0
    ) -> rt.RankInfo:
        """Join a process group of `world_size` ranks as `rank` (call it in every process before the engine).

        backend None: the launcher's choice when started by launch_distributed_training, else NCCL on
        CUDA and gloo on CPU. The rendezvous is MASTER_ADDR:MASTER_PORT (default localhost:12355).
        Raises when the group cannot be formed; the environment is left as it was then.
        """
        check_backend(backend)
        backend = backend or os.environ.get(BACKEND_ENV) or "auto"
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": os.environ.get("LOCAL_RANK", str(rank)),
            "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE", str(world_size)),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "localhost"),
            "MASTER_PORT": os.environ.get("MASTER_PORT", DEFAULT_PORT),
        }
        asked_by = ranks_asked_by(int(env["LOCAL_WORLD_SIZE"]))
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            return rt.init_runtime(backend, timeout_minutes, ranks_asked_by=asked_by, backend_setting="backend")
        except BaseException as exc:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if rank == 0 and "EADDRINUSE" in str(exc):
                # Two seed-004 scripts at once both take localhost:12355; torch's "failed to listen ... EADDRINUSE"
                # says nothing of the variable that moves it.
                from phalanx.launch.preflight import port_holder

                holder = port_holder(int(env["MASTER_PORT"]))
                raise ConfigError(
                    f"MASTER_PORT {env['MASTER_PORT']} is already in use on this machine"
                    + (f" (by {holder})" if holder else "")
                    + ": another job, or an earlier run of this script, holds it. Set MASTER_PORT to a free port in "
                    "every process of this job (launch_distributed_training picks one itself), or stop that process"
                ) from None
            raise

    @staticmethod
    def cleanup_distributed() -> None:
        rt.shutdown()

    def _join_process_group(self, world_size: int, backend: Optional[str]) -> bool:
        """True when a process group is up (joining it from torchrun's environment if needed), else warn."""
        if not dist.is_initialized() and rt.launched_by_torchrun():
            rank, world, _, _ = rt.env_rank_info()
            try:
                self.setup_distributed(rank, world, backend)
            except Exception as exc:  # noqa: BLE001 - any start-up failure means the seed's fallback
                self.fallback_reason = f"joining the process group failed: {type(exc).__name__}: {exc}"
        if not dist.is_initialized():
            self.fallback_reason = self.fallback_reason or (
                "no process group is initialised (call TrainingEngine.setup_distributed(rank, world_size) first, "
                "or start the script with launch_distributed_training or torchrun)"
            )
            warn_fallback(
                f"distributed=True but {self.fallback_reason}; training in a single process on {self.device}."
            )
            return False
        if dist.get_world_size() != world_size:
            warnings.warn(
                f"world_size={world_size} was passed but the process group has {dist.get_world_size()} ranks; "
                "using the process group's",
                RuntimeWarning,
                stacklevel=3,
            )
        return True

    def _rank_info(self) -> rt.RankInfo:
        if not self.distributed:
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise ConfigError(
                    f"a process group of {dist.get_world_size()} ranks is running but distributed=False: "
                    "pass distributed=True (ranks then share the work), or call "
                    "TrainingEngine.cleanup_distributed() first"
                )
            return rt.RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=self.device)
        world = dist.get_world_size()
        return rt.RankInfo(
            rank=dist.get_rank(),
            world_size=world,
            local_rank=self.local_rank,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            device=self.device,
        )

    def _make_strategy(self, use_amp: bool, amp_dtype: str) -> Strategy:
        if amp_dtype not in ("auto", "bf16", "fp16"):
            raise ConfigError(
                f"amp_dtype = {amp_dtype!r}; use 'auto' (bf16 where supported, else fp16), 'bf16' or 'fp16'"
            )
        if use_amp and self.device.type != "cuda" and self.rank.is_main:
            warnings.warn(
                f"use_amp=True needs a CUDA device; this run is on {self.device} and trains in fp32",
                RuntimeWarning,
                stacklevel=3,
            )
        precision = Precision.choose(amp_dtype if use_amp and self.device.type == "cuda" else "no", self.device)
        if not self.distributed:
            return Strategy(self.rank, precision)
        from phalanx.parallel.ddp import DDPStrategy

        # Buffers (running statistics) follow rank 0 before every forward, as torch's DDP does by default.
        return DDPStrategy(self.rank, precision, broadcast_buffers=True)

    # ---- facts and reductions ----------------------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        return self.rank.is_main

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without its DDP wrapper: what is saved, loaded and averaged by EMA."""
        return self.strategy.unwrap()

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        return self.strategy.scaler

    def reduce_tensor(self, tensor: torch.Tensor, average: bool = True) -> torch.Tensor:
        """Mean (or sum) of `tensor` over ranks, on every rank; unchanged in one process. See metrics.reduce_tensor."""
        return reduce_tensor(tensor, average) if self.distributed else tensor.detach().clone()

    _reduce_tensor = reduce_tensor  # seed 004's name

    # ---- the loop ---------------------------------------------------------------------------------

    def train(
        self,
        train_loader: Iterable,
        val_loader: Optional[Iterable],
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module,
        scheduler: Any = None,
        num_epochs: int = 100,
        save_best: bool = True,
        save_last: bool = True,
        *,
        resume_from: Union[str, Path, None] = None,
        monitor: str = "val_loss",
        max_grad_norm: float = 0.0,
        scheduler_interval: str = "epoch",
        save_steps: Optional[int] = None,
    ) -> dict[str, list]:
        """Train for `num_epochs` epochs (counting those a resumed checkpoint already did); returns the history.

        history: lists per epoch of epoch, train_loss, val_loss, lr, epoch_time, and train_acc / val_acc
        when outputs are class scores for integer labels. Every rank returns the same numbers.
        `monitor` picks checkpoint-best (one of MONITORS): lower is better for losses, higher for accuracies.
        `scheduler_interval`: 'epoch' (ReduceLROnPlateau gets the monitored value) or 'step'.
        `save_steps`: also commit checkpoint-last every this many optimizer steps, inside epochs; a resume
        from it continues mid-epoch (needs a sampler that records its position, see `_epoch_sampler`).
        """
        if scheduler_interval not in ("epoch", "step"):
            raise ConfigError(f"scheduler_interval = {scheduler_interval!r}; use 'epoch' or 'step'")
        # A float was a TypeError from range(); a negative count or clipping norm did nothing, silently.
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 0:
            raise ConfigError(f"num_epochs = {num_epochs!r}; give a whole number of epochs, 0 or more")
        if not max_grad_norm >= 0:
            raise ConfigError(f"max_grad_norm = {max_grad_norm!r}; give a positive norm to clip to, or 0 for none")
        if monitor not in MONITORS:
            raise ConfigError(f"monitor = {monitor!r}; choose one of {', '.join(MONITORS)}")
        for name, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
            if isinstance(loader, torch.utils.data.Dataset):
                # Iterating a dataset yields single rows: a shape error from the model's first layer.
                raise ConfigError(
                    f"{name} is a {type(loader).__name__}, not a loader: pass DataLoader(dataset, batch_size=..., "
                    "sampler=DistributedSampler(dataset) when distributed), which yields (inputs, targets) batches"
                )
        self._check_training_objects(optimizer, criterion, scheduler)
        # A file on the way was NotADirectoryError or FileExistsError from the lock's mkdir.
        check_can_create(self.output_dir, f"output_dir/experiment_name = {str(self.output_dir)!r}")
        if save_steps is not None and (save_steps < 1 or _epoch_sampler(train_loader) is None):
            raise ConfigError(
                f"save_steps = {save_steps!r} needs a positive step count and a train_loader whose sampler "
                "records its position (phalanx.data.sampler.StatefulDistributedSampler, as make_loaders "
                "builds); with another sampler, checkpoints can only be taken at the end of an epoch"
            )
        # One run per output folder: a second engine (or `phalanx train`) on it would rotate this run's
        # checkpoints away and resume from its state. Held while train() runs.
        with output_held(training_lock(self.output_dir), f"output_dir {self.output_dir}", self.is_main_process):
            self.attach(optimizer, scheduler)
            self._check_loaders(train_loader, val_loader)
            self.fault = planned_fault()
            if resume_from is not None:
                self.load_checkpoint(resume_from)
                self._restore_epoch_position(train_loader)
                # A best saved at an epoch's end, then a crash before that epoch's checkpoint-last.
                if self.is_main_process:
                    for line in set_aside_ahead(self.output_dir, self.global_step, f"best_metric {self.best_metric}"):
                        print(f"↩️  {line}", flush=True)
            elif self.is_main_process and self.global_step == 0:
                self._set_aside_an_earlier_run()
            # A second train() on this engine continues its own run, as a resume does (num_epochs counts every epoch).
            reporter = self._reporter(train_loader, num_epochs, resumed=resume_from is not None or self.global_step > 0)
            self._announce(reporter, train_loader, num_epochs)
            for epoch in range(self.epochs_done, num_epochs):
                started = time.perf_counter()
                for loader in (train_loader, val_loader):
                    set_sampler_epoch(loader, epoch)
                # A mid-epoch resume reports the rate the epoch started with, as the uninterrupted run does.
                lr = self._resume["lr"] if self._resume else optimizer.param_groups[0]["lr"]
                train_metrics = self.train_epoch(
                    train_loader,
                    criterion,
                    max_grad_norm,
                    scheduler_interval,
                    reporter,
                    save_steps=save_steps,
                    save_last=save_last,
                    lr=lr,
                )
                if train_metrics["samples"] == 0:  # a loader without len(): found empty only now, on every rank
                    raise ConfigError(f"train_loader yielded no rows in epoch {epoch + 1}; {NEEDS_ROWS}")
                val_metrics = self.validate(val_loader, criterion) if val_loader is not None else None
                if val_metrics is not None and val_metrics["samples"] == 0:
                    raise ConfigError(f"val_loader yielded no rows on any rank; {VAL_NEEDS_ROWS}")
                record = self._record(epoch, train_metrics, val_metrics, lr, time.perf_counter() - started)
                if scheduler is not None and scheduler_interval == "epoch":
                    step_scheduler(scheduler, record.get(self._monitor_key(monitor, record)))
                reporter.log(self.global_step, record, kind="epoch")
                reporter.say(epoch_line(record, num_epochs))
                key = self._monitor_key(monitor, record) if save_best else None
                if key and self.checkpointer.maybe_save_best(
                    record[key], self.global_step, lower_is_better="loss" in key
                ):
                    reporter.say(f"💾 New best {key} {self.best_metric:.4f}: {self.output_dir / BEST}")
                if save_last:
                    self.save_checkpoint(LAST)
            reporter.close()
            return self.history

    def train_epoch(
        self,
        loader: Iterable,
        criterion: nn.Module,
        max_grad_norm: float = 0.0,
        scheduler_interval: str = "epoch",
        reporter: Optional[Reporter] = None,
        *,
        save_steps: Optional[int] = None,
        save_last: bool = True,
        lr: Optional[float] = None,
    ) -> dict:
        """One pass over `loader` (the rest of it, after a mid-epoch resume); returns loss (and accuracy)
        averaged over every rank's samples. `save_steps`: commit checkpoint-last every this many steps."""
        self.model.train()
        self.checkpointer.policy = CheckpointPolicy(every=save_steps or None)
        totals = MetricTotals(self.device)
        sampler = _epoch_sampler(loader)
        progress = {
            "epoch": self.epochs_done,
            "lr": optimizer_lr(self.optimizer) if lr is None else lr,
            "position": sampler.position if sampler is not None else 0,
            "rows": 0,
        }
        resume, self._resume = self._resume, None
        if resume is not None:
            totals.sums.copy_(torch.tensor(resume["totals"], dtype=torch.float64))
        postfix: dict = {}
        batches = iter(loader)
        if resume is not None:
            # The loader drew its workers' base seed from the global RNG when the iterator was made; the run
            # that saved had drawn it before the step it saved after. The saved state goes back on now.
            load_rng_file(resume["folder"], self.rank)
        last = _length(loader)
        if self.distributed and last is None:
            batches = self._in_step(batches)
        for i, batch in enumerate(batches):
            inputs, targets = self._to_device(batch)
            with self.strategy.autocast():
                outputs, loss = forward_loss(self.model, criterion, inputs, targets, training=True)
            self._inject_fault()
            self.strategy.backward(loss)
            self.strategy.step(max_grad_norm)
            if self.ema is not None:
                self.ema.update(self.unwrapped_model)  # every rank: the weights are the same after the all-reduce
            if self.scheduler is not None and scheduler_interval == "step":
                self.scheduler.step()
            self.global_step += 1
            totals.add(loss.detach().float(), outputs, targets)
            progress["rows"] += rows_of(targets)
            if reporter is not None and reporter.is_main:
                if i % 10 == 0:  # .item() waits for the device: only rank 0 reads it, every few steps
                    postfix = {"loss": f"{loss.item():.4f}"}
                reporter.advance(1, postfix)
            # The end of the epoch is saved after validation (save_last); a step save there would be overwritten.
            if self.checkpointer.due(self.global_step) and not (save_last and last is not None and i == last - 1):
                self.save_checkpoint(LAST, epoch_progress={**progress, "totals": totals.sums.tolist()}, sampler=sampler)
        return totals.reduce()

    def _in_step(self, batches: Iterable) -> Iterable:
        """A train_loader without len() (an IterableDataset) on several ranks: before each step the ranks say whether
        they have a batch, so that one running out first is refused on every rank at the same step. Without this the
        others waited in DDP's all-reduce for it until the collective timeout. One tiny all-reduce per step."""
        for step in itertools.count():
            batch = next(batches, None)  # type: ignore[call-overload]
            have = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
            have[self.rank.rank] = batch is not None
            have = rt.all_reduce_sum(have).tolist()
            if all(have):
                yield batch
                continue
            if any(have):
                out = [r for r, h in enumerate(have) if not h]
                more = [r for r, h in enumerate(have) if h]
                raise ConfigError(
                    f"train_loader ran out on rank {', '.join(map(str, out))} after {step} batches of this epoch, "
                    f"while rank {', '.join(map(str, more))} had more; every rank needs the same number of batches. "
                    "Shard an IterableDataset evenly across ranks (and drop the remainder), or use a map-style "
                    "dataset with a DistributedSampler"
                )
            return

    def _inject_fault(self) -> None:
        """PHALANX_FAULT (runtime/faults.py): kill or raise in the middle of a step, after forward, as `phalanx train` does."""
        step, fault = self.global_step + 1, getattr(self, "fault", None)
        if fault is None:
            return
        if fault.due("kill", step, self.rank.rank):
            kill_self()
        if fault.due("raise", step, self.rank.rank):
            raise RuntimeError(f"injected fault in forward at step {step}")

    @torch.no_grad()
    def validate(self, loader: Iterable, criterion: nn.Module) -> dict:
        """Loss (and accuracy) over every rank's validation shard, on the EMA weights when EMA is on.

        Runs on the unwrapped model, so ranks may hold different numbers of batches (no DDP collective).
        """
        model = self.ema.module if self.ema is not None else self.unwrapped_model
        self._sync_buffers(model)
        was_training = model.training
        model.eval()
        totals = MetricTotals(self.device)
        for batch in loader:
            inputs, targets = self._to_device(batch)
            with self.strategy.autocast():
                outputs, loss = forward_loss(model, criterion, inputs, targets, training=False)
            totals.add(loss.float(), outputs, targets)
        model.train(was_training)
        return totals.reduce()

    # ---- checkpoints ------------------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Use the caller's optimizer (built on the model's parameters) and scheduler for steps and checkpoints."""
        self.optimizer, self.scheduler = optimizer, scheduler
        self.strategy.optimizer = optimizer
        optimizer.zero_grad(set_to_none=True)
        self.checkpointer.states = self._stateful()

    def _stateful(self) -> dict[str, Any]:
        state: dict[str, Any] = {"precision": self.strategy}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        if self.ema is not None:
            state[EMA] = self.ema
        return state

    def _trainer_state(self) -> dict:
        return {
            "epochs_done": self.epochs_done,
            "global_step": self.global_step,
            "best_metric": self.best_metric,
            "history": self.history,
            "world_size": self.world_size,
            "experiment_name": self.experiment_name,
        }

    def save_checkpoint(self, name: str = LAST, *, epoch_progress: Optional[dict] = None, sampler: Any = None) -> Path:
        """Commit output_dir/name atomically (every rank calls it; rank 0 writes). Returns the folder.

        `epoch_progress` (a save inside an epoch): where the epoch stands, so a resume continues it: the
        sampler's global position (rows of the epoch's order handed out over all ranks), the learning rate
        the epoch started with, and every rank's running loss/accuracy sums."""
        trainer_state = self._trainer_state()
        if epoch_progress is not None:
            totals = rt.gather_objects(epoch_progress["totals"])  # every rank's sums; rank 0 writes them
            position = epoch_progress["position"] + epoch_progress["rows"] * sampler.world_size
            trainer_state["epoch_progress"] = {
                "epoch": epoch_progress["epoch"],
                "lr": epoch_progress["lr"],
                "totals": totals,
                "sampler": {**sampler.state_dict(), "position": position},
            }
        return self.checkpointer.save(name, trainer_state=trainer_state)

    def load_checkpoint(
        self, folder: Union[str, Path], optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None
    ) -> dict:
        """Restore weights, EMA, optimizer/scheduler/scaler (those attached), RNG and counters from a checkpoint.

        Weights land on this engine's device whatever device saved them; returns trainer_state.
        """
        if optimizer is not None:
            self.attach(optimizer, scheduler)
        missing = [name for name in self.checkpointer.states if not (Path(folder) / state_file(name)).is_file()]
        if is_committed(Path(folder)) and missing:
            raise PhalanxError(
                f"{folder} has no {', '.join(state_file(m) for m in missing)}: it was saved by a run "
                "configured differently (e.g. without EMA, or without a scheduler)"
            )
        state = self.checkpointer.load(Path(folder))
        self.epochs_done, self.global_step = int(state["epochs_done"]), int(state["global_step"])
        self.best_metric, self.history = state.get("best_metric"), state.get("history", {})
        progress = state.get("epoch_progress")
        self._resume = None
        if progress is not None:  # saved inside an epoch: train() continues that epoch where it stopped
            totals = progress["totals"]
            # Loss sums are per rank; on another number of ranks only their sum matters, so rank 0 carries it.
            mine = (
                totals[self.rank.rank]
                if len(totals) == self.world_size
                else ([sum(col) for col in zip(*totals)] if self.rank.is_main else [0.0] * len(totals[0]))
            )
            self._resume = {
                "folder": committed_copy(Path(folder)),
                "lr": progress["lr"],
                "totals": mine,
                "sampler": progress["sampler"],
            }
        return state

    def _restore_epoch_position(self, loader: Iterable) -> None:
        """After a mid-epoch checkpoint: put the train sampler where the saving run's ranks together had got to."""
        if self._resume is None:
            return
        sampler = _epoch_sampler(loader)
        if sampler is None:
            raise ConfigError(
                "the checkpoint was saved inside an epoch (save_steps); resuming it needs the same kind of "
                "train_loader sampler (phalanx.data.sampler.StatefulDistributedSampler)"
            )
        sampler.load_state_dict(self._resume["sampler"])

    # ---- helpers ----------------------------------------------------------------------------------

    def _to_device(self, batch) -> tuple[Any, torch.Tensor]:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigError(
                f"TrainingEngine expects batches of (inputs, targets); got {type(batch).__name__}"
                f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
            )
        return move_to(batch[0], self.device), move_to(batch[1], self.device)

    def _sync_buffers(self, model: nn.Module) -> None:
        """Rank 0's buffers everywhere, so every rank validates the same model."""
        if self.distributed:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def _check_training_objects(self, optimizer: Any, criterion: Any, scheduler: Any) -> None:
        """What train() is handed, checked before anything is written: a class where an instance goes (a hurried
        nn.CrossEntropyLoss without its ()) failed deep in the first step with torch's words ("Boolean value of Tensor
        with more than one value is ambiguous", "missing 1 required positional argument: 'self'"), and an optimizer
        built on another model's parameters trained nothing without a word."""
        for name, value, example in (
            ("criterion", criterion, "nn.CrossEntropyLoss()"),
            ("optimizer", optimizer, "torch.optim.SGD(model.parameters(), lr=0.1)"),
            ("scheduler", scheduler, "torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)"),
        ):
            if isinstance(value, type):
                raise ConfigError(
                    f"{name} is the class {value.__name__}, not an instance of it: pass one, e.g. {example} (built on "
                    f"the model's parameters for an optimizer, on the optimizer for a scheduler)"
                )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer = {optimizer!r} is not a torch.optim.Optimizer; pass one built on the model's parameters, "
                "e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
            )
        if not callable(criterion):
            raise ConfigError(
                f"criterion = {criterion!r} is not callable; pass a loss module such as nn.CrossEntropyLoss() or a "
                "function criterion(outputs, targets) -> loss"
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise ConfigError(
                f"scheduler = {scheduler!r} has no step(); pass a torch.optim.lr_scheduler instance or None"
            )
        mine = {id(p) for p in self.unwrapped_model.parameters() if p.requires_grad}
        if mine and not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            raise ConfigError(
                f"the optimizer ({type(optimizer).__name__}) holds none of the model's trainable parameters, so "
                "nothing would train: build it on the model you gave the engine, e.g. "
                f"torch.optim.{type(optimizer).__name__}(engine.unwrapped_model.parameters(), ...)"
            )

    def _check_loaders(self, loader: Iterable, val_loader: Optional[Iterable]) -> None:
        """Ranks must run the same number of training steps, or DDP's all-reduce waits forever; an empty loader is
        refused (on every rank alike) before anything trains. Loaders without len() are checked as they run."""
        mine = (_length(loader), _length(val_loader) if val_loader is not None else None)
        everyone = rt.gather_objects(mine) if self.distributed else [mine]
        val_counts = [val for _, val in everyone]
        if val_loader is not None and None not in val_counts and sum(val_counts) == 0:
            raise ConfigError(f"val_loader yields no batches on any rank; {VAL_NEEDS_ROWS}")
        counts = [train for train, _ in everyone]
        if None in counts:
            return
        if set(counts) == {0}:
            raise ConfigError(f"train_loader yields no batches; {NEEDS_ROWS}")
        if not self.distributed:
            # Found before the epoch rather than at its end (synchronised BatchNorm counts every rank's rows).
            batch, rows = getattr(loader, "batch_size", None), _length(getattr(loader, "sampler", None))
            if batch and rows and rows % batch == 1 and not loader.drop_last and has_batchnorm(self.model):
                raise ConfigError(f"train_loader's last batch holds 1 row ({rows} rows, batch_size {batch}); {ONE_ROW}")
            return
        if len(set(counts)) > 1:
            raise ConfigError(
                f"train_loader yields {counts} batches on ranks 0..{len(counts) - 1}; every rank needs the "
                "same number. Use a DistributedSampler (or phalanx's StatefulDistributedSampler) for training"
            )
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and not hasattr(sampler, "set_epoch"):
            warnings.warn(
                "train_loader has no distributed sampler: every rank reads the whole dataset each epoch",
                RuntimeWarning,
                stacklevel=3,
            )

    def _set_aside_an_earlier_run(self) -> None:
        """A fresh train() in a folder an earlier run left would cut its metrics.jsonl at once and replace its
        checkpoint-best with this run's first epoch (always a new best): seed 004's scripts are rerun as they are, so a
        rerun with another learning rate threw away a 99.7% model for a 46% one. The earlier run's files move into
        output_dir/earlier-run-<time>/ instead (kept, never deleted), said before this run writes anything."""
        recover_replaced(self.output_dir / BEST)  # a replacement of the best cut short: the committed one is the run's
        names = [name for name in (LAST, BEST, METRICS_FILE, TENSORBOARD_DIR) if (self.output_dir / name).exists()]
        if not names:
            return
        aside = crashed_folder(self.output_dir, "earlier-run")
        for name in names:
            os.replace(self.output_dir / name, aside / name)
        print(
            f"↩️  {self.output_dir} held an earlier run ({', '.join(names)}): moved to {aside}, kept for you to compare "
            f"or delete; this run starts over. To continue that run instead, move its files back and pass "
            f"resume_from='{self.output_dir / LAST}'.",
            flush=True,
        )

    def _reporter(self, loader: Iterable, num_epochs: int, resumed: bool) -> Reporter:
        try:
            total = len(loader) * num_epochs  # type: ignore[arg-type]
        except TypeError:
            total = None
        extra = {"resume_step": self.global_step} if resumed else {}
        return Reporter(
            self.output_dir,
            is_main=self.is_main_process,
            total_steps=total,
            tensorboard=self.tensorboard,
            progress_bar=self.progress_bar,
            **extra,
        )

    def _announce(self, reporter: Reporter, loader: Iterable, num_epochs: int) -> None:
        say = reporter.say
        batch = getattr(loader, "batch_size", None)
        say("🔧 TrainingEngine configuration:")
        say(
            f"   - World size: {self.world_size} ({self.strategy.name}, {self.device}"
            f"{', ' + dist.get_backend() if self.distributed else ''})"
            + (f" - fallback: {self.fallback_reason}" if self.fallback_reason else "")
        )
        say(f"   - Batch size per rank: {batch}; effective: {batch * self.world_size if batch else '?'}")
        say(
            f"   - Precision: {self.strategy.precision.dtype or 'fp32'}"
            f"{' with GradScaler' if self.strategy.scaler else ''}; EMA: "
            f"{f'decay {self.ema.decay}' if self.ema else 'off'}"
        )
        say(f"   - Epochs: {num_epochs} (starting at {self.epochs_done + 1}); outputs in {self.output_dir}")

    def _record(self, epoch: int, train: dict, val: Optional[dict], lr: float, seconds: float) -> dict:
        record = {"epoch": epoch + 1, "train_loss": train["loss"]}
        if "accuracy" in train:
            record["train_acc"] = train["accuracy"]
        if val is not None:
            record["val_loss"] = val["loss"]
            if "accuracy" in val:
                record["val_acc"] = val["accuracy"]
        # The slowest rank's time, so every rank's history is the same
        seconds = rt.all_reduce_max(torch.tensor([seconds], dtype=torch.float64, device=self.device)).item()
        record.update(lr=lr, epoch_time=seconds)
        for key, value in record.items():
            self.history.setdefault(key, []).append(value)
        self.epochs_done = epoch + 1
        return record

    def _monitor_key(self, monitor: str, record: dict) -> str:
        if monitor in record:
            return monitor
        if monitor.startswith("val_") and "val_loss" not in record:
            return "train_" + monitor[4:] if "train_" + monitor[4:] in record else "train_loss"
        raise ConfigError(f"monitor = {monitor!r} is not in this run's history; choose one of {sorted(record)}")


def _epoch_sampler(loader: Any) -> Any:
    """The loader's sampler when it can say where it is in its epoch (phalanx's StatefulDistributedSampler), else None."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if all(hasattr(sampler, a) for a in ("state_dict", "load_state_dict", "position", "world_size")):
            return sampler
    return None


def _length(loader: Any) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def forward_loss(model: nn.Module, criterion: Any, inputs: Any, targets: Any, *, training: bool) -> tuple[Any, Any]:
    """`model(inputs)` and `criterion(outputs, targets)`, refusing by name what cannot train: torch's own error
    (a None passed to cross_entropy, `.backward()` on None, "grad can be implicitly created only for scalar
    outputs") names neither the model nor the criterion nor what would be accepted."""
    try:
        outputs = model(inputs)
    except ValueError as exc:
        if not (training and "Expected more than 1 value per channel when training" in str(exc)):
            raise
        # torch's words name neither the batch nor the loader setting that makes such a batch.
        raise ConfigError(f"a training batch of {rows_of(targets)} row reached BatchNorm ({exc}); {ONE_ROW}") from None
    if outputs is None:
        raise ConfigError(
            f"model(inputs) returned None ({type(getattr(model, 'module', model)).__name__}.forward has no return?); TrainingEngine passes "
            "the model's output to criterion(outputs, targets): return the predictions (e.g. class scores)"
        )
    name = getattr(criterion, "__name__", type(criterion).__name__)
    if not isinstance(outputs, torch.Tensor) and isinstance(criterion, nn.modules.loss._Loss):
        # torch's losses take tensors: its TypeError ("argument 'input' must be Tensor, not dict") names neither.
        model_name = type(getattr(model, "module", model)).__name__
        if isinstance(outputs, dict):
            what, pick = (
                f"a dict (keys {', '.join(repr(k) for k in outputs)})",
                f"outputs[{next(iter(outputs), 'KEY')!r}]",
            )
        elif isinstance(outputs, (tuple, list)):
            what, pick = f"a {type(outputs).__name__} of {len(outputs)}", "outputs[0]"
        else:
            what, pick = f"a {type(outputs).__name__}", "the scores in outputs"
        raise ConfigError(
            f"{model_name}(inputs) returned {what}, but criterion {name} takes a tensor of predictions. Return the "
            f"tensor from forward, or pass a criterion that picks it, e.g. "
            f"lambda outputs, targets: nn.functional.cross_entropy({pick}, targets)"
        )
    loss = criterion(outputs, targets)
    accepted = "a one-element tensor, the batch mean (a torch loss with its default reduction='mean')"
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"criterion {name}(outputs, targets) returned {type(loss).__name__}; it must return {accepted}"
        )
    if loss.numel() != 1:
        raise ConfigError(
            f"criterion {name}(outputs, targets) returned a tensor of shape {tuple(loss.shape)}; it must return "
            f"{accepted}, not one loss per row (reduction='none')"
        )
    if training and not loss.requires_grad:
        raise ConfigError(
            f"criterion {name}(outputs, targets) returned a loss with no gradient (computed under torch.no_grad, "
            "detached, or from a model with no trainable parameter); it must be computed from the model's outputs"
        )
    return outputs, loss


def rows_of(targets: Any) -> int:
    """Rows in a batch, counted from its targets (a tensor's first dimension)."""
    return int(targets.shape[0]) if isinstance(targets, torch.Tensor) and targets.dim() > 0 else len(targets)


def optimizer_lr(optimizer: Optional[torch.optim.Optimizer]) -> Optional[float]:
    return optimizer.param_groups[0]["lr"] if optimizer is not None else None


def move_to(obj: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) on `device`; pinned memory copies asynchronously."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=obj.is_pinned())
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


def set_sampler_epoch(loader: Optional[Iterable], epoch: int) -> None:
    """A new shuffle per epoch, the same on every rank (DistributedSampler and phalanx's sampler)."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
            return


def step_scheduler(scheduler: Any, monitored: Optional[float]) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(monitored)
    else:
        scheduler.step()


def epoch_line(record: dict, num_epochs: int) -> str:
    parts = [f"📊 Epoch {record['epoch']}/{num_epochs}", f"train loss {record['train_loss']:.4f}"]
    if "train_acc" in record:
        parts[-1] += f" acc {record['train_acc']:.2%}"
    if "val_loss" in record:
        parts.append(
            f"val loss {record['val_loss']:.4f}" + (f" acc {record['val_acc']:.2%}" if "val_acc" in record else "")
        )
    parts += [f"lr {record['lr']:.2e}", f"{record['epoch_time']:.1f}s"]
    return " | ".join(parts)
