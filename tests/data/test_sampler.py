"""The distributed sampler: disjoint, equal shards that interleave into the single-process order; resumable."""

from phalanx.data.sampler import StatefulDistributedSampler, eval_shard


def test_two_ranks_read_what_one_process_reads_per_global_batch():
    single = list(StatefulDistributedSampler(20, 0, 1, seed=3))
    ranks = [list(StatefulDistributedSampler(20, r, 2, seed=3)) for r in range(2)]
    b = 2
    for step in range(5):
        global_single = set(single[step * 2 * b:(step + 1) * 2 * b])
        global_ranks = set(ranks[0][step * b:(step + 1) * b]) | set(ranks[1][step * b:(step + 1) * b])
        assert global_single == global_ranks


def test_uneven_rows_give_every_rank_the_same_count():
    shards = [list(StatefulDistributedSampler(7, r, 3, seed=0)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    assert set().union(*shards) == set(range(7))


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
