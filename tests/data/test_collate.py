"""Merging a step's packed micro-batches (data/collate.py:merge_packed): a join is exactly the packing of its rows.
Moving a pass to the device: pageable tensors are pinned before their asynchronous copy (to_device)."""

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


def test_a_pass_built_after_the_loader_is_pinned_before_its_asynchronous_copy_to_a_gpu(monkeypatch):
    """The loader pins what it collates; a merged or graph-padded pass is built afterwards in pageable memory, and a
    copy from there may wait for the GPU's stream. to_device pins such tensors first (and only those), and every copy
    is non-blocking. No GPU here: the copies are recorded, not run."""
    from phalanx.data.collate import to_device
    from phalanx.models.graphs import GraphShapes

    pinned, copies = set(), []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: id(self) in pinned)

    def pin_memory(self):
        out = self.clone()
        pinned.add(id(out))
        return out

    def to(self, device, non_blocking=False):
        copies.append((id(self) in pinned, non_blocking, torch.device(device).type))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    loaded = [collate(rows([n], seed=n), pad_token_id=0, packing=True) for n in (9, 14)]
    for batch in loaded:  # as the DataLoader hands them over on CUDA
        pinned.update(id(v) for v in batch.values() if torch.is_tensor(v))
    to_device(loaded[0], torch.device("cuda"))
    tensors = sum(torch.is_tensor(v) for v in loaded[0].values())
    assert copies == [(True, True, "cuda")] * tensors and len(pinned) == 2 * tensors  # nothing pinned twice
    copies.clear()
    (merged,) = merge_packed(loaded, 64)
    padded = GraphShapes.for_run(64, 2, 0).pad(merged)
    to_device(padded, torch.device("cuda"))
    assert copies == [(True, True, "cuda")] * tensors  # pinned here first
    copies.clear()
    to_device(padded, torch.device("cpu"))
    assert copies == [(False, True, "cpu")] * tensors  # nothing to pin for a CPU run
