"""Which rows each rank reads, in which order, and where it stopped: a checkpointable distributed sampler.

Every rank gets the same number of rows per epoch (the shuffled order is padded by
wrapping around), so no rank runs out of batches while another waits in a collective.
Rank r takes positions p+r, p+r+W, p+r+2W ... of the epoch's permutation, so W ranks with
batch b read exactly the rows one process with batch W*b reads, step for step.

The padding is computed like any row (every rank runs the same steps) but, where the sampler marks it
(`mark_padding`, fine-tuning), trains nothing: a padded position is handed out as `row + num_rows`, and
`WithPaddingRows` gives it back with no target. So a row count that the ranks do not divide trains exactly
what one process trains, each row once, instead of a few rows twice per epoch.

The position p is global (rows of the epoch's order consumed by all ranks together), so
a run saved with W ranks resumes with a different W on the same remaining rows.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler

from phalanx.data.chat import IGNORE_INDEX


class StatefulDistributedSampler(Sampler[int]):
    """`mark_padding`: hand out the wrapped-around positions as `row + num_rows` (see the module's docstring), for a
    dataset wrapped in WithPaddingRows; off, they are the rows themselves (torch's DistributedSampler's way, for
    datasets whose loss phalanx does not control)."""

    def __init__(
        self,
        num_rows: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        mark_padding: bool = False,
    ):
        if num_rows <= 0:
            raise ValueError("the sampler needs at least one row")
        self.num_rows = num_rows
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.mark_padding = mark_padding
        self.epoch = 0
        self.position = 0  # rows of this epoch's order handed out over all ranks
        self.total = math.ceil(num_rows / world_size) * world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def _epoch_order(self) -> list[int]:
        order = epoch_order(self.num_rows, self.seed + self.epoch, self.shuffle)
        # Wrap around so every rank gets the same count.
        offset = self.num_rows if self.mark_padding else 0
        return order + [row + offset for row in wrapped(order, self.total - len(order))]

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

    def epoch_units(self) -> int:
        """What `position` counts to in one epoch: rows of the (wrapped) order."""
        return self.total

    @property
    def exhausted(self) -> bool:
        """Every row of this epoch has been handed out."""
        return self.position >= self.total

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_tokens") is not None:
            raise ValueError(
                f"the checkpoint's data position counts micro-batches of training.batch_tokens = "
                f"{state['batch_tokens']}, this run reads batch_size rows: resume with the same batch_tokens"
            )
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), self.total)


def eval_shard(num_rows: int, rank: int, world_size: int) -> list[int]:
    """Evaluation rows of this rank: a strided shard with no padding, so no row counts twice."""
    return list(range(rank, num_rows, world_size))


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Micro-batches by a token budget (`training.batch_tokens`): each yields the row indices of one packed
    micro-batch holding at most `budget` tokens, however many rows that is.

    The epoch's shuffled order (the same permutation StatefulDistributedSampler draws) is cut into bins by
    first fit over a window of `lookahead` open bins: a row goes into the oldest open bin it fits in, and the
    oldest bin is closed when the window is full. The bins depend on the rows, the budget, the seed and the
    epoch only, never on the world size; rank r takes bins p+r, p+r+W, ... (p = bins handed out over all
    ranks). So W ranks with gradient accumulation a train the same bins per optimizer step as one process
    with accumulation W*a, and a run resumes exactly, with any W, from the bin position it saved. The last
    bins wrap around to the first so every rank gets the same count; with `mark_padding` their rows are handed out
    as `row + len(lengths)` (no targets: WithPaddingRows).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        budget: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        lookahead: int = 64,
        mark_padding: bool = False,
    ):
        if not lengths:
            raise ValueError("the sampler needs at least one row")
        if budget <= 0:
            raise ValueError(f"the token budget must be positive, got {budget}")
        self.lengths = list(lengths)
        self.budget = budget
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.lookahead = lookahead
        self.mark_padding = mark_padding
        self.epoch = 0
        self.position = 0  # bins of this epoch handed out over all ranks
        self._bins_of: dict[int, list[list[int]]] = {}

    def bins(self, epoch: int) -> list[list[int]]:
        """The epoch's micro-batches (row indices), padded by wrapping to a multiple of the world size."""
        if epoch not in self._bins_of:
            self._bins_of = {epoch: self._pack(epoch_order(len(self.lengths), self.seed + epoch, self.shuffle))}
        return self._bins_of[epoch]

    def _pack(self, order: list[int]) -> list[list[int]]:
        closed: list[list[int]] = []
        open_bins: list[tuple[list[int], list[int]]] = []  # (rows, [tokens]) in the order they were opened
        for index in order:
            n = self.lengths[index]
            for rows, used in open_bins:
                if used[0] + n <= self.budget:
                    rows.append(index)
                    used[0] += n
                    break
            else:  # a row longer than the budget gets a bin of its own (max_length <= budget is checked in config)
                open_bins.append(([index], [n]))
                if len(open_bins) > self.lookahead:
                    closed.append(open_bins.pop(0)[0])
        closed.extend(rows for rows, _ in open_bins)
        total = math.ceil(len(closed) / self.world_size) * self.world_size
        offset = len(self.lengths) if self.mark_padding else 0
        return closed + [[row + offset for row in rows] for rows in wrapped(closed, total - len(closed))]

    def micro_batches_per_rank(self, epoch: int) -> int:
        return len(self.bins(epoch)) // self.world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __iter__(self) -> Iterator[list[int]]:
        bins = self.bins(self.epoch)
        while self.position + self.rank < len(bins):
            batch = bins[self.position + self.rank]
            self.position += self.world_size  # every rank advances in lockstep
            yield batch
        self.position = max(self.position, len(bins))

    def __len__(self) -> int:
        return max(0, math.ceil((len(self.bins(self.epoch)) - self.position - self.rank) / self.world_size))

    def epoch_units(self) -> int:
        """What `position` counts to in one epoch: micro-batches (bins)."""
        return len(self.bins(self.epoch))

    @property
    def exhausted(self) -> bool:
        return self.position >= self.epoch_units()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_tokens": self.budget,
        }

    def load_state_dict(self, state: dict) -> None:
        # A position counts bins of one budget: under another budget it would point at other rows.
        saved_budget = state.get("batch_tokens")
        if saved_budget != self.budget:
            raise ValueError(
                f"the checkpoint's data position counts micro-batches of training.batch_tokens = "
                f"{saved_budget}, this run packs {self.budget}: resume with the same batch_tokens"
            )
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), len(self.bins(self.epoch)))


class TakenPosition:
    """A train sampler whose saved position counts the micro-batches the loop has taken, not those handed to the
    loader: with loader workers the DataLoader draws `prefetch_factor x workers` micro-batches ahead of the loop,
    and saving the drawn position would skip those on resume.

    `begin_pass()` before each pass over the loader, `took(batch)` for each micro-batch the loop takes; the rest
    (set_epoch, exhausted, epoch, ...) is the sampler's own. Rows count for StatefulDistributedSampler, whole
    micro-batches for TokenBudgetBatchSampler: the units each one's position moves in."""

    def __init__(self, sampler: "StatefulDistributedSampler | TokenBudgetBatchSampler"):
        self.sampler = sampler
        self.counts_rows = isinstance(sampler, StatefulDistributedSampler)
        self.begin_pass()

    def begin_pass(self) -> None:
        self._start, self._taken = self.sampler.position, 0

    def took(self, batch: dict) -> None:
        self._taken += batch["rows"] if self.counts_rows else 1

    @property
    def position(self) -> int:
        return self._start + self._taken * self.sampler.world_size

    @property
    def exhausted(self) -> bool:
        """Every micro-batch of this epoch was taken (handed out is not enough: workers draw ahead)."""
        return self.position >= self.sampler.epoch_units()

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.begin_pass()

    def __iter__(self):
        return iter(self.sampler)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def wrapped(order: list, count: int) -> list:
    """`count` items wrapped around from the start of `order`, going round as often as it takes (fewer rows or bins
    than ranks)."""
    return [order[i % len(order)] for i in range(count)]


class WithPaddingRows(Dataset):
    """Tokenized rows (input_ids, labels, ...) as a sampler with `mark_padding` indexes them: `i` is row `i`, and
    `i + len(rows)`, a position that only evens out the ranks, is row `i` with every label IGNORE_INDEX. It is
    computed like any row, so every rank runs the same steps and collectives, but it has no target: it adds
    nothing to the loss, the gradients or the step's target-token count."""

    def __init__(self, rows: Any):
        self.rows = rows
        self.num_rows = len(rows)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        rows = [index % self.num_rows for index in indices]
        fetch = getattr(self.rows, "__getitems__", None)  # containers that read a batch of rows in one call
        examples = fetch(rows) if fetch is not None else [self.rows[row] for row in rows]
        return [
            {**example, "labels": [IGNORE_INDEX] * len(example["labels"])} if index >= self.num_rows else example
            for index, example in zip(indices, examples)
        ]


def epoch_order(num_rows: int, seed: int, shuffle: bool) -> list[int]:
    """The rows of one epoch in training order: a seeded permutation (seed + epoch), or in place."""
    if not shuffle:
        return list(range(num_rows))
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
