"""Atomic checkpoint folders: stage, fsync, rename, then write the commit marker last.

A folder counts as a checkpoint only when its marker exists, so a crash at any moment
leaves either the previous committed checkpoint or the new one, never a half-written one
that resume would trust.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from phalanx.checkpoint.layout import MARKER, STEP_DIR, retired_dir, staging_dir
from phalanx.runtime.durable import fsync_path, fsync_tree, write_json_atomic


def fresh_staging_dir(final: Path) -> Path:
    """An empty staging folder for `final` (leftovers of a crashed save are discarded)."""
    staging = staging_dir(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(staging: Path, final: Path, meta: dict) -> None:
    """Move a fully written staging folder into place and mark it committed (one writer only)."""
    fsync_tree(staging)
    recover_replaced(final)  # an earlier replacement of `final` cut short: its committed copy must not be deleted
    retired = retired_dir(final)
    if retired.exists():
        shutil.rmtree(retired)
    if final.exists():
        os.replace(final, retired)  # e.g. checkpoint-best being superseded
    os.replace(staging, final)
    write_json_atomic(final / MARKER, meta)
    fsync_path(final.parent)
    if retired.exists():
        shutil.rmtree(retired)


def committed_copy(final: Path) -> Path:
    """The folder to read for `final`: itself, or, when a crash cut short its replacement (commit() of a folder that
    already existed, e.g. checkpoint-last), the committed copy it was replacing, still waiting beside it.
    Reading only: every rank may call it."""
    retired = retired_dir(final)
    return retired if not is_committed(final) and is_committed(retired) else final


def recover_replaced(final: Path) -> bool:
    """Put back the committed copy that a cut-short replacement of `final` left beside it (see committed_copy);
    the replacing copy never got its marker, so it is discarded. The single writer calls this. Returns True when
    something was put back."""
    retired = retired_dir(final)
    if committed_copy(final) == final:
        return False
    if final.exists():
        shutil.rmtree(final)
    os.replace(retired, final)
    fsync_path(final.parent)
    return True


def uncommit(path: Path) -> None:
    """Remove a checkpoint's marker, before its files are deleted: a crash mid-delete must not leave a marked,
    half-deleted checkpoint that a resume would trust. Nothing happens to a folder without one."""
    (path / MARKER).unlink(missing_ok=True)
    fsync_path(path)


def is_committed(path: Path) -> bool:
    return (path / MARKER).is_file()


def why_not_committed(path: Path) -> str:
    """Why `path` is not a committed checkpoint, in the words an error needs: missing, a file, or a folder without
    the marker (the commit record every phalanx save writes last)."""
    if not path.exists():
        return "no such folder"
    if not path.is_dir():
        return "a file, not a checkpoint folder"
    return f"no {MARKER} in it: not a phalanx checkpoint, or a save that crashed before it committed"


def step_folders(output_dir: Path) -> list[tuple[int, Path]]:
    """Every checkpoint-{step} folder, committed or not (a save or a delete cut short), oldest first."""
    if not output_dir.is_dir():
        return []
    matches = ((STEP_DIR.fullmatch(child.name), child) for child in output_dir.iterdir())
    return sorted((int(match.group(1)), child) for match, child in matches if match and child.is_dir())


def committed_step_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint-{step} folders, oldest first."""
    return [(step, path) for step, path in step_folders(output_dir) if is_committed(path)]


def apply_retention(output_dir: Path, limit: int | None, keep: set[Path]) -> list[Path]:
    """Delete the oldest committed checkpoint-{step} folders beyond `limit`, never one in `keep`."""
    if limit is None:
        return []
    folders = step_folders(output_dir)
    committed = [(step, path) for step, path in folders if is_committed(path)]
    checkpoints = [path for _, path in committed]
    removable = [p for p in checkpoints[: max(len(checkpoints) - limit, 0)] if p not in keep]
    for path in removable:
        uncommit(path)
        shutil.rmtree(path)
    # What such a crash left (an unmarked, half-deleted checkpoint-{step}), or a commit cut before its marker, older
    # than the newest committed checkpoint: never read again, and never saved again under that name to replace it,
    # so without this it would hold its share of the disk for good.
    newest = committed[-1][0] if committed else None
    for step, path in folders:
        if newest is not None and step < newest and path not in keep and (step, path) not in committed:
            shutil.rmtree(path)
    return removable
