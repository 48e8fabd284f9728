"""Preemption: SIGTERM / SIGUSR1 (what SLURM and Kubernetes send) ask the run to save and stop.

The handler only sets a flag. Training folds the flag into the step's collective, so every rank
learns of the request in the same step and all of them stop together. Generation ranks meet in no
collective between batches (each commits to its own shard), so a rank that was signalled also
raises the flag in the process group's store, where the others see it before their next batch
(`requested_anywhere`).
"""

from __future__ import annotations

import signal

# Exit status of a run that saved a checkpoint because it was asked to stop: EX_TEMPFAIL,
# "try again later". A requeue (SLURM, torchrun --max-restarts) resumes from that checkpoint.
PREEMPTED_EXIT_CODE = 75

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_STORE_KEY = "phalanx/preempt"


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._published = False

    def install(self) -> "PreemptionFlag":
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

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


def ignore_preemption_signals(worker_id: int = 0) -> None:
    """A helper process's (DataLoader worker's) answer to SIGTERM/SIGUSR1: none. SLURM and `kill -TERM -PGID` signal
    every process of the job; a worker that died of it would fail the rank before it could save. The rank itself
    stops its workers once its checkpoint is committed."""
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preempted(Exception):
    """Raised after the preemption checkpoint is committed; the CLI exits with PREEMPTED_EXIT_CODE."""
