"""The flag syntax the subcommands share: a subcommand's own flags, mistyped, name the nearest one."""

import pytest

from phalanx.config.flags import CommandParser
from phalanx.errors import ConfigError


def parser() -> CommandParser:
    p = CommandParser(prog="phalanx generate", allow_abbrev=False)
    p.add_argument("--num_questions", type=int)
    p.add_argument("--num_sequences_per_question", type=int)
    return p


def test_a_mistyped_flag_names_the_nearest_one_and_the_help():
    with pytest.raises(ConfigError) as err:
        parser().parse_args(["--num_question", "8"])
    assert str(err.value) == (
        "phalanx generate: unrecognized arguments: --num_question 8. Did you mean --num_questions? "
        "`phalanx generate --help` lists the flags."
    )


def test_a_bad_value_or_an_unlike_flag_is_said_without_a_guess():
    with pytest.raises(ConfigError, match=r"argument --num_questions: invalid int value: 'x'\. `phalanx generate"):
        parser().parse_args(["--num_questions", "x"])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --zzz\. `phalanx generate --help`"):
        parser().parse_args(["--zzz"])


def test_dashes_are_read_as_underscores_as_phalanx_train_reads_them(capsys):
    """`phalanx train --max-steps 2` was taken while `phalanx config deepspeed --zero-stage 2` was refused."""
    from phalanx.launch.command import launcher_parser, slurm_parser
    from phalanx.parallel.config_files import config_main

    assert parser().parse_args(["--num-questions", "8", "--num-sequences-per-question=3"]).num_questions == 8
    assert config_main(["deepspeed", "--zero-stage", "3"]) == 0  # a subcommand's parser reads its own flags
    assert '"stage": 3' in capsys.readouterr().out
    launcher = launcher_parser().parse_args(["--num-gpus-per-node", "2", "--master-addr", "h"])
    assert (launcher.num_gpus_per_node, launcher.master_addr) == (2, "h")
    assert slurm_parser().parse_args(["--num-gpus-per-node", "4", "--mem-per-gpu", "80G"]).mem_per_gpu == "80G"
    # A mistyped dashed flag still names the nearest; words after `--` go to another command as they are.
    with pytest.raises(ConfigError, match="unrecognized arguments: --num-question 8. Did you mean --num_questions?"):
        parser().parse_args(["--num-question", "8"])
    tail = CommandParser(prog="phalanx x")
    tail.add_argument("--max_steps")
    tail.add_argument("rest", nargs="*")
    assert tail.parse_args(["--max-steps", "2", "--", "--max-steps"]).rest == ["--max-steps"]


def test_phalanx_generate_and_launcher_use_it():
    from phalanx.generate.args import build_parser
    from phalanx.launch.command import launcher_parser

    with pytest.raises(ConfigError, match="Did you mean --num_questions?"):
        build_parser().parse_args(["--num_question", "8"])
    with pytest.raises(ConfigError, match="Did you mean --master_addr?"):
        launcher_parser().parse_args(["--num_gpus_per_node", "0", "--master_adr", "x"])


@pytest.mark.parametrize(
    "command, argv, said",
    [
        ("config", ["deepspeed", "--zero", "3"], "unrecognized arguments: --zero 3. Did you mean --zero_stage?"),
        ("config", ["fsdp", "--over"], "unrecognized arguments: --over. Did you mean --overwrite?"),
        (
            "launcher",
            ["--num_gpus_per_node", "0", "--conf", "c.yaml"],
            "arguments: --conf c.yaml. Did you mean --config?",
        ),
        ("slurm", ["--num_gpus", "0"], "--num_gpus is not a flag of phalanx slurm: did you mean --num_gpus_per_node?"),
        ("env", ["--world", "2"], "unrecognized arguments: --world 2. Did you mean --world_size?"),
        ("generate", ["--model", "m"], "unrecognized arguments: --model m. Did you mean --model_name?"),
        ("train", ["--over"], "unknown flag --over. Did you mean 'overwrite_output_dir'?"),
        ("plan", ["--dev", "cpu"], "unknown flag --dev. Did you mean 'device'?"),  # plan's own flags too
        ("data", ["preview", "--row", "2"], "unknown flag --row. Did you mean 'rows'?"),
    ],
)
def test_no_command_takes_an_abbreviated_flag(command, argv, said, tmp_path, monkeypatch):
    """argparse's default reads `--over` as --overwrite: a typo taken silently, and one that changes meaning when a
    second flag shares the prefix. Every subcommand refuses it, naming the flag it begins."""
    from phalanx.cli import resolve_command

    monkeypatch.chdir(tmp_path)  # where a command that took the abbreviation would write its script

    with pytest.raises(ConfigError) as refused:
        resolve_command(command)(argv)
    assert said in str(refused.value) and refused.value.exit_code == 2


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--generate", "--num_questions 2"], None),  # --generate's value, not a flag of the launcher
        (["--generate", "--num_questions 2", "--num_gpu_per_node", "2"], "--num_gpu_per_node"),
        (["--overwrite", "--num_gpu_per_node", "2"], "--num_gpu_per_node"),  # a bare switch takes no value
    ],
)
def test_a_missing_required_flag_names_only_a_mistyped_one(argv, hint):
    """argparse reports a missing required flag before an unknown one, so the words given are searched for the
    mistyped flag; a known flag's value is not one, even when it starts with "--" (launcher --generate's flags)."""
    from phalanx.launch.command import launcher_parser

    with pytest.raises(ConfigError) as refused:
        launcher_parser().parse_args(argv)
    said = str(refused.value)
    assert said.startswith("phalanx launcher: the following arguments are required: --num_gpus_per_node.")
    if hint is None:
        assert "is not a flag of" not in said
    else:
        assert f"{hint} is not a flag of phalanx launcher: did you mean --num_gpus_per_node?" in said
