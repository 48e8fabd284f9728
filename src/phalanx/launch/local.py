"""Start N ranks on this machine through torch's own elastic launcher (what torchrun uses), and report bad input
that the ranks find once. What a launcher of phalanx ranks shares, whichever starts them (torch's agent here and in
launch.torchrun, DeepSpeed's in launch.deepspeed_launcher): the ranks' environment and scratch folder, their exit
records, and the status they add up to.

The parent stays light: it imports torch's launcher, never the model or data stack, so the ranks start about as
soon as they would under torchrun. The ranks check the data themselves; a bad row or field they meet is the same
on every rank, so each rank hands its message to the launcher (torch's per-rank error file) instead of printing
it, and `launch_local` prints it once, whichever rank failed first and whichever the agent stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from phalanx.errors import PhalanxError, RanksFailed
from phalanx.runtime.exit import EXIT_RECORDS, exit_record, listening_marker, rank_exit_record
from phalanx.runtime.signals import stop_signal_received

# Set for the ranks `launch_local` starts: they leave printing bad input to it.
PARENT_REPORTS = "PHALANX_LAUNCHER_REPORTS_ERRORS"
# Also set for them: the launcher's pid (a rank stops when it is no longer among the rank's ancestors) and where each
# rank records its exit status (runtime.exit.EXIT_RECORDS).
LAUNCHER_PID = "PHALANX_LAUNCHER_PID"
ORPHAN_POLL_S = 0.25
# The kind a rank gives its error-file message when it stopped because a peer on its node was killed.
STOPPED_FOR_LOST_PEER = "stopped-for-lost-peer"
BAD_INPUT_EXIT_CODE = PhalanxError.exit_code  # what the CLI returns for bad input
# How long ranks get to finish (a preempted rank commits its checkpoint or batch) once the launcher stops them.
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
# The signals torch's agent turns into its shutdown (it passes them to the ranks, waits, then kills): all of its
# defaults but SIGINT, which the launcher handles itself (StopSignals: a second Ctrl-C must stop the ranks at once).
AGENT_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(
    module_args: Sequence[str],
    nproc: int,
    master_port: Optional[int] = None,
    max_restarts: int = 0,
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> int:
    """Run `python -m phalanx <module_args>` as `nproc` ranks; returns 0, the preemption status when the ranks
    saved and stopped on a signal, or 130 after a second Ctrl-C; raises RanksFailed naming the ranks that failed
    otherwise.

    `shutdown_timeout_s`: after a SIGTERM or Ctrl-C (or once a rank has exited), how long the agent waits for the
    ranks to finish before it kills them; a preempted rank saves in that time. torch's own default is 30 s."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from phalanx.runtime.collector import startup_done

    startup_done()  # this process watches the ranks for the whole run: it collects as usual from here

    if master_port:
        from phalanx.launch.preflight import check_port_free

        check_port_free(master_port)  # c10d would join whatever listens there as a client, and wait forever
    port = master_port or free_port()

    def start(scratch: Path) -> None:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=f"phalanx-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{port}",
            max_restarts=max_restarts,
            monitor_interval=0.2,  # notice a dead rank quickly and stop the others
            # The agent keeps each rank's error file here; torch's default (a new /tmp/torchelastic_* per run) is
            # never removed.
            logs_specs=DefaultLogsSpecs(log_dir=str(scratch / "logs")),
            **shutdown_timeout_option(LaunchConfig, shutdown_timeout_s),
            **agent_signals_option(LaunchConfig),
        )
        elastic_launch(config, entrypoint=sys.executable)("-m", "phalanx", *module_args)

    return supervise_ranks(start, nproc)


def supervise_ranks(start: Callable[[Path], None], local_ranks: int, quiet_agent: bool = True) -> int:
    """Run torch's elastic agent in this process, `start(scratch)`, as phalanx's launcher: the ranks record their
    exit status and stop if this process dies; SIGUSR1 and Ctrl-C reach them (StopSignals); the status says what
    they did. Returns 0, 75 (the ranks saved their progress and stopped on a signal) or 130 (a second Ctrl-C
    stopped them at once); raises RanksFailed naming the ranks that failed, or PhalanxError with the bad input
    they found.

    `scratch` is this launch's folder, removed at the end (and by a later launch when this one is killed).
    `quiet_agent`: silence the agent's own log lines (quiet_agent_logs)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with rank_records() as (scratch, rank_env):
        stop = StopSignals()
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM)}
        os.environ.update(rank_env)  # the agent copies this process's environment into each rank's
        restore_levels = quiet_agent_logs() if quiet_agent else lambda: None
        try:
            caught = stop_signal_received()  # by this process's PreemptionFlag, while it started: start no rank
            if caught:
                raise SignalException(f"Process {os.getpid()} got signal: {caught}", sigval=signal.Signals[caught])
            start(scratch)
        except SignalException as exc:
            # SIGTERM, or Ctrl-C: the agent passed it to the ranks and waited for them (killing those still running
            # after its shutdown timeout). What each rank did is in its exit record.
            records = Path(rank_env[EXIT_RECORDS])
            codes = read_exit_records(records, local_ranks)
            return after_stop_signal(exc.sigval.name, codes, still_starting(records, local_ranks, codes))
        except ChildFailedError as exc:
            error_files = {rank: f.error_file_data for rank, f in exc.failures.items()}
            stopped = stopped_for_lost_peer(error_files)
            failed = {f"rank {rank}": f.exitcode for rank, f in sorted(exc.failures.items()) if rank not in stopped}
            failed = failed or {f"rank {rank}": f.exitcode for rank, f in sorted(exc.failures.items())}
            return after_rank_failure(failed, reported_bad_input(error_files))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for name in rank_env:
                os.environ.pop(name, None)
            restore_levels()
    return 0


@contextlib.contextmanager
def rank_records() -> Iterator[tuple[Path, dict[str, str]]]:
    """This launch's scratch folder (launch.scratch: removed at the end, or by a later launch when this one is
    killed) and the environment its ranks get: they leave bad input to this launcher (PARENT_REPORTS), stop when
    this process is gone (LAUNCHER_PID) and record their exit status in the folder's `exit` (EXIT_RECORDS)."""
    from phalanx.launch.scratch import launcher_scratch

    with launcher_scratch() as scratch:
        records = scratch / "exit"
        records.mkdir()
        yield scratch, {PARENT_REPORTS: "1", LAUNCHER_PID: str(os.getpid()), EXIT_RECORDS: str(records)}


class StopSignals:
    """The launcher's handler for SIGUSR1 and Ctrl-C (SIGINT), and for SIGTERM until the agent installs its own (a
    SIGTERM before any rank starts is raised as the agent's handler raises it). The agent starts each rank in a
    session of its own, so a signal to the launcher's process group (a terminal's Ctrl-C) reaches no rank: the
    launcher passes it on.

    SIGUSR1 (SLURM's usual warning) goes straight to the ranks, which save and stop. The first Ctrl-C is raised as
    torch's own handler would raise it: the agent passes SIGINT to the ranks, which save and stop, and waits for
    them, restarting none. A second Ctrl-C comes while the agent waits: it goes straight to the ranks, which stop
    at once (runtime.signals)."""

    def __init__(self) -> None:
        self.interrupts = 0

    def __call__(self, signum: int, frame) -> None:
        import signal

        from torch.distributed.elastic.multiprocessing.api import SignalException

        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts == 1:
                raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)
        if signum == signal.SIGTERM:
            # Only until the agent starts the ranks and installs its own SIGTERM handler, which raises the same.
            raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)
        forward_to_children(signum)


def shutdown_timeout_option(launch_config: type, seconds: int) -> dict:
    """LaunchConfig's `shutdown_timeout` (torch's SIGTERM-to-SIGKILL grace for the ranks), where this torch has it.
    Older ones always wait 30 s: say so when the setting asks for more."""
    if "shutdown_timeout" in fields_of(launch_config):
        return {"shutdown_timeout": int(seconds)}
    if seconds > 30:
        import torch

        print(
            f"note: torch {torch.__version__} kills the ranks 30 s after a SIGTERM whatever the shutdown timeout "
            f"({seconds} s) says; a newer torch (its torchrun has --shutdown-timeout) waits that long",
            file=sys.stderr,
            flush=True,
        )
    return {}


def agent_signals_option(launch_config: type) -> dict:
    """LaunchConfig's `signals_to_handle` without SIGINT (AGENT_SIGNALS), where this torch has it (2.9 and later).
    An older agent takes Ctrl-C itself: the first one works the same, a second one waits for the ranks' save."""
    return {"signals_to_handle": AGENT_SIGNALS} if "signals_to_handle" in fields_of(launch_config) else {}


def fields_of(launch_config: type) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(launch_config)}


def stopped_before_training(signal_name: str, when: str) -> int:
    """The status of a launch a stop signal ended before any rank trained (`when`: 'before the ranks started', ...):
    nothing was written for it, so 75 (a requeue starts the run), or 130 for Ctrl-C (a person stopping it)."""
    from phalanx.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

    code = INTERRUPTED_EXIT_CODE if signal_name == "SIGINT" else PREEMPTED_EXIT_CODE
    print(
        f"⏸️  {signal_name} came {when}: nothing was trained or written for it; rerun the same command"
        f"{'' if code == INTERRUPTED_EXIT_CODE else ' (or requeue the job)'} to start. Exiting with status {code}.",
        file=sys.stderr,
        flush=True,
    )
    return code


def after_stop_signal(signal_name: str, codes: dict[str, Optional[int]], starting: frozenset = frozenset()) -> int:
    """The launcher's status after a SIGTERM or Ctrl-C, from each rank's exit code ({"rank 1": 75}; None: no record,
    the rank was killed) and the ranks the signal killed while they were still starting (`starting`, still_starting):
    those had nothing to save, so when every rank stopped cleanly or so, the status is 75 (a requeue starts the run).

    75 only when a rank exited 75: it did so once every rank's work was committed (train: the preemption checkpoint,
    whose save ends in a barrier; generate: each rank's last batch, before the gather they all meet in), so a requeue
    resumes from it; rank 0 has said so. 130 when a second Ctrl-C stopped the ranks before that; rank 0 has said so
    too. Ranks that died without saving are a failure, named."""
    from phalanx.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

    unclean = {rank: code for rank, code in codes.items() if code not in (0, PREEMPTED_EXIT_CODE)}
    described = describe_rank_exits(unclean)
    if unclean and set(unclean) <= starting and PREEMPTED_EXIT_CODE not in codes.values():
        return stopped_before_training(signal_name, "while the ranks were starting")
    if PREEMPTED_EXIT_CODE in codes.values():
        if unclean:
            print(f"note: after the ranks saved their progress, {described}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    if INTERRUPTED_EXIT_CODE in codes.values():
        return INTERRUPTED_EXIT_CODE
    if not unclean:
        return 0  # every rank had finished when the signal came
    raise RanksFailed(
        f"launcher received {signal_name} and the ranks stopped without saving their progress for it: "
        f"{described}. What they committed earlier is kept; rerun the same command to continue from it."
    )


def after_rank_failure(failed: dict[str, Optional[int]], reported: Optional[PhalanxError]) -> int:
    """The launcher's status when ranks ended unsuccessfully without a stop signal to it: `failed`, the ranks that
    failed first ({"rank 1": 2}; None: no record, the rank was killed), and `reported`, the bad input they found
    (reported_bad_input).

    75 when a rank exited 75: the ranks were signalled directly (SLURM signals every process of a step) and it did
    so once every rank's work was committed; the launcher then stops the ranks still tearing down, which is no
    failure. Bad input raises `reported` (status 2: a rerun repeats it; 1 for an unreachable Hub); anything else
    RanksFailed naming the ranks (status 1)."""
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    if PREEMPTED_EXIT_CODE in failed.values():
        return PREEMPTED_EXIT_CODE
    if reported is not None:
        raise reported
    if all(code is None or code < 0 for code in failed.values()):
        see = where_a_killed_rank_says_why(list(failed.values()))
    else:
        see = "See the rank's message above."
    raise RanksFailed(f"failed on {describe_rank_exits(failed)}; the other ranks were stopped. {see}")


# Signals a process sends itself when it crashes in native code (torch, a library, a CUDA kernel).
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")


def where_a_killed_rank_says_why(codes: list[Optional[int]]) -> str:
    """A rank killed by a signal wrote no message: say where its cause is written instead. SIGKILL (or no exit status)
    is often the out-of-memory killer; a crash in native code, which the same sentence blamed on memory, shows where
    it happened under PYTHONFAULTHANDLER=1 (torch's DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo was one)."""
    import signal

    killed_by = {signal.Signals(-code).name for code in codes if code is not None}
    crashed = sorted(killed_by.intersection(CRASH_SIGNALS))
    said = "A killed rank leaves no message:"
    if crashed:
        said += (
            f" {' and '.join(crashed)} is a crash inside native code (torch, a library or a CUDA kernel); rerun with "
            "PYTHONFAULTHANDLER=1 in the environment and each rank prints the Python lines it crashed in."
        )
    if not crashed or None in codes or killed_by - set(crashed):
        said += (
            " SIGKILL is often the kernel's out-of-memory killer (`dmesg` says so), and `phalanx plan` estimates "
            "what a run needs."
        )
    return said


def still_starting(folder: Path, local_ranks: int, codes: dict[str, Optional[int]]) -> frozenset:
    """The ranks (named as in `codes`) that left no exit record and never came to handle stop signals
    (runtime.exit.listening_marker): a signal killed them while they were starting."""
    return frozenset(
        f"local rank {local}"
        for local in range(local_ranks)
        if codes.get(f"local rank {local}", 0) is None and not listening_marker(exit_record(folder, local)).exists()
    )


def describe_rank_exits(codes: dict[str, Optional[int]]) -> str:
    """'rank 1 (exit code 2), local rank 0 (killed: no exit status)'"""
    return ", ".join(
        f"{rank} ({'killed: no exit status' if code is None else describe_exit(code)})" for rank, code in codes.items()
    )


def read_exit_records(folder: Path, local_ranks: int) -> dict[str, Optional[int]]:
    """Each local rank's exit status (runtime.exit.record_exit) under its global rank's name; a rank that left no
    record is named by its local rank."""
    codes: dict[str, Optional[int]] = {}
    for local in range(local_ranks):
        try:
            code, rank = exit_record(folder, local).read_text(encoding="utf-8").split()
            codes[f"rank {rank}"] = int(code)
        except (OSError, ValueError):
            codes[f"local rank {local}"] = None
    return codes


def start_rank_process() -> None:
    """Called first in every `phalanx` process. In a rank of `launch_local` (or launch.deepspeed_launcher): drop the
    record an earlier attempt (--max_restarts) left, say which process this local rank is, and stop when the launcher
    is gone or when a peer was killed while this rank was asked to stop."""
    launcher = os.environ.get(LAUNCHER_PID)
    record = rank_exit_record()
    if not launcher or record is None:
        return
    record.unlink(missing_ok=True)
    listening_marker(record).unlink(missing_ok=True)
    write_rank_pid(record)
    watch_launcher_and_peers(int(launcher), record)


def watch_launcher_and_peers(launcher: int, record: Path) -> None:
    """Stop this rank at once, from a thread, when it can do nothing more that anyone would keep:

    - the launcher died (SIGKILL, out of memory): a rank has no one to report to or to stop it, and would go on
      writing into the output a rerun is about to use (the launcher's process group took none of its ranks along:
      torch's agent starts each in a session of its own, launch.deepspeed_launcher starts DeepSpeed's in one). It
      stops when the launcher is no longer among its ancestors (its parent under torch's agent; under DeepSpeed's,
      the runner and its launch process stand between).
    - a peer on this node was killed (it left no exit record) and this rank has been sent a stop signal: that is how
      the launcher stops the others after a rank died. The step, the rendezvous or the save this rank is in needs
      every rank, so it would wait there, where no signal handler runs, until the launcher kills it (30 s later,
      torch's agent): it stops now instead. A rank killed while the others were still importing no longer costs
      half a minute. A stop signal alone (preemption) still saves: every rank takes part and records its exit.

    What the rank committed stays valid either way (commits are atomic)."""
    import threading

    from phalanx.runtime.exit import exit_at_once
    from phalanx.runtime.signals import stop_signal_received

    def watch() -> None:
        while True:
            if not descends_from(launcher):
                say = f"the launcher (pid {launcher}) is gone"
                break
            lost = lost_peers(record) if stop_signal_received() else []
            if lost:
                say = stopped_for(lost)
                break
            time.sleep(ORPHAN_POLL_S)
        print(f"[rank {os.environ.get('RANK')}] {say}; stopping this rank", file=sys.stderr, flush=True)
        exit_at_once(1)

    threading.Thread(target=watch, name="phalanx-launcher-watch", daemon=True).start()


def stopped_for(lost: list[str]) -> str:
    """Say that this rank stops because `lost` peers were killed, and leave it for the launcher, which then names
    them, not this rank (stopped_for_lost_peer)."""
    say = f"{', '.join(lost)} ended without an exit status (killed), and nothing more can finish without it"
    write_rank_message(STOPPED_FOR_LOST_PEER, f"stopped: {say}", int(os.environ.get("RANK", "0")))
    return say


def stand_aside_for_killed_peer() -> bool:
    """In a rank of launch_local whose collective failed (gloo: "Connection closed by peer") because a peer on this
    node was killed: say so in one line, instead of the collective's traceback, and leave the launcher to name the
    killed rank alone. False (nothing said) when no peer was killed: then the failure is this rank's own."""
    record = rank_exit_record()
    lost = lost_peers(record) if record is not None else []
    if not lost:
        return False
    # The collective's own error (gloo: "Connection closed by peer") only repeats that the peer is gone.
    print(f"[rank {os.environ.get('RANK')}] {stopped_for(lost)}; stopping this rank", file=sys.stderr, flush=True)
    return True


def rank_pid_file(record: Path) -> Path:
    """Beside a rank's exit record: the pid of the process that is that local rank now, and its attempt."""
    return record.with_name(f"{record.name}.pid")


def write_rank_pid(record: Path) -> None:
    try:
        rank_pid_file(record).write_text(f"{os.getpid()} {attempt()}", encoding="utf-8")
    except OSError:
        pass  # no peer watch for this rank: the launcher still stops it, later


def attempt() -> str:
    """Which start of the ranks this is (torch's agent counts its restarts; DeepSpeed's launcher does not restart)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def lost_peers(record: Path) -> list[str]:
    """The local ranks of this node, started in this attempt, whose process is gone without an exit record: killed
    (SIGKILL, the out-of-memory killer), as "local rank 1 (pid 4242)"."""
    lost = []
    for pid_file in sorted(record.parent.glob("local-rank-*.pid")):
        if pid_file == rank_pid_file(record):
            continue
        try:
            pid, started = pid_file.read_text(encoding="utf-8").split()
        except (OSError, ValueError):
            continue
        exit_record_file = pid_file.with_suffix("")
        # Gone first, then no record: a rank writes its record before it ends, so this order cannot miss one.
        if started == attempt() and not process_running(int(pid)) and not exit_record_file.exists():
            lost.append(f"{exit_record_file.name.replace('-', ' ')} (pid {pid})")
    return lost


def process_running(pid: int) -> bool:
    """True while `pid` exists and has not ended (a zombie, ended but not yet reaped by its parent, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def descends_from(ancestor: int) -> bool:
    """True while `ancestor` is this process's parent, or its parent's parent and so on (read from /proc; without
    it, the parent alone counts). A process whose parent dies is adopted by init (or a subreaper), so the chain
    from it no longer reaches the dead process, nor a new one that took its pid."""
    pid = os.getppid()
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = parent_pid(pid)
        if pid is None:
            return False
    return False


def parent_pid(pid: int) -> Optional[int]:
    """The parent of `pid` (/proc, Linux); None when it has ended or cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def quiet_agent_logs():
    """Silence the elastic agent's own log lines ("Sending process 123 closing signal SIGTERM", "failed (exitcode:
    2) local_rank: 0 ..."): the ranks and this launcher say what went wrong. LOGLEVEL=INFO (torch's switch) keeps
    them. Returns the function that restores the levels."""
    import logging

    if "LOGLEVEL" in os.environ:
        return lambda: None
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))
    ]
    levels = [(log, log.level) for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)

    def restore() -> None:
        for log, level in levels:
            log.setLevel(level)

    return restore


def report_bad_input(exc: PhalanxError, rank: int) -> int:
    """In a rank of a multi-rank run: say what is wrong with the input once for the whole job, return the exit code.

    Bad input (a config field, a data row) is the same on every rank, so printing it on each would repeat it N
    times. The message goes to the rank's error file (runtime.exit.rank_error_file): torch's per-rank one when a
    torch launcher set it (phalanx's launchers print it once; torchrun shows it in its failure summary), or the
    one beside its exit record under launch.deepspeed_launcher. Otherwise rank 0 prints it, and the other ranks
    print it too only where nothing would relay it (DeepSpeed's own launcher): a message shown twice beats one lost.
    """
    message = str(exc)
    if exc.exit_code == 0:  # a note (nothing to do): the ranks succeed, and launchers relay messages of failures only
        if rank == 0:
            print(f"{exc.label}: {message}", file=sys.stderr, flush=True)
        return 0
    relayed = write_rank_message(type(exc).__name__, message, rank, exc.exit_code)
    if relayed and os.environ.get(PARENT_REPORTS) == "1":
        pass  # phalanx's launcher prints it
    elif rank == 0:
        print(f"{exc.label}: {message}", file=sys.stderr, flush=True)
    elif not relayed:
        print(f"[rank {rank}] {exc.label}: {message}", file=sys.stderr, flush=True)
    return exc.exit_code


def write_rank_message(kind: str, message: str, rank: int, exit_code: int = BAD_INPUT_EXIT_CODE) -> bool:
    """Leave `message` in this rank's error file (runtime.exit.rank_error_file) for its launcher; False where it has
    none or it cannot be written. `kind`: the error class's name for bad input, STOPPED_FOR_LOST_PEER for a rank
    that stopped because a peer was killed (its launcher names the peer, not it). `exit_code`: the launcher's status
    for the message (the error's: 2 for bad input, 1 for an unreachable Hub)."""
    from phalanx.runtime.exit import rank_error_file

    error_file = rank_error_file()
    if not error_file:
        return False
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        # torch's own layout (ErrorHandler.record_exception), so torchrun's summary shows the message as the rank's
        # "traceback"; the "phalanx" key tells phalanx's launcher that the message is ours.
        error_file.write_text(
            json.dumps(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
                    },
                    "phalanx": {"rank": rank, "kind": kind, "message": message, "exit_code": exit_code},
                }
            )
        )
    except OSError:
        return False
    return True


def stopped_for_lost_peer(error_files: dict[int, object]) -> set[int]:
    """The ranks whose error file says they stopped because a peer was killed (watch_launcher_and_peers)."""
    return {
        rank
        for rank, data in error_files.items()
        if isinstance(data, dict) and isinstance(data.get("phalanx"), dict)
        if data["phalanx"].get("kind") == STOPPED_FOR_LOST_PEER
    }


def reported_bad_input(error_files: dict[int, object]) -> Optional[PhalanxError]:
    """The error to raise for the bad input that failed ranks left in their error files (see report_bad_input): its
    message(s), once each, and its status (the first rank's); None where they left none. `error_files` holds what
    each rank's file says ({rank: parsed JSON}, None or anything else where it said nothing)."""
    by_message: dict[str, list[int]] = {}
    exit_codes = []
    for rank, data in sorted(error_files.items()):
        ours = data.get("phalanx") if isinstance(data, dict) else None
        if (
            isinstance(ours, dict)
            and isinstance(ours.get("message"), str)
            and ours.get("kind") != STOPPED_FOR_LOST_PEER
        ):
            by_message.setdefault(ours["message"], []).append(rank)
            exit_codes.append(ours.get("exit_code", BAD_INPUT_EXIT_CODE))
    if not by_message:
        return None
    if len(by_message) == 1:
        error = PhalanxError(next(iter(by_message)))
    else:
        error = PhalanxError(
            "\n".join(f"rank {', '.join(map(str, ranks))}: {message}" for message, ranks in by_message.items())
        )
    error.exit_code = exit_codes[0] if isinstance(exit_codes[0], int) else BAD_INPUT_EXIT_CODE
    return error


def describe_exit(code: int) -> str:
    import signal

    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def child_pids(parent: int) -> list[int]:
    """Direct children of `parent`, read from /proc (Linux): the lists the kernel keeps for each of its threads
    (CONFIG_PROC_CHILDREN, the usual setting), else the parent of every process."""
    lists = list(Path(f"/proc/{parent}/task").glob("*/children"))
    if lists:
        try:
            return [int(pid) for listed in lists for pid in listed.read_text().split()]
        except OSError:
            pass  # a thread of `parent` ended while we looked: read every process
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def catches_stop_signals(pid: int) -> bool:
    """True once `pid`, a phalanx process, catches the stop signals (runtime.signals.PreemptionFlag installs
    SIGUSR1's handler last); before that a stop signal would kill it, or be lost where it inherited SIGUSR1 ignored."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration, IndexError, ValueError):
        return False
    return bool(caught & (1 << (signal.SIGUSR1 - 1)))


def forward_to_children(signum: int) -> None:
    for pid in child_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
