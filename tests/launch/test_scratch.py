"""The launcher's scratch folder (launch/scratch.py): the folder of a launcher that was killed is removed by the next
launch on this machine, and no other."""

import os
import subprocess
import sys
import tempfile

from helpers import phalanx_env
from phalanx.launch.scratch import launcher_scratch

HOLD_A_FOLDER = """
import time
from phalanx.launch.scratch import launcher_scratch
with launcher_scratch() as folder:
    print(folder, flush=True)
    time.sleep(600)
"""


def start_holder(tmp_path) -> tuple[subprocess.Popen, str]:
    """A launcher stand-in: a real process that made its scratch folder and keeps it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_FOLDER],
        env=phalanx_env({"TMPDIR": str(tmp_path)}),
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_a_killed_launchers_folder_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_folder = start_holder(tmp_path)
    alive, alive_folder = start_holder(tmp_path)
    try:
        killed.kill()  # SIGKILL, as the out-of-memory killer would: no `finally` runs
        killed.wait()
        assert os.path.isdir(killed_folder), "left behind"
        # Another host's (a /tmp that containers share) and an older phalanx's: nothing says whose they are.
        foreign = tmp_path / f"phalanx-launch-{killed.pid}@another-host-abcd1234"
        unnamed = tmp_path / "phalanx-launch-abcd1234"
        foreign.mkdir()
        unnamed.mkdir()
        with launcher_scratch() as mine:
            assert mine.is_dir() and mine.name.startswith(f"phalanx-launch-{os.getpid()}@")
            assert not os.path.exists(killed_folder)
            assert os.path.isdir(alive_folder) and foreign.is_dir() and unnamed.is_dir()
        assert not mine.exists(), "a launcher that ends removes its own"
    finally:
        alive.kill()
        alive.wait()
