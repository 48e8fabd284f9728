"""Preemption: SIGTERM / SIGUSR1 (what SLURM and Kubernetes send) ask the run to save and stop.

The handler only sets a flag; the loop folds the flag into the step's collective, so
every rank learns of the request in the same step and all of them stop together.
"""

from __future__ import annotations

import signal

# Exit status of a run that saved a checkpoint because it was asked to stop: EX_TEMPFAIL,
# "try again later". A requeue (SLURM, torchrun --max-restarts) resumes from that checkpoint.
PREEMPTED_EXIT_CODE = 75

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> "PreemptionFlag":
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


class Preempted(Exception):
    """Raised after the preemption checkpoint is committed; the CLI exits with PREEMPTED_EXIT_CODE."""
