"""`phalanx train`'s command module and the pieces every command shares: the table, the config flags, the quieting."""

import os
import subprocess
import sys

import pytest

from phalanx.cli import COMMANDS, resolve_command
from phalanx.config.loader import config_from_args
from phalanx.errors import ConfigError


def test_every_command_in_the_table_resolves_to_a_function():
    for name in COMMANDS:
        assert callable(resolve_command(name)), name


def test_config_from_args_reads_file_and_flags_as_train_does(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  learning_rate: 0.5\n")
    cfg, config_path, pairs = config_from_args([str(path), "--lora_r", "4", "--training.seed=3"])
    assert config_path == str(path) and pairs == [("lora_r", "4"), ("training.seed", "3")]
    assert (cfg.training.learning_rate, cfg.lora.r, cfg.training.seed) == (0.5, 4, 3)


def test_a_commands_own_flags_stay_out_of_the_config():
    cfg, _, pairs = config_from_args(["--device", "cpu", "--lora_r", "4"], own_flags=("device",))
    assert cfg.lora.r == 4 and ("device", "cpu") in pairs


def test_flags_only_takes_the_file_from_the_launcher_and_refuses_one_after_the_dashes(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  r: 2\n")
    cfg, config_path, _ = config_from_args(["--max_steps", "5"], flags_only=True, config_path=str(path))
    assert config_path == str(path) and (cfg.lora.r, cfg.training.max_steps) == (2, 5)
    with pytest.raises(ConfigError, match="not a file .*use --config"):
        config_from_args(["other.yaml"], flags_only=True, config_path=str(path))


def test_train_help_and_a_bad_flag_need_no_torch():
    """The command module stays import-light: help and a bad config are answered before torch is loaded."""
    code = (
        "import sys; from phalanx.cli import run_command; "
        "codes = [run_command(['train', '--help']), run_command(['train', '--no_such_flag', '1'])]; "
        "print(codes, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[0, 2] False"


def test_a_rank_keeps_a_stop_signal_that_comes_while_the_config_stack_imports():
    """A rank installs its handler before pydantic is imported: a Ctrl-C or SIGTERM that came in that import (the
    first tenths of a second of every rank, seconds on a busy machine) was a KeyboardInterrupt traceback, or the
    rank's death, and the launcher then stopped the others without saving."""
    code = (
        "import os, signal, sys\n"
        "class SignalOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pydantic':\n"
        "            os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
        "sys.meta_path.insert(0, SignalOnImport())\n"
        "from phalanx.train import command\n"
        "def rank(args, preemption):\n"
        "    import phalanx.config.loader  # as the real train_rank does\n"
        "    print('requested', preemption.requested, preemption.signal_name)\n"
        "    return 0\n"
        "command.train_rank = rank\n"
        "sys.exit(command.main(['--max_steps', '1']))\n"
    )
    for name in ("SIGINT", "SIGTERM"):
        env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
        done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, env=env)
        assert done.returncode == 0, (name, done.returncode, done.stderr[-2000:])
        assert done.stdout.strip().splitlines()[-1] == f"requested True {name}", done.stdout


def test_a_rank_that_crashes_exits_1_not_the_bad_input_status(monkeypatch, tmp_path):
    """A rank of a multi-rank run whose step raises (here as a peer's death does) is a crash: the CLI's status is 1,
    as a single process that crashes, so neither the rank's own status nor torchrun's summary says "bad input"."""
    import types

    from phalanx.cli import run_command
    from phalanx.errors import RanksFailed
    from phalanx.train.command import train_worker

    def peer_died(cfg, preemption, **run_options):
        raise RuntimeError("Connection closed by peer")

    # Stand-ins for the run's modules, whose model stack takes seconds to import and plays no part here.
    run_module = types.SimpleNamespace(build_run=peer_died, finish_run=None, stop_loader_workers=None)
    monkeypatch.setitem(sys.modules, "phalanx.train.run", run_module)
    monkeypatch.setitem(sys.modules, "phalanx.train.loop", types.SimpleNamespace(train=None))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = config_from_args(["--output_dir", str(tmp_path / "out")])[0]
    with pytest.raises(RanksFailed, match="rank 0 failed: RuntimeError: Connection closed by peer") as caught:
        train_worker(cfg, preemption=None)
    assert caught.value.exit_code == 1
    assert run_command(["train", "--output_dir", str(tmp_path / "out2")]) == 1


def test_a_refusal_raised_by_every_rank_is_reported_once_with_its_status(monkeypatch, tmp_path, capsys):
    """A damaged checkpoint (or nan_policy stop) raises a plain PhalanxError on every rank: like a bad row it goes to
    the launcher through the rank's error file, to be printed once with status 2, not by each rank with the
    launcher's crash status 1. A rank's crash (RanksFailed) still raises."""
    import json

    from phalanx.errors import PhalanxError, RanksFailed
    from phalanx.launch.local import PARENT_REPORTS, reported_bad_input
    from phalanx.train import command

    message = "out/checkpoint-4/optimizer.pt cannot be read: this checkpoint is damaged"
    raised: list[Exception] = [PhalanxError(message)]

    def refuse(cfg, preemption):
        raise raised[0]

    monkeypatch.setattr(command, "train_worker", refuse)
    monkeypatch.setattr(command, "load_only_what_the_run_needs", lambda cfg: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(PARENT_REPORTS, "1")
    files = {}
    for rank in (0, 1):
        files[rank] = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[rank]))
        assert command.train_rank(["--output_dir", str(tmp_path / "out")], preemption=None) == 2
    assert capsys.readouterr().err == "", "the launcher prints it, once"
    reported = reported_bad_input({rank: json.loads(path.read_text()) for rank, path in files.items()})
    assert str(reported) == message and reported.exit_code == 2
    raised[0] = RanksFailed("rank 1 failed: RuntimeError: boom")
    with pytest.raises(RanksFailed):
        command.train_rank(["--output_dir", str(tmp_path / "out")], preemption=None)
