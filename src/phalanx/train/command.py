"""`phalanx train`: one process, `--world_size N` local ranks, or one rank of a launcher, from start to exit status.

Import-light on purpose: a rank installs its preemption handler before the model stack is imported (seconds), so
no signal is lost, and a bad config is reported before torch is loaded at all.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from phalanx.errors import PhalanxError, RanksFailed

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig
    from phalanx.runtime.signals import PreemptionFlag


def train_help() -> str:
    from phalanx.config.docs import flags_table

    return "usage: phalanx train [CONFIG.yaml | --config CONFIG.yaml] [--flag value ...]\n\n" + flags_table()


def main(args: Sequence[str]) -> int:
    if "-h" in args or "--help" in args:
        print(train_help())
        return 0
    import os

    # Only `signal`: installed before the config stack (pydantic) and the model stack are imported, so no preemption
    # signal that comes while a rank starts is lost (a Ctrl-C in pydantic's import was a traceback and a rank lost).
    from phalanx.runtime.signals import PreemptionFlag

    # A rank of torchrun, the DeepSpeed launcher, SLURM or `--world_size N` (runtime.dist.launched_by_torchrun,
    # tested here without importing torch, so that a bad config is reported at once).
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train_rank(args, PreemptionFlag().install())
    # This process too, before its imports: a signal while it starts is kept (one process: it stops at its first
    # step; `--world_size N`: no rank is started).
    preemption = PreemptionFlag().install()
    from phalanx.config.loader import config_from_args
    from phalanx.runtime.quiet import quiet_libraries

    cfg = config_from_args(args)[0]
    cfg.check_nodes(1)  # one process, or `--world_size N` ranks on this machine
    if cfg.model.load_in_4bit:
        from phalanx.models.packages import require_4bit_packages

        require_4bit_packages()  # once here, not once per rank
    if cfg.distributed.world_size > 1:
        preemption.work = "starting no rank"
        return launch_train_ranks(cfg, args, preemption)
    load_only_what_the_run_needs(cfg)
    quiet_libraries()
    return train_worker(cfg, preemption)


def load_only_what_the_run_needs(cfg: RunConfig) -> None:
    """Before the model stack is imported: a run without a 4-bit base leaves bitsandbytes out (about a second per
    rank), one of another strategy leaves DeepSpeed out (a few tenths, and its warning). DeepSpeed on CPU ranks (gloo)
    is told its accelerator, as the generated launcher scripts tell it: left to guess, it warns on every rank that it
    was "unable to detect" a GPU."""
    from phalanx.models.packages import leave_out_bitsandbytes, leave_out_deepspeed
    from phalanx.runtime.dist import resolve_backend

    if not cfg.model.load_in_4bit:
        leave_out_bitsandbytes()
    if cfg.distributed.strategy != "deepspeed":
        leave_out_deepspeed()
    elif resolve_backend(cfg.distributed.backend) == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def launch_train_ranks(cfg: RunConfig, args: Sequence[str], preemption: Optional[PreemptionFlag] = None) -> int:
    """`--world_size N`: start N local ranks at once. This process only checks what needs no model or data library
    (the ranks tokenize, one of them at a time through the cache's lock, before they join the process group).
    `preemption`: this process's flag until the launcher's own handlers take over; a stop asked for before then
    starts no rank (status 75, or 130 for Ctrl-C: nothing was trained)."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.launch.local import launch_local
    from phalanx.parallel import check_before_launch
    from phalanx.runtime.dist import check_world_fits, resolve_backend

    check_world_fits(cfg.distributed.world_size, cfg.distributed.backend)
    check_before_launch(cfg, cfg.distributed.world_size, on_gpu=resolve_backend(cfg.distributed.backend) == "nccl")
    resume_point(cfg)  # an output_dir that holds another run, or is in use, is refused here, before any rank starts
    if preemption is not None and preemption.requested:
        from phalanx.launch.local import stopped_before_training

        return stopped_before_training(preemption.signal_name, "before the ranks started")
    return launch_local(
        ["train", *args],
        cfg.distributed.world_size,
        cfg.distributed.master_port,
        max_restarts=cfg.distributed.max_restarts,
        shutdown_timeout_s=cfg.distributed.shutdown_timeout_s,
    )


def train_rank(args: Sequence[str], preemption: PreemptionFlag) -> int:
    """One rank started by a launcher. What phalanx refuses (a config field, a data row, a damaged checkpoint or one
    only this rank reads, a loss that stays NaN under nan_policy stop, a Hub that cannot be reached) is reported once
    for the job, with its own status (2, or 1 for the Hub): the launcher exits with it even when the other ranks crash
    because this one left (their gloo sees a closed connection). A rank's crash (RanksFailed) is not refused input and
    keeps its status 1."""
    from phalanx.config.loader import config_from_args
    from phalanx.runtime.dist import env_rank_info
    from phalanx.runtime.quiet import quiet_libraries

    rank, world = env_rank_info()[:2]
    try:
        cfg = config_from_args(args)[0]
        load_only_what_the_run_needs(cfg)
        quiet_libraries()
        return train_worker(cfg, preemption)
    except PhalanxError as exc:
        if world == 1 or isinstance(exc, RanksFailed):
            raise
        from phalanx.launch.local import report_bad_input

        return report_bad_input(exc, rank)


def print_crash_traceback(rank: int, exc: BaseException) -> None:
    """A crash is phalanx's or a library's fault, not the input's: where it happened is what a report of it needs.
    The launcher's line says only `rank 0 failed: AssertionError: ` (DeepSpeed's loader asserted with no message),
    which one process's run shows with its traceback; each line marked with the rank, as ranks' output interleaves."""
    import traceback

    lines = "".join(traceback.format_exception(exc)).rstrip("\n").splitlines()
    print("\n".join(f"[rank {rank}] {line}" for line in lines), file=sys.stderr, flush=True)


def merge_tokens_for_this_device(cfg: RunConfig) -> Optional[int]:
    """On CUDA, for merged micro-batches with no merge_tokens set: the largest pass `phalanx plan`'s memory model fits
    on this rank's GPU (None: keep what one micro-batch holds; merge_tokens_that_fit says when merging applies). An
    estimate that cannot be made only leaves it there."""
    import torch

    if not torch.cuda.is_available():
        return None
    from phalanx.plan.fit import merge_tokens_that_fit
    from phalanx.runtime.dist import env_rank_info
    from phalanx.runtime.watch import one_line

    rank, _, local_rank, _ = env_rank_info()
    try:
        memory = torch.cuda.get_device_properties(local_rank % torch.cuda.device_count()).total_memory
        return merge_tokens_that_fit(cfg, memory)
    except (PhalanxError, OSError, ValueError, KeyError) as exc:
        if rank == 0:  # every rank gets the same answer: one line says it
            print(f"🧮 merged passes keep one micro-batch's size: no memory estimate ({one_line(exc)})", flush=True)
        return None


def train_worker(cfg: RunConfig, preemption: PreemptionFlag) -> int:
    """One rank's whole run. A failure is reported with what every rank was doing, so the stuck one is named."""
    from phalanx.launch.local import STOPPED_FOR_LOST_PEER, write_rank_message
    from phalanx.runtime.collector import startup_done
    from phalanx.runtime.dist import env_rank_info, shutdown
    from phalanx.runtime.output_lock import release_lock, training_lock
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE, Preempted
    from phalanx.runtime.watch import describe_ranks, is_timeout, one_line, peer_that_failed, record_failure
    from phalanx.train.loop import train
    from phalanx.train.run import build_run, finish_run, stop_loader_workers

    startup_done()  # before build_run: the DDP reducer's cycles stay collectable (runtime.collector)
    rank, world = env_rank_info()[:2]
    run = None
    try:
        run = build_run(cfg, preemption, merge_tokens_that_fit=merge_tokens_for_this_device(cfg))
        train(run)
        finish_run(run)
    except Preempted as exc:
        if rank == 0:  # every rank stopped at the same step, for the same request: one line says it
            print(
                f"⏸️  {exc}; exiting with status {PREEMPTED_EXIT_CODE}: rerun the same command (or requeue the job) "
                "to resume from it",
                file=sys.stderr,
                flush=True,
            )
        return PREEMPTED_EXIT_CODE
    except PhalanxError as exc:
        if world > 1 and not isinstance(exc, RanksFailed):
            record_failure(rank, exc)  # a rank-local refusal (a damaged file only it reads): the others stand aside
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise
        from phalanx.checkpoint.commit import committed_step_checkpoints

        kept = [p.name for _, p in committed_step_checkpoints(Path(cfg.output_dir))]
        where = f" ({exc.filename})" if exc.filename else ""  # pyarrow's and safetensors' errors name no file
        raise PhalanxError(
            f"rank {rank} cannot write to output_dir {cfg.output_dir}: {exc.strerror}{where}. "
            f"Committed checkpoints are intact: {kept or 'none yet'}; free space or fix permissions, "
            "then rerun the same command to resume."
        ) from None
    except Exception as exc:
        if world > 1:
            # A crash: status 1 as a single process that crashes, never the bad-input 2 that tells a requeue wrapper
            # (or torchrun's summary reader) a rerun would only repeat it. Often it is a peer's failure seen from
            # here (gloo: "Connection closed by peer"): then the peer is named, and this rank stands aside.
            from phalanx.launch.local import stand_aside_for_killed_peer

            # A peer killed mid-step (kill -9, the OOM killer) leaves no failure record: this rank says so in one line
            # and the launcher names the killed rank (status 1).
            if stand_aside_for_killed_peer():
                return 1
            first = peer_that_failed(world, rank, after_own_timeout=is_timeout(exc))
            if first is not None:
                write_rank_message(STOPPED_FOR_LOST_PEER, f"stopped: {first} failed first", rank)
                raise RanksFailed(f"rank {rank} stopped: {first} failed first (here: {one_line(exc)})") from exc
            doing = describe_ranks(world)  # before this rank's own phase says "failed"
            record_failure(rank, exc)
            if not is_timeout(exc):  # a wait for a peer that stopped taking part: the message names the peer
                print_crash_traceback(rank, exc)
            raise RanksFailed(
                f"rank {rank} failed: {type(exc).__name__}: {exc}\n  what each rank was doing: {doing}"
            ) from exc
        raise
    finally:
        if run is not None:
            run.reporter.close()  # a failed run keeps the metrics and TensorBoard events it logged
            stop_loader_workers(run.train_loader)  # before exit: see stop_loader_workers
        release_lock(training_lock(cfg.output_dir))  # for a next run in this process (exit frees it anyway)
        # Free DDP (its reducer holds the process group) before destroying the group: the other order can
        # tear gloo down inside a Python destructor, where its threads wait for the GIL we hold: a hang at exit.
        del run
        shutdown()
    return 0
