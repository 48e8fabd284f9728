"""Durable files: fsync what was written, replace files atomically.

The one home of these helpers for every package that writes outputs a crash must not leave half-written
(checkpoints, the tokenized-data cache, the embedded model preset, generation manifests); none of them
needs the checkpoint package to use them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync one file or folder (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (and `root` itself), before it is renamed into place."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write `payload` to `path` through a fsynced temporary file and one rename: readers see the old or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
