"""The preemption flag's cross-rank mark (generation ranks meet in no collective between batches)."""

import os
import signal

import torch.distributed as dist

from phalanx.runtime.signals import PreemptionFlag


def test_a_signalled_rank_marks_the_store_and_the_others_see_it():
    signalled, other = PreemptionFlag(), PreemptionFlag()
    assert not signalled.requested_anywhere()  # no process group: this process's flag only
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not other.requested_anywhere()
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        signalled.install()
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        assert signalled.requested and signalled.requested_anywhere()
        assert other.requested_anywhere() and not other.requested and other.signal_name == "SIGUSR1"
    finally:
        dist.destroy_process_group()
