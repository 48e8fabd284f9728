"""The distributed sampler: disjoint, equal shards that interleave into the single-process order; resumable."""

import random
from collections import Counter

import pytest

from phalanx.data.chat import IGNORE_INDEX
from phalanx.data.collate import batch_counts, collate
from phalanx.data.sampler import StatefulDistributedSampler, TokenBudgetBatchSampler, WithPaddingRows, eval_shard


def test_two_ranks_read_what_one_process_reads_per_global_batch():
    single = list(StatefulDistributedSampler(20, 0, 1, seed=3))
    ranks = [list(StatefulDistributedSampler(20, r, 2, seed=3)) for r in range(2)]
    b = 2
    for step in range(5):
        global_single = set(single[step * 2 * b : (step + 1) * 2 * b])
        global_ranks = set(ranks[0][step * b : (step + 1) * b]) | set(ranks[1][step * b : (step + 1) * b])
        assert global_single == global_ranks


def test_uneven_rows_give_every_rank_the_same_count():
    shards = [list(StatefulDistributedSampler(7, r, 3, seed=0)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    assert set().union(*shards) == set(range(7))


def test_padding_is_marked_and_comes_back_with_no_target_so_each_row_trains_once():
    """Fine-tuning marks the positions that only even out the ranks (row + num_rows); WithPaddingRows gives them back
    with every label ignored. Fewer rows than ranks go round as often as it takes, so every rank still gets a row."""
    shards = [list(StatefulDistributedSampler(3, r, 8, seed=0, mark_padding=True)) for r in range(8)]
    assert all(len(s) == 1 for s in shards)
    real = [i for s in shards for i in s if i < 3]
    assert sorted(real) == [0, 1, 2], "each row once"
    padding = Counter(i - 3 for s in shards for i in s if i >= 3)
    assert set(padding) == {0, 1, 2} and sorted(padding.values()) == [1, 2, 2], "the order wraps round, twice over"
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]} for _ in range(3)]
    rows[1] = {"input_ids": [9, 9], "labels": [IGNORE_INDEX, 9]}
    dataset = WithPaddingRows(rows)
    assert len(dataset) == 3 and dataset[1] == rows[1]
    assert dataset.__getitems__([4, 0]) == [{"input_ids": [9, 9], "labels": [IGNORE_INDEX] * 2}, rows[0]]
    for packing in (True, False):
        batch = collate(dataset.__getitems__([0, 3]), pad_token_id=0, packing=packing)
        assert batch_counts(batch)[0] == batch_counts(collate([rows[0]], pad_token_id=0, packing=packing))[0] == 2


def test_padding_bins_are_marked_and_every_rank_gets_one_with_fewer_bins_than_ranks():
    sampler = TokenBudgetBatchSampler([5, 5, 5], 10, world_size=4, seed=0, mark_padding=True)
    bins = sampler.bins(0)
    assert len(bins) == 4, "4 ranks, 2 bins: each rank needs one"
    assert sorted(i for b in bins[:2] for i in b) == [0, 1, 2]
    assert [[i - 3 for i in b] for b in bins[2:]] == bins[:2], "the padding bins are the first ones, marked"
    one_bin = TokenBudgetBatchSampler([5], 10, world_size=4, seed=0)
    assert one_bin.bins(0) == [[0]] * 4  # unmarked (a dataset phalanx does not control): the rows themselves


def test_epochs_reshuffle_and_resume_continues_where_it_stopped():
    sampler = StatefulDistributedSampler(10, 0, 1, seed=1)
    sampler.set_epoch(1)
    it = iter(sampler)
    first = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    rest = list(it)
    resumed = StatefulDistributedSampler(10, 0, 1, seed=1)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    assert sorted(first + rest) == list(range(10))
    other_epoch = StatefulDistributedSampler(10, 0, 1, seed=1)
    assert list(other_epoch) != first + rest


def test_eval_shard_has_no_padding():
    assert eval_shard(5, 0, 2) == [0, 2, 4]
    assert eval_shard(5, 1, 2) == [1, 3]


def test_position_is_global_so_a_different_world_size_reads_the_remaining_rows():
    two = [StatefulDistributedSampler(10, r, 2, seed=5) for r in range(2)]
    iters = [iter(s) for s in two]
    read = [next(iters[r]) for _ in range(2) for r in range(2)]  # two rows per rank
    state = two[0].state_dict()
    assert state["position"] == 4
    one = StatefulDistributedSampler(10, 0, 1, seed=5)
    one.load_state_dict(state)
    rest = list(one)
    assert sorted(read + rest) == list(range(10)) and len(rest) == 6


# Token-budget micro-batches (training.batch_tokens)


def _lengths(n: int = 200, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, 500) for _ in range(n)]


def test_every_bin_fits_the_budget_and_each_row_is_read_once_per_epoch():
    lengths = _lengths()
    sampler = TokenBudgetBatchSampler(lengths, budget=1024, seed=3)
    bins = list(sampler)
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    # First fit over a window fills the budget well: rows of 20-500 tokens, bins at least 90% full on average.
    fill = sum(lengths) / (len(bins) * 1024)
    assert fill > 0.9, fill


def test_ranks_together_read_the_bins_one_process_reads_with_more_accumulation():
    lengths = _lengths(101)
    one = list(TokenBudgetBatchSampler(lengths, 1024, seed=7))
    ranks = [list(TokenBudgetBatchSampler(lengths, 1024, rank=r, world_size=3, seed=7)) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1  # the same micro-batch count on every rank
    for step in range(len(ranks[0])):
        together = [ranks[r][step] for r in range(3)]
        assert together == [one[(3 * step + r) % len(one)] for r in range(3)]  # the last step wraps around


def test_resume_continues_at_the_saved_bin_with_another_world_size():
    lengths = _lengths(80)
    two = [TokenBudgetBatchSampler(lengths, 900, rank=r, world_size=2, seed=5) for r in range(2)]
    two[0].set_epoch(1), two[1].set_epoch(1)
    iters = [iter(s) for s in two]
    read = [next(iters[r]) for _ in range(3) for r in range(2)]
    state = two[0].state_dict()
    assert state["position"] == 6 and state["epoch"] == 1
    one = TokenBudgetBatchSampler(lengths, 900, seed=5)
    one.load_state_dict(state)
    rest = list(one)
    assert read + rest == TokenBudgetBatchSampler(lengths, 900, seed=5).bins(1)[: len(read) + len(rest)]
    assert one.exhausted
    assert TokenBudgetBatchSampler(lengths, 900, seed=5).bins(0) != one.bins(1)  # epochs reshuffle


def test_a_position_saved_under_another_budget_or_by_rows_is_refused():
    lengths = _lengths(30)
    state = TokenBudgetBatchSampler(lengths, 900).state_dict()
    with pytest.raises(ValueError, match="batch_tokens = 900, this run packs 1000"):
        TokenBudgetBatchSampler(lengths, 1000).load_state_dict(state)
    with pytest.raises(ValueError, match="this run reads batch_size rows"):
        StatefulDistributedSampler(30).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_tokens = None"):
        TokenBudgetBatchSampler(lengths, 900).load_state_dict(StatefulDistributedSampler(30).state_dict())


def _loader(by_tokens: bool, workers: int):
    """(sampler, loader) of rank 1 of 2 over 40 rows: 3 rows per micro-batch, or bins of 200 tokens."""
    import torch
    from torch.utils.data import DataLoader

    def collate(rows):
        return {"rows": len(rows), "ids": torch.tensor(rows)}

    if by_tokens:
        lengths = [random.Random(i).randint(10, 100) for i in range(40)]
        inner = TokenBudgetBatchSampler(lengths, 200, rank=1, world_size=2, seed=3)
        return inner, DataLoader(list(range(40)), batch_sampler=inner, collate_fn=collate, num_workers=workers)
    inner = StatefulDistributedSampler(40, rank=1, world_size=2, seed=3)
    return inner, DataLoader(list(range(40)), batch_size=3, sampler=inner, collate_fn=collate, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("by_tokens", [False, True])
def test_the_saved_position_counts_micro_batches_taken_not_those_workers_drew_ahead(workers, by_tokens):
    from phalanx.data.sampler import TakenPosition

    whole = [b["ids"].tolist() for b in _loader(by_tokens, 0)[1]]
    inner, loader = _loader(by_tokens, workers)
    sampler = TakenPosition(inner)
    sampler.begin_pass()
    taken = []
    for batch in loader:
        sampler.took(batch)
        taken.append(batch["ids"].tolist())
        if len(taken) == 2:
            break
    units = len(taken) if by_tokens else sum(len(t) for t in taken)
    assert sampler.state_dict()["position"] == units * 2  # both ranks advance together
    if workers:
        assert inner.position > sampler.position  # the loader drew ahead: saving its count would skip rows
    assert not sampler.exhausted

    # Restored from that state, a new loader hands out exactly the micro-batches after the two taken.
    restored_inner, rest_loader = _loader(by_tokens, workers)
    restored = TakenPosition(restored_inner)
    restored.load_state_dict(sampler.state_dict())
    restored.begin_pass()
    rest = []
    for batch in rest_loader:
        restored.took(batch)
        rest.append(batch["ids"].tolist())
    assert taken + rest == whole and restored.exhausted
