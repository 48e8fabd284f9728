"""`phalanx generate`'s flags: each one is in docs/generate.md's table, as users look them up there."""

import re
from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.generate.args import build_parser, parse_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "generate.md"


def test_every_flag_is_in_the_docs_table():
    table = {
        flag
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `--")
        for flag in re.findall(r"`(--[a-z_]+)`", line.split("|")[1])
    }
    flags = {name for action in build_parser()._actions for name in action.option_strings if name.startswith("--")} - {
        "--help"
    }
    underscored = {name for name in flags if "-" not in name[2:]}  # each flag's dashed spelling is an alias
    assert underscored - table == set(), "flags missing from docs/generate.md"
    assert table - underscored == set(), "docs/generate.md lists flags phalanx generate does not take"


def test_a_master_port_outside_tcp_is_refused_by_the_parser():
    """--master_port 70000 went on to the launcher's free-port check and ended in socket.bind's OverflowError
    traceback; now the parser names it, as phalanx train and launcher do."""
    for bad in ("70000", "0", "abc"):
        with pytest.raises(ConfigError, match=f"argument --master_port: {bad} is not a TCP port; give 1..65535"):
            parse_args(["--world_size", "2", "--master_port", bad])
    assert parse_args(["--master_port", "29501"]).master_port == 29501
