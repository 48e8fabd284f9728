"""Python's cyclic garbage collector while a phalanx process starts.

A rank imports torch, transformers and peft: about 480k objects that live as long as the process. Each full
collection walks all of them, and the collector runs seven while they are being made: about 1.2 s of a rank's
6 s of imports on one CPU core. The program (cli.main, never a library caller) defers full collections from its
first line; once a command has imported what it runs with, `startup_done` freezes what exists out of the
collector's reach and restores the thresholds, so later full collections walk only what the run makes (the one
before leaving the process group, runtime.dist.shutdown, drops from 0.3 s to milliseconds). Young collections never
stop, so cyclic garbage made while starting is still freed.
"""

from __future__ import annotations

import gc

_deferred_from: tuple[int, int, int] | None = None  # the thresholds to restore, while full collections wait


def defer_full_collections() -> None:
    global _deferred_from
    if _deferred_from is None:
        _deferred_from = gc.get_threshold()
        young, middle, _ = _deferred_from
        gc.set_threshold(young, middle, 1_000_000)  # a full collection after a million middle ones: none


def startup_done() -> None:
    """The command has imported its libraries: freeze them out of the collector and collect as usual again. Call it
    before making objects whose cycles must be collected later (a DDP reducer holds the process group until its
    cycle is freed). A no-op in a process whose program did not defer (a library caller, the tests)."""
    global _deferred_from
    if _deferred_from is not None:
        gc.freeze()
        gc.set_threshold(*_deferred_from)
        _deferred_from = None
