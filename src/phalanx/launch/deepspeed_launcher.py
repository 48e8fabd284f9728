"""`python -m phalanx.launch.deepspeed_launcher ARGS`: DeepSpeed's launcher (deepspeed.launcher.runner, with its own
command line) as the `--use_deepspeed` scripts of `phalanx launcher` and `phalanx slurm` start it, ending the way
`phalanx train --world_size N` and launch.torchrun end.

On one node DeepSpeed's runner has no handler for SIGTERM or Ctrl-C: a signal to it alone ends it and leaves the ranks
training. Signalled with its process group, its `launch` process passes SIGTERM on to the ranks (they save and exit
75), but the runner has died of the signal, so the status (143) says nothing of what the ranks did. Here the runner
runs as a child, in a session of its own, with SIGTERM, SIGINT and SIGUSR1 ignored: its `launch` process installs
its own SIGTERM / SIGINT handler and each rank its stop handlers (runtime.signals), so nothing dies of a stop signal
before the ranks have answered it. A SIGTERM, SIGUSR1 or Ctrl-C to this process, alone or with its process group (a
terminal's Ctrl-C, `kill -TERM -- -PGID`), reaches every rank of this node once, from here, as soon as the rank
catches it: the ranks save and exit 75; a second Ctrl-C stops them at once. The ranks record their exit status and
stop when this process is gone (launch.local.rank_records), and the status is theirs: 75 when they saved and
stopped, 130 after a second Ctrl-C, 1 naming the rank that failed (RanksFailed), 2 with the bad input they found,
printed once, 0 when they finished.

DeepSpeed keeps its own ways: once a rank exits (75 included) or its launch process gets a SIGTERM, it sends SIGTERM
to every rank and kills those still running 30 s later (a fixed grace, not torchrun's shutdown timeout), and it
restarts nothing. This supervises the ranks of this node: one node, or several with `--no_ssh`, each node running its
own launcher (what the scripts write); DeepSpeed's pdsh and MPI modes start the ranks elsewhere, where no record of
theirs comes back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Collection, Optional, Sequence

from phalanx.errors import PhalanxError, RanksFailed

# How often a stop request that came is passed on to the ranks that have not had it yet (those still starting).
POLL_S = 0.1
# DeepSpeed's runner exits 2 when its own arguments are wrong (argparse), before any rank starts.
USAGE_EXIT_CODE = 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return run_deepspeed(list(sys.argv[1:] if argv is None else argv))
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def run_deepspeed(args: list[str]) -> int:
    """Run `python -m deepspeed.launcher.runner ARGS` as phalanx's launcher; returns 0, 75 or 130, or raises
    RanksFailed / PhalanxError (see the module's docstring)."""
    from phalanx.launch.local import after_stop_signal, rank_records, read_exit_records
    from phalanx.runtime.exit import EXIT_RECORDS
    from phalanx.runtime.signals import STOP_SIGNALS

    with rank_records() as (_, rank_env):
        records = Path(rank_env[EXIT_RECORDS])
        local_ranks = local_rank_count(args)
        requests: list[int] = []  # the stop signals this process got, in order
        previous = {sig: signal.signal(sig, lambda signum, frame: requests.append(signum)) for sig in STOP_SIGNALS}
        try:
            runner = subprocess.Popen(
                [sys.executable, "-m", "deepspeed.launcher.runner", *args],
                env={**os.environ, **rank_env},
                # Neither the terminal's Ctrl-C nor a signal to this process group reaches DeepSpeed's processes:
                # each rank gets a stop request once, from here.
                start_new_session=True,
                preexec_fn=ignore_stop_signals,
            )
            passed: dict[int, int] = {}  # rank pid: how many of `requests` it was sent
            while True:
                try:
                    status = runner.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                # Until every rank of this node has had every request (then the ranks are stopping).
                if requests and sum(sent == len(requests) for sent in passed.values()) < (local_ranks or sys.maxsize):
                    pass_on(requests, runner.pid, passed)
            codes = read_exit_records(records, local_ranks or recorded_ranks(records))
            if requests:
                return after_stop_signal(signal.Signals(requests[0]).name, codes)
            return after_runner(status, codes, records)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def ignore_stop_signals() -> None:
    """DeepSpeed's runner (and, inherited, its launch process and ranks) starts with the stop signals ignored: the
    runner keeps waiting for its launch process, which installs its own SIGTERM / SIGINT handler, and the ranks
    install theirs (runtime.signals), all of them overriding this. A SIGUSR1 that comes before a rank catches it is
    ignored, not fatal; this process passes its own on once the rank catches it (pass_on)."""
    from phalanx.runtime.signals import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def pass_on(requests: list[int], runner: int, passed: dict[int, int]) -> None:
    """Send each rank (a child of DeepSpeed's launch process, the runner's child) the stop signals of `requests` it
    has not been sent yet, once it catches them: a rank still starting would die of SIGTERM or SIGINT."""
    from phalanx.launch.local import catches_stop_signals, child_pids

    for launch in child_pids(runner):
        for rank in child_pids(launch):
            sent = passed.get(rank, 0)
            if sent == len(requests) or not catches_stop_signals(rank):
                continue
            for signum in requests[sent:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank, signum)
            passed[rank] = len(requests)


def local_rank_count(args: Sequence[str]) -> Optional[int]:
    """How many ranks DeepSpeed starts on this node: its `--num_gpus` (the scripts always give it), else
    LOCAL_WORLD_SIZE (the scripts export it for the ranks); None when neither says."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--num_gpus", "--num_accelerators"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit() and int(value) > 0:
                return int(value)
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return None


def recorded_ranks(records: Path) -> int:
    """How many local ranks left an exit record (all those numbered below the highest that did)."""
    from phalanx.runtime.exit import exit_record

    return max((local + 1 for local in range(1024) if exit_record(records, local).exists()), default=0)


def after_runner(status: int, codes: dict[str, Optional[int]], records: Path) -> int:
    """The status when no stop signal came to this process, from what the ranks recorded (DeepSpeed's runner exits
    with the code of the first rank that failed, and 0 when its launch process was killed)."""
    from phalanx.launch.local import after_rank_failure, describe_exit, reported_bad_input, stopped_for_lost_peer

    if codes and all(code == 0 for code in codes.values()):
        return 0
    if all(code is None for code in codes.values()):
        if status == USAGE_EXIT_CODE:
            return status  # DeepSpeed said what is wrong with its arguments
        raise RanksFailed(
            f"the DeepSpeed launcher ended ({describe_exit(status)}) and no rank of this node left an exit status; "
            "see its messages above"
        )
    messages = error_files(records, len(codes))
    # A rank that stopped because a peer was killed is not what failed: the peer is named (no record: killed).
    stopped = {f"rank {rank}" for rank in stopped_for_lost_peer(messages)}
    return after_rank_failure(first_failures(codes, records, stopped), reported_bad_input(messages))


def first_failures(
    codes: dict[str, Optional[int]], records: Path, stopped: Collection[str] = ()
) -> dict[str, Optional[int]]:
    """The ranks to name after a failure: the first to record one (a rank that fails because a peer is gone leaves
    later, runtime.exit.FAILED_RANK_EXIT_DELAY_S; DeepSpeed then stops the others), those that left no record
    (killed), and those that exited 75 (they saved: see launch.local.after_rank_failure). `stopped`: ranks that said
    they stopped because a peer was killed (launch.local.stopped_for_lost_peer), left out where a killed one is named."""
    from phalanx.runtime.exit import exit_record
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    def when(local: int) -> int:
        try:
            return exit_record(records, local).stat().st_mtime_ns
        except OSError:
            return 0

    # read_exit_records lists the ranks in local rank order.
    killed = any(code is None for code in codes.values())
    failed = [
        (when(local), name, code)
        for local, (name, code) in enumerate(codes.items())
        if code not in (0, None) and not (killed and name in stopped)
    ]
    named = {name: code for _, name, code in sorted(failed)[:1]}
    named.update({name: code for name, code in codes.items() if code in (None, PREEMPTED_EXIT_CODE)})
    return named


def error_files(records: Path, local_ranks: int) -> dict[int, object]:
    """What the ranks of this node wrote into their error files (launch.local.report_bad_input), by rank."""
    from phalanx.runtime.exit import error_file_beside, exit_record

    found: dict[int, object] = {}
    for local in range(local_ranks):
        try:
            data = json.loads(error_file_beside(exit_record(records, local)).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        ours = data.get("phalanx") if isinstance(data, dict) else None
        found[ours["rank"] if isinstance(ours, dict) and isinstance(ours.get("rank"), int) else local] = data
    return found


if __name__ == "__main__":
    sys.exit(main())
