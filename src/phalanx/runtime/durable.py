"""Durable files: fsync what was written, replace files atomically.

The one home of these helpers for every package that writes outputs a crash must not leave half-written
(checkpoints, the tokenized-data cache, the embedded model preset, generation manifests); none of them
needs the checkpoint package to use them.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
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


def remove_dead_writers(parent: Path, prefix: str) -> list[Path]:
    """Remove the files and folders `parent/<prefix><pid>` whose process is gone: what a writer killed with SIGKILL
    left (a temporary file, a staging folder), where no rerun looks since each writer names its own. A live process's
    entry stays. Returns what was removed."""
    removed = []
    for entry in parent.glob(f"{prefix}*"):
        pid = entry.name[len(prefix) :]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def write_bytes_atomic(path: Path, data: bytes, executable: bool = False) -> None:
    """Write `data` to `path` through a fsynced temporary file and one rename, then fsync the folder: readers see the
    old content or the new, and after a power loss the file holds one of them, never nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if executable:
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write `payload` to `path` as indented JSON, atomically (write_bytes_atomic)."""
    write_bytes_atomic(path, json.dumps(payload, indent=2, default=str).encode("utf-8"))


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
            f"{subject}: cannot create or write into {existing.resolve()} ({exc.strerror}); give a folder this user can "
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


def write_generated_files(files: dict[Path, str], overwrite: bool, subject: str, executable: bool = False) -> list[str]:
    """Write the files a command generates for the user (a launch script and its .bat, a DeepSpeed or FSDP JSON),
    each byte for byte (a .bat keeps its CRLF line ends) through a temporary file and one rename. Returns, per file,
    "wrote", or "unchanged" when it already holds exactly this text (rerunning the same command is fine).

    An existing file with other content may be the user's (edited by hand, or written with other flags): unless
    `overwrite`, it is refused naming `subject` (what the user gave, e.g. "--output scripts/run.sh"), and every file
    is checked before any is written, so nothing already written is lost or left half-replaced. The checks create
    nothing either (check_can_create, not create_folder): a refused command leaves no new folder behind."""

    from phalanx.errors import ConfigError

    encoded = {Path(path): text.encode("utf-8") for path, text in files.items()}
    unchanged = set()
    for path, data in encoded.items():
        check_can_create(path.parent, subject)
        if path.is_dir():
            raise ConfigError(f"{subject}: {path} is a folder; give the file to write")
        if path.is_file():
            if path.read_bytes() == data:
                unchanged.add(path)
            elif not overwrite:
                raise ConfigError(
                    f"{subject}: {path} already exists and holds something else (edited by hand, or written with "
                    "other flags); it is left as it is. Pass --overwrite to replace it, or give another --output."
                )
    for path, data in encoded.items():
        if path in unchanged:
            continue
        create_folder(path.parent, subject)
        write_bytes_atomic(path, data, executable)
    return ["unchanged" if path in unchanged else "wrote" for path in encoded]
