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


def test_a_relative_folder_is_named_by_the_folder_it_is_in(monkeypatch):
    """A relative output in a folder that takes no new entry named that folder '.' (the one phalanx runs in)."""
    monkeypatch.chdir("/proc")
    with pytest.raises(ConfigError, match=r"^output_dir = 'o': cannot create or write into /proc \("):
        create_folder(Path("o"), "output_dir = 'o'")


def test_a_generated_file_never_replaces_what_someone_else_put_there(tmp_path: Path, capsys):
    """`phalanx config deepspeed|fsdp --output`, `launcher` and `slurm` replaced an existing file whatever it held
    (a DeepSpeed JSON the user had tuned by hand). The same text again is fine; other text needs --overwrite; a
    launcher's .sh and .bat are checked before either is written."""
    from phalanx.cli import main

    ds = tmp_path / "config" / "ds_config.json"
    assert main(["config", "deepspeed", "--zero_stage", "2", "--output", str(ds)]) == 0
    assert capsys.readouterr().out == f"wrote {ds}\n"
    assert main(["config", "deepspeed", "--zero_stage", "2", "--output", str(ds)]) == 0
    assert capsys.readouterr().out == f"wrote {ds} (unchanged)\n"
    tuned = ds.read_text().replace('"stage": 2', '"stage": 2, "overlap_comm": true')
    ds.write_text(tuned)
    assert main(["config", "deepspeed", "--zero_stage", "3", "--output", str(ds)]) == 2
    err = capsys.readouterr().err
    assert f"--output {ds}: {ds} already exists and holds something else" in err and "--overwrite" in err, err
    assert ds.read_text() == tuned
    assert main(["config", "deepspeed", "--zero_stage", "3", "--output", str(ds), "--overwrite"]) == 0
    assert '"stage": 3' in ds.read_text() and not list(ds.parent.glob(".*.tmp"))

    # The launcher's pair: an edited .bat stops both from being written.
    script = tmp_path / "scripts" / "run.sh"
    flags = ["launcher", "--num_gpus_per_node", "0", "--nproc_per_node", "2", "--output", str(script)]
    assert main(flags) == 0 and script.stat().st_mode & 0o111 and script.with_suffix(".bat").is_file()
    capsys.readouterr()
    script.with_suffix(".bat").write_bytes(b"rem mine\r\n")
    before = script.read_bytes()
    assert main(flags) == 2  # the .sh would be the same, the .bat is someone's
    assert f"{script.with_suffix('.bat')} already exists" in capsys.readouterr().err
    assert main([*flags, "--nproc_per_node", "1"]) == 2  # the .sh would change: refused first, nothing written
    assert f"{script} already exists" in capsys.readouterr().err
    assert script.read_bytes() == before and script.with_suffix(".bat").read_bytes() == b"rem mine\r\n"
    assert main([*flags, "--nproc_per_node", "1", "--overwrite"]) == 0
    assert script.read_bytes() != before and script.stat().st_mode & 0o111


def test_a_refused_generated_file_leaves_no_new_folder(tmp_path: Path):
    """Every file is checked before any folder is made: a refusal of the second file used to leave the first one's
    new folder behind."""
    from phalanx.runtime.durable import write_generated_files

    mine = tmp_path / "mine.json"
    mine.write_text("tuned by hand")
    with pytest.raises(ConfigError, match="already exists and holds something else"):
        write_generated_files({tmp_path / "new" / "run.sh": "a", mine: "b"}, False, "--output x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"] and mine.read_text() == "tuned by hand"
    write_generated_files({tmp_path / "new" / "run.sh": "a", mine: "b"}, True, "--output x")
    assert (tmp_path / "new" / "run.sh").read_text() == "a" and mine.read_text() == "b"


def test_an_atomic_write_is_synced_before_and_after_its_rename(tmp_path: Path, monkeypatch):
    """The new bytes reach the disk before the rename, and the rename itself (the folder) after it: a power loss
    leaves the old file or the new one (metrics.jsonl cut back on resume, info files, generated scripts)."""
    import os

    from phalanx.observe.metrics import keep_until
    from phalanx.runtime import durable

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", recording_fsync)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo', encoding="utf-8")
    assert [r["step"] for r in keep_until(metrics, 1)] == [1]
    assert metrics.read_text(encoding="utf-8") == '{"step": 1, "loss": 2.0}\n'
    assert synced == [str(tmp_path / ".metrics.jsonl.tmp"), str(tmp_path)]
    assert not (tmp_path / ".metrics.jsonl.tmp").exists()


def test_what_a_killed_writer_left_is_removed_and_a_live_writers_files_stay(tmp_path: Path):
    """Writers name their temporary file or staging folder with their pid, so a rerun never reuses a killed one's:
    remove_dead_writers clears those whose process is gone (file or folder), never a live one's or another name."""
    import os

    from helpers import gone_pid
    from phalanx.runtime.durable import remove_dead_writers

    dead = gone_pid()
    (tmp_path / f".model.staging-{dead}").mkdir()
    (tmp_path / f".model.staging-{dead}" / "model.safetensors").write_bytes(b"half written")
    (tmp_path / f".model.staging-{dead + 1000000}").write_bytes(b"a file, no such process either")
    live = tmp_path / f".model.staging-{os.getpid()}"
    live.mkdir()
    other = tmp_path / ".model.staging-notapid"
    other.mkdir()
    removed = remove_dead_writers(tmp_path, ".model.staging-")
    assert sorted(p.name for p in removed) == sorted([f".model.staging-{dead}", f".model.staging-{dead + 1000000}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
