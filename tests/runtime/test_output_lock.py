"""One run per output: a second run on a live run's output_dir is refused by name; a killed run frees it."""

import json
import time

import pytest

from helpers import lock_held_elsewhere, run_phalanx, start_phalanx, tiny_run
from phalanx.errors import ConfigError
from phalanx.runtime.output_lock import check_free, hold_lock, release_lock, training_lock


def test_a_lock_is_refused_while_held_and_free_once_its_holder_is_killed(tmp_path):
    lock = training_lock(tmp_path / "out")
    with lock_held_elsewhere(lock) as holder:
        for attempt in (check_free, hold_lock):
            with pytest.raises(ConfigError) as err:
                attempt(lock, "--output_dir out")
            assert f"--output_dir out is in use by another run (pid {holder} on " in str(err.value)
    check_free(lock, "--output_dir out")  # the holder was SIGKILLed: no clean-up of its own ran
    hold_lock(lock, "--output_dir out")
    assert json.loads(lock.read_text())["pid"] != holder  # the new holder's record
    release_lock(lock)
    assert lock.is_file()  # kept: only the flock says who holds it


def test_a_second_run_on_a_live_runs_output_dir_is_refused_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    flags = ["train", "--output_dir", str(out), *tiny_run({"max_steps": 400})]
    first = start_phalanx(*flags, output=False)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file():  # training: the lock is held and a step is logged
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        before = sorted(p.name for p in out.iterdir())
        # --overwrite_output_dir would delete the first run's files, a different config would be called a crashed
        # run to move aside: the lock is checked before either (one rank checks it the same way: resume_point).
        second = run_phalanx(*flags, "--max_steps", "3", "--world_size", "2", "--overwrite_output_dir")
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"--output_dir {out} is in use by another run (pid {first.pid} on " in second.stderr, second.stderr
        assert f"phalanx train --output_dir {out}" in second.stderr  # the holder's command, to find it by
        assert first.poll() is None, "the refused runs disturbed the first"
        assert sorted(p.name for p in out.iterdir()) == before  # nothing moved aside or deleted
    finally:
        first.kill()
        first.wait()


def test_only_rank_0_asks_whether_the_output_dir_is_free(tmp_path, monkeypatch):
    """Ranks check output_dir before joining; where a job's ranks are already joined (a library call, an elastic
    restart of some ranks), a rank other than 0 would find the lock its own rank 0 took and stop alone, leaving
    rank 0 in a collective with a closed peer. Rank 0 asks; hold_on_main_rank tells every rank its answer."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.config.loader import load_config

    cfg = load_config(None, {"output_dir": str(tmp_path / "out")})
    with lock_held_elsewhere(training_lock(tmp_path / "out")):
        monkeypatch.setenv("RANK", "1")
        assert resume_point(cfg) is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match="is in use by another run"):
            resume_point(cfg)


def test_a_lock_file_this_user_cannot_open_is_left_to_the_checks_that_follow(tmp_path, monkeypatch):
    """Another user's run folder: root reads anything, so the refusal of os.open is simulated. check_free must not
    end in a traceback; the output checks after it (or hold_lock) say what is wrong with the folder."""
    import os

    lock = training_lock(tmp_path / "out")
    lock.parent.mkdir()
    lock.write_text("{}")

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", refused)
    check_free(lock, "--output_dir out")  # returns: nothing is known to hold it
