"""Parallel strategies behind one interface (see base.Strategy)."""

from phalanx.parallel.base import Precision, Strategy
from phalanx.runtime.dist import RankInfo


def make_strategy(rank: RankInfo, precision: Precision, comm_hook: str = "none") -> Strategy:
    """One process trains plainly; several ranks use DDP."""
    if rank.distributed:
        from phalanx.parallel.ddp import DDPStrategy

        return DDPStrategy(rank, precision, comm_hook)
    return Strategy(rank, precision)
