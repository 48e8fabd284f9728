"""Merging a step's packed micro-batches (data/collate.py:merge_packed): a join is exactly the packing of its rows."""

import torch

from phalanx.data.collate import collate, merge_packed, passes_per_step


def rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 50, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [y if i > n // 3 else -100 for i, y in enumerate(ids)]})
    return out


def assert_same_batch(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_joined_micro_batches_are_the_packing_of_all_their_rows():
    examples = rows((7, 12, 5, 9, 30))
    micro = [collate([e], 0, packing=True) for e in examples[:3]] + [collate(examples[3:], 0, packing=True)]
    merged = merge_packed(micro, max_tokens=63)
    assert len(merged) == 1
    assert_same_batch(merged[0], collate(examples, 0, packing=True))


def test_passes_hold_at_most_the_budget_in_order_and_lose_no_row():
    examples = rows((7, 12, 5, 9, 30, 4))
    micro = [collate([e], 0, packing=True) for e in examples]
    merged = merge_packed(micro, max_tokens=30)
    assert [b["input_ids"].shape[1] for b in merged] == [24, 9, 30, 4]  # 7+12+5, 9 (+30 > 30), 30, 4 (+30 > 30)
    assert [b["row_lengths"] for b in merged] == [(7, 12, 5), (9,), (30,), (4,)]
    assert_same_batch(merged[0], collate(examples[:3], 0, packing=True))
    for key in ("rows", "input_tokens", "target_tokens"):
        assert sum(b[key] for b in merged) == sum(b[key] for b in micro)


def test_padded_batches_and_single_micro_batches_are_left_alone():
    examples = rows((7, 12))
    padded = [collate([e], 0, packing=False) for e in examples]
    assert merge_packed(padded, max_tokens=100) is padded
    one = [collate(examples, 0, packing=True)]
    assert merge_packed(one, max_tokens=100) is one


def test_a_step_makes_as_many_passes_as_its_micro_batches_fill_at_their_bound():
    """What compile's 'auto' counts: warm-up pays back per forward/backward pass, and merging makes fewer of them."""
    from phalanx.config.loader import load_config

    cfg = load_config(
        None, {"training.batch_size": 1, "training.gradient_accumulation_steps": 8, "data.max_length": 2048}
    )
    assert passes_per_step(cfg, None) == 8  # one per micro-batch
    assert passes_per_step(cfg, 2048) == 8  # one micro-batch's bound: rows may each fill it
    assert passes_per_step(cfg, 4096) == 4
    assert passes_per_step(cfg, 16384) == 1  # a whole step in one pass
    assert passes_per_step(cfg, 32768) == 1
