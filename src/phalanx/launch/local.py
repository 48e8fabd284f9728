"""Start N ranks on this machine through torch's own elastic launcher (what torchrun uses)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
import uuid
from typing import Optional, Sequence

from phalanx.errors import PhalanxError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(module_args: Sequence[str], nproc: int, master_port: Optional[int] = None, max_restarts: int = 0) -> int:
    """Run `python -m phalanx <module_args>` as `nproc` ranks; returns 0, or the preemption status when the ranks
    saved and stopped on a signal; raises PhalanxError naming the ranks that failed otherwise."""
    import signal

    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if master_port:
        from phalanx.launch.preflight import check_port_free

        check_port_free(master_port)  # c10d would join whatever listens there as a client, and wait forever
    port = master_port or free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"phalanx-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=max_restarts,
        monitor_interval=0.2,  # notice a dead rank quickly and stop the others
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # The elastic agent starts each rank in its own session, so a signal sent to this launcher's process group
    # never reaches them: pass SIGUSR1 (SLURM's usual warning) on; the ranks save a checkpoint and stop.
    signal.signal(signal.SIGUSR1, forward_to_children)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "phalanx", *module_args)
    except SignalException as exc:
        # SIGTERM/SIGINT: the agent has already passed SIGTERM to the ranks, which save before they exit.
        print(f"launcher received {exc.sigval.name}; the ranks were asked to stop and keep what they finished (rerun to resume)",
              file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        # A rank exits 75 only after the preemption checkpoint is committed (save ends in a barrier); the agent
        # then stops the ranks still tearing down, which is no failure.
        if PREEMPTED_EXIT_CODE in codes:
            return PREEMPTED_EXIT_CODE
        failed = ", ".join(f"rank {rank} ({describe_exit(f.exitcode)})" for rank, f in sorted(exc.failures.items()))
        raise PhalanxError(f"failed on {failed}; the other ranks were stopped. See the rank's message above.") from None
    return 0


def describe_exit(code: int) -> str:
    import signal

    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def child_pids(parent: int) -> list[int]:
    """Direct children of `parent`, read from /proc (Linux)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def forward_to_children(signum, frame) -> None:
    for pid in child_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
