"""TrainingEngine in one process: EMA against a hand-computed reference, checkpoints and resume, fallbacks, API."""

import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import phalanx
from engine import engine_ranks
from helpers import lock_held_elsewhere
from phalanx.checkpoint.commit import is_committed
from phalanx.engine.checkpoint import load_weights
from phalanx.engine.ema import ModelEMA
from phalanx.engine.engine import DistributedFallbackWarning, TrainingEngine
from phalanx.engine.launch import distributed_train_worker, launch_distributed_training
from phalanx.engine.metrics import MetricTotals, is_classification, reduce_tensor
from phalanx.engine.syncbn import CPUSyncBatchNorm, convert_sync_batchnorm
from phalanx.errors import ConfigError, PhalanxError
from phalanx.runtime.output_lock import hold_lock, release_lock, training_lock

QUIET = {"progress_bar": False, "tensorboard": False}


def test_seed_004_names_are_exported():
    assert phalanx.TrainingEngine is TrainingEngine
    assert phalanx.launch_distributed_training is launch_distributed_training
    assert phalanx.distributed_train_worker is distributed_train_worker


# ---- EMA ---------------------------------------------------------------------------------------


def test_ema_matches_a_hand_computed_average():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEMA(model, decay=0.9)
    expected = {k: v.clone().double() for k, v in model.state_dict().items()}
    for t in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
            model[1].num_batches_tracked.add_(1)
        d = min(0.9, (1 + t) / (10 + t))  # warm-up: 0.1, 0.18, 0.25, 0.31
        for k, v in model.state_dict().items():
            expected[k] = d * expected[k] + (1 - d) * v.double() if v.is_floating_point() else v.clone()
        ema.update(model)
    assert ema.updates == 4
    for k, v in ema.module.state_dict().items():
        assert torch.allclose(v.double(), expected[k].double(), atol=1e-6), k
    assert ema.module.state_dict()["1.num_batches_tracked"].item() == 4  # counters are copied, not averaged


def test_ema_without_warmup_uses_the_constant_decay():
    model = nn.Linear(2, 1, bias=False)
    ema = ModelEMA(model, decay=0.5, warmup=False)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)
    assert torch.allclose(ema.module.weight, 0.5 * start + 0.5)


def test_engine_ema_follows_every_optimizer_step():
    """The engine's EMA equals a hand-written loop: SGD step, then ema = d*ema + (1-d)*w with the warm-up decay."""
    data = engine_ranks.dataset("mlp", 24, 1)
    loader = DataLoader(data, batch_size=8)
    engine = TrainingEngine(engine_ranks.mlp(), "cpu", use_ema=True, ema_decay=0.95, output_dir="unused", **QUIET)
    optimizer = torch.optim.SGD(engine.unwrapped_model.parameters(), lr=0.1)
    engine.attach(optimizer)
    engine.train_epoch(loader, nn.CrossEntropyLoss())
    engine.train_epoch(loader, nn.CrossEntropyLoss())

    model = engine_ranks.mlp()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    manual = torch.optim.SGD(model.parameters(), lr=0.1)
    t = 0
    for _ in range(2):
        for x, y in loader:
            manual.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            manual.step()
            d = min(0.95, (1 + t) / (10 + t))
            reference = {k: d * reference[k] + (1 - d) * v for k, v in model.state_dict().items()}
            t += 1
    assert engine.ema.updates == t == 6
    for k, v in engine.ema.module.state_dict().items():
        assert torch.allclose(v, reference[k], atol=1e-6), k


# ---- metrics -------------------------------------------------------------------------------------


def test_epoch_metrics_weigh_batches_by_their_sample_counts():
    totals = MetricTotals(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    outputs, targets = torch.randn(7, 3, generator=g), torch.randint(0, 3, (7,), generator=g)
    for lo, hi in [(0, 4), (4, 7)]:  # an uneven last batch
        totals.add(nn.functional.cross_entropy(outputs[lo:hi], targets[lo:hi]), outputs[lo:hi], targets[lo:hi])
    reduced = totals.reduce()
    assert reduced["samples"] == 7
    assert reduced["loss"] == pytest.approx(nn.functional.cross_entropy(outputs, targets).item(), abs=1e-6)
    assert reduced["accuracy"] == pytest.approx((outputs.argmax(1) == targets).float().mean().item())


def test_accuracy_only_for_class_scores_against_integer_labels():
    assert is_classification(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    assert is_classification(torch.zeros(2, 3, 5, 5), torch.zeros(2, 5, 5, dtype=torch.long))  # segmentation
    assert not is_classification(torch.zeros(4, 1), torch.zeros(4, 1))  # regression
    totals = MetricTotals(torch.device("cpu"))
    totals.add(torch.tensor(0.5), torch.zeros(4, 1), torch.zeros(4, 1))
    assert "accuracy" not in totals.reduce()


def test_reduce_tensor_without_a_process_group_is_a_copy():
    value = torch.tensor([2.0])
    out = reduce_tensor(value)
    assert out.tolist() == [2.0] and out is not value
    engine = TrainingEngine(nn.Linear(2, 2), "cpu", **QUIET)
    assert engine._reduce_tensor(value).tolist() == [2.0]


def test_cpu_sync_batchnorm_is_plain_batchnorm_in_one_process():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3))
    synced = convert_sync_batchnorm(engine_ranks.bn_cnn(), torch.device("cpu"))
    assert isinstance(synced[1], CPUSyncBatchNorm) and isinstance(synced[6], CPUSyncBatchNorm)
    converted = convert_sync_batchnorm(plain, torch.device("cpu"))
    assert converted[1].weight is plain[1].weight and converted[1].running_mean is plain[1].running_mean
    x = torch.randn(4, 1, 6, 6)
    reference = nn.BatchNorm2d(3)
    reference.load_state_dict(converted[1].state_dict())
    h = converted[0](x).detach()
    assert torch.allclose(converted[1](h), reference(h), atol=1e-6)
    assert torch.allclose(converted[1].running_var, reference.running_var)


# ---- checkpoints and resume ------------------------------------------------------------------------


def resumable_run(out_dir, epochs, resume_from=None, **train_kwargs) -> TrainingEngine:
    """BatchNorm + dropout (RNG), EMA, a scheduler and a shuffling sampler: everything resume must restore."""
    data, val = engine_ranks.dataset("bn", 24, 1), engine_ranks.dataset("bn", 9, 2)
    torch.manual_seed(123)
    model = nn.Sequential(engine_ranks.bn_cnn(), nn.Dropout(0.3), nn.Linear(3, 3))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3))
    engine = TrainingEngine(
        model, "cpu", use_ema=True, ema_decay=0.9, experiment_name="resume", output_dir=out_dir, **QUIET
    )
    optimizer = torch.optim.SGD(engine.unwrapped_model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    engine.train(
        loader,
        DataLoader(val, batch_size=4),
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler,
        num_epochs=epochs,
        resume_from=resume_from,
        **train_kwargs,
    )
    return engine


def test_checkpoint_resume_continues_exactly_and_loads_on_cpu(tmp_path):
    straight = resumable_run(tmp_path / "a", epochs=4)
    resumable_run(tmp_path / "b", epochs=2)
    last = tmp_path / "b" / "resume" / "checkpoint-last"
    resumed = resumable_run(tmp_path / "c", epochs=4, resume_from=last)
    assert resumed.epochs_done == 4 and resumed.global_step == straight.global_step == 12
    for key, values in straight.history.items():
        if key != "epoch_time":
            assert resumed.history[key] == pytest.approx(values, abs=1e-6), key
    for mine, theirs in [
        (resumed.unwrapped_model, straight.unwrapped_model),
        (resumed.ema.module, straight.ema.module),
    ]:
        for (k, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            assert torch.allclose(a, b, atol=1e-6), k
    assert resumed.scheduler.get_last_lr() == pytest.approx(straight.scheduler.get_last_lr())

    # Weights alone, onto a device of the reader's choice, into a model that was never wrapped.
    fresh = nn.Sequential(engine_ranks.bn_cnn(), nn.Dropout(0.3), nn.Linear(3, 3))
    fresh.load_state_dict(load_weights(tmp_path / "a" / "resume" / "checkpoint-last", map_location="cpu"))
    for (k, a), b in zip(fresh.state_dict().items(), straight.unwrapped_model.state_dict().values()):
        assert torch.equal(a, b), k
    ema = load_weights(tmp_path / "a" / "resume" / "checkpoint-last", map_location=torch.device("cpu"), ema=True)
    assert all(torch.equal(ema[k], v) for k, v in straight.ema.module.state_dict().items())
    # State files are plain tensors: safe loading works.
    torch.load(last / "optimizer.pt", map_location="cpu", weights_only=True)
    assert (tmp_path / "a" / "resume" / "checkpoint-best" / "phalanx_checkpoint.json").is_file()


def test_a_resume_sets_aside_a_best_saved_after_its_checkpoint(tmp_path, capsys):
    """checkpoint-best is saved at an epoch's end before checkpoint-last: a crash between them leaves a best from a
    step the resumed run has not reached (checkpoint.resume.set_aside_ahead); the rerun of that epoch saves
    it again."""
    import json
    import shutil

    run = tmp_path / "resume"
    marked = lambda name: json.loads((run / name / "phalanx_checkpoint.json").read_text())["global_step"]  # noqa: E731
    resumable_run(tmp_path, epochs=2, monitor="train_loss")
    shutil.copytree(run / "checkpoint-last", tmp_path / "last-6")
    resumable_run(tmp_path, epochs=3, resume_from=run / "checkpoint-last", monitor="train_loss")
    assert marked("checkpoint-best") == 9, "the test's premise: epoch 3 is a new best"
    shutil.rmtree(run / "checkpoint-last")
    shutil.copytree(tmp_path / "last-6", run / "checkpoint-last")  # the crash came before epoch 3's checkpoint-last
    capsys.readouterr()
    resumable_run(tmp_path, epochs=3, resume_from=run / "checkpoint-last", monitor="train_loss")
    [aside] = run.glob("crashed-*/checkpoint-best")
    assert f"checkpoint-best came from step 9, after step 6 where this run resumes: moved to {aside}" in (
        capsys.readouterr().out
    )
    assert marked("checkpoint-best") == 9  # saved again by the rerun of epoch 3


def test_uncommitted_checkpoints_are_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(PhalanxError, match="not a committed phalanx checkpoint"):
        load_weights(tmp_path / "half")
    engine = TrainingEngine(nn.Linear(2, 2), "cpu", **QUIET)
    with pytest.raises(PhalanxError, match="not a committed"):
        engine.load_checkpoint(tmp_path / "half")


def test_an_engine_refuses_an_output_another_run_holds_and_frees_its_own_when_done(tmp_path):
    """Two engines on one output folder would rotate each other's checkpoints away: the second is refused before it
    writes anything; a finished train() lets the next run (another engine, `phalanx train`) have the folder."""
    folder = tmp_path / "resume"
    with lock_held_elsewhere(training_lock(folder)) as holder:
        with pytest.raises(
            ConfigError, match=re.escape(f"output_dir {folder} is in use by another run (pid {holder} on ")
        ):
            resumable_run(tmp_path, epochs=1)
        assert sorted(p.name for p in folder.iterdir()) == [".phalanx.lock"]  # no checkpoint, no metrics
    resumable_run(tmp_path, epochs=1)
    hold_lock(training_lock(folder), "x")  # released by the run that finished
    release_lock(training_lock(folder))


# ---- fallbacks and bad input ------------------------------------------------------------------------


def tiny_config(out_dir, batch=8) -> dict:
    config = engine_ranks.worker_config(str(out_dir), batch)
    config["train_kwargs"] = {"num_epochs": 1}
    return config


def test_engine_without_a_process_group_warns_and_trains_alone(tmp_path):
    assert not torch.distributed.is_initialized()
    with pytest.warns(DistributedFallbackWarning, match="no process group is initialised"):
        engine = TrainingEngine(engine_ranks.mlp(), "cpu", distributed=True, world_size=2, output_dir=tmp_path, **QUIET)
    assert not engine.distributed and engine.world_size == 1 and engine.strategy.name == "single"
    assert "no process group" in engine.fallback_reason


def test_worker_falls_back_to_one_process_when_start_up_fails(tmp_path, recwarn):
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    # NCCL cannot start on a machine without CUDA devices: the seed's fallback trains in one process.
    history = distributed_train_worker(0, 2, backend="nccl", **tiny_config(tmp_path))
    messages = [str(w.message) for w in recwarn if issubclass(w.category, DistributedFallbackWarning)]
    assert any("distributed start-up failed" in m and "single process" in m for m in messages), messages
    assert history["epoch"] == [1] and (tmp_path / "worker" / "checkpoint-last" / "phalanx_checkpoint.json").is_file()
    assert {k: os.environ.get(k) for k in before} == before, "a failed start-up leaves the environment as it was"
    with pytest.warns(DistributedFallbackWarning, match="rank 1: distributed start-up failed"):
        assert distributed_train_worker(1, 2, backend="nccl", **tiny_config(tmp_path / "r1")) is None


def test_launch_with_no_devices_warns_and_runs_here(tmp_path):
    with pytest.warns(DistributedFallbackWarning, match="world_size=0"):
        history = launch_distributed_training(distributed_train_worker, 0, **tiny_config(tmp_path))
    assert history["epoch"] == [1]


def test_amp_on_cpu_warns_and_trains_in_fp32():
    with pytest.warns(RuntimeWarning, match="use_amp=True needs a CUDA device"):
        engine = TrainingEngine(nn.Linear(2, 2), "cpu", use_amp=True, **QUIET)
    assert engine.strategy.precision.dtype is None and engine.scaler is None and not engine.use_amp
    with pytest.raises(ConfigError, match="amp_dtype = 'fp8'"):
        TrainingEngine(nn.Linear(2, 2), "cpu", use_amp=True, amp_dtype="fp8", **QUIET)


def test_worker_config_errors_name_the_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batchsize'\].*accepted keys"):
        distributed_train_worker(0, 1, **tiny_config(tmp_path), batchsize=4)
    config = tiny_config(tmp_path)
    config["engine_kwargs"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match="set by distributed_train_worker"):
        distributed_train_worker(0, 1, **config)


def test_lambdas_cannot_be_spawned_so_the_ranks_fork(monkeypatch):
    from phalanx.engine import launch

    assert launch._start_method("auto", distributed_train_worker, {"model_fn": engine_ranks.mlp}) == "spawn"
    assert launch._start_method("auto", distributed_train_worker, {"model_fn": lambda: None}) == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="model_fn .* cannot be sent to spawned ranks"):
        launch._start_method("auto", distributed_train_worker, {"model_fn": lambda: None})


def test_bad_batches_and_monitor_get_clear_errors(tmp_path):
    engine = TrainingEngine(nn.Linear(2, 2), "cpu", output_dir=tmp_path, **QUIET)
    optimizer = torch.optim.SGD(engine.unwrapped_model.parameters(), lr=0.1)
    triples = DataLoader(
        TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.zeros(4)), batch_size=2
    )
    with pytest.raises(ConfigError, match=r"expects batches of \(inputs, targets\); got list of length 3"):
        engine.train(triples, None, optimizer, nn.CrossEntropyLoss(), num_epochs=1)
    pairs = DataLoader(TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)), batch_size=2)
    with pytest.raises(ConfigError, match="monitor = 'val_f1'; choose one of val_loss, val_acc"):
        engine.train(pairs, pairs, optimizer, nn.CrossEntropyLoss(), num_epochs=1, monitor="val_f1")


def test_the_digits_example_learns_in_one_process(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "digits_classification.py"
    spec = importlib.util.spec_from_file_location("digits_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # --use-amp on CPU warns and trains in fp32
        history = example.main(
            ["--epochs", "2", "--use-ema", "--use-amp", "--output-dir", str(tmp_path), "--no-progress-bar"]
        )
    assert history["val_acc"][-1] > 0.8
    assert (tmp_path / "digits" / "checkpoint-best" / "ema.pt").is_file()
    # --world-size 0 (torch.cuda.device_count() on a CPU machine, as seed 004 writes it) is the launcher's warned
    # one-process run; it was read as unset and started 2 ranks.
    with pytest.warns(DistributedFallbackWarning, match="world_size=0"):
        history = example.main(
            ["--distributed", "--world-size", "0", "--epochs", "1", "--output-dir", str(tmp_path / "w0")]
            + ["--no-progress-bar"]
        )
    assert history["epoch"] == [1]


def test_the_digits_example_answers_bad_values_in_one_line(tmp_path):
    """Run as the README shows it: `--batch-size 0` ended in torch's sampler's ValueError traceback, a backend
    the engine refuses in its ConfigError's traceback; now one line and status 2, nothing written."""
    import subprocess
    import sys

    from helpers import ROOT, phalanx_env

    example = str(ROOT / "examples" / "digits_classification.py")
    for args, needle in [
        (["--batch-size", "0"], "argument --batch-size: '0': give a whole number, at least 1"),
        (["--distributed", "--world-size", "2", "--backend", "foo"], "error: backend = 'foo': not a torch.distributed"),
        (["--world-size", "2"], "error: --world-size 2 starts ranks only with --distributed"),  # was trained on 1
    ]:
        proc = subprocess.run(
            [sys.executable, example, *args, "--output-dir", str(tmp_path / "runs")],
            env=phalanx_env(None),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


class _ReturnsNothing(nn.Linear):
    def forward(self, x):
        super().forward(x)


def test_a_model_or_criterion_that_gives_no_trainable_loss_is_named():
    """Without the check these were torch's own errors (cross_entropy of None, `.backward()` on None, "grad can be
    implicitly created only for scalar outputs"), which name neither the model nor the criterion."""
    loader = DataLoader(TensorDataset(torch.randn(4, 2), torch.zeros(4, dtype=torch.long)), batch_size=2)
    cases = [
        (
            _ReturnsNothing(2, 2),
            nn.CrossEntropyLoss(),
            False,
            r"model\(inputs\) returned None \(_ReturnsNothing\.forward",
        ),
        (
            nn.Linear(2, 2),
            lambda outputs, targets: None,
            False,
            r"criterion <lambda>\(outputs, targets\) returned NoneType",
        ),
        (nn.Linear(2, 2), nn.CrossEntropyLoss(reduction="none"), False, r"shape \(2,\).*reduction='none'"),
        (nn.Linear(2, 2), lambda o, t: nn.functional.cross_entropy(o.detach(), t), False, "a loss with no gradient"),
        (nn.Linear(2, 2), nn.CrossEntropyLoss(reduction="none"), True, r"CrossEntropyLoss\(outputs, targets\).*shape"),
    ]
    for model, criterion, validating, message in cases:
        engine = TrainingEngine(model, "cpu", output_dir="unused", **QUIET)
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ConfigError, match=message):
            (engine.validate if validating else engine.train_epoch)(loader, criterion)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "no step was taken"


def test_launch_arguments_that_would_fail_inside_the_ranks_are_refused_before_they_start(tmp_path):
    """A misspelt backend was a failed start-up, which seed 004's fallback turned into a warning and a one-process
    run; misspelt engine/train keywords and an empty dataset were errors from deep inside every rank; an explicit
    start_method='spawn' with a lambda was pickle's own error."""
    with pytest.raises(
        ConfigError, match=r"backend = 'ncll': not a torch.distributed backend; accepted: None .*'gloo'"
    ):
        launch_distributed_training(distributed_train_worker, 2, backend="ncll", **tiny_config(tmp_path))
    with pytest.raises(ConfigError, match="backend = 'cpu:glo'"):
        TrainingEngine.setup_distributed(0, 2, backend="cpu:glo")
    config = tiny_config(tmp_path)
    config["engine_kwargs"] = {**config.get("engine_kwargs", {}), "use_ammp": True}
    with pytest.raises(ConfigError, match=r"engine_kwargs: unknown key 'use_ammp'. Did you mean 'use_amp'\?"):
        distributed_train_worker(0, 1, **config)
    config = tiny_config(tmp_path)
    config["train_kwargs"] = {"num_epoch": 1}
    with pytest.raises(ConfigError, match=r"train_kwargs: unknown key 'num_epoch'. Did you mean 'num_epochs'\?"):
        distributed_train_worker(0, 1, **config)
    config = tiny_config(tmp_path)
    config["train_kwargs"] = {"optimizer": None}  # the worker builds it
    with pytest.raises(ConfigError, match="train_kwargs: unknown key 'optimizer'"):
        distributed_train_worker(0, 1, **config)
    config = tiny_config(tmp_path)
    config["train_dataset"] = TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"train_dataset is empty \(0 rows\)"):
        distributed_train_worker(0, 1, **config)
    with pytest.raises(ConfigError, match=r"train_fn .* cannot be sent to spawned ranks with start_method='spawn'"):
        launch_distributed_training(lambda rank, world_size: None, 2, start_method="spawn")
    assert not (tmp_path / "worker").exists(), "nothing was trained or written"


def test_a_resume_path_that_is_missing_or_a_file_and_bad_train_counts_are_named(tmp_path):
    """A missing resume_from, or a file, was "it may be a save that crashed"; num_epochs=1.5 was range()'s TypeError,
    and a negative num_epochs or max_grad_norm trained nothing or clipped nothing without a word."""
    engine = TrainingEngine(nn.Linear(2, 2), "cpu", output_dir=tmp_path, **QUIET)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(PhalanxError, match=r"nope is not a committed phalanx checkpoint \(no such folder\)"):
        engine.load_checkpoint(tmp_path / "nope")
    with pytest.raises(PhalanxError, match=r"notes.txt is not a committed .* \(a file, not a checkpoint folder\)"):
        engine.load_checkpoint(tmp_path / "notes.txt")
    pairs = DataLoader(TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)), batch_size=2)
    optimizer = torch.optim.SGD(engine.unwrapped_model.parameters(), lr=0.1)
    for bad in (1.5, -1, True):
        with pytest.raises(ConfigError, match=f"num_epochs = {bad!r}; give a whole number of epochs, 0 or more"):
            engine.train(pairs, None, optimizer, nn.CrossEntropyLoss(), num_epochs=bad)
    with pytest.raises(ConfigError, match="max_grad_norm = -1.0; give a positive norm to clip to, or 0 for none"):
        engine.train(pairs, None, optimizer, nn.CrossEntropyLoss(), num_epochs=1, max_grad_norm=-1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "nothing trained or written"


def test_a_fresh_run_in_a_folder_an_earlier_run_left_sets_that_run_aside(tmp_path, capsys):
    """The earlier run's metrics.jsonl was cut and its checkpoint-best replaced by the new run's first epoch (always a
    new best): rerunning a seed-004 script lost the earlier best model. It now moves, whole, into earlier-run-<time>/."""
    resumable_run(tmp_path, epochs=1)
    folder = tmp_path / "resume"
    assert "held an earlier run" not in capsys.readouterr().out, "the first run sets nothing aside"
    earlier = {
        name: (folder / name / "model.safetensors").read_bytes() for name in ("checkpoint-last", "checkpoint-best")
    }
    earlier_metrics = (folder / "metrics.jsonl").read_text()
    resumable_run(tmp_path, epochs=1, max_grad_norm=0.01)  # another run: its best is another model
    out = capsys.readouterr().out
    (aside,) = folder.glob("earlier-run-*")
    assert (
        f"↩️  {folder} held an earlier run (checkpoint-last, checkpoint-best, metrics.jsonl): moved to {aside}" in out
    ), out
    for name, weights in earlier.items():
        assert is_committed(aside / name) and (aside / name / "model.safetensors").read_bytes() == weights
        assert (folder / name / "model.safetensors").read_bytes() != weights, "the new run saved its own"
    assert (aside / "metrics.jsonl").read_text() == earlier_metrics
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == len(earlier_metrics.splitlines())
    resumable_run(tmp_path, epochs=2, resume_from=folder / "checkpoint-last", max_grad_norm=0.01)
    assert "held an earlier run" not in capsys.readouterr().out, "a resume continues it"
    assert len(list(folder.glob("earlier-run-*"))) == 1
