"""Atomic commits and retention: only marked folders count; retention never deletes what it must keep."""

import os
from pathlib import Path

from phalanx.checkpoint.commit import (
    MARKER,
    apply_retention,
    commit,
    committed_step_checkpoints,
    fresh_staging_dir,
    is_committed,
)


def make_checkpoint(out: Path, name: str) -> Path:
    final = out / name
    staging = fresh_staging_dir(final)
    (staging / "weights.bin").write_bytes(b"x" * 10)
    commit(staging, final, {"name": name})
    return final


def test_commit_moves_staging_and_writes_marker_last(tmp_path: Path):
    final = make_checkpoint(tmp_path, "checkpoint-5")
    assert is_committed(final) and (final / "weights.bin").read_bytes() == b"x" * 10
    assert not (tmp_path / ".checkpoint-5.staging").exists()


def test_uncommitted_folders_are_ignored(tmp_path: Path):
    make_checkpoint(tmp_path, "checkpoint-5")
    (tmp_path / "checkpoint-10").mkdir()  # a save that crashed before its marker
    assert [step for step, _ in committed_step_checkpoints(tmp_path)] == [5]


def test_replacing_a_committed_folder(tmp_path: Path):
    make_checkpoint(tmp_path, "checkpoint-best")
    staging = fresh_staging_dir(tmp_path / "checkpoint-best")
    (staging / "weights.bin").write_bytes(b"new")
    commit(staging, tmp_path / "checkpoint-best", {})
    assert (tmp_path / "checkpoint-best" / "weights.bin").read_bytes() == b"new"
    assert (tmp_path / "checkpoint-best" / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-best"]


def test_retention_keeps_newest_and_protected(tmp_path: Path):
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, f"checkpoint-{step}")
    removed = apply_retention(tmp_path, 2, keep={tmp_path / "checkpoint-10"})
    assert sorted(p.name for p in removed) == ["checkpoint-20"]
    assert [s for s, _ in committed_step_checkpoints(tmp_path)] == [10, 30, 40]


def test_retention_finishes_a_delete_that_a_crash_cut_short(tmp_path: Path):
    """Killed while retention deleted checkpoint-10 (un-marked first, then half its files gone): never read again, and
    never saved again under that name, so the resumed run's next retention deletes it instead of leaving it on the
    disk for good. An unmarked checkpoint-50 newer than every committed one (a save of the crashed run cut before its
    marker) stays until the resumed run saves step 50 again, replacing it."""
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, f"checkpoint-{step}")
    (tmp_path / "checkpoint-10" / MARKER).unlink()
    make_checkpoint(tmp_path, "checkpoint-50")
    (tmp_path / "checkpoint-50" / MARKER).unlink()
    removed = apply_retention(tmp_path, 2, keep={tmp_path / "checkpoint-40"})
    assert [p.name for p in removed] == ["checkpoint-20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-30", "checkpoint-40", "checkpoint-50"]


def test_a_replacement_cut_short_by_a_crash_is_undone(tmp_path):
    """commit() of an existing folder (checkpoint-last, -best) moves the old one aside first; a crash before the new
    one is marked must leave the old one as the checkpoint, not no checkpoint at all."""
    from phalanx.checkpoint.commit import committed_copy, recover_replaced

    final = tmp_path / "checkpoint-last"
    staging = fresh_staging_dir(final)
    (staging / "weights").write_text("old")
    commit(staging, final, {"global_step": 1})
    os.replace(final, tmp_path / ".checkpoint-last.retired")  # the crash: the old one moved aside ...
    staging = fresh_staging_dir(final)
    (staging / "weights").write_text("new, unmarked")
    os.replace(staging, final)  # ... and the new one renamed into place, but its marker never written
    assert not is_committed(final)
    assert committed_copy(final) == tmp_path / ".checkpoint-last.retired", "readers (every rank) read the old copy"
    assert recover_replaced(final)
    assert is_committed(final) and (final / "weights").read_text() == "old" and (final / MARKER).is_file()
    assert not (tmp_path / ".checkpoint-last.retired").exists()
    assert not recover_replaced(final), "a committed folder is left alone"

    # The next save of the same name, after such a crash, never deletes the only committed copy first.
    os.replace(final, tmp_path / ".checkpoint-last.retired")
    staging = fresh_staging_dir(final)
    (staging / "weights").write_text("newer")
    commit(staging, final, {"global_step": 3})
    assert is_committed(final) and (final / "weights").read_text() == "newer"


def test_every_command_that_takes_a_checkpoint_says_why_a_path_is_not_one(tmp_path, capsys):
    """`phalanx export`, --resume_from_checkpoint and load_checkpoint name the same three cases: a path that is not
    there, a file, a folder without the commit marker (export said "no phalanx_checkpoint.json" for a typo)."""
    from phalanx.cli import main

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "checkpoint-4").mkdir()
    cases = {
        "nope": "no such folder",
        "notes.txt": "a file, not a checkpoint folder",
        "checkpoint-4": f"no {MARKER} in it: not a phalanx checkpoint, or a save that crashed before it committed",
    }
    for name, why in cases.items():
        path = tmp_path / name
        assert main(["export", str(path), str(tmp_path / "exported")]) == 2
        assert f"{path} is not a committed phalanx checkpoint ({why})" in capsys.readouterr().err
        flags = ["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(path), "--max_steps", "1"]
        assert main(["train", *flags]) == 2
        assert f"resume_from_checkpoint = '{path}' is not a committed phalanx checkpoint ({why})" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "exported").exists() and not (tmp_path / "run").exists()
