"""Start a Python training function on N local ranks (seed 004's launch helpers).

`launch_distributed_training(train_fn, world_size, backend, **kwargs)` runs
`train_fn(rank, world_size, **kwargs)` in `world_size` fresh processes started with
`torch.multiprocessing.start_processes`. Each rank finds its rendezvous in the environment
(MASTER_ADDR/MASTER_PORT on a free local port, RANK, WORLD_SIZE, LOCAL_RANK), as under
torchrun. Processes are spawned, so `train_fn` and `kwargs` must pickle (module-level
functions, classes, functools.partial); when something does not (a lambda, as in seed
004's example) and this platform can fork with CUDA not yet initialised, the ranks are
forked instead. If one rank fails, the others are stopped and RanksFailed (a PhalanxError) names the rank
with its traceback. Rank 0's return value is returned.

`distributed_train_worker(rank, world_size, **config)` is the ready-made `train_fn`: it
joins the process group (or, when that fails, warns and trains in one process on rank 0),
builds sharded loaders, the engine, optimizer, criterion and scheduler, and trains.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from phalanx.engine.engine import BACKEND_ENV, TrainingEngine, check_backend, warn_fallback
from phalanx.errors import ConfigError, RanksFailed

CONFIG_KEYS = (
    "model_fn",
    "train_dataset",
    "val_dataset",
    "batch_size",
    "num_workers",
    "optimizer_fn",
    "criterion_fn",
    "scheduler_fn",
    "engine_kwargs",
    "train_kwargs",
    "seed",
)
REQUIRED_KEYS = ("model_fn", "train_dataset", "optimizer_fn", "criterion_fn")
BUILDERS = (  # key, what it builds, an example, the class the example names when the value is no instance
    (
        "model_fn",
        "the model (called with no arguments)",
        "model_fn={cls} (the class), or a function returning one",
        "MyModel",
    ),
    (
        "optimizer_fn",
        "the optimizer from the parameters",
        "optimizer_fn=functools.partial(torch.optim.{cls}, lr=0.1)",
        "SGD",
    ),
    ("criterion_fn", "the loss (called with no arguments)", "criterion_fn=nn.{cls} (the class)", "CrossEntropyLoss"),
    (
        "scheduler_fn",
        "the scheduler from the optimizer",
        "functools.partial(torch.optim.lr_scheduler.{cls}, ...)",
        "StepLR",
    ),
)
SET_BY_WORKER = ("model", "device", "distributed", "local_rank", "world_size", "backend")
TRAIN_ARGS_BY_WORKER = ("train_loader", "val_loader", "optimizer", "criterion", "scheduler")


def launch_distributed_training(
    train_fn: Callable[..., Any],
    world_size: int,
    backend: Optional[str] = None,
    start_method: str = "auto",
    **kwargs: Any,
) -> Any:
    """Run train_fn(rank, world_size, **kwargs) on `world_size` local ranks and return rank 0's result.

    backend None: NCCL when CUDA is available, gloo otherwise. world_size below 2 runs train_fn(0, 1, **kwargs)
    in this process (a warning says so when it is 0, e.g. torch.cuda.device_count() on a machine without GPUs).
    start_method: 'auto' (spawn, or fork when the arguments do not pickle), 'spawn', 'fork' or 'forkserver'.
    """
    check_backend(backend)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if world_size < 2:
        if world_size < 1:
            warn_fallback(f"world_size={world_size}: no devices to start ranks on; training in this process")
        return train_fn(0, 1, **_with_backend(train_fn, kwargs, backend))
    if _is_worker(train_fn):
        # Refused here, once, before any rank starts: inside the ranks each raised it with its own traceback.
        check_worker_config({**_bound_keywords(train_fn), **kwargs})
    method = _start_method(start_method, train_fn, kwargs)
    from phalanx.launch.local import free_port
    from phalanx.launch.scratch import launcher_scratch

    port = free_port()
    # What this process would start DataLoader workers with (fork on Linux): a spawned rank inherits 'spawn' instead,
    # and each of its loader workers re-imported the script and torch and was sent a pickled copy of the dataset.
    workers = multiprocessing.get_start_method()
    with launcher_scratch() as scratch:  # a later launch removes it if this process is killed
        result_file = scratch / "rank0.pkl"
        context = torch.multiprocessing.start_processes(
            _rank_entry,
            args=(world_size, port, backend, train_fn, kwargs, str(result_file), workers),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        _join(context)
        if not result_file.is_file():
            return None
        with open(result_file, "rb") as f:
            return pickle.load(f)  # written a moment ago by our own rank 0


def _rank_entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    train_fn: Callable,
    kwargs: dict,
    result_file: str,
    workers: str,
) -> None:
    multiprocessing.set_start_method(workers, force=True)  # as under torchrun, whose ranks are plain processes
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        **{BACKEND_ENV: backend},
    )
    result = train_fn(rank, world_size, **_with_backend(train_fn, kwargs, backend))
    if rank == 0:
        try:
            payload = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - the training itself succeeded
            warnings.warn(
                f"rank 0's result ({type(result).__name__}) cannot be returned to the launcher: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        Path(result_file).write_bytes(payload)


def _with_backend(train_fn: Callable, kwargs: dict, backend: str) -> dict:
    """Hand the backend to a train_fn that names a `backend` parameter; others read it from the environment."""
    try:
        accepts = "backend" in inspect.signature(train_fn).parameters
    except (TypeError, ValueError):
        accepts = False
    return {**kwargs, "backend": backend} if accepts and "backend" not in kwargs else kwargs


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


def _unpicklable(train_fn: Callable, kwargs: dict) -> Optional[str]:
    """The first argument that cannot be sent to a spawned process, or None."""
    for name, value in [("train_fn", train_fn), *kwargs.items()]:
        try:
            pickle.Pickler(_NullSink()).dump(value)  # size and time only; nothing is kept
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            return f"{name} ({type(exc).__name__}: {exc})"
    return None


def _start_method(requested: str, train_fn: Callable, kwargs: dict) -> str:
    if requested not in ("auto", "spawn", "fork", "forkserver"):
        raise ConfigError(f"start_method = {requested!r}; use 'auto', 'spawn', 'fork' or 'forkserver'")
    if requested == "fork":
        return requested
    # 'spawn' and 'forkserver' pickle what they send: checked here, so the error names the argument instead of
    # being pickle's own from inside torch.multiprocessing.
    bad = _unpicklable(train_fn, kwargs)
    if bad is None:
        return "spawn" if requested == "auto" else requested
    can_fork = sys.platform.startswith("linux") and not torch.cuda.is_initialized()
    if requested == "auto" and can_fork:
        return "fork"
    if requested != "auto":
        why = f" with start_method={requested!r}; start_method='auto' forks the ranks instead where it can"
    elif sys.platform.startswith("linux"):
        why = " (forking is no option: CUDA is already initialised in this process)"
    else:
        why = ""
    raise ConfigError(
        f"{bad} cannot be sent to spawned ranks{why}. Use module-level functions or functools.partial "
        "instead of lambdas and local functions"
    )


def _join(context: Any) -> None:
    """Wait for every rank; on a failure the others are stopped and the first failing rank is named."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        while not context.join():
            pass
    except ProcessRaisedException as exc:
        raised = _raised(context)
        first = raised[0][0] if raised else exc.error_index
        details = "".join(f"\n\n-- rank {rank} raised:\n{trace}" for rank, trace in raised) or str(exc)
        raise RanksFailed(f"rank {first} failed; the other ranks were stopped.{details}") from None
    except ProcessExitedException as exc:
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        raise RanksFailed(f"rank {exc.error_index} {how}; the other ranks were stopped.") from None
    finally:
        for process in context.processes:  # e.g. KeyboardInterrupt in the launcher: take the ranks down too
            if process.is_alive():
                process.terminate()
                process.join(5)
                if process.is_alive():
                    process.kill()


def _raised(context: Any) -> list[tuple[int, str]]:
    """(rank, traceback) of every rank that raised, earliest first: a rank that lost its peer fails second."""
    found = []
    for rank, path in enumerate(context.error_files):
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                found.append((os.path.getmtime(path), rank, pickle.load(f)))  # torch's own traceback file
    return [(rank, trace) for _, rank, trace in sorted(found)]


def distributed_train_worker(
    rank: int, world_size: int, backend: Optional[str] = None, **config: Any
) -> Optional[dict]:
    """Seed 004's worker: set up, train with TrainingEngine, clean up. Returns the history (None on idle ranks).

    config keys: model_fn() -> model; train_dataset, val_dataset (optional); batch_size (per rank, default 32);
    num_workers (default 0); optimizer_fn(params); criterion_fn(); scheduler_fn(optimizer) (optional);
    engine_kwargs and train_kwargs (passed to TrainingEngine and engine.train); seed (default 0).
    """
    check_worker_config(config)
    engine_kwargs = dict(config.get("engine_kwargs") or {})

    distributed = world_size > 1
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:
        try:
            device = TrainingEngine.setup_distributed(rank, world_size, backend).device
        except Exception as exc:  # noqa: BLE001 - seed 004: any start-up failure falls back to one process
            if rank != 0:
                warn_fallback(
                    f"rank {rank}: distributed start-up failed ({type(exc).__name__}: {exc}); "
                    "rank 0 trains alone, this rank stops"
                )
                return None
            warn_fallback(
                f"distributed start-up failed ({type(exc).__name__}: {exc}); "
                f"training in a single process on {device} instead of {world_size} ranks"
            )
            distributed, rank, world_size = False, 0, 1
    try:
        from phalanx.runtime.seed import seed_everything

        seed = int(config.get("seed", 0))
        seed_everything(seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        model = config["model_fn"]()
        train_loader, val_loader = make_loaders(
            config["train_dataset"],
            config.get("val_dataset"),
            rank,
            world_size,
            batch_size=config.get("batch_size", 32),
            num_workers=config.get("num_workers", 0),
            device=device,
            seed=seed,
        )
        engine = TrainingEngine(
            model,
            device,
            distributed=distributed,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            world_size=world_size,
            backend=backend,
            **engine_kwargs,
        )
        optimizer = config["optimizer_fn"](engine.unwrapped_model.parameters())
        criterion = config["criterion_fn"]()
        scheduler_fn = config.get("scheduler_fn")
        scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
        return engine.train(
            train_loader, val_loader, optimizer, criterion, scheduler, **(config.get("train_kwargs") or {})
        )
    finally:
        if distributed:
            TrainingEngine.cleanup_distributed()


def check_worker_config(config: dict) -> None:
    """distributed_train_worker's config, checked before any rank joins or trains (by launch_distributed_training
    before it starts them): a misspelt key or an unusable dataset was an error from deep inside every rank."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if unknown or missing:
        raise ConfigError(
            f"distributed_train_worker config: unknown key(s) {unknown}, missing {missing}; "
            f"accepted keys are {', '.join(CONFIG_KEYS)} (required: {', '.join(REQUIRED_KEYS)})"
        )
    engine_kwargs = dict(config.get("engine_kwargs") or {})
    clash = sorted(set(engine_kwargs) & set(SET_BY_WORKER))
    if clash:
        raise ConfigError(f"engine_kwargs {clash} are set by distributed_train_worker itself; remove them")
    _check_keywords("engine_kwargs", engine_kwargs, TrainingEngine.__init__, SET_BY_WORKER)
    _check_keywords("train_kwargs", config.get("train_kwargs") or {}, TrainingEngine.train, TRAIN_ARGS_BY_WORKER)
    for key, builds, example, example_cls in BUILDERS:
        value = config.get(key)
        if value is None and key not in REQUIRED_KEYS:
            continue
        # A built object where its builder goes (model_fn=Net()): called with no arguments inside every rank, it
        # failed there with "forward() missing 1 required positional argument".
        if isinstance(value, (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
            name = type(value).__name__
            raise ConfigError(
                f"{key} is a {name} instance; it must build {builds} in each rank, e.g. {example.format(cls=name)}"
            )
        if not callable(value):
            raise ConfigError(
                f"{key} = {value!r} is not callable; it must build {builds}, e.g. {example.format(cls=example_cls)}"
            )
    for key in ("train_dataset", "val_dataset"):
        dataset = config.get(key)
        if dataset is not None and (isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")):
            # The worker shards rows by index (a sampler over range(len)): a stream has neither.
            kind = "an IterableDataset" if isinstance(dataset, IterableDataset) else "without len()"
            raise ConfigError(
                f"{key} is a {type(dataset).__name__}, {kind}; distributed_train_worker splits rows across ranks by "
                "index, so it needs a map-style dataset (__len__ and __getitem__). For a stream, build the loaders "
                "yourself, every rank yielding the same number of batches, and call TrainingEngine.train"
            )
    if len(config["train_dataset"]) == 0:
        raise ConfigError("train_dataset is empty (0 rows); give a dataset with at least one row")
    if config.get("val_dataset") is not None and len(config["val_dataset"]) == 0:
        raise ConfigError("val_dataset is empty (0 rows); give it rows, or leave it out (None) to validate nothing")
    for key, default, least in (("batch_size", 32, 1), ("num_workers", 0, 0)):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{key} = {value!r}; give a whole number, {least} or more")


def _is_worker(train_fn: Callable) -> bool:
    """distributed_train_worker itself, or a functools.partial of it."""
    while isinstance(train_fn, functools.partial):
        train_fn = train_fn.func
    return train_fn is distributed_train_worker


def _bound_keywords(train_fn: Callable) -> dict:
    """The keywords functools.partial layers bind (outermost wins, as when called)."""
    bound: dict = {}
    while isinstance(train_fn, functools.partial):
        bound = {**train_fn.keywords, **bound}
        train_fn = train_fn.func
    return bound


def _check_keywords(label: str, given: dict, function: Callable, supplied: tuple[str, ...]) -> None:
    """Every key of `given` must be a parameter of `function` that the worker does not fill in itself."""
    import difflib

    accepted = [name for name in inspect.signature(function).parameters if name not in ("self", *supplied)]
    for key in given:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"{label}: unknown key {key!r}.{hint} Accepted: {', '.join(accepted)} "
                f"({function.__qualname__}'s arguments)"
            )


def make_loaders(
    train_dataset: Dataset,
    val_dataset: Optional[Dataset],
    rank: int,
    world_size: int,
    *,
    batch_size: int,
    num_workers: int,
    device: torch.device,
    seed: int = 0,
) -> tuple[DataLoader, Optional[DataLoader]]:
    """Training rows shuffled per epoch and split across ranks (rank r reads positions r, r+W, ... of the
    epoch's order, so W ranks with batch b see one process's batches of W*b); validation rows split without
    padding, so every row counts once."""
    from phalanx.data.sampler import StatefulDistributedSampler, eval_shard

    pin = device.type == "cuda"
    sampler = StatefulDistributedSampler(len(train_dataset), rank, world_size, seed=seed, shuffle=True)
    train_loader = DataLoader(
        train_dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin,
        persistent_workers=num_workers > 0,
    )
    val_loader = None
    if val_dataset is not None:
        shard = Subset(val_dataset, eval_shard(len(val_dataset), rank, world_size))
        val_loader = DataLoader(
            shard,
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            pin_memory=pin,
            persistent_workers=num_workers > 0,
        )
    return train_loader, val_loader
