"""A tampered checkpoint never runs code: resuming refuses it and names the file, under DDP and FSDP2 (DeepSpeed's
engine checkpoint: tests/parallel/test_deepspeed.py, on the run it resumes).

Each case copies a finished one-process run, replaces one pickled state file of checkpoint-4 with a pickle whose
loading would run a shell command (creating a marker file), and resumes from checkpoint-4 through the CLI. The
restricted unpicklers (phalanx.checkpoint.safe_load) must refuse the file before anything in it runs: exit 2, the
file named, no marker. The untampered checkpoints of the same runs load in the resume tests.
"""

import shutil

import pytest

from checkpoint.resume_ranks import FLAGS, shape
from helpers import run_phalanx, write_payload
from phalanx.checkpoint.safe_load import (
    UnsafeCheckpointError,
    check_dcp_metadata,
    load_state_file,
)

pytestmark = pytest.mark.distributed


# strategy flags, the file of checkpoint-4 to tamper with
CASES = {
    "ddp": (["--strategy", "ddp"], "scheduler.pt"),
    "fsdp": (["--strategy", "fsdp"], "sharded_state/.metadata"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_refuses_a_tampered_state_file_without_running_it(case, resume_data, reference, tmp_path):
    flags, tampered = CASES[case]
    out = tmp_path / "run"
    finished = reference(case, 1)  # the one-process runs of the resume tests (trained once per session)
    shutil.copytree(finished, out)
    marker = tmp_path / "payload-ran"
    target = out / "checkpoint-4" / tampered
    assert target.is_file(), sorted(p.name for p in target.parent.iterdir())
    write_payload(target, marker)
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(resume_data),
        "--output_dir",
        str(out),
        *flags,
        *shape(1),
        *FLAGS,
        "--resume_from_checkpoint",
        str(out / "checkpoint-4"),
        "--force",
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{target} holds" in proc.stderr and "never runs code from a checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "the pickle's payload ran"


def test_the_restricted_loaders_accept_what_phalanx_writes_and_refuse_the_rest(reference, tmp_path):
    checkpoint = reference("fsdp", 1) / "checkpoint-4"
    check_dcp_metadata(checkpoint / "sharded_state")
    assert set(load_state_file(checkpoint / "rng_state_0.pt")) >= {"python", "numpy", "torch"}
    marker = tmp_path / "payload-ran"
    for name in ("scheduler.pt", ".metadata"):
        write_payload(tmp_path / name, marker)
    with pytest.raises(UnsafeCheckpointError, match="scheduler.pt holds objects other than tensors"):
        load_state_file(tmp_path / "scheduler.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"\.metadata holds a pickle that is not DCP metadata .*posix.system"
    ):
        check_dcp_metadata(tmp_path)
    assert not marker.exists()
