"""What ranks say of themselves in the rendezvous store: the phase each is in, and which one failed first."""

import socket

import pytest
import torch.distributed as dist

from phalanx.runtime.watch import describe_ranks, is_timeout, peer_that_failed, record_failure, set_phase


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process: its store is the one the ranks of a run share."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_failure_is_recorded_for_the_peers_and_a_timeout_is_not(one_rank_group):
    """A rank whose collective breaks reads whether another rank failed first, and then stands aside. A rank that
    timed out waiting for a peer that stopped taking part did not fail first: recording it would make that peer
    stand aside for it, and the launcher would name the rank that waited instead of the one that stopped."""
    set_phase(0, "training step 3")
    record_failure(0, RuntimeError("[gloo/transport/tcp/pair.cc:598] Timed out waiting 6000ms for recv operation"))
    record_failure(0, TimeoutError("store get"))
    assert peer_that_failed(world_size=2, rank=1) is None
    assert describe_ranks(1) == "rank 0: training step 3"

    record_failure(0, RuntimeError("injected fault in forward at step 3\nmore lines"))
    assert peer_that_failed(world_size=2, rank=1) == "rank 0 (RuntimeError: injected fault in forward at step 3)"
    assert peer_that_failed(world_size=1, rank=0) is None, "a rank's own failure is not a peer's"
    assert peer_that_failed(world_size=2, rank=1, after_own_timeout=True) == peer_that_failed(world_size=2, rank=1)


def test_a_rank_that_timed_out_does_not_stand_aside_for_a_peer_that_lost_its_connection(one_rank_group):
    """Two ranks each wait for the other (one left the loop early): the first to time out closes the connection, and
    the other records only that loss. The one that timed out must not then stand aside for it, as if that peer had
    failed first (a loaded machine decides which times out first: tests/runtime/test_faults.py saw it once)."""
    record_failure(0, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54478"))
    assert peer_that_failed(world_size=2, rank=1) == (
        "rank 0 (RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54478)"
    )
    assert peer_that_failed(world_size=2, rank=1, after_own_timeout=True) is None


def test_what_counts_as_a_timeout():
    assert is_timeout(TimeoutError()) and is_timeout(RuntimeError("Watchdog caught collective operation timeout"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:4817"))
