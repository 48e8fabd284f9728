"""Checks a node runs before torchrun starts, so a broken set-up ends in a clear message instead of a wait.

torch's launcher turns the common mistakes into long silences: a taken port makes a c10d
rendezvous join as a client of whatever holds the port, an unreachable master makes the
other nodes retry for ten minutes, a missing GPU shows up as a CUDA error on one rank.
The launcher and SLURM scripts run `python -m phalanx.launch.preflight` first; it exits 2
with a message naming the problem and what to change, within `--timeout` seconds.

On success it prints one line for the script: the network interface and local address
this node uses to reach the master ("-" for the interface when it cannot be told).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from phalanx.errors import PhalanxError

PREFIX = "phalanx preflight"


def say(message: str) -> None:
    print(f"{PREFIX}: {message}", file=sys.stderr, flush=True)


# --- devices -------------------------------------------------------------------------------


def visible_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# How the scripts' rank count is given when they run; the written --nproc_per_node is only its default.
RANKS_PER_NODE = "ranks per node (the script's first argument, PHALANX_NPROC_PER_NODE or --nproc_per_node)"


def check_devices(num_gpus_per_node: int, nproc_per_node: int, cuda_count: Optional[Callable[[], int]] = None) -> None:
    """One rank per GPU on GPU nodes; no more CPU ranks than cores on CPU nodes.

    `nproc_per_node` is what the script runs, which its first argument or PHALANX_NPROC_PER_NODE may make fewer
    than the GPUs it was written for: seed 000's `launch_distributed.sh 2` on a 4-GPU machine trains on GPUs 0 and 1
    (torchrun and DeepSpeed's launcher take GPUs 0..N-1). It was refused as 'GPU nodes run one rank per GPU', as was
    the `bash run_training.sh 2` docs/launch.md shows. Too many are named as they were given."""
    asked = f"{nproc_per_node} {RANKS_PER_NODE}"
    if num_gpus_per_node > 0:
        count = (cuda_count or visible_cuda_devices)()
        visible = (
            f"this node ({socket.gethostname()}) has {count} CUDA device(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
        if nproc_per_node == num_gpus_per_node and num_gpus_per_node > count:
            raise PhalanxError(
                f"{visible}, but the launcher asks for {num_gpus_per_node} per node. Use --num_gpus_per_node {count}"
                + (" or fewer" if count else "")
                + ", or --num_gpus_per_node 0 --nproc_per_node N to run N CPU ranks over gloo."
            )
        if nproc_per_node > count:
            raise PhalanxError(f"{visible}, but {asked} ask for one each. Give {count} or fewer.")
    else:
        cores = os.cpu_count() or 1
        if nproc_per_node > cores:
            raise PhalanxError(
                f"{asked} on this node ({socket.gethostname()}), which has {cores} core(s): each CPU (gloo) rank "
                f"needs one. Give {cores} or fewer."
            )


# --- addresses and ports ---------------------------------------------------------------------


def resolve(host: str) -> str:
    """The IPv4 address `host` names; PhalanxError when it names none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise PhalanxError(
            f"cannot resolve the master address {host!r} ({exc.strerror}). Give --master_addr as an IP address "
            "or a host name every node can resolve."
        ) from None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except (PhalanxError, ValueError):
        return False


def refuse_loopback_master(host: str, num_nodes: int) -> None:
    """Several nodes cannot meet at a loopback master address. A host name is named with what it resolves to here:
    Debian and Ubuntu list a machine's own name as 127.0.1.1 in /etc/hosts, so `--master_addr $(hostname)` on the
    master was refused as 'a loopback address', which the name is not anywhere else."""
    if num_nodes < 2 or not is_loopback(host):
        return
    try:
        ipaddress.ip_address("127.0.0.1" if host.lower() == "localhost" else host)
        what = f"--master_addr {host} is a loopback address"
    except ValueError:
        what = (
            f"--master_addr {host} resolves to {resolve(host)} on this machine ({socket.gethostname()}), a loopback "
            "address (/etc/hosts lists it so; Debian and Ubuntu list a machine's own name that way)"
        )
    raise PhalanxError(
        f"{what}, which the other {num_nodes - 1} node(s) cannot reach. Give the master node's IP address on the "
        "network the nodes share (`hostname -I` on the master lists its addresses)."
    )


def check_master_is_here(host: str) -> None:
    """Node 0 hosts the rendezvous, so the master address must be one of its own."""
    addr = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise PhalanxError(
                    f"this is node_rank 0, which hosts the rendezvous, but the master address {host} ({addr}) is not an "
                    f"address of this machine ({socket.gethostname()}). Start node_rank 0 on the master node, or "
                    "give --master_addr an address of this machine that the other nodes can reach."
                ) from None
            raise


def port_holder(port: int) -> Optional[str]:
    """'pid 123: python -m ...' for the local process listening on `port`, when Linux lets us see it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(cols[9])
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {proc.name}: {cmd[:120]}"
        except OSError:
            continue
    return None


def check_port_free(port: int) -> None:
    """The rendezvous store listens on `port` on every interface; something else already listening there wins."""
    families = [(socket.AF_INET, ("0.0.0.0", port))]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, ("::", port)))
    for family, address in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                if exc.errno != errno.EADDRINUSE:
                    raise
                holder = port_holder(port)
                raise PhalanxError(
                    f"port {port} is already in use on this machine ({socket.gethostname()})"
                    + (f" by {holder}" if holder else "")
                    + ". Another training job or rendezvous may still be running. Choose another --master_port "
                    "(every node must use the same one), or stop the process that holds it."
                ) from None


def wait_for_master(host: str, port: int, timeout: float, progress_every: float = 15.0) -> None:
    """Return once the master accepts TCP connections on `port`; PhalanxError naming the cause after `timeout` s."""
    addr = resolve(host)
    start = time.monotonic()
    deadline = start + timeout
    next_note = start + progress_every
    reason = "no attempt finished"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, remaining))):
                return
        except ConnectionRefusedError:
            reason = f"the connection was refused: nothing listens on {addr}:{port} yet"
        except socket.timeout:
            # A short last attempt can time out before the kernel gives a clearer answer; keep that answer.
            if reason == "no attempt finished" or reason.startswith("no answer"):
                reason = "no answer: packets to it are dropped (a firewall?) or the address belongs to no machine"
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                reason = f"{exc.strerror}: this node has no route to it"
        now = time.monotonic()
        if now >= next_note:
            say(f"still waiting for the master node at {host}:{port} ({reason}); {now - start:.0f}/{timeout:.0f} s")
            next_note = now + progress_every
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise PhalanxError(
        f"cannot reach the master node at {host}:{port} after {timeout:.0f} s: {reason}. Check that node_rank 0 runs "
        f"with the same --master_addr and --master_port, that {host} is the master's address on a network this node "
        f"shares (ip route get {addr}), and that no firewall blocks port {port}. PHALANX_RDZV_TIMEOUT sets how long "
        "to wait."
    )


def interface_towards(host: str) -> tuple[str, str]:
    """(interface, local address) this machine uses to reach `host`; interface '-' when it cannot be told."""
    addr = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((addr, 9))  # UDP connect only picks a route; nothing is sent
            local = sock.getsockname()[0]
        except OSError:
            return "-", addr
    return interface_with_address(local) or "-", local


def interface_with_address(address: str) -> Optional[str]:
    if sys.platform != "linux":
        return None
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


# --- the whole check -----------------------------------------------------------------------------


def preflight(
    num_gpus_per_node: int,
    nproc_per_node: int,
    num_nodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    timeout: float,
) -> tuple[str, str]:
    check_devices(num_gpus_per_node, nproc_per_node)
    if not 0 <= node_rank < num_nodes:
        raise PhalanxError(f"--node_rank {node_rank} is outside 0..{num_nodes - 1} for --num_nodes {num_nodes}")
    refuse_loopback_master(master_addr, num_nodes)
    if node_rank == 0:
        check_master_is_here(master_addr)
        check_port_free(master_port)
    else:
        wait_for_master(master_addr, master_port, timeout)
    return interface_towards(master_addr)


# The scripts pass these values as the user can change them when the script runs (its first argument, the
# PHALANX_* variables), past the checks `phalanx launcher` made when it wrote them: a bad one is named as it was
# set, not as preflight's flag (a 0 ranks per node otherwise reached torch's launcher as a bare AssertionError).
SCRIPT_VALUES = {
    "nproc_per_node": (RANKS_PER_NODE, 1),
    "num_nodes": ("the number of nodes (PHALANX_NUM_NODES or --num_nodes)", 1),
    "node_rank": ("the node rank (PHALANX_NODE_RANK or --node_rank)", 0),
    "master_port": ("the master port (PHALANX_MASTER_PORT or --master_port)", 1),
    "timeout": ("the rendezvous timeout in seconds (PHALANX_RDZV_TIMEOUT or --rdzv_timeout)", 1),
}


def script_value(name: str, text: str) -> int:
    """The whole number `text` gives for SCRIPT_VALUES[name]; PhalanxError naming how it is set otherwise."""
    what, least = SCRIPT_VALUES[name]
    highest = 65535 if name == "master_port" else None
    value = int(text) if text.strip().lstrip("-").isdigit() else None
    if value is None or value < least or (highest is not None and value > highest):
        accepted = f"{least}..{highest}" if highest is not None else f"a whole number, at least {least}"
        raise PhalanxError(f"{what} is {text!r}; accepted: {accepted}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    # allow_abbrev=False: the scripts phalanx writes spell every flag out; a prefix is a typo, as in CommandParser
    parser = argparse.ArgumentParser(
        prog="python -m phalanx.launch.preflight", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--num_gpus_per_node", type=int, required=True)
    parser.add_argument("--nproc_per_node", required=True)
    parser.add_argument("--num_nodes", default="1")
    parser.add_argument("--node_rank", default="0")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", required=True)
    parser.add_argument("--timeout", default="600")
    args = parser.parse_args(argv)
    try:
        values = {name: script_value(name, getattr(args, name)) for name in SCRIPT_VALUES}
        ifname, local = preflight(
            args.num_gpus_per_node,
            values["nproc_per_node"],
            values["num_nodes"],
            values["node_rank"],
            args.master_addr,
            values["master_port"],
            values["timeout"],
        )
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(ifname, local)
    return 0


if __name__ == "__main__":
    sys.exit(main())
