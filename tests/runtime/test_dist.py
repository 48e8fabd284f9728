"""runtime.dist: which environment makes this process a rank, and how many fit."""

import os

import pytest
import torch
import torch.distributed as dist

from phalanx.errors import ConfigError
from phalanx.runtime.dist import check_world_fits, env_rank_info, init_runtime, shutdown


def test_a_world_size_left_in_the_shell_without_a_rank_is_one_process(monkeypatch, capsys):
    """Seed 001's guide exports MASTER_ADDR, MASTER_PORT and WORLD_SIZE=2 before torchrun; a plain `phalanx train` or
    `phalanx generate` from that shell failed in init_process_group ("environment variable RANK expected")."""
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env_rank_info() == (0, 1, 0, 1)
    rank = init_runtime("gloo")
    try:
        assert (rank.rank, rank.world_size, rank.device.type) == (0, 1, "cpu") and not dist.is_initialized()
    finally:
        shutdown()
    assert "WORLD_SIZE=2 is set in the environment but RANK is not" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # a launcher's rank: the environment is its own
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_rank_info() == (1, 2, 1, 2)


def test_nccl_ranks_without_cuda_devices_are_pointed_to_gloo(monkeypatch):
    """With no CUDA device the advice was "Use --world_size 1 or fewer", which NCCL cannot run either."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"only 0 CUDA device\(s\) .* use --backend gloo \(or auto\) for CPU ranks"):
        check_world_fits(2, "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="only 2 CUDA device.* Use --world_size 2 or fewer."):
        check_world_fits(4, "nccl")


def test_too_many_ranks_under_torchrun_are_named_by_its_flag(monkeypatch):
    """`torchrun --nproc_per_node=3 -m phalanx train` on 2 cores was told 'Use --world_size 2 or fewer', a flag
    torchrun's ranks ignore."""
    cores = os.cpu_count() or 1
    with pytest.raises(
        ConfigError, match=f"distributed.world_size = {cores + 1} CPU ranks.* Use --world_size {cores} "
    ):
        check_world_fits(cores + 1, "gloo")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(cores + 1))):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        check_world_fits(cores + 1, "gloo")
    assert f"torchrun --nproc_per_node {cores + 1} CPU ranks on this machine" in str(err.value)
    assert f"Use --nproc_per_node {cores} or fewer" in str(err.value) and "--world_size" not in str(err.value)


def test_cpu_ranks_share_the_cores_unless_omp_num_threads_says_otherwise(monkeypatch):
    """Without OMP_NUM_THREADS each CPU rank takes its share of the cores (more threads than cores slows every rank);
    a value the user set is left to torch. The test session sets OMP_NUM_THREADS=1 (tests/conftest.py), so the ranks
    it launches take the other path: this is where the share itself is checked."""
    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)  # one of two ranks on this machine (a world of one: no process group)
    try:
        torch.set_num_threads(cores + 1)  # neither value it should end with
        init_runtime("gloo")
        assert torch.get_num_threads() == max(1, cores // 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        torch.set_num_threads(cores + 1)
        init_runtime("gloo")
        assert torch.get_num_threads() == cores
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        init_runtime("gloo")
        assert torch.get_num_threads() == 1, "OMP_NUM_THREADS is the user's to set"
    finally:
        shutdown()
        torch.set_num_threads(before)
