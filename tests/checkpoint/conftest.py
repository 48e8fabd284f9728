"""Shared by the resume tests: one small dataset and uninterrupted reference runs, each trained once per session."""

from pathlib import Path

import pytest

from checkpoint.resume_ranks import FLAGS, shape
from helpers import run_phalanx, write_chat_jsonl


@pytest.fixture(scope="session")
def resume_data(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("resume-data") / "train.jsonl", 30)


@pytest.fixture(scope="session")
def reference(resume_data, tmp_path_factory):
    """get(strategy, world) -> output_dir of an uninterrupted run with FLAGS, trained once per session."""
    cache: dict = {}

    def get(strategy: str, world: int) -> Path:
        if (strategy, world) not in cache:
            out = tmp_path_factory.mktemp(f"{strategy}{world}")
            proc = run_phalanx(
                "train",
                "--dataset_path",
                str(resume_data),
                "--output_dir",
                str(out),
                "--strategy",
                strategy,
                *shape(world),
                *FLAGS,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[strategy, world] = out
        return cache[strategy, world]

    return get
