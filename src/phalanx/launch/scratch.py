"""The scratch folder a launcher keeps while its ranks run (their error files, their exit records, rank 0's
result), and the removal of those that killed launchers left behind.

A launcher removes its folder when it ends; a SIGKILL (or the out-of-memory killer) gives it no chance. The
folder's name carries the launcher's pid and host name, so the next launch on this machine removes each folder
whose launcher is gone, and only those: a folder of another user, another host (a /tmp that containers share)
or a live process is left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from phalanx.runtime.durable import pid_alive

PREFIX = "phalanx-launch-"
# phalanx-launch-<pid>@<host>-<mkdtemp's 8 random characters>
_NAME = re.compile(rf"^{PREFIX}(\d+)@(.*)-[a-z0-9_]{{8}}$")


@contextlib.contextmanager
def launcher_scratch() -> Iterator[Path]:
    remove_abandoned_scratch()
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}@{_host()}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_abandoned_scratch(root: Path | None = None) -> list[Path]:
    """Remove this user's scratch folders on this host whose launcher process no longer exists; returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for folder in root.glob(f"{PREFIX}*@*"):
        match = _NAME.match(folder.name)
        if not match or match.group(2) != _host():
            continue
        try:
            if folder.stat().st_uid != os.getuid() or pid_alive(int(match.group(1))):
                continue
        except OSError:
            continue  # removed meanwhile
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())
