"""Shared by the strategy tests: one dataset and one single-process reference per finetune mode per session."""

from pathlib import Path

import pytest
from helpers import write_chat_jsonl

from parallel.common import train


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("parallel") / "train.jsonl", 48)


@pytest.fixture(scope="session")
def single(dataset, tmp_path_factory):
    """get(finetune) -> (output folder, per-step losses) of one process with batch 4, trained once per session."""
    cache = {}

    def get(finetune: str) -> tuple[Path, list[float]]:
        if finetune not in cache:
            out = tmp_path_factory.mktemp(f"single-{finetune}")
            cache[finetune] = out, train(dataset, out, 1, 4, finetune)
        return cache[finetune]

    return get
