"""The `phalanx` command: a table of subcommands and the dispatch to them, nothing more."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence, Union

from phalanx.errors import PhalanxError
from phalanx.runtime.quiet import quiet_import_notes


def cmd_config_docs(args: Sequence[str]) -> int:
    if args:
        usage = "usage: phalanx config-docs  (prints the config reference as Markdown; it takes no arguments)"
        if list(args) in (["-h"], ["--help"]):
            print(usage)
            return 0
        raise PhalanxError(f"phalanx config-docs: unexpected argument {args[0]!r}\n{usage}")
    from phalanx.config.docs import config_reference

    print(config_reference())
    return 0


# Each subcommand lives with its component; "module:function" strings keep `phalanx --help` import-light.
COMMANDS: dict[str, tuple[Union[str, Callable[[Sequence[str]], int]], str]] = {
    "train": (
        "phalanx.train.command:main",
        "[CONFIG.yaml] [--flag value ...]  fine-tune a causal LM (LoRA or full) on 1..N ranks",
    ),
    "generate": ("phalanx.generate.command:main", "--model_name M --prompts FILE ...  sharded batch generation"),
    "config": (
        "phalanx.parallel.config_files:config_main",
        "deepspeed|fsdp [--flags]  write a DeepSpeed / FSDP config file",
    ),
    "launcher": ("phalanx.launch.command:launcher_main", "--config C --num_gpus_per_node N  write a launch script"),
    "slurm": ("phalanx.launch.command:slurm_main", "--config C --num_nodes N  write an sbatch script"),
    "env": ("phalanx.launch.command:env_main", "versions, devices and an all-reduce check"),
    "plan": (
        "phalanx.plan.command:main",
        "[CONFIG.yaml] [--world_size N] [--device_memory_gb X]  memory per rank for each strategy",
    ),
    "export": (
        "phalanx.checkpoint.command:main",
        "CHECKPOINT OUT  a from_pretrained folder from a sharded-only checkpoint, or a LoRA adapter merged",
    ),
    "data": (
        "phalanx.data.command:main",
        "preview|templates ...  the rows as the loss sees them; the chat templates phalanx ships",
    ),
    "config-docs": (cmd_config_docs, "print the config reference (Markdown)"),
}


def usage() -> str:
    lines = [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    return (
        "usage: phalanx <command> [args]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\n`phalanx train --help` lists every flag."
    )


def resolve_command(name: str) -> Callable[[Sequence[str]], int]:
    target = COMMANDS[name][0]
    if callable(target):
        return target
    import importlib

    module, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise PhalanxError(f"`phalanx {name}` is not available in this version yet") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is not None:
        return run_command(list(argv))
    from phalanx.runtime.collector import defer_full_collections

    defer_full_collections()  # first: the imports ahead are seconds, a fifth of them in full collections
    from phalanx.launch.local import start_rank_process
    from phalanx.models.packages import command_owns_process
    from phalanx.runtime.exit import drop_closed_stdout, exit_without_teardown, record_exit

    command_owns_process()  # the program, not a library call: its command may decide what this process loads
    start_rank_process()  # a rank of `--world_size N`: stop if the launcher dies
    try:
        code = run_command(sys.argv[1:])
    except BrokenPipeError:
        code = drop_closed_stdout()  # `phalanx train --help | head`: the reader stopped, not an error of ours
    except BaseException:
        record_exit(1)  # what the interpreter exits with on an uncaught exception
        raise
    exit_without_teardown(code)  # last, a rank's record says it is done (its checkpoint is committed)


def run_command(argv: list[str]) -> int:
    # Commands that load models quiet the libraries themselves (runtime.quiet), after installing their signal
    # handlers: the imports take seconds, and a preemption signal must not be lost in them.
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        import difflib

        near = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        if argv[0].startswith("-"):
            hint = f" The command comes first: phalanx train {' '.join(argv)}"
        print(f"{usage()}\nerror: unknown command {argv[0]!r}.{hint}", file=sys.stderr)
        return 2
    import os

    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    try:
        quiet_import_notes()  # imports logging: a Ctrl-C may come in it too
        return resolve_command(argv[0])(argv[1:])
    except PhalanxError as exc:
        print(f"{prefix}{exc.label}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        # A Ctrl-C that comes before a command installs its own handler (a launcher reading prompts or checking the
        # config, `phalanx plan`, `data preview`): one line and the shell's status, not a traceback from whatever
        # library was importing. Every file phalanx writes is committed atomically, so nothing is half-written.
        from phalanx.runtime.signals import INTERRUPTED_EXIT_CODE

        print(
            f"{prefix}⏹️  phalanx {argv[0]}: stopped by Ctrl-C; what was committed earlier is kept",
            file=sys.stderr,
            flush=True,
        )
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
