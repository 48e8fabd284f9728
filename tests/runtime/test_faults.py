"""Faults on real ranks: a rank that raises, dies, stops taking part or sees NaN; preemption; a full disk.

Every case must end every rank within the timeout with a message naming the rank, keep what was
committed, and (for NaN and preemption) decide the same on all ranks.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    ctrl_c_twice_while_starting,
    descendants,
    read_metrics,
    run_phalanx,
    start_phalanx,
    tiny_run,
    write_chat_jsonl,
)
from phalanx.checkpoint.commit import committed_step_checkpoints

pytestmark = pytest.mark.distributed

COMMON = tiny_run({"max_steps": None, "world_size": 2, "save_steps": 2, "batch_size": 2, "logging.tensorboard": None})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("faults") / "train.jsonl", 24)


def train(dataset: Path, out: Path, *extra: str, fault: str | None = None, timeout: float = 300):
    env = {"PHALANX_FAULT": fault} if fault else None
    start = time.monotonic()
    proc = run_phalanx(
        "train", "--dataset_path", str(dataset), "--output_dir", str(out), *COMMON, *extra, env=env, timeout=timeout
    )
    return proc, time.monotonic() - start


def test_rank_that_raises_in_forward_stops_everyone_and_is_named(dataset, tmp_path):
    proc, _ = train(dataset, tmp_path / "o", "--max_steps", "6", fault="raise@step=3,rank=1")
    assert proc.returncode == 1, proc.stderr[-2000:]  # a crash, as one process's: not bad input (2)
    assert "rank 1" in proc.stderr and "injected fault in forward at step 3" in proc.stderr
    # A crash comes with where it happened, from the rank that crashed only (the launcher's line names no place).
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "[rank 1] Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert 'phalanx/train/loop.py", line' in proc.stderr, proc.stderr[-3000:]
    # Rank 0's allreduce broke because rank 1 left: it stands aside and names rank 1, and the launcher names only
    # rank 1 (both were named, each with exit code 1, and rank 0's message was gloo's "Connection closed by peer").
    assert "rank 0 stopped: rank 1 (RuntimeError: injected fault in forward at step 3) failed first" in proc.stderr
    assert "error: failed on rank 1 (exit code 1); the other ranks were stopped" in proc.stderr, proc.stderr[-2000:]
    assert [s for s, _ in committed_step_checkpoints(tmp_path / "o")] == [2]


def test_rank_killed_mid_step_is_named(dataset, tmp_path):
    proc, _ = train(dataset, tmp_path / "o", "--max_steps", "6", fault="kill@step=3,rank=1")
    assert proc.returncode == 1 and "rank 1 (killed by SIGKILL)" in proc.stderr, proc.stderr[-2000:]
    # Rank 0's all-reduce broke when rank 1 died: it stands aside in one line. It printed "error: rank 0 failed:
    # RuntimeError: ... Connection closed by peer" first, an error line blaming the rank that was not at fault.
    assert "rank 0 failed" not in proc.stderr and "Connection closed by peer" not in proc.stderr, proc.stderr[-2000:]
    assert "[rank 0] local rank 1 (pid" in proc.stderr, proc.stderr[-2000:]


def test_rank_killed_while_the_others_start_is_named_and_they_stop_at_once(dataset, tmp_path):
    """A rank killed while the ranks still import and meet (the out-of-memory killer during model load, say): the
    launcher asks the others to stop, but they wait in the rendezvous, where no signal handler runs. Each sees that
    its peer is gone and stops at once, not when torch's agent kills it 30 s later; only the killed rank is named."""
    proc = start_phalanx("train", "--dataset_path", str(dataset), "--output_dir", str(tmp_path / "o"), *COMMON)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(rank_pids(proc)) < 2:
        time.sleep(0.05)
    time.sleep(1.0)  # the ranks are importing the model stack now
    victim = next(pid for pid in rank_pids(proc) if environment(pid).get("RANK") == "1")
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-2000:]
    assert time.monotonic() - killed < 15, "rank 0 waited for torch's agent to kill it"
    assert f"[rank 0] local rank 1 (pid {victim}) ended without an exit status (killed)" in stderr, stderr[-2000:]
    assert "error: failed on rank 1 (killed by SIGKILL); the other ranks were stopped" in stderr, stderr[-2000:]
    assert "out-of-memory killer" in stderr


def test_rank_that_stops_taking_part_is_named_within_the_timeout(dataset, tmp_path):
    """Rank 1 leaves the loop at step 3 (fewer batches than rank 0); rank 0 waits in a collective until the timeout."""
    proc, elapsed = train(
        dataset, tmp_path / "o", "--max_steps", "6", "--distributed.timeout_minutes", "0.1", fault="hang@step=3,rank=1"
    )
    assert proc.returncode != 0
    assert "rank 1: finishing" in proc.stderr and "rank 0: training step 3" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 120
    # Rank 0 timed out waiting for rank 1: it is no failure for rank 1 to stand aside for (runtime.watch.is_timeout).
    assert "stopped: rank 0" not in proc.stderr, proc.stderr[-2000:]


def test_nan_loss_on_one_rank_is_skipped_by_all(dataset, tmp_path):
    out = tmp_path / "o"
    proc, _ = train(dataset, out, "--max_steps", "4", fault="nan@step=3,rank=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "non-finite loss" in proc.stdout
    info = json.loads((out / "final_training_info.json").read_text())
    assert info["skipped_steps"] == 1 and info["global_step"] == 4
    assert all(r["loss"] == r["loss"] for r in read_metrics(out)), "no NaN reaches the logged losses"


def test_nan_loss_with_stop_policy_saves_and_exits(dataset, tmp_path):
    out = tmp_path / "o"
    proc, _ = train(
        dataset, out, "--max_steps", "6", "--save_steps", "100", "--nan_policy", "stop", fault="nan@step=3,rank=0"
    )
    assert proc.returncode != 0 and "non-finite loss" in proc.stderr and "checkpoint-2 saved" in proc.stderr
    assert [s for s, _ in committed_step_checkpoints(out)] == [2]


def environment(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def rank_pids(launcher: subprocess.Popen) -> list[int]:
    """The ranks below a `--world_size` launcher (processes whose environment holds RANK)."""
    return [pid for pid in descendants(launcher.pid) if "RANK" in environment(pid)]


@pytest.mark.parametrize(
    "sig, moment",
    [(signal.SIGUSR1, "training"), (signal.SIGTERM, "start-up"), (signal.SIGTERM, "training, to the whole group")],
    ids=["SIGUSR1-while-training", "SIGTERM-while-starting", "SIGTERM-to-ranks-and-loader-workers"],
)
def test_preemption_signal_saves_a_checkpoint_and_exits_for_requeue(sig, moment, dataset, tmp_path):
    """SLURM sends USR1 ahead of the time limit (--signal) and TERM on preemption or scancel: both save and exit 75.

    A signal that arrives while the ranks still import, tokenize and load (seconds on a real model) is kept, not
    fatal: the ranks finish starting, train the first step, commit checkpoint-1 and exit 75. scancel signals every
    process of the job, DataLoader workers too: they ignore it, and their rank saves.

    The rerun that resumes from the preemption's checkpoint runs in the last case only: a signal only sets the flag
    the loop reads at the end of a step, and every case saves through the same checkpointer, so what the cases
    differ in (how the signal reaches the ranks, when, which step is committed) is checked in each; the last case
    is the one whose loader workers were signalled too."""
    out = tmp_path / "o"
    train_args = ["train", "--dataset_path", str(dataset), "--output_dir", str(out), *COMMON]
    workers = ["--training.loader_workers", "2"] if "group" in moment else []
    proc = start_phalanx(*train_args, "--max_steps", "200", "--save_steps", "1000", *workers, new_session=True)
    deadline = time.monotonic() + 180
    if moment.startswith("training"):
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2):
            time.sleep(0.2)
    else:
        while time.monotonic() < deadline and len(rank_pids(proc)) < 2:
            time.sleep(0.05)
        time.sleep(1.0)  # the ranks are importing the model stack now
        assert not out.exists(), "the signal must reach the ranks before training starts"
    if "group" in moment:
        os.killpg(proc.pid, sig)  # the launcher, its ranks and their loader workers all get it
    else:
        os.kill(proc.pid, sig)  # SLURM signals the launcher (--signal=B:USR1, or TERM); it passes the signal on
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert f"preempted ({sig.name})" in stderr
    steps = [s for s, _ in committed_step_checkpoints(out)]
    assert len(steps) == 1 and (steps[0] >= 2 if moment.startswith("training") else steps[0] == 1), steps
    if "group" not in moment:
        return  # the resume from this checkpoint: the last case's (see above)
    resumed = run_phalanx(
        "train",
        "--dataset_path",
        str(dataset),
        "--output_dir",
        str(out),
        *COMMON,
        "--max_steps",
        "200",
        "--save_steps",
        "1000",
        "--max_steps",
        str(steps[0] + 2),
        "--force",
    )
    assert resumed.returncode == 0 and f"checkpoint-{steps[0]} at step {steps[0]}" in resumed.stdout


def tree_digest(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "world_size-2"])
def test_ctrl_c_saves_and_a_second_ctrl_c_stops_at_once(world_size, dataset, tmp_path):
    """Ctrl-C at a terminal signals its foreground process group: the one process and its DataLoader workers, or the
    `--world_size` launcher (torch starts the ranks in sessions of their own; the launcher passes it on). The first
    Ctrl-C is a preemption: the ranks finish the step, commit a checkpoint and exit 75, and rank 0 alone says so.
    A second one stops at once: exit 130, one line, no traceback; pressed while a rerun starts, it leaves the
    committed checkpoint as it was."""
    out = tmp_path / "o"
    train_args = ["train", "--dataset_path", str(dataset), "--output_dir", str(out), *COMMON]
    train_args += ["--world_size", str(world_size), "--max_steps", "200", "--save_steps", "1000"]
    train_args += ["--training.loader_workers", "2"]  # workers must outlive the Ctrl-C until their rank has saved
    proc = start_phalanx(*train_args, new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not ((out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert (
        stderr.count(
            "⏸️  Ctrl-C: finishing this step and saving a checkpoint before stopping; press Ctrl-C again to stop at once without saving"
        )
        == 1
    ), stderr[-3000:]
    assert stderr.count("preempted (SIGINT) at step") == 1, "one line for all ranks"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    [(step, checkpoint)] = committed_step_checkpoints(out)
    before = tree_digest(out / checkpoint.name)

    # The same command again (it would resume from the checkpoint), pressed twice while it starts.
    log = tmp_path / "rerun.log"
    proc = start_phalanx(*train_args, new_session=True, stderr_to=log)
    try:
        ranks = (
            (lambda: [proc.pid]) if world_size == 1 else (lambda: rank_pids(proc) if len(rank_pids(proc)) == 2 else [])
        )
        pressed = ctrl_c_twice_while_starting(proc, log, ranks)
        proc.wait(timeout=60)
        stopped_in = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                os.kill(pid, signal.SIGKILL)
    stderr = log.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert stopped_in < 10, stopped_in
    assert stderr.count("Ctrl-C again: stopped at once, without saving") == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "error:" not in stderr, stderr[-3000:]
    assert committed_step_checkpoints(out) == [(step, checkpoint)]
    assert tree_digest(out / checkpoint.name) == before


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.fail(
            f"this test needs to mount a small tmpfs (as root) to fill a disk for real: {result.stderr.strip()}"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_full_or_read_only_disk_keeps_the_previous_checkpoint(how, dataset, small_disk):
    """After checkpoint-2 is committed, the disk fills up (every byte taken) or output_dir turns read-only: the run
    stops with what went wrong and the checkpoints that are still good, and those load."""
    out = small_disk / "run"
    train_args = ["train", "--dataset_path", str(dataset), "--output_dir", str(out), *COMMON]
    proc = start_phalanx(*train_args, "--max_steps", "200", "--logging.tensorboard", "false", new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not committed_step_checkpoints(out):
        time.sleep(0.1)
    filler = small_disk / "filler"
    if how == "full":
        with open(filler, "wb") as f:  # take every remaining byte
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
    else:
        # output_dir turns read-only from here on (root ignores permissions; a read-only bind mount stops it too):
        # files the run holds open stay writable, as after a permission change; the next checkpoint cannot be made.
        subprocess.run(["mount", "--bind", str(out), str(out)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(out)], check=True, capture_output=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if how == "read-only":
            subprocess.run(["umount", str(out)], check=False, capture_output=True)
    assert proc.returncode != 0
    if how == "full":
        assert "cannot write checkpoint checkpoint-" in stderr and "Free space there: 0.0 MB" in stderr, stderr[-3000:]
    else:
        assert "Read-only file system" in stderr and "fix permissions" in stderr, stderr[-3000:]
    assert "Committed checkpoints are intact: ['checkpoint-2'" in stderr, stderr[-3000:]
    kept = committed_step_checkpoints(out)
    assert kept and kept[0][0] == 2
    if how == "full":
        filler.unlink()
    from safetensors.torch import load_file

    assert load_file(kept[-1][1] / "adapter_model.safetensors"), "the committed checkpoint still loads"


def test_a_full_cache_disk_is_named_as_the_cache_not_output_dir(dataset, small_disk):
    """The tokenized data go to phalanx's cache (PHALANX_CACHE), not to output_dir. With no room left there, the run
    said 'rank 0 cannot write to output_dir ...: No space left on device (None)': a user who freed space in
    output_dir met the same error again. Named as the cache, with the variable that moves it; no partial folder
    is left for a later run to trust (it is renamed into place only when complete)."""
    from phalanx.config.schema import DataConfig
    from phalanx.data.prepare import prepare_data
    from phalanx.errors import PhalanxError
    from phalanx.models.load import load_tokenizer

    tokenizer = load_tokenizer("embedded:tiny-qwen3")
    cache = small_disk / "data"
    cache.mkdir()
    with open(small_disk / "filler", "wb") as f:  # leave a few KB: room for the lock file, not for the rows
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - 16 * 1024))
    with pytest.raises(PhalanxError) as refused:
        prepare_data(DataConfig(dataset_path=str(dataset), test_size=0), tokenizer, seed=0, cache_root=cache)
    said = str(refused.value)
    assert f"cannot write the tokenized data into phalanx's cache {cache}: No space left on device" in said, said
    assert "PHALANX_CACHE" in said and "not output_dir" in said, said
    assert [p.suffix for p in cache.iterdir()] == [".lock"], "no partial tokenized folder is left"


def test_a_full_cache_disk_while_building_the_embedded_model_is_named_as_the_cache(small_disk):
    """Building an embedded model on a full cache disk ended in safetensors' own SafetensorError traceback."""
    from phalanx.errors import PhalanxError
    from phalanx.models.presets import materialize_embedded_model

    models = small_disk / "models"
    models.mkdir()
    with open(small_disk / "filler", "wb") as f:  # room for the lock file and the config, not for the weights
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - 64 * 1024))
    with pytest.raises(PhalanxError) as refused:
        materialize_embedded_model("tiny-qwen3", models)
    said = str(refused.value)
    assert f"cannot write the embedded model 'tiny-qwen3' into phalanx's cache {models}: No space left" in said, said
    assert "PHALANX_CACHE" in said
    assert [p.suffix for p in models.iterdir()] == [".lock"], "no partial model folder is left"
