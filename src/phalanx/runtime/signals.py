"""Stop signals: SIGTERM / SIGUSR1 (what SLURM and Kubernetes send) and Ctrl-C ask the run to save and stop.

The handler only sets a flag. Training folds the flag into the step's collective, so every rank
learns of the request in the same step and all of them stop together. Generation ranks meet in no
collective between batches (each commits to its own shard), so a rank that was signalled also
raises the flag in the process group's store, where the others see it before their next batch
(`requested_anywhere`).

Ctrl-C (SIGINT) is the same request from a person at a terminal, who may not want to wait: the first
one asks for the save, and says so; a second one ends the process at once, without saving. What was
committed before stays valid (commits are atomic).
"""

from __future__ import annotations

import os
import signal

# Exit status of a run that saved a checkpoint because it was asked to stop: EX_TEMPFAIL,
# "try again later". A requeue (SLURM, torchrun --max-restarts) resumes from that checkpoint.
PREEMPTED_EXIT_CODE = 75
# Exit status after a second Ctrl-C: 128 + SIGINT, what a shell reports for a program that Ctrl-C ended.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# SIGUSR1's handler is installed last: a process that catches it catches all of them (Python catches SIGINT anyway).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

_STORE_KEY = "phalanx/preempt"

# The stop signal this process has been sent (its name), whichever PreemptionFlag caught it: a rank's watcher thread
# reads it (launch.local.watch_launcher_and_peers) while the main thread may be blocked where no handler runs.
_stop_signal_received: str = ""


def stop_signal_received() -> str:
    """The name of the stop signal this process has been sent ("" for none yet)."""
    return _stop_signal_received


class PreemptionFlag:
    """`work`: what this process does before it stops, as the first Ctrl-C's line tells the user."""

    def __init__(self, work: str = "finishing this step and saving a checkpoint") -> None:
        self.requested = False
        self.signal_name = ""
        self.interrupts = 0
        self.work = work
        self.committed = False  # what this process stops with is committed (set by the caller): nothing left to lose
        self._published = False

    def install(self) -> "PreemptionFlag":
        from phalanx.runtime.exit import mark_listening

        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        mark_listening()
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                from phalanx.runtime.exit import exit_at_once

                if self.committed:  # saved already: it only tears down; the status stays the saved one's
                    exit_at_once(PREEMPTED_EXIT_CODE)
                say_once("⏹️  Ctrl-C again: stopped at once, without saving; what was committed earlier is kept")
                exit_at_once(INTERRUPTED_EXIT_CODE)
            say_once(f"⏸️  Ctrl-C: {self.work} before stopping; press Ctrl-C again to stop at once without saving")
        global _stop_signal_received
        self.requested = True
        self.signal_name = _stop_signal_received = signal.Signals(signum).name

    def requested_anywhere(self) -> bool:
        """This rank's request, or one another rank published: one round trip to the process group's store (none
        without a process group). A rank that sees another's takes its signal name, so every rank reports the same."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.requested
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        if self.requested:
            if not self._published:
                store.set(_STORE_KEY, self.signal_name)
                self._published = True
            return True
        if not store.check([_STORE_KEY]):
            return False
        self.signal_name = self.signal_name or store.get(_STORE_KEY).decode()
        return True


def say_once(line: str) -> None:
    """Print `line` from a signal handler, on rank 0 only (every rank gets the signal; one line is enough).

    One write(2) to the file descriptor: the handler may run while the main thread is inside a print to stderr,
    where a second buffered write would fail. On a terminal the line starts afresh (a progress bar may be drawn)."""
    if os.environ.get("RANK", "0") != "0":
        return
    start = "\n" if os.isatty(2) else ""
    try:
        os.write(2, f"{start}{line}\n".encode())
    except OSError:
        pass


def ignore_preemption_signals(worker_id: int = 0) -> None:
    """A helper process's (DataLoader worker's) answer to SIGTERM, SIGUSR1 and Ctrl-C: none. SLURM, `kill -TERM
    -PGID` and a terminal's Ctrl-C signal every process of the job or of the foreground process group; a worker
    that died of it would fail the rank before it could save. The rank itself stops its workers once its
    checkpoint is committed."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preempted(Exception):
    """Raised after the preemption checkpoint is committed; the CLI exits with PREEMPTED_EXIT_CODE."""
