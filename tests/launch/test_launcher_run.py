"""Generated launcher scripts, executed: a single-node run, the failure messages, and an elastic restart.

Every script here is the file `phalanx launcher` wrote, started with bash as a user would,
with 2 CPU ranks over gloo (`--num_gpus_per_node 0`). Ports are free ones on loopback.
"""

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import ctrl_c_twice_while_starting, preempted_at
from phalanx.checkpoint.commit import committed_step_checkpoints, is_committed

pytestmark = pytest.mark.system


def run_script(
    support, project: Path, env: dict, *args: str, timeout: float = 240
) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = support.run_bounded(["bash", *args], project, env, timeout)
    return proc, time.monotonic() - start


def test_single_node_script_trains_on_two_ranks(reference_run, reference_run_dir, support):
    """The reference run is `bash scripts/run_training.sh 2 --output_dir REFERENCE/run` (see conftest)."""
    info = support.read_info(reference_run_dir / "run")
    assert info["world_size"] == 2 and info["global_step"] == support.MAX_STEPS and info["effective_batch_size"] == 4
    losses = [reference_run[s] for s in sorted(reference_run)]
    assert all(loss == loss and loss < 20 for loss in losses) and losses[-1] < losses[0], losses
    assert (reference_run_dir / "run" / "adapter_model.safetensors").is_file()
    # The Windows twin was written next to it (it cannot run here; test_generate.py checks its lines).
    assert (reference_run_dir / "scripts" / "run_training.bat").is_file()


def test_a_script_with_generate_writes_the_data_then_trains_on_it(project, generate, support):
    """Seed 001's ./run_distributed.sh: generation on the 2 ranks, then training on what it wrote, one script."""
    (project / "seed001.yaml").write_text(
        "training:\n  max_steps: 2\n  batch_size: 1\nlogging:\n  progress_bar: false\n"
    )
    data = "data/seed001/traj_chat.jsonl"
    generate(
        "launcher", "--config", "seed001.yaml", "--num_gpus_per_node", "0", "--nproc_per_node", "2",
        "--master_port", str(support.free_port()), "--output", "scripts/seed001.sh",
        "--generate", f"--num_questions 4 --batch_size 4 --num_sequences_per_question 2 --max_new_tokens 12 --output {data}",
        "--", "--output_dir", "runs/seed001",
    )  # fmt: skip
    proc, _ = run_script(support, project, support.local_env(), "scripts/seed001.sh")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Wrote 6 records to {data} and 2 (1 prompts) to data/seed001/traj_val.jsonl" in proc.stdout
    assert proc.stdout.index("Wrote 6 records") < proc.stdout.index("Starting distributed training")
    info = support.read_info(project / "runs" / "seed001")
    assert info["world_size"] == 2 and info["global_step"] == 2
    assert info["config"]["data"]["dataset_path"] == data
    assert info["config"]["data"]["eval_dataset_path"] == "data/seed001/traj_val.jsonl"
    assert info["best_eval_loss"] is not None, "evaluated on the generated validation file"


def test_port_already_taken_fails_fast_with_the_holder(project, generate, support):
    generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(support.free_port()),
        "--output",
        "scripts/taken.sh",
    )
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # The port comes from the environment here, which also shows the override reaches the script.
        env = support.local_env(PHALANX_MASTER_PORT=str(port))
        proc, seconds = run_script(support, project, env, "scripts/taken.sh", "--output_dir", "runs/taken", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"port {port} is already in use on this machine" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    assert "Choose another --master_port" in proc.stderr
    assert seconds < 30
    assert not (project / "runs" / "taken").exists(), "no rank started"


def test_more_gpus_than_the_node_has_fails_fast(project, generate, support):
    generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "2",
        "--master_port",
        str(support.free_port()),
        "--output",
        "scripts/gpus.sh",
    )
    proc, seconds = run_script(
        support, project, support.local_env(CUDA_VISIBLE_DEVICES=""), "scripts/gpus.sh", timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has 0 CUDA device(s) visible" in proc.stderr and "asks for 2 per node" in proc.stderr
    assert "--num_gpus_per_node 0 --nproc_per_node N" in proc.stderr
    assert seconds < 30


def test_bad_rank_count_or_port_given_when_the_script_runs_is_named(project, generate, support):
    """The script's first argument and PHALANX_* variables bypass the launcher's checks: 0 ranks reached torch's
    launcher as a bare AssertionError traceback (status 1), a port above 65535 an OverflowError in preflight, a
    first argument that is no count the ranks as a stray argument."""
    generate("launcher", "--config", "train.yaml", "--num_gpus_per_node", "0", "--output", "scripts/counts.sh")
    proc, _ = run_script(support, project, support.local_env(), "scripts/counts.sh", "0", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ranks per node (the script's first argument, PHALANX_NPROC_PER_NODE" in proc.stderr
    assert "is '0'; accepted: a whole number, at least 1" in proc.stderr
    # a word that is no count went on to every rank, which said "unexpected argument 'four' after --backend gloo"
    proc, _ = run_script(support, project, support.local_env(), "scripts/counts.sh", "four", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "counts.sh: the first argument is the number of ranks on this node (e.g. 2) or a --flag" in proc.stderr
    assert "got 'four'" in proc.stderr and "--backend gloo" not in proc.stderr
    env = support.local_env(PHALANX_MASTER_PORT="99999")
    proc, _ = run_script(support, project, env, "scripts/counts.sh", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "the master port (PHALANX_MASTER_PORT or --master_port) is '99999'; accepted: 1..65535" in proc.stderr
    assert not (project / "runs" / "default").exists(), "no rank started"


def test_the_slurm_script_run_with_bash_says_to_submit_it(project, generate, support):
    """`bash scripts/slurm_job.sh` outside any job printed scontrol's four errors and 'SLURM_JOB_ID: unbound
    variable', status 1."""
    generate("slurm", "--config", "train.yaml", "--num_gpus_per_node", "0", "--output", "scripts/job.sh")
    env = {k: v for k, v in support.local_env().items() if not k.startswith("SLURM_")}
    proc, _ = run_script(support, project, env, "scripts/job.sh", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "job.sh is a SLURM batch script: submit it with sbatch job.sh" in proc.stderr
    assert "unbound variable" not in proc.stderr and "scontrol" not in proc.stderr


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{global rank: pid} of the ranks torchrun (the script exec's into it) has started."""
    out = {}
    try:
        children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = child
    return out


def test_killed_rank_restarts_and_resumes_under_max_restarts(project, generate, reference_run, support):
    """Elastic: SIGKILL rank 1 after the first checkpoint; torchrun restarts both ranks, which resume from it."""
    generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--master_port",
        str(support.free_port()),
        "--output",
        "scripts/elastic.sh",
    )
    out = project / "runs" / "elastic"
    log = project / "elastic.log"
    with running_script(support, project, log, "scripts/elastic.sh", "--output_dir", str(out)) as proc:
        deadline = time.monotonic() + 180
        killed = None
        while time.monotonic() < deadline and proc.poll() is None:
            if is_committed(out / f"checkpoint-{support.SAVE_STEPS}"):
                ranks = worker_pids(proc.pid)
                if 1 in ranks:
                    os.kill(ranks[1], signal.SIGKILL)
                    killed = ranks[1]
                    break
            time.sleep(0.1)
        assert killed, "rank 1 was not found running after the first checkpoint:\n" + log.read_text()[-3000:]
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "-9" in text or "SIGKILL" in text, "torchrun saw the killed rank"
    info = support.read_info(out)
    assert info["world_size"] == 2 and info["global_step"] == support.MAX_STEPS
    resumed = support.losses_by_step(out)
    assert sorted(resumed) == sorted(reference_run)
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx(
        [reference_run[s] for s in sorted(reference_run)], abs=1e-5
    )


@contextlib.contextmanager
def running_script(support, project: Path, log: Path, *args: str) -> Iterator[subprocess.Popen]:
    """`bash SCRIPT ARGS` in a process group of its own (as a terminal's foreground job), output into `log`; its
    whole process tree is killed if it still runs when the block ends (a failed assertion)."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            ["bash", *args],
            cwd=project,
            env=support.local_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            support.kill_tree(proc)


def sigterm_after_a_checkpoint_ends_with_75(support, project: Path, script: str, name: str) -> None:
    """Start `script` for a long run, send its process a SIGTERM once a checkpoint is committed: every rank commits
    one at the step it stops at and the script exits 75, saying so once, without a traceback."""
    out, log = project / "runs" / name, project / f"{name}.log"
    with running_script(support, project, log, script, "--output_dir", str(out), "--max_steps", "200") as proc:
        deadline = time.monotonic() + 180
        while not is_committed(out / f"checkpoint-{support.SAVE_STEPS}"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 75, text[-4000:]
    assert text.count("preempted (SIGTERM) at step") == 1 and "Traceback" not in text, text[-4000:]
    stopped_at = preempted_at(text)
    assert stopped_at >= support.SAVE_STEPS
    assert committed_step_checkpoints(out)[-1][0] == stopped_at, "the ranks saved when they stopped"


def test_script_status_tells_a_requeue_what_the_ranks_did(project, generate, support):
    """What a requeue wrapper reads: SIGTERM mid-run (a scheduler's preemption) makes every rank commit a checkpoint
    and exit 75, and the script exits 75 too, saying so once, without a traceback. Ctrl-C twice (a terminal's SIGINT
    to its foreground process group) stops it at once: 130, one line. A rank that fails: 1 (bad input is 2), naming it."""
    generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(support.free_port()),
        "--output",
        "scripts/status.sh",
    )
    # the script's process: phalanx.launch.torchrun, which bash exec'd
    sigterm_after_a_checkpoint_ends_with_75(support, project, "scripts/status.sh", "status-term")

    out, log = project / "runs" / "status-int", project / "status-int.log"
    with running_script(support, project, log, "scripts/status.sh", "--output_dir", str(out)) as proc:
        ranks = lambda: list(worker_pids(proc.pid).values())  # noqa: E731
        ctrl_c_twice_while_starting(proc, log, lambda: ranks() if len(ranks()) == 2 else [])
        rc = proc.wait(timeout=60)
    text = log.read_text()
    assert rc == 130, text[-4000:]
    assert text.count("Ctrl-C again: stopped at once, without saving") == 1 and "Traceback" not in text, text[-4000:]

    out = project / "runs" / "status-fail"
    proc, _ = run_script(
        support,
        project,
        support.local_env(PHALANX_FAULT="raise@step=2,rank=1"),
        "scripts/status.sh",
        "--output_dir",
        str(out),
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]  # a rank's crash, told apart from bad input (2)
    assert "rank 1 failed: RuntimeError: injected fault in forward at step 2" in text, text[-4000:]
    # A crash shows where: the failed rank's traceback once, each line marked with the rank (dd8d332).
    assert "error: failed on rank" in text and text.count("Traceback (most recent call last)") == 1, text[-4000:]
    assert "[rank 1] Traceback (most recent call last)" in text, text[-4000:]


def test_deepspeed_launcher_script_trains_cpu_ranks_with_the_deepspeed_engine(
    project, generate, reference_run, support
):
    """`--use_deepspeed` on a CPU node: the script starts the real DeepSpeed launcher (its CPU accelerator over
    gloo), which starts 2 ranks that train with strategy deepspeed, the same losses as the torchrun reference. Its
    status tells a requeue what the ranks did, as the torchrun script's does: a SIGTERM to the script's process alone
    (DeepSpeed's own runner would die of it and leave the ranks training) makes them commit a checkpoint and exit 75,
    said once. (A rank that fails ends it with 1, naming the rank: launch.local.after_rank_failure, tested with the
    DeepSpeed launcher's records in test_local.py and with real ranks under the torchrun script above.)"""
    out = generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--use_deepspeed",
        "--master_port",
        str(support.free_port()),
        "--output",
        "scripts/deepspeed.sh",
        "--",
        "--strategy",
        "deepspeed",
    )
    assert "2 rank(s) on this machine" in out
    assert not (project / "scripts" / "deepspeed.bat").exists()
    proc, _ = run_script(
        support, project, support.local_env(), "scripts/deepspeed.sh", "--output_dir", "runs/deepspeed"
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    # The DeepSpeed launcher (not torchrun) started the ranks, with DeepSpeed's CPU accelerator.
    assert "deepspeed.launcher.launch" in text and "dist_world_size=2" in text, text[-3000:]
    assert "Setting accelerator to CPU" not in text, "DS_ACCELERATOR=cpu chose it; DeepSpeed did not have to guess"
    assert "World Size: 2 (deepspeed, cpu" in text
    out_dir = project / "runs" / "deepspeed"
    info = support.read_info(out_dir)
    assert info["world_size"] == 2 and info["strategy"] == "deepspeed" and info["global_step"] == support.MAX_STEPS
    assert (out_dir / "adapter_model.safetensors").is_file() and (out_dir / "adapter_config.json").is_file()
    losses = support.losses_by_step(out_dir)
    assert sorted(losses) == sorted(reference_run)
    assert [losses[s] for s in sorted(losses)] == pytest.approx(
        [reference_run[s] for s in sorted(reference_run)], abs=1e-5
    )

    # the script's process alone: bash exec'd phalanx's DeepSpeed launcher
    sigterm_after_a_checkpoint_ends_with_75(support, project, "scripts/deepspeed.sh", "deepspeed-term")
