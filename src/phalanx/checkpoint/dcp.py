"""Sharded training state through torch.distributed.checkpoint (DCP), written synchronously or in the background.

Each rank writes its own shards; DCP records every tensor's global shape and each piece's offset,
so a checkpoint saved on W ranks loads on any other number of ranks (it reads the pieces a rank
now owns, whoever wrote them). A folder is not a checkpoint by itself: `checkpoint.io` writes it
inside the staging folder and commits the whole checkpoint once every rank's part is on disk.

`save_state(..., asynchronous=True)` copies the state to CPU memory now (the only part the training
loop waits for) and writes it from a background thread; it returns the write's Future. Background
writes use their own gloo process group: DCP's collectives there never interleave with the
training's on the default group (and NCCL runs need a CPU group for them anyway).

Fault injection for tests: PHALANX_FAULT="killsave@step=N[,rank=R]" SIGKILLs a rank right after it
wrote its shards of checkpoint-N (before the metadata and the commit), wherever the write runs.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from phalanx.checkpoint.layout import STAGING_STEP_DIR
from phalanx.runtime.faults import kill_self, planned_fault

_background_group: tuple = (None, None)  # (the default group it was made in, the gloo group)


def background_group() -> Optional[dist.ProcessGroup]:
    """A gloo group for background writes, made once per process group (every rank calls this at the same save)."""
    global _background_group
    if not dist.is_initialized():
        return None
    world, group = _background_group
    if world is not dist.group.WORLD:
        _background_group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _background_group[1]


class _Writer(FileSystemWriter):
    """DCP's file writer (fsyncs every file it writes), with the killsave fault hook."""

    def __init__(self, path: Path, kill_after_write: bool):
        super().__init__(str(path), sync_files=True)
        self.kill_after_write = kill_after_write

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if self.kill_after_write:
            written.wait()
            kill_self()
        return written


def _kill_due(folder: Path) -> bool:
    fault = planned_fault()
    if fault is None or fault.kind != "killsave":
        return False
    match = next((m for m in map(STAGING_STEP_DIR.fullmatch, (p.name for p in (folder, *folder.parents))) if m), None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return match is not None and fault.due("killsave", int(match.group(1)), rank)


def save_state(state: dict, folder: Path, asynchronous: bool = False) -> Optional[Future]:
    """Write `state` (tensors may be DTensor shards) into `folder`; every rank calls this.

    Synchronous: returns None once every rank's shards and the metadata are written. Asynchronous: returns
    the background write's Future; its result is ready on rank 0 only after every rank has written."""
    import torch.distributed.checkpoint as dcp

    writer = _Writer(folder, kill_after_write=_kill_due(folder))
    if not asynchronous:
        dcp.save(state, storage_writer=writer)
        return None
    return dcp.async_save(state, storage_writer=writer, process_group=background_group())


def load_state(state: dict, folder: Path) -> None:
    """Fill `state` in place from `folder`, each rank reading the pieces of the tensors it now holds."""
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.safe_load import dcp_reader

    dcp.load(state, storage_reader=dcp_reader(folder))
