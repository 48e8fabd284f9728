"""How a `phalanx` process ends once its command has returned (fast, and late enough that a launcher blames the
right rank), and how a rank of phalanx's own launcher leaves its exit status for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn, Optional

# A launcher (torchrun, `--world_size`) polls its ranks about once a second and reports the first one that exited
# as the cause. A rank that failed has often failed because a peer died first (killed, out of memory): it leaves
# this much later, so that the launcher names the peer, not the ranks that lost it.
FAILED_RANK_EXIT_DELAY_S = 2.0

# Set by phalanx's launchers (launch.local, launch.deepspeed_launcher) for their ranks: the folder where each rank
# records its exit status. After a stop signal torch's agent reaps the ranks and keeps their exit codes to itself;
# DeepSpeed's launcher reports one code at most.
EXIT_RECORDS = "PHALANX_RANK_EXIT_RECORDS"


def rank_exit_record() -> Optional[Path]:
    """Where this process, a rank of phalanx's launcher, records its exit status (None elsewhere). Named by the local
    rank, which the launcher on this node knows; the file holds the exit status and the global rank."""
    folder, local_rank = os.environ.get(EXIT_RECORDS), os.environ.get("LOCAL_RANK")
    return exit_record(Path(folder), local_rank) if folder and local_rank is not None else None


def exit_record(folder: Path, local_rank: int | str) -> Path:
    """The exit record of local rank `local_rank` in the launcher's folder `folder`."""
    return folder / f"local-rank-{local_rank}"


def listening_marker(record: Path) -> Path:
    """Beside a rank's exit record: there once the rank handles stop signals (runtime.signals.PreemptionFlag). A rank
    that a stop signal killed without it was still starting: it had nothing to save."""
    return record.with_name(f"{record.name}.listening")


def mark_listening() -> None:
    """Called once this process handles stop signals: a rank of phalanx's launcher says so (listening_marker)."""
    record = rank_exit_record()
    if record is not None:
        try:
            listening_marker(record).touch()
        except OSError:
            pass  # the launcher then counts a rank killed while starting as one that lost progress: a worse status


def error_file_beside(record: Path) -> Path:
    """The error file of the rank whose exit record is `record`, where no torch launcher gave it one."""
    return record.with_name(f"{record.name}.error")


def rank_error_file() -> Optional[Path]:
    """Where this rank leaves the message of the bad input it found for its launcher to print once
    (launch.local.report_bad_input): torch's per-rank error file where a torch launcher set one, else, under
    phalanx's DeepSpeed launcher (which sets none), the file beside its exit record. None elsewhere."""
    torch_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if torch_file:
        return Path(torch_file)
    record = rank_exit_record()
    return error_file_beside(record) if record is not None else None


def record_exit(code: int) -> None:
    """Called as a `phalanx` process exits: a rank of phalanx's launcher leaves its exit status there."""
    record = rank_exit_record()
    if record is not None:
        try:
            record.write_text(f"{code} {os.environ.get('RANK', '?')}", encoding="utf-8")
        except OSError:
            pass  # the launcher then reports this rank as killed: a worse message, not a wrong status


def exit_at_once(code: int) -> NoReturn:
    """End this process now, from anywhere (a signal handler): no teardown, no waiting for threads. Its record
    says how it ended."""
    record_exit(code)
    os._exit(code)


def exit_without_teardown(code: int) -> NoReturn:
    """End the `phalanx` program once its command has returned, skipping the interpreter's teardown.

    Finalizing the modules torch, transformers and peft import takes 1.5-2 s per process (every rank, every run).
    Everything the command wrote is closed by now; what teardown would still do that matters is done here: wait
    for non-daemon threads (a checkpoint being written in the background), run the atexit handlers, flush. The
    exit record is written last: a rank's record says it is done, so a preempted rank's checkpoint is committed."""
    import atexit
    import threading
    import time

    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    if code not in (0, PREEMPTED_EXIT_CODE) and "RANK" in os.environ:
        time.sleep(FAILED_RANK_EXIT_DELAY_S)

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = drop_closed_stdout()
    sys.stderr.flush()
    exit_at_once(code)


# 128 + SIGPIPE: what a shell shows for a program that a closed pipe stopped (`yes | head`).
CLOSED_PIPE_EXIT_CODE = 141


def drop_closed_stdout() -> int:
    """Whoever read stdout has stopped reading (`phalanx train --help | head`, a pager quit early): point stdout at
    /dev/null so that no later write or flush raises again, and return the status of a program a closed pipe
    stopped. Nothing is lost: the reader asked for no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_PIPE_EXIT_CODE
