"""The preemption flag's cross-rank mark (generation ranks meet in no collective between batches)."""

import os
import signal

import pytest
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


def test_a_second_ctrl_c_after_the_stop_was_committed_keeps_its_status(monkeypatch, capfd):
    """A second Ctrl-C ends the process at once: with 130 and "without saving" while the save is still to come, with
    the saved run's 75 and no such line once it is committed (the rank is only tearing down)."""
    import signal

    import phalanx.runtime.exit as exit_module
    from phalanx.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, PreemptionFlag

    def exit_at_once(code):
        raise SystemExit(code)

    monkeypatch.setattr(exit_module, "exit_at_once", exit_at_once)
    monkeypatch.setenv("RANK", "0")
    for committed, code in ((False, INTERRUPTED_EXIT_CODE), (True, PREEMPTED_EXIT_CODE)):
        flag = PreemptionFlag()
        flag._handle(signal.SIGINT, None)
        assert flag.requested and "Ctrl-C: finishing this step" in capfd.readouterr().err
        flag.committed = committed
        with pytest.raises(SystemExit) as stopped:
            flag._handle(signal.SIGINT, None)
        assert stopped.value.code == code
        assert ("without saving" in capfd.readouterr().err) is not committed
