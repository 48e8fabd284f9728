"""Two nodes on one machine: network namespaces joined by a veth pair, each running its own launcher script.

Node 0 (10.77.0.1) and node 1 (10.77.0.2) each run the script `phalanx launcher --node_rank R`
wrote for them; they meet over the veth addresses (static rendezvous on node 0) and train with
world size 2, one rank per node. The losses must equal the single-node run of the same global
batch (2 ranks x batch 2 there, 2 nodes x 1 rank x batch 2 here), step by step.
"""

import signal
import subprocess
import time

import pytest

from helpers import preempted_at
from phalanx.checkpoint.commit import committed_step_checkpoints, is_committed

pytestmark = pytest.mark.system


def write_node_scripts(generate, node_pair, port: int, name: str) -> None:
    """scripts/<name>0.sh and <name>1.sh: `phalanx launcher` for node 0 and node 1 of two, one CPU rank each."""
    for rank in (0, 1):
        generate(
            "launcher",
            "--config",
            "train.yaml",
            "--num_gpus_per_node",
            "0",
            "--nproc_per_node",
            "1",
            "--num_nodes",
            "2",
            "--node_rank",
            str(rank),
            "--master_addr",
            node_pair.addresses[0],
            "--master_port",
            str(port),
            "--output",
            f"scripts/{name}{rank}.sh",
        )


def test_two_nodes_train_like_one(project, generate, reference_run, node_pair, support):
    port = 29400 + support.free_port() % 500  # any port: each namespace has its own
    write_node_scripts(generate, node_pair, port, "node")
    # The two 'machines' share this one's cores: one thread per rank keeps them from fighting over them.
    env = {k: v for k, v in support.local_env(OMP_NUM_THREADS="1").items() if k != "GLOO_SOCKET_IFNAME"}
    env["PHALANX_RDZV_TIMEOUT"] = "120"
    out = project / "runs" / "two-nodes"
    logs = [project / f"node{rank}.log" for rank in (0, 1)]
    procs = []
    for rank in (1, 0):  # the worker node first: it waits for the master, as on a real cluster
        with open(logs[rank], "w") as sink:
            procs.append(
                node_pair.popen(
                    rank,
                    ["bash", f"scripts/node{rank}.sh", "--output_dir", str(out)],
                    cwd=project,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
        time.sleep(0.5)
    try:
        codes = [p.wait(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the two nodes did not finish within 240 s:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    # Each node found the veth interface towards the master; gloo advertises it (the host name resolves to loopback).
    for rank in (0, 1):
        assert f"reached from {node_pair.addresses[rank]} ({node_pair.ifname})" in logs[rank].read_text()
    info = support.read_info(out)
    assert info["world_size"] == 2 and info["global_step"] == support.MAX_STEPS
    two_nodes = support.losses_by_step(out)
    assert sorted(two_nodes) == sorted(reference_run)
    assert [two_nodes[s] for s in sorted(two_nodes)] == pytest.approx(
        [reference_run[s] for s in sorted(reference_run)], abs=1e-5
    )


@pytest.mark.parametrize(
    "master, reason",
    [
        ("10.77.0.9", "No route to host"),  # on the veth subnet, but no machine answers ARP for it
        ("10.78.0.1", "Network is unreachable"),  # no route at all from node 1
    ],
)
def test_unreachable_master_ends_with_a_message_not_a_hang(project, generate, node_pair, support, master, reason):
    generate(
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "1",
        "--num_nodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        master,
        "--master_port",
        "29500",
        "--output",
        f"scripts/lost-{master}.sh",  # one per case: phalanx launcher does not replace another case's script
    )
    env = {**support.local_env(), "PHALANX_RDZV_TIMEOUT": "4"}
    start = time.monotonic()
    proc = node_pair.popen(
        1,
        ["bash", f"scripts/lost-{master}.sh"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        support.kill_tree(proc)
        pytest.fail("the worker node did not give up within 60 s")
    seconds = time.monotonic() - start
    assert proc.returncode == 2, out + err
    assert f"cannot reach the master node at {master}:29500 after 4 s" in err and reason in err
    assert "PHALANX_RDZV_TIMEOUT" in err
    assert seconds < 30


def test_sigterm_on_both_nodes_ends_each_script_with_75(project, generate, node_pair, support):
    """A preemption reaches every node's script: the ranks commit one checkpoint together and each node's script
    exits 75, node 1's too (its launcher reads the exit records of its own, local, ranks)."""
    port = 29400 + support.free_port() % 500
    write_node_scripts(generate, node_pair, port, "stop")
    env = {k: v for k, v in support.local_env(OMP_NUM_THREADS="1").items() if k != "GLOO_SOCKET_IFNAME"}
    out = project / "runs" / "two-nodes-stopped"
    logs = [project / f"stop{rank}.log" for rank in (0, 1)]
    procs = {}
    for rank in (1, 0):
        with open(logs[rank], "w") as sink:
            procs[rank] = node_pair.popen(
                rank,
                ["bash", f"scripts/stop{rank}.sh", "--output_dir", str(out), "--max_steps", "200"],
                cwd=project,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        time.sleep(0.5)
    deadline = time.monotonic() + 200
    while not is_committed(out / f"checkpoint-{support.SAVE_STEPS}"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), logs[0].read_text()
        time.sleep(0.1)
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    codes = {rank: proc.wait(timeout=120) for rank, proc in procs.items()}
    text = "\n".join(log.read_text()[-2500:] for log in logs)
    assert codes == {0: 75, 1: 75}, text
    assert text.count("preempted (SIGTERM) at step") == 1, text
    stopped_at = preempted_at(text)
    assert stopped_at >= support.SAVE_STEPS and committed_step_checkpoints(out)[-1][0] == stopped_at
