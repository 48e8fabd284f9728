"""Process-group lifecycle and rank facts: who am I, which device, and the reductions the loop needs.

One process with no process group is a first-class case: every helper here works
without torch.distributed being initialised, so single-process code paths are the same.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from phalanx.errors import ConfigError


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun / torch's elastic launcher (the environment holds the rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank_info() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) as a launcher set them; (0, 1, 0, 1) in a process no launcher
    started. A WORLD_SIZE without a RANK is the shell's, not this process's: seed 001's guide has users
    `export WORLD_SIZE=2` before running torchrun, and a plain `phalanx train` from that shell then waited for
    ranks that no one starts (torch: "environment variable RANK expected, but not set")."""
    if not launched_by_torchrun():
        return 0, 1, 0, 1
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_world_fits(local_world_size: int, backend: str, asked_by: Optional[tuple[str, str]] = None) -> None:
    """Refuse more ranks per machine than devices: one CUDA device per rank, one core per CPU rank. Named as the user
    asked for them: in ranks torchrun started, by its --nproc_per_node (--world_size is ignored there); `asked_by`:
    (what asked for them, the setting to change) where another caller did, e.g. TrainingEngine's launcher."""
    torchrun = launched_by_torchrun()
    asked = (
        f"torchrun --nproc_per_node {local_world_size}" if torchrun else f"distributed.world_size = {local_world_size}"
    )
    flag = "--nproc_per_node" if torchrun else "--world_size"
    if asked_by is not None:
        asked, flag = asked_by
    if resolve_backend(backend) == "nccl":
        count = torch.cuda.device_count()
        if local_world_size > count:
            raise ConfigError(
                f"{asked} ranks on this machine, but only {count} CUDA device(s) "
                f"are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
                + (
                    f"Use {flag} {count} or fewer."
                    if count
                    else "NCCL runs on CUDA devices only: use --backend gloo (or auto) for CPU ranks."
                )
            )
    else:
        cores = os.cpu_count() or 1
        if local_world_size > cores:
            raise ConfigError(
                f"{asked} CPU ranks on this machine, but it has {cores} core(s). "
                f"Use {flag} {cores} or fewer (each gloo rank needs a core)."
            )


def init_runtime(
    backend: str = "auto",
    timeout_minutes: float = 10.0,
    group_of_one: bool = False,
    ranks_asked_by: Optional[tuple[str, str]] = None,
    backend_setting: str = "distributed.backend",
) -> RankInfo:
    """Join the process group the environment describes (if any) and pick this rank's device.

    `group_of_one`: a single process still gets a (one-rank) process group, for strategies built on
    collectives (FSDP2, DeepSpeed) that users run on one device for their offload and memory savings.
    `ranks_asked_by`: how the ranks were asked for, when not by torchrun or --world_size (check_world_fits);
    `backend_setting`: the name the caller gave the backend under, for the message that refuses it.
    """
    rank, world, local_rank, local_world = env_rank_info()
    if not launched_by_torchrun() and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        print(
            f"note: WORLD_SIZE={os.environ['WORLD_SIZE']} is set in the environment but RANK is not, so no launcher "
            "started this process: it runs as one process. For several ranks use --world_size N, or torchrun.",
            file=sys.stderr,
            flush=True,
        )
    backend = resolve_backend(backend)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(f"{backend_setting} = 'nccl' needs CUDA devices; none are visible. Use 'gloo' or 'auto'.")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks on one machine share its cores; more threads than cores makes every rank slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        check_world_fits(local_world, backend, ranks_asked_by)
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
            **attempt_store(rank, world, timeout_minutes),
        )
    elif world == 1 and group_of_one and not dist.is_initialized():
        # What a launcher would have set: libraries such as DeepSpeed read the rank from the environment.
        # Set, not defaulted: a WORLD_SIZE left in the shell (see env_rank_info) must not tell them otherwise.
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ[name] = value
        dist.init_process_group(
            backend=backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if backend == "nccl" else None,
        )
    return RankInfo(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, device=device)


def attempt_store(rank: int, world: int, timeout_minutes: float) -> dict:
    """Under torch's elastic agent, give each restart attempt its own key space in the agent's store.

    The agent keeps one store across restarts; without a per-attempt prefix, restarted ranks can read
    the previous attempt's gloo addresses and fail to connect to ranks that no longer exist.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(minutes=timeout_minutes),
    )
    return {"store": dist.PrefixStore(f"phalanx/attempt_{attempt}", client), "rank": rank, "world_size": world}


def shutdown() -> None:
    """Leave the process group once nothing else holds it (collect first: DDP reducers keep references)."""
    if dist.is_initialized():
        import gc

        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place and returned); a no-op without a process group."""
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def gather_objects(obj: object) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
