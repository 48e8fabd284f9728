"""Shared by the TrainingEngine tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is fastest, and much faster when other jobs share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
