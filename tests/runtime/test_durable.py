"""Durable files and output folders: a folder that cannot be made is refused by name before anything is written."""

from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.runtime.durable import check_can_create, create_folder


def test_a_folder_that_can_be_made_passes_and_nothing_is_left_behind(tmp_path: Path):
    check_can_create(tmp_path / "a" / "b", "--output a/b/x")
    assert list(tmp_path.iterdir()) == []  # the trial folder is gone; the folder itself is not made
    create_folder(tmp_path / "a" / "b", "--output a/b/x")
    assert (tmp_path / "a" / "b").is_dir()


def test_a_file_on_the_path_is_named(tmp_path: Path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    for folder in (blocker, blocker / "sub"):
        with pytest.raises(ConfigError, match=f"^--output x: {blocker} is a file, not a folder; give a folder"):
            create_folder(folder, "--output x")
    assert blocker.read_text() == "keep me"


def test_a_folder_that_takes_no_new_entry_is_named_with_the_reason():
    # /proc is a virtual file system: no user, root included, can make a folder in it
    with pytest.raises(ConfigError, match=r"^output_dir = 'o': cannot create or write into /proc \(.+\); give a"):
        create_folder(Path("/proc/nope/out"), "output_dir = 'o'")
