"""The `phalanx` command: subcommands parse their arguments and dispatch, nothing more."""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from phalanx.config.flags import split_flags  # noqa: F401 - the flag syntax every subcommand shares
from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.runtime.signals import PreemptionFlag


def train_help() -> str:
    from phalanx.config.docs import flags_table

    return "usage: phalanx train [CONFIG.yaml] [--flag value ...]\n\n" + flags_table()


def cmd_train(args: Sequence[str]) -> int:
    if "-h" in args or "--help" in args:
        print(train_help())
        return 0
    import os

    from phalanx.config.loader import load_config, overrides_from_flags
    # Only `signal`: installed before the model stack is imported (seconds), so no preemption signal is lost.
    from phalanx.runtime.signals import PreemptionFlag

    config_path, pairs = split_flags(args)
    # A rank of torchrun, the DeepSpeed launcher, SLURM or `--world_size N` (runtime.dist.launched_by_torchrun,
    # tested here without importing torch, so that a bad config is reported at once).
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train_rank(config_path, pairs, PreemptionFlag().install())
    cfg = load_config(config_path, overrides_from_flags(pairs))
    cfg.check_nodes(1)  # one process, or `--world_size N` ranks on this machine
    if cfg.model.load_in_4bit:
        from phalanx.models.packages import require_4bit_packages

        require_4bit_packages()  # once here, not once per rank
    if cfg.distributed.world_size > 1:
        return launch_train_ranks(cfg, args)
    preemption = PreemptionFlag().install()
    quiet_libraries()
    return train_worker(cfg, preemption)


def launch_train_ranks(cfg, args: Sequence[str]) -> int:
    """`--world_size N`: start N local ranks at once. This process only checks what needs no model or data library
    (the ranks tokenize, one of them at a time through the cache's lock, before they join the process group)."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.launch.local import launch_local
    from phalanx.parallel import check_before_launch
    from phalanx.runtime.dist import check_world_fits, resolve_backend

    check_world_fits(cfg.distributed.world_size, cfg.distributed.backend)
    check_before_launch(cfg, cfg.distributed.world_size, on_gpu=resolve_backend(cfg.distributed.backend) == "nccl")
    resume_point(cfg)  # an output_dir that holds another run is refused here, once, before any rank starts
    return launch_local(["train", *args], cfg.distributed.world_size, cfg.distributed.master_port,
                        max_restarts=cfg.distributed.max_restarts, shutdown_timeout_s=cfg.distributed.shutdown_timeout_s)


def train_rank(config_path: Optional[str], pairs: list[tuple[str, str]], preemption: PreemptionFlag) -> int:
    """One rank started by a launcher. Bad input is the same on every rank: it is reported once for the job."""
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.errors import ConfigError, DataError
    from phalanx.runtime.dist import env_rank_info

    rank, world = env_rank_info()[:2]
    try:
        cfg = load_config(config_path, overrides_from_flags(pairs))
        quiet_libraries()
        return train_worker(cfg, preemption)
    except (ConfigError, DataError) as exc:
        if world == 1:
            raise
        from phalanx.launch.local import report_bad_input

        return report_bad_input(exc, rank)


def train_worker(cfg, preemption: PreemptionFlag) -> int:
    """One rank's whole run. A failure is reported with what every rank was doing, so the stuck one is named."""
    from phalanx.runtime.dist import env_rank_info, shutdown
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE, Preempted
    from phalanx.runtime.watch import describe_ranks
    from phalanx.train.loop import train
    from phalanx.train.run import build_run, finish_run

    rank, world = env_rank_info()[:2]
    run = None
    try:
        run = build_run(cfg, preemption)
        train(run)
        finish_run(run)
    except Preempted as exc:
        print(f"⏸️  {exc}; exiting with status {PREEMPTED_EXIT_CODE} so a requeue resumes it", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except PhalanxError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise
        from phalanx.checkpoint.commit import committed_step_checkpoints

        kept = [p.name for _, p in committed_step_checkpoints(Path(cfg.output_dir))]
        raise PhalanxError(f"rank {rank} cannot write to output_dir {cfg.output_dir}: {exc.strerror} ({exc.filename}). "
                           f"Committed checkpoints are intact: {kept or 'none yet'}; free space or fix permissions, "
                           "then rerun the same command to resume.") from None
    except Exception as exc:
        if world > 1:
            raise PhalanxError(f"rank {rank} failed: {type(exc).__name__}: {exc}\n  what each rank was doing: "
                               f"{describe_ranks(world)}") from exc
        raise
    finally:
        if run is not None:
            run.reporter.close()  # a failed run keeps the metrics and TensorBoard events it logged
        # Free DDP (its reducer holds the process group) before destroying the group: the other order can
        # tear gloo down inside a Python destructor, where its threads wait for the GIL we hold: a hang at exit.
        del run
        shutdown()
    return 0


def cmd_config_docs(args: Sequence[str]) -> int:
    from phalanx.config.docs import config_reference

    print(config_reference())
    return 0


# Each subcommand lives with its component; "module:function" strings keep `phalanx --help` import-light.
COMMANDS = {
    "train": (cmd_train, "[CONFIG.yaml] [--flag value ...]  fine-tune a causal LM (LoRA or full) on 1..N ranks"),
    "generate": ("phalanx.generate.command:main", "--model_name M --prompts FILE ...  sharded batch generation"),
    "config": ("phalanx.launch.ds_fsdp_config:config_main", "deepspeed|fsdp [--flags]  write a DeepSpeed / FSDP config file"),
    "launcher": ("phalanx.launch.command:launcher_main", "--config C --num_gpus_per_node N  write a launch script"),
    "slurm": ("phalanx.launch.command:slurm_main", "--config C --num_nodes N  write an sbatch script"),
    "env": ("phalanx.launch.command:env_main", "versions, devices and an all-reduce check"),
    "plan": ("phalanx.plan.command:main", "[CONFIG.yaml] [--world_size N] [--device_memory_gb X]  memory per rank for each strategy"),
    "export": ("phalanx.checkpoint.export:main", "CHECKPOINT OUT  a from_pretrained folder from a sharded-only checkpoint"),
    "data": ("phalanx.data.command:main", "preview|templates ...  the rows as the loss sees them; the chat templates phalanx ships"),
    "config-docs": (cmd_config_docs, "print the config reference (Markdown)"),
}


def usage() -> str:
    lines = [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "usage: phalanx <command> [args]\n\ncommands:\n" + "\n".join(lines) + "\n\n`phalanx train --help` lists every flag."


def resolve_command(name: str):
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


def quiet_libraries() -> None:
    """phalanx prints its own progress; the libraries' bars and deprecation chatter would interleave with it."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:
        from phalanx.launch.local import record_exit, start_rank_process

        start_rank_process()  # a rank of `--world_size N`: stop if the launcher dies
        try:
            code = run_command(sys.argv[1:])
        except BaseException:
            record_exit(1)  # what the interpreter exits with on an uncaught exception
            raise
        exit_without_teardown(code)
    return run_command(list(argv))


# A launcher (torchrun, `--world_size`) polls its ranks about once a second and reports the first one that exited
# as the cause. A rank that failed has often failed because a peer died first (killed, out of memory): it leaves
# this much later, so that the launcher names the peer, not the ranks that lost it.
FAILED_RANK_EXIT_DELAY_S = 2.0


def exit_without_teardown(code: int) -> None:
    """End the `phalanx` program once its command has returned, skipping the interpreter's teardown.

    Finalizing the modules torch, transformers and peft import takes 1.5-2 s per process (every rank, every run).
    Everything the command wrote is closed by now; what teardown would still do that matters is done here: wait
    for non-daemon threads (a checkpoint being written in the background), run the atexit handlers, flush."""
    import atexit
    import os
    import threading
    import time

    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    if code not in (0, PREEMPTED_EXIT_CODE) and "RANK" in os.environ:
        time.sleep(FAILED_RANK_EXIT_DELAY_S)

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    from phalanx.launch.local import record_exit

    record_exit(code)  # last: a rank's record says it is done (a preempted rank's checkpoint is committed)
    os._exit(code)


def run_command(argv: list[str]) -> int:
    # Commands that load models quiet the libraries themselves (quiet_libraries), after installing their signal
    # handlers: the imports take seconds, and a preemption signal must not be lost in them.
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return resolve_command(argv[0])(argv[1:])
    except PhalanxError as exc:
        import os

        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
