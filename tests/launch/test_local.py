"""`--world_size N` (launch/local.py) without starting ranks: what reaches torch's elastic agent, and the status after a
SIGTERM read from the ranks' exit records. The real launches are in tests/runtime/test_faults.py and
tests/generate/test_system.py."""

import dataclasses

import pytest

from phalanx.cli import main
from phalanx.errors import PhalanxError
from phalanx.launch.local import after_stop_signal, shutdown_timeout_option


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
