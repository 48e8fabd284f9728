"""`python -m phalanx.launch.torchrun ARGS`: torchrun (torch.distributed.run, with its own command line) as the
scripts of `phalanx launcher` start it, ending the way `phalanx train --world_size N` ends.

torchrun alone exits 1, with a traceback, after a SIGTERM even when every rank saved its progress and exited 75,
so a requeue wrapper cannot tell a preemption from a crash; it also kills the ranks on SIGUSR1 and answers a
second Ctrl-C by waiting for the save. Here the agent runs in this process under launch.local's supervision:
status 75 when the ranks saved and stopped, 130 after a second Ctrl-C, 1 with the message when ranks failed, 2
when they found bad input, 0 when they finished; SIGUSR1 and Ctrl-C reach the ranks, and ranks stop when this process dies.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from phalanx.errors import PhalanxError


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torchrun

    from phalanx.launch.local import AGENT_SIGNALS, supervise_ranks

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))

    def start(scratch: Path) -> None:
        if args.log_dir is None:
            args.log_dir = str(scratch / "logs")  # torch's default, a new /tmp/torchelastic_* per run, stays forever
        if hasattr(args, "signals_to_handle"):  # torch 2.9 and later; an older agent takes Ctrl-C itself
            args.signals_to_handle = AGENT_SIGNALS
        torchrun.run(args)

    try:
        # The agent's log lines stay, as under torchrun: they say which rank failed and when the ranks restart.
        return supervise_ranks(start, torchrun.determine_local_world_size(args.nproc_per_node), quiet_agent=False)
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
