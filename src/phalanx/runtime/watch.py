"""What each rank is doing, kept in the rendezvous store so a failure report can name the rank that stopped.

Each rank records a short phase ("step 12", "saving checkpoint-10", "finishing") in the
store the ranks share. When a collective fails or times out, the rank that noticed reads
every rank's last phase: the one that differs is the one that stopped taking part.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_KEY = "phalanx/phase/{}"


def set_phase(rank: int, phase: str) -> None:
    if dist.is_initialized():
        c10d._get_default_store().set(_KEY.format(rank), phase)


FAILED = "failed: "


def one_line(exc: BaseException, limit: int = 160) -> str:
    """`Type: first line of the message`, cut to `limit` characters: what a rank's failure is called in a phase."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record_failure(rank: int, exc: BaseException) -> None:
    """Say in the store, before this rank tears down (which is what the others' collectives then fail on), that it
    failed and with what: a peer whose step breaks because this rank left reads it (peer_that_failed) and stands
    aside, so the launcher names this rank. Not for a timeout: a rank that waited in a collective for a peer that
    stopped taking part is not its cause (its message names the peer by phase). Best effort: the store may be gone
    too."""
    if is_timeout(exc):
        return
    try:
        set_phase(rank, FAILED + one_line(exc))
    except Exception:  # noqa: BLE001 - the store's host died: the launcher still names the ranks by exit
        pass


def is_timeout(exc: BaseException) -> bool:
    """A collective or store operation that gave up waiting (gloo: "Timed out waiting ...", NCCL's watchdog:
    "collective operation timeout", the store: DistStoreError ... timeout)."""
    return isinstance(exc, TimeoutError) or any(word in str(exc).lower() for word in ("timed out", "timeout"))


def is_lost_connection(failure: str) -> bool:
    """A recorded failure that says only that the rank's connection to a peer broke (gloo: "Connection closed by
    peer"): what a rank sees when the peer gives up first, since a gloo send or recv that times out closes its pair."""
    return any(words in failure.lower() for words in ("connection closed", "connection reset", "broken pipe"))


def peer_that_failed(world_size: int, rank: int, *, after_own_timeout: bool = False) -> str | None:
    """'rank 1 (RuntimeError: ...)' for the first other rank that recorded a failure (record_failure), else None.

    `after_own_timeout`: this rank's collective timed out, so a peer that recorded only a lost connection lost it
    to this rank giving up (each was waiting for the other: a peer that stopped taking part), and is no cause to
    stand aside for. Which of two waiting ranks times out first is a race a loaded machine decides."""
    if not dist.is_initialized():
        return None
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        for other in range(world_size):
            key = _KEY.format(other)
            if other != rank and store.check([key]):
                phase = store.get(key).decode()
                failure = phase[len(FAILED) :]
                if phase.startswith(FAILED) and not (after_own_timeout and is_lost_connection(failure)):
                    return f"rank {other} ({failure})"
    except Exception:  # noqa: BLE001 - the store's host died with its rank: nothing to tell
        return None
    return None


def describe_ranks(world_size: int) -> str:
    """One line per rank with its last recorded phase (best effort: the store may be gone too)."""
    if not dist.is_initialized():
        return ""
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        parts = []
        for r in range(world_size):
            key = _KEY.format(r)
            phase = store.get(key).decode() if store.check([key]) else "not started"
            parts.append(f"rank {r}: {phase}")
        return "; ".join(parts)
    except Exception as exc:  # the store's host may have died with its rank
        return f"(ranks' phases unavailable: {exc})"


def set_collective_timeout(minutes: float) -> None:
    """Switch from the generous start-up timeout to the training one (a missing rank is noticed sooner)."""
    if dist.is_initialized():
        c10d._set_pg_timeout(timedelta(minutes=minutes), None)
