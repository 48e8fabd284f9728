"""DDPStrategy: wrapping a model for DistributedDataParallel on real gloo ranks."""

import subprocess
import sys
import textwrap

from helpers import phalanx_env

# Two forked gloo ranks wrap a linear layer with DDPStrategy, each takes a backward pass on its own input, and rank 0
# checks DDP's averaged gradient against the mean of both ranks' inputs computed by hand. A rank that crashes in
# native code dies of a signal, which the exit codes report.
TWO_RANKS = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from phalanx.parallel.base import Precision
    from phalanx.parallel.ddp import DDPStrategy
    from phalanx.runtime.dist import RankInfo

    def rank_main(rank, store_file):
        dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2)
        torch.manual_seed(0)
        model = nn.Linear(3, 1, bias=False)
        ddp = DDPStrategy(RankInfo(rank, 2, rank, 2, torch.device("cpu")), Precision(None)).wrap(model)
        inputs = torch.arange(6.0).reshape(2, 3)
        ddp(inputs[rank : rank + 1]).sum().backward()
        if rank == 0:
            assert torch.allclose(model.weight.grad, inputs.mean(0, keepdim=True)), model.weight.grad
            print("level", dist.get_debug_level(), flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        torch.multiprocessing.start_processes(rank_main, args=(sys.argv[1],), nprocs=2, start_method="fork")
    """
)


def test_ddp_trains_on_gloo_ranks_under_torch_distributed_debug_detail(tmp_path):
    # Seed 001's guide says `export TORCH_DISTRIBUTED_DEBUG=DETAIL` to debug; on CPU ranks torch's DDP constructor then
    # died of SIGSEGV in every rank (its logger took DETAIL's wrapper for the gloo group; torch 2.13).
    run = subprocess.run(
        [sys.executable, "-c", TWO_RANKS, str(tmp_path / "store")],
        # gloo on loopback, as the launched tiers run it: found through the host name it hung past the timeout in a
        # full suite run (the network-namespace tests run beside it)
        env=phalanx_env({"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "level DebugLevel.DETAIL" in run.stdout  # the rest of the run keeps the checks it asked for
    assert run.stderr.count("DDP's gradient all-reduce runs on a gloo group without DETAIL's checks") == 1
