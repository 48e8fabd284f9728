"""SLURM for real: the sbatch scripts `phalanx slurm` writes, submitted to a two-node cluster on this machine.

The `slurm_cluster` fixture (conftest.py) starts munged, slurmctld and two slurmd, each node in a network
namespace of its own, with private configs, ports and socket, and stops them afterwards. The main job runs on
both nodes, one CPU rank each: srun starts one torchrun per node, they meet at the first node's address, and
mid-run the job gets the time-limit warning SLURM sends `--signal_time` seconds early (here by hand, with
`scancel --signal=USR1 --batch`), so the ranks save a checkpoint, the job requeues itself, starts again on both
nodes and resumes: the losses must equal the uninterrupted single-node run's (same global batch).
"""

import time

import pytest

from phalanx.checkpoint.commit import is_committed

pytestmark = pytest.mark.system


def wait_for_state(cluster, job_id: str, done, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = cluster.job(job_id)
        if done(job):
            return job
        time.sleep(1)
    pytest.fail(f"job {job_id}: {what} within {timeout:.0f} s; last state {cluster.job(job_id)}\n{cluster.logs()}")


def test_sbatch_job_trains_is_preempted_requeues_and_resumes(slurm_cluster, project, generate, reference_run, support):
    generate(
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "1",
        "--time_limit",
        "00:15:00",
        "--job_name",
        "phalanx-test",
        "--output",
        "scripts/slurm_job.sh",
        "--",
        "--output_dir",
        "runs/slurm",
    )
    submitted = slurm_cluster.run("sbatch", "--parsable", "scripts/slurm_job.sh", timeout=30, cwd=project)
    assert submitted.returncode == 0, submitted.stderr + slurm_cluster.logs()
    job_id = submitted.stdout.strip().split(";")[0]
    out = project / "runs" / "slurm"
    log = project / f"slurm-{job_id}.out"

    # Wait for the first checkpoint, then send what SLURM sends --signal_time seconds before the time limit.
    deadline = time.monotonic() + 180
    while not is_committed(out / f"checkpoint-{support.SAVE_STEPS}"):
        state = slurm_cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"job {job_id} is {state} before its first checkpoint:\n"
            + (log.read_text()[-4000:] if log.exists() else slurm_cluster.logs())
        )
        assert time.monotonic() < deadline, "no checkpoint within 180 s:\n" + (
            log.read_text()[-4000:] if log.exists() else ""
        )
        time.sleep(0.2)
    warned = slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    assert warned.returncode == 0, warned.stderr

    job = wait_for_state(
        slurm_cluster,
        job_id,
        lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and j.get("Restarts") != "0",
        240,
        "did not finish after a requeue",
    )
    text = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", text[-5000:]
    assert job["Restarts"] == "1"
    a, b = slurm_cluster.names
    master = slurm_cluster.nodes.addresses[0]
    for expected in (
        f"phalanx: job {job_id} (restart 0) on {a},{b}",
        "time limit near: asking the ranks to save",
        "requeueing job",
        f"phalanx: job {job_id} (restart 1)",
        "Resuming from",
        "training step ended with exit code 0",
        f"master {master}:",
        f"phalanx: node 0 of 2 ({a}), master {master}:",
        f"phalanx: node 1 of 2 ({b}), master {master}:",
        f"reached from {slurm_cluster.nodes.addresses[1]} (phx0)",
    ):
        assert expected in text, expected
    assert text.count("World Size: 2") == 2, "both runs of the job had 2 ranks, one per node"
    info = support.read_info(out)
    assert info["world_size"] == 2 and info["global_step"] == support.MAX_STEPS
    resumed = support.losses_by_step(out)
    assert sorted(resumed) == sorted(reference_run)
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx(
        [reference_run[s] for s in sorted(reference_run)], abs=1e-5
    )


def test_gpus_the_cluster_does_not_have_are_refused_at_submission(slurm_cluster, project, generate):
    generate(
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "1",
        "--num_gpus_per_node",
        "8",
        "--time_limit",
        "10",
        "--output",
        "scripts/slurm_gpu.sh",
    )
    start = time.monotonic()
    proc = slurm_cluster.run("sbatch", "scripts/slurm_gpu.sh", timeout=30, cwd=project)
    assert proc.returncode != 0
    assert "gres" in proc.stderr.lower() or "configuration is not available" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20


def test_sbatch_job_with_the_deepspeed_launcher_on_cpu_ranks(slurm_cluster, project, generate, reference_run, support):
    """`phalanx slurm --use_deepspeed` for a CPU partition: srun starts the DeepSpeed launcher on the node, which
    starts 2 gloo ranks training with strategy deepspeed; the losses are the torchrun reference run's."""
    generate(
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "1",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--use_deepspeed",
        "--time_limit",
        "00:15:00",
        "--job_name",
        "phalanx-ds",
        "--output",
        "scripts/slurm_ds.sh",
        "--",
        "--output_dir",
        "runs/slurm-ds",
        "--strategy",
        "deepspeed",
    )
    submitted = slurm_cluster.run("sbatch", "--parsable", "scripts/slurm_ds.sh", timeout=30, cwd=project)
    assert submitted.returncode == 0, submitted.stderr + slurm_cluster.logs()
    job_id = submitted.stdout.strip().split(";")[0]
    job = wait_for_state(
        slurm_cluster,
        job_id,
        lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
        180,
        "did not finish",
    )
    log = project / f"slurm-{job_id}.out"
    text = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", text[-5000:]
    assert "deepspeed.launcher.launch" in text and "dist_world_size=2" in text, text[-3000:]
    assert "World Size: 2 (deepspeed, cpu" in text and "training step ended with exit code 0" in text
    out = project / "runs" / "slurm-ds"
    info = support.read_info(out)
    assert info["world_size"] == 2 and info["strategy"] == "deepspeed" and info["global_step"] == support.MAX_STEPS
    assert (out / "adapter_model.safetensors").is_file()
    losses = support.losses_by_step(out)
    assert sorted(losses) == sorted(reference_run)
    assert [losses[s] for s in sorted(losses)] == pytest.approx(
        [reference_run[s] for s in sorted(reference_run)], abs=1e-5
    )
