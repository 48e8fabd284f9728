"""`phalanx train`'s command module and the pieces every command shares: the table, the config flags, the quieting."""

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
