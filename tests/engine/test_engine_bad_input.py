"""TrainingEngine with what a hurried user passes: models that return a dict or a tuple, empty loaders, a dataset
where a loader goes, a CUDA device on a CPU machine, an IterableDataset. Each trains or is refused by name."""

import functools
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dist_workers import run_ranks
from engine import engine_ranks
from phalanx.engine.engine import TrainingEngine
from phalanx.engine.launch import distributed_train_worker, launch_distributed_training
from phalanx.errors import ConfigError, PhalanxError

QUIET = {"progress_bar": False, "tensorboard": False}


def pairs(rows: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g))


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x):
        return {"logits": self.net(x)}


class TupleOut(DictOut):
    def forward(self, x):
        return self.net(x), x.sum()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def dict_loss(outputs, targets):
    return nn.functional.cross_entropy(outputs["logits"], targets)


def tuple_loss(outputs, targets):
    return nn.functional.cross_entropy(outputs[0], targets)


def fit(tmp_path, model, criterion, train, val=None, epochs=1, **train_kwargs):
    engine = TrainingEngine(model, "cpu", output_dir=tmp_path, **QUIET)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return engine.train(train, val, optimizer, criterion, num_epochs=epochs, **train_kwargs)


@pytest.mark.parametrize("model, criterion", [(DictOut, dict_loss), (TupleOut, tuple_loss)])
def test_a_model_that_returns_a_dict_or_a_tuple_trains_with_a_criterion_that_takes_it(tmp_path, model, criterion):
    """The loss was computed, then the epoch's metrics called outputs.detach(): AttributeError 'dict' object has no
    attribute 'detach'. Accuracy needs class scores, so such a run reports losses only."""
    loader = DataLoader(pairs(), batch_size=4)
    history = fit(tmp_path, model(), criterion, loader, loader, epochs=2)
    assert history["epoch"] == [1, 2] and "val_loss" in history and "train_acc" not in history
    assert (tmp_path / "experiment" / "checkpoint-best" / "model.safetensors").is_file()


def test_a_dict_or_tuple_output_given_to_a_torch_loss_is_named(tmp_path):
    """It was torch's TypeError "cross_entropy_loss(): argument 'input' (position 1) must be Tensor, not dict", which
    names neither the model nor what to do."""
    loader = DataLoader(pairs(), batch_size=4)
    with pytest.raises(ConfigError, match=r"DictOut\(inputs\) returned a dict \(keys 'logits'\).*CrossEntropyLoss.*"):
        fit(tmp_path, DictOut(), nn.CrossEntropyLoss(), loader)
    with pytest.raises(ConfigError, match=r"TupleOut\(inputs\) returned a tuple of 2.*outputs\[0\]"):
        fit(tmp_path / "t", TupleOut(), nn.CrossEntropyLoss(), loader)


def test_empty_loaders_are_refused_instead_of_a_nan_history(tmp_path):
    """An empty train_loader gave train_loss nan and committed an untrained checkpoint-last; an empty val_loader gave
    val_loss nan every epoch and never a checkpoint-best, without a word."""
    empty = DataLoader(pairs(0), batch_size=4)
    with pytest.raises(ConfigError, match=r"train_loader yields no batches.*at least one row"):
        fit(tmp_path, nn.Linear(4, 3), nn.CrossEntropyLoss(), empty)
    with pytest.raises(ConfigError, match=r"val_loader yields no batches.*val_loader=None"):
        fit(tmp_path, nn.Linear(4, 3), nn.CrossEntropyLoss(), DataLoader(pairs(), batch_size=4), [])
    with pytest.raises(ConfigError, match=r"train_loader yielded no rows"):
        fit(tmp_path, nn.Linear(4, 3), nn.CrossEntropyLoss(), DataLoader(Rows(0), batch_size=4))
    assert not (tmp_path / "experiment" / "checkpoint-last").exists(), "nothing was committed"


def test_a_dataset_where_a_loader_goes_is_named(tmp_path):
    """Iterating a TensorDataset yields single rows: BatchNorm's "expected 2D or 3D input (got 1D input)"."""
    with pytest.raises(ConfigError, match=r"train_loader is a TensorDataset, not a loader.*DataLoader\("):
        fit(tmp_path, nn.Linear(4, 3), nn.CrossEntropyLoss(), pairs())
    with pytest.raises(ConfigError, match=r"val_loader is a TensorDataset, not a loader"):
        fit(tmp_path, nn.Linear(4, 3), nn.CrossEntropyLoss(), DataLoader(pairs(), batch_size=4), pairs())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_or_misspelt_is_named():
    """Seed 004's device = torch.device(f'cuda:{rank}') on a CPU machine was "AssertionError: Torch not compiled with
    CUDA enabled" from deep inside torch; a misspelt one torch's list of every device type."""
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(ConfigError, match=r"device = .*cuda.* no CUDA device.*device=None"):
            TrainingEngine(nn.Linear(2, 2), device, **QUIET)
    with pytest.raises(ConfigError, match=r"device = 'cpuu' is not a device.*'cpu'"):
        TrainingEngine(nn.Linear(2, 2), "cpuu", **QUIET)


class Rows(IterableDataset):
    """An IterableDataset of `rows` (x, label) pairs; no __len__."""

    def __init__(self, rows: int):
        self.rows = rows

    def __iter__(self):
        data = pairs(max(self.rows, 1))
        return (data[i] for i in range(self.rows))


def test_an_iterable_dataset_trains_in_one_process(tmp_path):
    history = fit(tmp_path, mlp(), nn.CrossEntropyLoss(), DataLoader(Rows(8), batch_size=4), epochs=2)
    assert history["epoch"] == [1, 2]


def uneven_iterable(rank: int, world: int, out_dir: str, even: bool = False) -> str:
    """Rank 0's IterableDataset holds 2 batches, rank 1's 3 (`even`: 3 each): the third step's all-reduce had no
    partner."""
    torch.set_num_threads(1)
    model = mlp()
    engine = TrainingEngine(
        model, "cpu", distributed=True, local_rank=rank, world_size=world, output_dir=out_dir, **QUIET
    )
    loader = DataLoader(Rows(8 if rank == 0 and not even else 12), batch_size=4)
    try:
        engine.train(loader, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), num_epochs=1)
    except ConfigError as exc:
        return str(exc)
    return "trained"


@pytest.mark.distributed
def test_an_iterable_dataset_that_runs_out_on_one_rank_is_refused_not_a_hang(tmp_path):
    """Ranks without a len() could not be compared up front: the rank with more batches waited in DDP's all-reduce
    until the collective timeout (10 minutes)."""
    results = run_ranks(uneven_iterable, 2, str(tmp_path))
    for message in results:
        assert "train_loader ran out on rank 0 after 2 batches" in message and "rank 1 had more" in message, message
    assert run_ranks(uneven_iterable, 2, str(tmp_path / "even"), True) == ["trained", "trained"]


def worker_config(tmp_path, **changes) -> dict:
    config = engine_ranks.worker_config(str(tmp_path), 8)
    config["train_kwargs"] = {"num_epochs": 1}
    return {**config, **changes}


def test_the_worker_refuses_an_iterable_dataset_and_bad_batch_settings_by_name(tmp_path):
    """An IterableDataset was "TypeError: object of type 'Rows' has no len()"; batch_size 0 DataLoader's ValueError
    from inside every rank."""
    with pytest.raises(ConfigError, match=r"train_dataset is a Rows, an IterableDataset.*map-style"):
        distributed_train_worker(0, 1, **worker_config(tmp_path, train_dataset=Rows(8)))
    with pytest.raises(ConfigError, match=r"val_dataset is a Rows, an IterableDataset"):
        distributed_train_worker(0, 1, **worker_config(tmp_path, val_dataset=Rows(8)))
    with pytest.raises(ConfigError, match=r"val_dataset is empty \(0 rows\).*None"):
        distributed_train_worker(0, 1, **worker_config(tmp_path, val_dataset=pairs(0)))
    for key, bad in (("batch_size", 0), ("batch_size", "8"), ("num_workers", -1)):
        with pytest.raises(ConfigError, match=f"{key} = {bad!r}"):
            distributed_train_worker(0, 1, **worker_config(tmp_path, **{key: bad}))
    assert not (tmp_path / "worker").exists(), "nothing was trained or written"


def test_the_launcher_checks_the_worker_config_before_any_rank_starts(tmp_path, monkeypatch):
    """A misspelt engine_kwargs key was raised inside every rank: RanksFailed with a traceback per rank."""
    import torch.multiprocessing

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_ranks)
    config = worker_config(tmp_path)
    config["engine_kwargs"] = {**config["engine_kwargs"], "use_emma": True}
    with pytest.raises(ConfigError, match=r"engine_kwargs: unknown key 'use_emma'. Did you mean 'use_ema'\?"):
        launch_distributed_training(distributed_train_worker, 2, **config)
    with pytest.raises(ConfigError, match=r"train_dataset is a Rows, an IterableDataset"):
        launch_distributed_training(distributed_train_worker, 2, **worker_config(tmp_path, train_dataset=Rows(8)))
    partial_worker = functools.partial(distributed_train_worker, seed=1)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batchsize'\]"):
        launch_distributed_training(partial_worker, 2, **worker_config(tmp_path), batchsize=3)


def test_a_resume_with_another_optimizer_is_named(tmp_path):
    """An SGD checkpoint resumed with Adam loaded without a word, then the first step raised KeyError: 'betas'."""
    loader = DataLoader(pairs(), batch_size=4)
    fit(tmp_path, mlp(), nn.CrossEntropyLoss(), loader)
    model = mlp()
    engine = TrainingEngine(model, "cpu", output_dir=tmp_path, experiment_name="other", **QUIET)
    with pytest.raises(PhalanxError, match=r"optimizer.pt was saved by another optimizer.*lack.*'betas'.*Adam"):
        engine.train(
            loader,
            None,
            torch.optim.Adam(model.parameters()),
            nn.CrossEntropyLoss(),
            num_epochs=2,
            resume_from=tmp_path / "experiment" / "checkpoint-last",
        )
    two_groups = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    with pytest.raises(PhalanxError, match=r"optimizer.pt does not fit this run's optimizer \(SGD\)"):
        engine.load_checkpoint(tmp_path / "experiment" / "checkpoint-last", two_groups)


def test_a_second_train_call_on_the_same_engine_continues_its_run(tmp_path, capsys):
    """The second call set the engine's own first epochs aside as "an earlier run" and said "this run starts over",
    while it went on from epoch 3; its metrics.jsonl then held epochs 3-4 only."""
    model = mlp()
    engine = TrainingEngine(model, "cpu", output_dir=tmp_path, **QUIET)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(pairs(), batch_size=4)
    engine.train(loader, loader, optimizer, nn.CrossEntropyLoss(), num_epochs=2)
    history = engine.train(loader, loader, optimizer, nn.CrossEntropyLoss(), num_epochs=4)
    assert history["epoch"] == [1, 2, 3, 4]
    assert "held an earlier run" not in capsys.readouterr().out
    assert not list((tmp_path / "experiment").glob("earlier-run-*"))
    logged = (tmp_path / "experiment" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in logged if '"epoch"' in line] == [1, 2, 3, 4]


def test_classes_where_instances_go_and_an_optimizer_of_another_model_are_named(tmp_path):
    """nn.CrossEntropyLoss without its () was "Boolean value of Tensor with more than one value is ambiguous"; an
    optimizer or scheduler class, or None, "zero_grad() missing 1 required positional argument: 'self'" or an
    AttributeError; an optimizer built on another model's parameters trained nothing, without a word."""
    model = mlp()
    loader = DataLoader(pairs(), batch_size=4)
    engine = TrainingEngine(model, "cpu", output_dir=tmp_path, **QUIET)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (sgd, nn.CrossEntropyLoss, None, r"criterion is the class CrossEntropyLoss.*nn.CrossEntropyLoss\(\)"),
        (torch.optim.SGD, nn.CrossEntropyLoss(), None, r"optimizer is the class SGD.*model.parameters\(\)"),
        (None, nn.CrossEntropyLoss(), None, r"optimizer = None.*torch.optim.Optimizer"),
        (sgd, nn.CrossEntropyLoss(), torch.optim.lr_scheduler.StepLR, r"scheduler is the class StepLR.*optimizer"),
        (sgd, "ce", None, r"criterion = 'ce' is not callable"),
        (torch.optim.SGD(mlp().parameters(), lr=0.1), nn.CrossEntropyLoss(), None, r"holds none of the model's"),
    ]
    for optimizer, criterion, scheduler, message in cases:
        with pytest.raises(ConfigError, match=message):
            engine.train(loader, None, optimizer, criterion, scheduler, num_epochs=1)
    assert not (tmp_path / "experiment").exists(), "nothing was trained or written"


def test_the_worker_names_an_instance_where_a_builder_goes(tmp_path):
    """model_fn=Net() (the model, not its builder) was "forward() missing 1 required positional argument" and
    criterion_fn=nn.CrossEntropyLoss() torch's "missing 2 required positional arguments", from inside every rank."""
    model = engine_ranks.bn_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ("model_fn", model, r"model_fn is a Sequential instance.*model_fn=Sequential"),
        ("criterion_fn", nn.CrossEntropyLoss(), r"criterion_fn is a CrossEntropyLoss instance.*nn.CrossEntropyLoss"),
        ("optimizer_fn", optimizer, r"optimizer_fn is a SGD instance.*functools.partial\(torch.optim.SGD"),
        ("scheduler_fn", torch.optim.lr_scheduler.StepLR(optimizer, 1), r"scheduler_fn is a StepLR instance"),
        ("model_fn", "resnet18", r"model_fn = 'resnet18' is not callable"),
    ]
    for key, value, message in cases:
        with pytest.raises(ConfigError, match=message):
            distributed_train_worker(0, 1, **worker_config(tmp_path, **{key: value}))
    assert not (tmp_path / "worker").exists(), "nothing was trained or written"


def loader_workers_start_method(rank: int, world_size: int) -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


@pytest.mark.distributed
def test_ranks_start_their_loader_workers_as_the_launching_process_does():
    """Spawned ranks inherited 'spawn' as their default start method, so every DataLoader worker (num_workers=4 per
    loader in seed 004) re-imported the script and torch and was sent a pickled copy of the dataset: the first epoch
    of the 64-row example took 10-24 s instead of 0.1 s on 2 CPU ranks. Ranks now fork their workers where the
    launching process would (Linux), as torchrun's ranks do."""
    import multiprocessing

    expected = multiprocessing.get_start_method()
    assert launch_distributed_training(loader_workers_start_method, 2) == expected


def test_a_rendezvous_port_in_use_is_named_with_the_variable_to_change(monkeypatch):
    """Two seed-004 scripts at once both take localhost:12355: the second's rank 0 failed with torch's "The server
    socket has failed to listen on any local network address ... EADDRINUSE", which says nothing of MASTER_PORT."""
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(
            ConfigError, match=rf"MASTER_PORT {port} is already in use on this machine.*by pid {os.getpid()}"
        ):
            TrainingEngine.setup_distributed(0, 2, backend="gloo", timeout_minutes=0.2)
    assert os.environ["MASTER_PORT"] == str(port) and "RANK" not in os.environ


def test_start_up_failures_name_the_engines_own_arguments(monkeypatch):
    """Seed 004's `distributed_training_example.py --distributed --world-size 4` on a 2-core machine: every rank's
    start-up failure (the seed's fallback then trains one process) said 'torchrun --nproc_per_node 4 CPU ranks ...
    Use --nproc_per_node 2 or fewer', a command the user never ran; `--backend nccl` without CUDA named phalanx
    train's 'distributed.backend'."""
    import os

    from phalanx.engine.engine import BACKEND_ENV

    cores = os.cpu_count() or 1
    too_many = cores + 1
    with pytest.raises(ConfigError) as err:  # the user's own processes (seed 004's Method 1)
        TrainingEngine.setup_distributed(0, too_many, backend="gloo")
    assert f"TrainingEngine.setup_distributed's world_size = {too_many} CPU ranks" in str(err.value)
    assert f"Use a world_size of {cores} or fewer" in str(err.value) and "torchrun" not in str(err.value)
    # A rank launch_distributed_training started (Method 2): it sets the environment torchrun would, and its backend.
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(too_many)), (BACKEND_ENV, "gloo")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        TrainingEngine.setup_distributed(0, too_many)
    assert f"launch_distributed_training's world_size = {too_many} CPU ranks" in str(err.value)
    assert "torchrun" not in str(err.value)
    monkeypatch.delenv(BACKEND_ENV)  # under torchrun itself its flag names them, as before
    with pytest.raises(ConfigError, match=f"torchrun --nproc_per_node {too_many} CPU ranks"):
        TrainingEngine.setup_distributed(0, too_many)
    # NCCL on a machine without CUDA (the example's --backend nccl): the engine's argument, not phalanx train's field.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^backend = 'nccl' needs CUDA devices; none are visible"):
        TrainingEngine.setup_distributed(0, 2, backend="nccl")


def test_a_model_wrapped_in_ddp_already_is_trained_and_saved_as_the_model_inside(tmp_path):
    """Seed 004's Method 1 imports DistributedDataParallel beside the engine: a model the user wrapped was wrapped
    again, and checkpoint-best held 'module.0.weight' where the model has '0.weight' (load_weights into it failed)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phalanx.engine.checkpoint import load_weights

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = mlp()
        with pytest.warns(RuntimeWarning, match="wrapped in DistributedDataParallel already"):
            engine = TrainingEngine(DDP(model), "cpu", distributed=True, output_dir=tmp_path, **QUIET)
        assert engine.unwrapped_model is model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine.train(DataLoader(pairs(), batch_size=4), None, optimizer, nn.CrossEntropyLoss(), num_epochs=1)
    finally:
        dist.destroy_process_group()
    fresh = mlp()
    fresh.load_state_dict(load_weights(tmp_path / "experiment" / "checkpoint-best", map_location="cpu"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_an_output_folder_that_cannot_be_made_and_a_bad_experiment_name_are_named(tmp_path):
    """output_dir naming a file was NotADirectoryError, an experiment_name naming a file FileExistsError, and
    experiment_name=None "unsupported operand type(s) for /: 'PosixPath' and 'NoneType'"."""
    (tmp_path / "notes.txt").write_text("x")
    loader = DataLoader(pairs(), batch_size=4)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for output_dir, name, message in (
        (tmp_path / "notes.txt", "experiment", r"notes.txt is a file, not a folder"),
        (tmp_path, "notes.txt", r"notes.txt is a file, not a folder"),
    ):
        engine = TrainingEngine(model, "cpu", output_dir=output_dir, experiment_name=name, **QUIET)
        with pytest.raises(ConfigError, match=rf"output_dir/experiment_name = .*: .*{message}"):
            engine.train(loader, None, optimizer, nn.CrossEntropyLoss(), num_epochs=1)
    for bad in (None, "", 3):
        with pytest.raises(ConfigError, match=rf"experiment_name = {bad!r}.*non-empty"):
            TrainingEngine(model, "cpu", output_dir=tmp_path, experiment_name=bad, **QUIET)
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_a_last_batch_of_one_row_under_batchnorm_is_named_with_the_fix(tmp_path):
    """9 rows in batches of 4 leave a last batch of 1: BatchNorm's "Expected more than 1 value per channel when
    training", after a whole epoch, with nothing said of the loader (distributed_train_worker in one process too)."""
    with pytest.raises(ConfigError, match=r"last batch holds 1 row \(9 rows, batch_size 4\).*drop_last=True"):
        fit(tmp_path, DictOut(), dict_loss, DataLoader(pairs(9), batch_size=4))
    config = worker_config(tmp_path, train_dataset=engine_ranks.dataset("bn", 9, 1), batch_size=4)
    with pytest.raises(ConfigError, match=r"last batch holds 1 row"):
        distributed_train_worker(0, 1, **config)
    assert not (tmp_path / "worker" / "checkpoint-last").exists(), "refused before an epoch was trained"
    # A loader without len(): found when the batch reaches BatchNorm
    with pytest.raises(ConfigError, match=r"a training batch of 1 row reached BatchNorm.*drop_last=True"):
        fit(tmp_path / "it", DictOut(), dict_loss, DataLoader(Rows(9), batch_size=4))
    fit(tmp_path / "dropped", DictOut(), dict_loss, DataLoader(pairs(9), batch_size=4, drop_last=True))
