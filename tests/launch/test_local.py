"""`--world_size N` (launch/local.py) without starting ranks: what reaches torch's elastic agent, and the status after a
SIGTERM or a failure read from the ranks' exit records (also what launch.deepspeed_launcher makes of them). The real
launches are in tests/runtime/test_faults.py, tests/generate/test_system.py and tests/launch/test_launcher_run.py."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from phalanx.cli import main
from phalanx.errors import DataError, HubUnreachable, PhalanxError, RanksFailed
from phalanx.launch import deepspeed_launcher
from phalanx.launch.local import (
    STOPPED_FOR_LOST_PEER,
    after_rank_failure,
    after_stop_signal,
    descends_from,
    lost_peers,
    report_bad_input,
    reported_bad_input,
    shutdown_timeout_option,
    stopped_for_lost_peer,
    write_rank_message,
    write_rank_pid,
)
from phalanx.runtime.exit import EXIT_RECORDS, record_exit


@pytest.fixture
def agent(monkeypatch):
    """torch's elastic_launch replaced by one that records its LaunchConfig and starts nothing."""
    import torch.distributed.launcher.api as api

    seen = []

    class Recorder:
        def __init__(self, config, entrypoint):
            seen.append(config)

        def __call__(self, *args):
            return {}

    monkeypatch.setattr(api, "elastic_launch", Recorder)
    return seen


def test_shutdown_timeout_reaches_the_elastic_agent(agent, project, monkeypatch, tmp_path, capsys):
    """distributed.shutdown_timeout_s (train) and --shutdown_timeout_s (generate) become LaunchConfig.shutdown_timeout:
    the seconds between the agent's SIGTERM to the ranks and its SIGKILL (torch's own default is 30)."""
    monkeypatch.chdir(project)
    assert main(["train", "train.yaml", "--world_size", "2", "--output_dir", str(tmp_path / "t")]) == 0
    assert (
        main(
            [
                "train",
                "train.yaml",
                "--world_size",
                "2",
                "--output_dir",
                str(tmp_path / "t"),
                "--shutdown_timeout_s",
                "1200",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "generate",
                "--world_size",
                "2",
                "--num_questions",
                "2",
                "--output",
                str(tmp_path / "g.jsonl"),
                "--shutdown_timeout_s",
                "45",
            ]
        )
        == 0
    )
    assert [c.shutdown_timeout for c in agent] == [300, 1200, 45], capsys.readouterr().err


def test_a_torch_without_the_setting_keeps_30_s_and_says_so(capsys):
    @dataclasses.dataclass
    class OldLaunchConfig:
        nproc_per_node: int = 1

    assert shutdown_timeout_option(OldLaunchConfig, 300) == {}
    assert "kills the ranks 30 s after a SIGTERM" in capsys.readouterr().err
    assert shutdown_timeout_option(OldLaunchConfig, 30) == {} and not capsys.readouterr().err


def test_status_after_a_stop_signal_follows_the_ranks_exit_records(capsys):
    assert after_stop_signal("SIGTERM", {"rank 0": 75, "rank 1": 75}) == 75
    assert not capsys.readouterr().err, "rank 0 has said it saved: the launcher adds nothing"
    # rank 0 exits 75 only once all work is committed
    assert after_stop_signal("SIGTERM", {"rank 0": 75, "local rank 1": None}) == 75
    assert "after the ranks saved their progress, local rank 1 (killed: no exit status)" in capsys.readouterr().err
    assert after_stop_signal("SIGTERM", {"rank 0": 0, "rank 1": 0}) == 0  # both had finished
    # A second Ctrl-C stopped them before they saved: rank 0 said so
    assert after_stop_signal("SIGINT", {"rank 0": 130, "rank 1": 130}) == 130
    assert after_stop_signal("SIGINT", {"rank 0": 75, "rank 1": 130}) == 75  # rank 0 had saved for everyone
    with pytest.raises(
        PhalanxError,
        match=r"without saving their progress for it: rank 0 \(exit code 1\), "
        r"rank 1 \(killed by SIGKILL\)",
    ):
        after_stop_signal("SIGTERM", {"rank 0": 1, "rank 1": -9})


def test_ranks_a_stop_signal_killed_while_they_started_had_nothing_to_save(tmp_path, capsys):
    """A rank that never came to handle stop signals (no listening marker, no exit record) was killed while it
    started: 75 for SIGTERM (a requeue starts the run), 130 for Ctrl-C, not a failure. One that was listening and
    left no record lost what it was doing: still a failure."""
    from phalanx.launch.local import still_starting
    from phalanx.runtime.exit import exit_record, listening_marker

    listening_marker(exit_record(tmp_path, 1)).touch()  # local rank 1 had installed its handlers
    codes = {"local rank 0": None, "local rank 1": None}
    assert still_starting(tmp_path, 2, codes) == {"local rank 0"}
    with pytest.raises(PhalanxError, match="without saving their progress for it: local rank 0"):
        after_stop_signal("SIGTERM", codes, still_starting(tmp_path, 2, codes))
    listening_marker(exit_record(tmp_path, 1)).unlink()
    starting = still_starting(tmp_path, 2, codes)
    assert starting == {"local rank 0", "local rank 1"}
    assert after_stop_signal("SIGTERM", codes, starting) == 75
    assert "SIGTERM came while the ranks were starting: nothing was trained" in capsys.readouterr().err
    assert after_stop_signal("SIGINT", codes, starting) == 130
    assert after_stop_signal("SIGTERM", {"rank 0": 75, "local rank 1": None}, frozenset({"local rank 1"})) == 75


def test_a_stop_signal_before_the_launch_starts_no_rank(monkeypatch, tmp_path, capsys):
    """`--world_size 2`: the launcher handles stop signals from its first line; one that came before the ranks would
    start (its imports and checks take a second or two) starts none and exits 75 (130 for Ctrl-C)."""
    import phalanx.launch.local as local
    from phalanx.config.loader import load_config
    from phalanx.runtime.signals import PreemptionFlag
    from phalanx.train.command import launch_train_ranks

    def no_launch(*args, **kwargs):
        raise AssertionError("no rank may start")

    monkeypatch.setattr(local, "launch_local", no_launch)
    cfg = load_config(None, {"distributed.world_size": 2, "output_dir": str(tmp_path / "out")})
    for signal_name, code in (("SIGTERM", 75), ("SIGINT", 130)):
        flag = PreemptionFlag()
        flag.requested, flag.signal_name = True, signal_name
        assert launch_train_ranks(cfg, [], flag) == code
        assert f"{signal_name} came before the ranks started: nothing was trained" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_status_after_a_rank_failure_names_it_and_tells_bad_input_apart():
    assert after_rank_failure({"rank 1": 75}, None) == 75  # signalled directly (SLURM): it saved for everyone
    with pytest.raises(
        RanksFailed, match=r"failed on rank 1 \(exit code 2\), local rank 0 \(killed: no exit status\);"
    ):
        after_rank_failure({"rank 1": 2, "local rank 0": None}, None)
    with pytest.raises(PhalanxError, match="^bad row 3$") as raised:
        after_rank_failure({"rank 0": 2, "rank 1": 2}, PhalanxError("bad row 3"))
    assert raised.value.exit_code == 2
    # Only killed ranks: none wrote a message, so the status says where the cause is written instead.
    with pytest.raises(RanksFailed, match=r"rank 1 \(killed by SIGKILL\); .* out-of-memory killer \(`dmesg`"):
        after_rank_failure({"rank 1": -9}, None)
    # A crash in native code is not memory: it was blamed on the out-of-memory killer, with no way to see where.
    with pytest.raises(RanksFailed) as crashed:
        after_rank_failure({"rank 0": -11, "rank 1": -11}, None)
    said = str(crashed.value)
    assert "SIGSEGV is a crash inside native code" in said and "PYTHONFAULTHANDLER=1" in said
    assert "out-of-memory" not in said


def test_an_unreachable_hub_on_the_ranks_is_said_once_with_its_own_status(tmp_path, monkeypatch, capsys):
    """Every rank meets it alike, so it is reported once, like bad input, but with status 1: a rerun once the network
    is back goes on, so a requeue wrapper may retry it (bad input is 2)."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv(EXIT_RECORDS, str(tmp_path))
    monkeypatch.setenv("PHALANX_LAUNCHER_REPORTS_ERRORS", "1")
    for local in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("RANK", str(local))
        record_exit(report_bad_input(HubUnreachable("dataset 'org/d': the Hub could not be reached"), local))
    assert (tmp_path / "local-rank-1").read_text() == "1 1" and not capsys.readouterr().err
    with pytest.raises(PhalanxError) as raised:
        deepspeed_launcher.after_runner(1, {"rank 0": 1, "rank 1": 1}, tmp_path)
    assert raised.value.exit_code == 1 and str(raised.value) == "dataset 'org/d': the Hub could not be reached"


def test_a_rank_names_the_peers_of_its_attempt_that_were_killed(tmp_path, monkeypatch):
    """Each rank says which process is its local rank (and in which attempt); a peer whose process is gone without an
    exit record was killed. A peer that recorded its exit, one still running, and one of an earlier attempt are not."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    me = tmp_path / "local-rank-0"
    write_rank_pid(me)
    assert (tmp_path / "local-rank-0.pid").read_text() == f"{os.getpid()} 1"
    peers = {local: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for local in (1, 2, 3, 4)}
    try:
        for local, peer in peers.items():
            attempt = "0" if local == 4 else "1"
            (tmp_path / f"local-rank-{local}.pid").write_text(f"{peer.pid} {attempt}")
        assert lost_peers(me) == []  # all running
        for local in (1, 2, 4):
            peers[local].kill()
            peers[local].wait()
        (tmp_path / "local-rank-2").write_text("1 2")  # rank 2 recorded its exit: it ended, it was not killed
        assert lost_peers(me) == [f"local rank 1 (pid {peers[1].pid})"]
    finally:
        for peer in peers.values():
            peer.kill()
            peer.wait()


def test_a_rank_that_stopped_for_a_killed_peer_is_not_named_as_a_failure(tmp_path, monkeypatch):
    """Its error file says why it stopped; the launchers name the killed peer, and do not take its line for bad input."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv(EXIT_RECORDS, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert write_rank_message(STOPPED_FOR_LOST_PEER, "stopped: local rank 1 (pid 7) ended without an exit status", 0)
    record_exit(1)
    files = {0: json.loads((tmp_path / "local-rank-0.error").read_text()), 1: None}
    assert stopped_for_lost_peer(files) == {0} and reported_bad_input(files) is None
    # Under DeepSpeed's launcher: rank 0 recorded 1, rank 1 left no record.
    with pytest.raises(RanksFailed, match=r"failed on local rank 1 \(killed: no exit status\); the other ranks"):
        deepspeed_launcher.after_runner(1, {"rank 0": 1, "local rank 1": None}, tmp_path)


def test_deepspeed_ranks_leave_bad_input_and_their_status_beside_their_exit_records(tmp_path, monkeypatch, capsys):
    """Under DeepSpeed's launcher no rank has torch's error file: bad input goes beside the exit record, and the
    launcher prints it once (status 2); a crash names the rank that recorded its failure first (status 1)."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv(EXIT_RECORDS, str(tmp_path))
    monkeypatch.setenv("PHALANX_LAUNCHER_REPORTS_ERRORS", "1")
    for local in (1, 0):  # rank 1 first
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("RANK", str(local))
        record_exit(report_bad_input(DataError("bad row 3"), local))
        time.sleep(0.01)
    assert not capsys.readouterr().err, "the launcher says it"
    assert json.loads((tmp_path / "local-rank-0.error").read_text())["phalanx"]["message"] == "bad row 3"
    codes = {"rank 0": 2, "rank 1": 2}
    with pytest.raises(PhalanxError, match="^bad row 3$"):
        deepspeed_launcher.after_runner(2, codes, tmp_path)
    for local in (0, 1):
        (tmp_path / f"local-rank-{local}.error").unlink()
    with pytest.raises(RanksFailed, match=r"failed on rank 1 \(exit code 2\); the other ranks were stopped"):
        deepspeed_launcher.after_runner(2, codes, tmp_path)
    assert deepspeed_launcher.after_runner(0, {"rank 0": 0, "rank 1": 0}, tmp_path) == 0
    assert deepspeed_launcher.after_runner(2, {"local rank 0": None}, tmp_path) == 2, "DeepSpeed's own usage error"
    with pytest.raises(RanksFailed, match=r"ended \(killed by SIGKILL\) and no rank of this node left an exit status"):
        deepspeed_launcher.after_runner(-9, {"local rank 0": None}, tmp_path)


def test_deepspeed_launcher_counts_the_ranks_of_this_node(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert deepspeed_launcher.local_rank_count(["--num_gpus", "3", "--module", "phalanx"]) == 3
    assert deepspeed_launcher.local_rank_count(["--num_accelerators=2"]) == 2
    assert deepspeed_launcher.local_rank_count(["--module", "phalanx"]) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert deepspeed_launcher.local_rank_count(["--module", "phalanx"]) == 4
    (tmp_path / "local-rank-1").write_text("0 1")
    assert deepspeed_launcher.recorded_ranks(tmp_path) == 2


def test_a_rank_watches_its_launcher_through_the_processes_between():
    """DeepSpeed's runner and launch process stand between phalanx's launcher and a rank: the launcher is an
    ancestor, not the parent; a process that is no ancestor (a sibling, a dead one) does not count."""
    assert descends_from(os.getppid())
    # A grandchild: sh forks python (a command follows), as DeepSpeed's processes start a rank.
    code = f"from phalanx.launch.local import descends_from; import os; print(os.getppid() != {os.getpid()}, descends_from({os.getpid()}))"
    child = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{code}"; exit'], capture_output=True, text=True, check=True
    )
    assert child.stdout.split() == ["True", "True"], child.stdout + child.stderr
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert not descends_from(sibling.pid)
    finally:
        sibling.kill()
        sibling.wait()


def test_a_note_from_the_ranks_is_said_by_rank_0_even_under_a_relaying_launcher(monkeypatch, capsys):
    """A finished run started again ('nothing to do', exit 0) under torchrun from a launcher script: the launcher
    relays messages of failed ranks only, so rank 0 says it itself (the note was lost); the others say nothing."""
    from phalanx.errors import NothingToDo
    from phalanx.launch.local import PARENT_REPORTS, report_bad_input

    monkeypatch.setenv(PARENT_REPORTS, "1")
    assert report_bad_input(NothingToDo("runs/x holds a finished run: nothing to do"), 0) == 0
    assert capsys.readouterr().err == "note: runs/x holds a finished run: nothing to do\n"
    assert report_bad_input(NothingToDo("runs/x holds a finished run: nothing to do"), 1) == 0
    assert capsys.readouterr().err == ""
