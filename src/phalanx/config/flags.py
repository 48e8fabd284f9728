"""The command-line syntax every subcommand that takes a run config shares: an optional CONFIG.yaml, then flags."""

from __future__ import annotations

from typing import Optional, Sequence

from phalanx.errors import PhalanxError


class BareSwitch(str):
    """The value of a flag given with none (`--overwrite_output_dir`): reads as 'true', and is recognisable, so a
    flag that takes a value (`--learning_rate` at the end of a line) is refused as missing one rather than as 'true'."""


BARE = BareSwitch("true")


def split_flags(args: Sequence[str]) -> tuple[Optional[str], list[tuple[str, str]]]:
    """'[CONFIG] --a 1 --b=2 --switch' -> ('CONFIG', [('a','1'), ('b','2'), ('switch','true')])."""
    config: Optional[str] = None
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value, i = args[i + 1], i + 1
                else:
                    value = BARE  # a bare switch such as --overwrite_output_dir
            pairs.append((name.replace("-", "_") if "." not in name else name, value))
        elif config is None:
            config = arg
        else:
            raise PhalanxError(f"unexpected argument {arg!r}: give at most one CONFIG.yaml, then --flag value pairs")
        i += 1
    return config, pairs
