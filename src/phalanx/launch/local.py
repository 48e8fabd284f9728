"""Start N ranks on this machine through torch's own elastic launcher (what torchrun uses)."""

from __future__ import annotations

import socket
import sys
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
    # SIGUSR1 is meant for the ranks (they save and stop); its default action would kill this launcher first.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "phalanx", *module_args)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if codes == {PREEMPTED_EXIT_CODE}:
            return PREEMPTED_EXIT_CODE
        failed = ", ".join(f"rank {rank} ({describe_exit(f.exitcode)})" for rank, f in sorted(exc.failures.items()))
        raise PhalanxError(f"failed on {failed}; the other ranks were stopped. See the rank's message above.") from None
    return 0


def describe_exit(code: int) -> str:
    import signal

    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
