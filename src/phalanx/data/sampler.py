"""Which rows each rank reads, in which order, and where it stopped: a checkpointable distributed sampler.

Every rank gets the same number of rows per epoch (the shuffled order is padded by
wrapping around), so no rank runs out of batches while another waits in a collective.
Rank r takes positions p+r, p+r+W, p+r+2W ... of the epoch's permutation, so W ranks with
batch b read exactly the rows one process with batch W*b reads, step for step.

The position p is global (rows of the epoch's order consumed by all ranks together), so
a run saved with W ranks resumes with a different W on the same remaining rows.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler


class StatefulDistributedSampler(Sampler[int]):
    def __init__(self, num_rows: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if num_rows <= 0:
            raise ValueError("the sampler needs at least one row")
        self.num_rows = num_rows
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # rows of this epoch's order handed out over all ranks
        self.total = math.ceil(num_rows / world_size) * world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def _epoch_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        while len(order) < self.total:  # wrap around so every rank gets the same count
            order += order[: self.total - len(order)]
        return order

    def __iter__(self) -> Iterator[int]:
        order = self._epoch_order()
        while self.position + self.rank < self.total:
            index = order[self.position + self.rank]
            # Every rank advances in lockstep, so the global position moves by W per row handed out.
            self.position += self.world_size
            yield index
        self.position = max(self.position, self.total)

    def __len__(self) -> int:
        return max(0, math.ceil((self.total - self.position - self.rank) / self.world_size))

    @property
    def exhausted(self) -> bool:
        """Every row of this epoch has been handed out."""
        return self.position >= self.total

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), self.total)


def eval_shard(num_rows: int, rank: int, world_size: int) -> list[int]:
    """Evaluation rows of this rank: a strided shard with no padding, so no row counts twice."""
    return list(range(rank, num_rows, world_size))
