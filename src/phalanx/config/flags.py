"""The command-line syntax every subcommand that takes a run config shares: an optional CONFIG.yaml, then flags."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Optional, Sequence

from phalanx.errors import ConfigError, PhalanxError


class CommandParser(argparse.ArgumentParser):
    """argparse for a subcommand's own flags: bad input is a ConfigError (one clear line, exit 2, no usage dump),
    and a mistyped flag names the nearest one, as `phalanx train` does. Flags are never abbreviated: argparse would
    take `--over` for `--overwrite` and `--zero 3` for `--zero_stage 3`, a typo silently read as some flag, and one
    that changes meaning the day a second flag shares the prefix; `phalanx train` reads only whole names too."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False  # also for the subcommands' parsers (add_subparsers(parser_class=...))
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given = self.underscored(sys.argv[1:] if args is None else args)  # for error(): the words it was given
        return super().parse_known_args(self._given, namespace)

    def underscored(self, words: Sequence[str]) -> list[str]:
        """`--zero-stage 2` as `--zero_stage 2`, as `phalanx train` reads `--max-steps`: a dashed word whose underscored
        spelling is one of this parser's flags (a subcommand's parser reads its own); words after `--` are left."""
        out: list[str] = []
        for i, word in enumerate(words):
            if word == "--":
                return out + list(words[i:])
            flag, eq, value = word.partition("=")
            dashed = flag.startswith("--") and "-" in flag[2:]
            if dashed and flag not in self._option_string_actions:
                underscored = "--" + flag[2:].replace("-", "_")
                if underscored in self._option_string_actions:
                    word = underscored + eq + value
            out.append(word)
        return out

    def error(self, message: str):
        # "phalanx launcher", or "phalanx config deepspeed" for a subcommand's own parser.
        command = self.prog if self.prog.startswith("phalanx ") else f"phalanx {self.prog.split()[-1]}"
        known = [name for action in self._actions for name in action.option_strings if name.startswith("--")]
        hint = ""
        if message.startswith("unrecognized arguments:"):
            for word in message.partition(":")[2].split():
                near = nearest_name(word.partition("=")[0], known) if word.startswith("--") else None
                if near:
                    hint = f" Did you mean {near}?"
                    break
        elif message.startswith("the following arguments are required:"):
            # argparse reports a missing required flag before an unknown one: `--num_gpu_per_node 2` was answered
            # with "required: --num_gpus_per_node" alone, as if the flag had not been given at all.
            value_next = ""  # "required" or "optional": the word after a known flag may be its value
            for word in getattr(self, "_given", []):
                flag = word.partition("=")[0]
                if word == "--":
                    break  # what follows goes to another command
                # A known flag's value, even one that starts with "--" (launcher --generate '--num_questions 2':
                # argparse reads a word with a space as a value); an optional value is never a flag-like word.
                taken = value_next == "required" or (value_next == "optional" and (word[:1] != "-" or " " in word))
                value_next = ""
                if taken:
                    continue
                action = self._option_string_actions.get(flag)
                if action is not None:
                    if action.nargs != 0 and "=" not in word:
                        value_next = "optional" if action.nargs == "?" else "required"
                elif flag.startswith("--"):
                    near = nearest_name(flag, known)
                    hint = f" {flag} is not a flag of {command}" + (f": did you mean {near}?" if near else ".")
                    break
        raise ConfigError(f"{command}: {message}.{hint} `{command} --help` lists the flags.")


def nearest_name(word: str, known: Sequence[str], cutoff: float = 0.6) -> Optional[str]:
    """The flag or key a mistyped one most likely meant: of those it begins (an abbreviation: `--over` ->
    --overwrite, which difflib finds too far off for a short prefix), the closest; else the closest spelling."""
    extended = sorted({name for name in known if name.startswith(word)})
    near = difflib.get_close_matches(word, extended or known, n=1, cutoff=0 if extended else cutoff)
    return near[0] if near else None


def tcp_port(value: str) -> int:
    """argparse type of a --master_port flag: a TCP port number (one above 65535 reached socket.bind's OverflowError)."""
    port = int(value) if value.isdigit() else 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; give 1..65535")
    return port


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
            pairs.append((name.replace("-", "_"), value))  # --max-steps, --training.max-steps: the field names
        elif pairs and isinstance(pairs[-1][1], str) and not args[i - 1].startswith("--") and not is_config_name(arg):
            # `--target_modules q_proj v_proj`: a second value for the flag before it, not a config file
            name, value = pairs[-1]
            raise PhalanxError(
                f"unexpected argument {arg!r} after --{name} {value}: a flag takes one value (a list is one "
                f"comma-separated value: --{name} {value},{arg}); a CONFIG.yaml goes first"
            )
        elif config is None:
            config = arg
        else:
            raise PhalanxError(f"unexpected argument {arg!r}: give at most one CONFIG.yaml, then --flag value pairs")
        i += 1
    return config, pairs


def is_config_name(arg: str) -> bool:
    """A positional argument that names a config file (by its extension)."""
    return arg.lower().endswith((".yaml", ".yml", ".json"))
