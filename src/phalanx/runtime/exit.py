"""How a `phalanx` process ends once its command has returned: fast, and late enough that a launcher blames the right rank."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

# A launcher (torchrun, `--world_size`) polls its ranks about once a second and reports the first one that exited
# as the cause. A rank that failed has often failed because a peer died first (killed, out of memory): it leaves
# this much later, so that the launcher names the peer, not the ranks that lost it.
FAILED_RANK_EXIT_DELAY_S = 2.0


def exit_without_teardown(code: int, record_exit: Callable[[int], None]) -> NoReturn:
    """End the `phalanx` program once its command has returned, skipping the interpreter's teardown.

    Finalizing the modules torch, transformers and peft import takes 1.5-2 s per process (every rank, every run).
    Everything the command wrote is closed by now; what teardown would still do that matters is done here: wait
    for non-daemon threads (a checkpoint being written in the background), run the atexit handlers, flush.
    `record_exit(code)` runs last (launch.local's: a rank's record says it is done, so a preempted rank's
    checkpoint is committed)."""
    import atexit
    import os
    import threading
    import time

    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    if code not in (0, PREEMPTED_EXIT_CODE) and "RANK" in os.environ:
        time.sleep(FAILED_RANK_EXIT_DELAY_S)

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    record_exit(code)
    os._exit(code)
