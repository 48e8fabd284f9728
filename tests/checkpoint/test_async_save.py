"""checkpoint.async_save under FSDP2 on 2 gloo ranks: the same checkpoints as a synchronous run, exact resume,
and a kill while a checkpoint is being written in the background leaves the previous one as the resume point.

The kill is injected with PHALANX_FAULT="killsave@step=4": each rank SIGKILLs itself right after writing
its shards of checkpoint-4, in the background writer thread, while the training thread goes on
(before the metadata file and the commit marker exist).
"""

import json
from pathlib import Path

import pytest
import torch

from checkpoint.resume_ranks import FLAGS, shape
from helpers import read_metrics, run_phalanx
from phalanx.checkpoint.commit import MARKER, committed_step_checkpoints

pytestmark = pytest.mark.distributed
ASYNC = ["--strategy", "fsdp", *shape(2), *FLAGS, "--checkpoint.async_save", "true"]


def train(data: Path, out: Path, fault: str | None = None):
    return run_phalanx(
        "train",
        "--dataset_path",
        str(data),
        "--output_dir",
        str(out),
        *ASYNC,
        env={"PHALANX_FAULT": fault} if fault else None,
    )


@pytest.fixture(scope="module")
def async_run(resume_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async")
    proc = train(resume_data, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def consolidated(folder: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder / "sharded_state", target)
    return torch.load(target, weights_only=True)


def unordered(path: Path) -> dict:
    config = json.loads(path.read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def assert_same_tree(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_async_checkpoints_equal_sync_ones(reference, async_run, tmp_path):
    sync_run = reference("fsdp", 2)
    assert [r["loss"] for r in read_metrics(async_run)] == [r["loss"] for r in read_metrics(sync_run)]
    saves = read_metrics(async_run, "save")
    assert [(s["name"], s["async"]) for s in saves] == [
        ("checkpoint-2", True),
        ("checkpoint-4", True),
        ("checkpoint-6", True),
    ]
    assert [s["async"] for s in read_metrics(sync_run, "save")] == [False] * 3
    # The last one too: the end of training waited for it before the run finished.
    assert [step for step, _ in committed_step_checkpoints(async_run)] == [2, 4, 6]
    assert not list(async_run.glob(".*.staging"))
    for step in (2, 4, 6):
        a, s = async_run / f"checkpoint-{step}", sync_run / f"checkpoint-{step}"
        files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(s).as_posix() for p in s.rglob("*") if p.is_file())
        for name in files:
            if name.startswith("sharded_state/") or name in ("trainer_state.json", MARKER, "README.md"):
                continue
            if name == "adapter_config.json":  # PEFT writes target_modules from a set: its order varies per process
                assert unordered(a / name) == unordered(s / name)
                continue
            assert (a / name).read_bytes() == (s / name).read_bytes(), (step, name)
        state_a, state_s = (json.loads((f / "trainer_state.json").read_text()) for f in (a, s))
        assert (
            state_a.pop("config")["checkpoint"]["async_save"] and not state_s.pop("config")["checkpoint"]["async_save"]
        )
        assert state_a == state_s
        assert_same_tree(consolidated(a, tmp_path), consolidated(s, tmp_path), f"checkpoint-{step}")


def test_kill_during_async_write_leaves_the_previous_checkpoint(resume_data, async_run, tmp_path):
    out = tmp_path / "run"
    proc = train(resume_data, out, fault="killsave@step=4")
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert [step for step, _ in committed_step_checkpoints(out)] == [2]
    staging = out / ".checkpoint-4.staging"
    assert len(list((staging / "sharded_state").glob("*.distcp"))) == 2, "both ranks had written their shards"
    assert not (staging / "sharded_state" / ".metadata").exists() and not (out / "checkpoint-4").exists()

    proc = train(resume_data, out)  # the same command: resumes from checkpoint-2, the newest committed one
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-2 at step 2" in proc.stdout
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(async_run)]  # bit-identical
    assert [step for step, _ in committed_step_checkpoints(out)] == [2, 4, 6] and not staging.exists()
