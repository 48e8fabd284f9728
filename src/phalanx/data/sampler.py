"""Which rows each rank reads, in which order, and where it stopped: a checkpointable distributed sampler.

Every rank gets the same number of rows per epoch (the shuffled order is padded by
wrapping around), so no rank runs out of batches while another waits in a collective.
Rank r takes positions r, r+W, r+2W ... of the epoch's permutation, so W ranks with
batch b read exactly the rows one process with batch W*b reads, step for step.
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
        self.consumed = 0  # rows of this epoch this rank has already handed out
        self.rows_per_rank = math.ceil(num_rows / world_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def _epoch_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        total = self.rows_per_rank * self.world_size
        order += order[: total - len(order)]  # wrap around so every rank has rows_per_rank
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        mine = self._epoch_order()
        while self.consumed < len(mine):
            index = mine[self.consumed]
            self.consumed += 1
            yield index

    def __len__(self) -> int:
        return self.rows_per_rank - self.consumed

    @property
    def exhausted(self) -> bool:
        """Every row of this epoch has been handed out."""
        return self.consumed >= self.rows_per_rank

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


def eval_shard(num_rows: int, rank: int, world_size: int) -> list[int]:
    """Evaluation rows of this rank: a strided shard with no padding, so no row counts twice."""
    return list(range(rank, num_rows, world_size))
