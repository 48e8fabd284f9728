"""`phalanx generate`'s flags: each one is in docs/generate.md's table, as users look them up there."""

import re
from pathlib import Path

from phalanx.generate.args import build_parser

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
