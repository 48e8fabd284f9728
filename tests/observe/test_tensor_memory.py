"""TensorMemoryTracker, the measuring stick of `phalanx plan`'s accuracy tests: live tensor bytes and their peak."""

import torch

from phalanx.observe.tensor_memory import TensorMemoryTracker


def test_counts_each_storage_once_until_freed_and_keeps_the_peak():
    with TensorMemoryTracker() as tracker:
        a = torch.ones(1000)  # 4,000 bytes
        view = a[10:20].view(2, 5)  # a view: no new storage
        b = a * 2
        assert tracker.current == 8000
        del b
        assert tracker.current == 4000 and tracker.peak == 8000
        c = torch.cat([a, a])  # 8,000 bytes
        assert tracker.peak == 12000 and tracker.peak_op == "cat"
        del a, view, c
        assert tracker.current == 0


def test_registered_tensors_backward_and_in_place_storage_resizes():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with TensorMemoryTracker() as tracker:
        tracker.track(weight)
        assert tracker.current == 64 * 64 * 4
        loss = (torch.randn(8, 64) @ weight).sum()
        loss.backward()  # backward's tensors are seen too: the gradient stays
        assert weight.grad is not None and tracker.current >= 2 * 64 * 64 * 4
        before = tracker.current
        weight.grad.untyped_storage().resize_(0)  # how FSDP2 frees gathered parameters, bypassing operators
        assert tracker.current == before - 64 * 64 * 4
