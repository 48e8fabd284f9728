"""One run per output: the first to start holds a lock on it until its process ends.

Two runs writing one output_dir (a job submitted twice, a rerun while the first still runs on another node) would
interleave checkpoints, rotate each other's folders away and resume from each other's state; two generation jobs
would append to each other's shards. The lock is an `flock` on a lock file (`<output_dir>/.phalanx.lock` for
training, `.<name>.lock` beside a generation output): the kernel drops it when the holding process exits, however it
exits (SIGKILL, OOM kill, requeue), so a crashed run never leaves an output locked. The file says who took it, for
the error the second run prints. On a shared file system flock holds across nodes where the file system supports it
(NFSv4, Lustre, GPFS); where it fails to lock at all the run says so and goes on unguarded.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from phalanx.errors import ConfigError

_held: dict[Path, int] = {}  # lock file -> open descriptor, kept until release_lock or the process ends


def training_lock(output_dir: Path) -> Path:
    return Path(output_dir).resolve() / ".phalanx.lock"


def output_file_lock(output: Path) -> Path:
    output = Path(output).resolve()
    return output.parent / f".{output.name}.lock"


def hold_lock(lock_file: Path, subject: str) -> None:
    """Take `lock_file` (its folder created if missing) for this process, or raise ConfigError naming the run that
    holds it. `subject` is what the user gave, for the message (e.g. '--output_dir runs/a')."""
    lock_file = Path(lock_file).resolve()
    if lock_file in _held:
        return
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # a file in the way, or no permission: the output checks that follow say which, by name
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(_in_use(lock_file, subject)) from None
    except OSError as exc:
        os.close(fd)
        print(f"⚠️  {subject}: cannot lock it against a second run ({exc.strerror}); going on", file=sys.stderr)
        return
    os.ftruncate(fd, 0)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    by_name = sys.argv[0].endswith(("/phalanx", "phalanx/__main__.py")) or sys.argv[0] == "phalanx"
    command = " ".join(["phalanx", *sys.argv[1:]] if by_name else sys.argv)
    os.write(fd, (json.dumps({**record, "command": command}) + "\n").encode())
    _held[lock_file] = fd


def hold_on_main_rank(lock_file: Path, subject: str, is_main: bool) -> None:
    """Rank 0 takes the lock for the job; when another run holds it, every rank raises the same error, so none is
    left waiting in a collective for a rank 0 that has gone. Call it where every rank is (after the process group
    is joined; alone, it is hold_lock)."""
    from phalanx.runtime.dist import broadcast_object

    refusal: Optional[str] = None
    if is_main:
        try:
            hold_lock(lock_file, subject)
        except ConfigError as exc:
            refusal = str(exc)
    refusal = broadcast_object(refusal)
    if refusal:
        raise ConfigError(refusal)


@contextmanager
def output_held(lock_file: Path, subject: str, is_main: bool) -> Iterator[None]:
    """hold_on_main_rank for the duration of a `with` block; released after it unless this process held the lock
    before (a caller's own lock stays the caller's)."""
    held_before = Path(lock_file).resolve() in _held
    hold_on_main_rank(lock_file, subject, is_main)
    try:
        yield
    finally:
        if not held_before:
            release_lock(lock_file)


def release_lock(lock_file: Path) -> None:
    """Let the next run have it (a no-op when this process does not hold it). The file stays: removing it could let
    two runs lock two different files of one name."""
    fd = _held.pop(Path(lock_file).resolve(), None)
    if fd is not None:
        os.close(fd)


def check_free(lock_file: Path, subject: str) -> None:
    """Refuse now, before ranks start, when another run holds `lock_file`; takes nothing (a rank takes it)."""
    lock_file = Path(lock_file).resolve()
    if lock_file in _held or not lock_file.is_file():
        return
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return  # unreadable (another user's run): hold_lock, or the output checks after it, say what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(_in_use(lock_file, subject)) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _in_use(lock_file: Path, subject: str) -> str:
    try:
        record = json.loads(lock_file.read_text(encoding="utf-8"))
        holder = f"pid {record['pid']} on {record['host']}, started {record['started']}: {record['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        holder = "it did not record who it is"
    return f"{subject} is in use by another run ({holder}). Wait for it to end, stop it, or choose another output."
