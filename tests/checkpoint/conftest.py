"""Shared by the resume tests: one small dataset and uninterrupted reference runs, each trained once per session
(by whichever xdist worker asks first: helpers.built_once)."""

from pathlib import Path

import pytest

from checkpoint.resume_ranks import FLAGS, shape
from helpers import built_once, run_phalanx, write_chat_jsonl


@pytest.fixture(scope="session")
def resume_data(tmp_path_factory) -> Path:
    folder = built_once(tmp_path_factory, "resume-data", lambda out: write_chat_jsonl(out / "train.jsonl", 30))
    return folder / "train.jsonl"


@pytest.fixture(scope="session")
def reference(resume_data, tmp_path_factory):
    """get(strategy, world) -> output_dir of an uninterrupted run with FLAGS, trained once per session (by the first
    worker that asks: helpers.built_once)."""

    def run(strategy: str, world: int, out: Path) -> None:
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

    def get(strategy: str, world: int) -> Path:
        return built_once(tmp_path_factory, f"reference-{strategy}{world}", lambda out: run(strategy, world, out))

    return get
