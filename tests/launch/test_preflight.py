"""The node checks behind the launcher's clear failure messages, one by one (in process, loopback only)."""

import os
import socket
import time

import pytest

from phalanx.errors import PhalanxError
from phalanx.launch import preflight


@pytest.fixture
def listener():
    """A process-local socket listening on a free loopback port (stands in for 'another job holds the port')."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_taken_port_names_the_port_and_the_holder(listener):
    with pytest.raises(PhalanxError) as err:
        preflight.check_port_free(listener)
    message = str(err.value)
    assert f"port {listener} is already in use" in message and "--master_port" in message
    assert f"by pid {os.getpid()}: " in message, "the process holding the port (this one) is named, with its command"


def test_free_port_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preflight.check_port_free(port)


def test_master_nobody_listens_on_fails_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        start = time.monotonic()
        with pytest.raises(PhalanxError) as err:
            preflight.wait_for_master("127.0.0.1", port, timeout=1.5)
    assert time.monotonic() - start < 5
    assert f"cannot reach the master node at 127.0.0.1:{port} after 2 s" in str(err.value)
    assert "connection was refused" in str(err.value)


def test_master_that_listens_is_found(listener):
    preflight.wait_for_master("127.0.0.1", listener, timeout=5)


def test_unresolvable_master_fails_at_once(monkeypatch):
    def no_such_name(*args, **kwargs):  # no DNS query leaves this machine
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(preflight.socket, "getaddrinfo", no_such_name)
    start = time.monotonic()
    with pytest.raises(PhalanxError, match="cannot resolve the master address 'head-node' .Name or service not known"):
        preflight.wait_for_master("head-node", 29500, timeout=60)
    assert time.monotonic() - start < 1


def test_node_zero_must_own_the_master_address():
    # 192.0.2.1 is TEST-NET-1: never an address of this machine; binding to it sends nothing.
    with pytest.raises(PhalanxError, match="192.0.2.1 .* is not an address of this machine"):
        preflight.check_master_is_here("192.0.2.1")
    preflight.check_master_is_here("127.0.0.1")


def test_more_gpus_than_the_node_has():
    with pytest.raises(PhalanxError) as err:
        preflight.check_devices(4, 4, cuda_count=lambda: 1)
    assert "has 1 CUDA device(s) visible" in str(err.value) and "asks for 4 per node" in str(err.value)
    assert "--num_gpus_per_node 1 or fewer" in str(err.value)
    preflight.check_devices(1, 1, cuda_count=lambda: 1)


def test_more_cpu_ranks_than_cores(monkeypatch):
    """`bash launch_distributed.sh 4` on a 2-core machine was told to use '--nproc_per_node 2', a flag of phalanx
    launcher, not of the script it ran."""
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    with pytest.raises(PhalanxError) as err:
        preflight.check_devices(0, 3)
    assert str(err.value).startswith("3 ranks per node (the script's first argument, PHALANX_NPROC_PER_NODE or ")
    assert "which has 2 core(s): each CPU (gloo) rank needs one. Give 2 or fewer." in str(err.value)


def test_a_script_for_more_gpus_runs_on_fewer():
    """Seed 000's `bash launch_distributed.sh 2` on a 4-GPU machine, as docs/launch.md shows it (`phalanx launcher
    --num_gpus_per_node 4`, then `bash scripts/run_training.sh 2`): 2 ranks on GPUs 0 and 1. It was refused as 'GPU
    nodes run one rank per GPU'. More ranks than visible GPUs are named as the script was given them."""
    preflight.check_devices(4, 2, cuda_count=lambda: 4)
    preflight.check_devices(8, 4, cuda_count=lambda: 4)  # a script written for 8 GPUs, run with 4 on a 4-GPU node
    with pytest.raises(PhalanxError) as err:
        preflight.check_devices(4, 6, cuda_count=lambda: 4)
    assert "has 4 CUDA device(s) visible" in str(err.value)
    assert "but 6 ranks per node (the script's first argument, " in str(err.value) and "Give 4 or fewer" in str(
        err.value
    )


def test_multi_node_refuses_a_loopback_master(monkeypatch):
    with pytest.raises(PhalanxError, match="--master_addr 127.0.0.1 is a loopback address, which the other 1 node"):
        preflight.preflight(0, 1, num_nodes=2, node_rank=0, master_addr="127.0.0.1", master_port=29500, timeout=1)
    # A host name that resolves to loopback only here (Debian's /etc/hosts lists the machine's own name as 127.0.1.1)
    # is said to be one: `--master_addr $(hostname)` on the master was refused as 'a loopback address'.
    real = preflight.socket.getaddrinfo

    def etc_hosts(host, *args):
        return real("127.0.1.1" if host == "master-node" else host, *args)

    monkeypatch.setattr(preflight.socket, "getaddrinfo", etc_hosts)
    with pytest.raises(PhalanxError) as err:
        preflight.preflight(0, 1, num_nodes=3, node_rank=0, master_addr="master-node", master_port=29500, timeout=1)
    assert "--master_addr master-node resolves to 127.0.1.1 on this machine" in str(err.value)
    assert "/etc/hosts" in str(err.value) and "which the other 2 node(s) cannot reach" in str(err.value)
    assert "master node's IP address" in str(err.value)


def test_interface_towards_loopback():
    assert preflight.interface_towards("127.0.0.1") == ("lo", "127.0.0.1")


def test_main_prints_the_interface_or_exits_2(capsys, listener):
    assert preflight.main(["--num_gpus_per_node", "0", "--nproc_per_node", "1", "--master_port", str(listener)]) == 2
    assert "already in use" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert preflight.main(["--num_gpus_per_node", "0", "--nproc_per_node", "1", "--master_port", str(port)]) == 0
    assert capsys.readouterr().out.strip() == "lo 127.0.0.1"


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--nproc_per_node", "0", "ranks per node (the script's first argument, PHALANX_NPROC_PER_NODE"),
        ("--nproc_per_node", "x", "ranks per node"),
        ("--num_nodes", "0", "the number of nodes (PHALANX_NUM_NODES"),
        ("--master_port", "70000", "the master port (PHALANX_MASTER_PORT"),
        ("--timeout", "-5", "the rendezvous timeout in seconds (PHALANX_RDZV_TIMEOUT"),
    ],
)
def test_a_value_the_script_was_given_when_it_ran_is_named_as_it_was_set(capsys, flag, value, named):
    """The script passes its first argument and PHALANX_* overrides here unchecked by `phalanx launcher`."""
    args = {"--num_gpus_per_node": "0", "--nproc_per_node": "1", "--master_port": "29500", flag: value}
    assert preflight.main([word for pair in args.items() for word in pair]) == 2
    err = capsys.readouterr().err
    assert named in err and f"is {value!r}; accepted:" in err and "Traceback" not in err
