"""Fault injection for the fault-tolerance tests: PHALANX_FAULT="kind@step=N[,rank=R]".

Kinds: kill (SIGKILL this process mid-step, after the first micro-batch's forward),
raise (an exception in forward), nan (a NaN loss on this rank), hang (stop taking part:
leave the loop early, as a rank with fewer batches would). Unset in normal runs; the
check costs one dictionary lookup per step.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: Optional[int]

    def due(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)


def planned_fault() -> Optional[Fault]:
    spec = os.environ.get("PHALANX_FAULT")
    # Only the first attempt fails: a restarted job (torchrun --max-restarts) must be able to recover.
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    kind, _, rest = spec.partition("@")
    fields = dict(item.split("=", 1) for item in rest.split(",") if item)
    return Fault(kind=kind, step=int(fields["step"]), rank=int(fields["rank"]) if "rank" in fields else None)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
