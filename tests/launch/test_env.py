"""`phalanx env`: versions, devices, environment, and an all-reduce check across the ranks it is started with."""

import json
import time

import pytest

from phalanx.cli import main
from phalanx.launch.envcheck import bus_factor, mismatches

pytestmark = pytest.mark.distributed


def test_one_process_reports_versions_and_skips_the_check(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "torch 2." in text and "backends: gloo yes" in text and "CPU core(s)" in text
    assert "NCCL_DEBUG=INFO" in text, "the variables that steer NCCL / gloo are shown"
    assert "all-reduce check: skipped (one process)" in text and "phalanx env --world_size 2" in text
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["check"] is None and doc["facts"]["backends"]["gloo"] is True
    assert doc["facts"]["env"]["NCCL_DEBUG"] == "INFO"


def test_two_ranks_all_reduce_and_report_bus_bandwidth(support, project):
    proc = support.run_cli(
        project, "env", "--world_size", "2", "--json", "--sizes_mb", "0.25,2", "--iters", "3", timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # only rank 0 prints
    check = doc["check"]
    assert check["world_size"] == 2 and check["backend"] == "gloo"
    assert [r["size_bytes"] for r in check["allreduce"]] == [2**18, 2 * 2**20]
    for row in check["allreduce"]:
        assert row["wrong_ranks"] == 0
        assert row["seconds"] > 0 and row["algbw_gbps"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(2))
    assert len(check["ranks"]) == 2 and all(r["torch"] == doc["facts"]["torch"] for r in check["ranks"])
    assert doc["facts"]["env"]["WORLD_SIZE"] == "2" and "MASTER_PORT" in doc["facts"]["env"]


def test_a_missing_rank_ends_in_a_message_within_the_timeout(capsys, monkeypatch, support):
    """WORLD_SIZE=2 but only rank 0 ever starts: the check gives up after --timeout, naming the rank."""
    port = support.free_port()
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    assert main(["env", "--backend", "gloo", "--timeout", "3"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert "the all-reduce check failed on rank 0 of 2" in err and "MASTER_ADDR=127.0.0.1" in err


def test_bus_factor_and_version_mismatch():
    assert bus_factor(2) == 1.0 and bus_factor(8) == pytest.approx(1.75)
    ranks = [
        {"phalanx": "0.1.0", "torch": "2.13.0", "cuda": "12.4", "nccl": "2.21"},
        {"phalanx": "0.1.0", "torch": "2.12.0", "cuda": "12.4", "nccl": "2.21"},
    ]
    assert mismatches(ranks) == ["torch differs between ranks: 2.13.0 on ranks [0]; 2.12.0 on ranks [1]"]
