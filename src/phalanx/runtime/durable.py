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


def check_can_create(folder: Path, subject: str) -> None:
    """Refuse now, naming `subject` (what the user gave, e.g. "output_dir = 'runs/a'"), a folder that cannot be
    created and written to, before anything is written: a file on its path, or a nearest existing folder that takes
    no new entry (no permission, a read-only or virtual file system). Tried with a temporary folder, removed at once,
    so a refusal leaves nothing behind and a success creates nothing."""
    import tempfile

    from phalanx.errors import ConfigError

    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise ConfigError(f"{subject}: {existing} is a file, not a folder; give a folder (it is created if missing)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".phalanx-write-check-", dir=existing))
    except OSError as exc:
        raise ConfigError(
            f"{subject}: cannot create or write into {existing} ({exc.strerror}); give a folder this user can "
            "write to (it is created if missing)"
        ) from None


def create_folder(folder: Path, subject: str) -> None:
    """`folder.mkdir(parents=True, exist_ok=True)`, with a failure reported as bad input naming `subject` and the
    path (check_can_create), not as a traceback."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:
        check_can_create(folder, subject)
        raise
