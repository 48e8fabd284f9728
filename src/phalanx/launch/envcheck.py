"""`phalanx env`: what a user runs first when a multi-node job hangs.

It prints the versions that must agree across nodes (torch, CUDA, NCCL, DeepSpeed ...),
the devices and communication backends this machine has, and the environment variables
that steer rendezvous and NCCL/gloo. Started on several ranks (`--world_size N`, torchrun,
a launcher or SLURM script) it then joins the process group with a bounded timeout, checks
that every rank runs the same versions, and times all-reduces of growing size, reporting
algorithm and bus bandwidth the way nccl-tests does (bus = algorithm x 2(n-1)/n).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from datetime import timedelta
from importlib import metadata
from typing import Any, Optional

from phalanx.errors import PhalanxError

ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "USE_LIBUV",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_RESTART_COUNT",
    "SLURM_CPUS_PER_TASK",
)
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_DISABLE_", "PHALANX_")
PACKAGES = ("transformers", "peft", "datasets", "accelerate", "deepspeed", "bitsandbytes")


def package_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def facts() -> dict[str, Any]:
    """Versions, devices and backends of this process's machine."""
    import torch
    import torch.distributed as dist

    import phalanx

    cuda = torch.cuda.is_available()
    devices = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
    nccl = None
    if cuda and dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL symbols
            nccl = None
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "phalanx": phalanx.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "packages": {name: package_version(name) for name in PACKAGES},
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": devices,
        "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "env": {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)},
    }


def describe(f: dict[str, Any]) -> list[str]:
    pkgs = ", ".join(f"{k} {v or 'not installed'}" for k, v in f["packages"].items())
    lines = [
        f"phalanx {f['phalanx']} on {f['host']}: Python {f['python']}, {f['platform']}",
        f"torch {f['torch']}: CUDA {f['cuda'] or 'not built'} "
        f"({'available' if f['cuda_available'] else 'not available'}), cuDNN {f['cudnn'] or '-'}, NCCL {f['nccl'] or '-'}",
        f"packages: {pkgs}",
        f"devices: {f['cpu_cores']} CPU core(s), torch uses {f['torch_threads']} thread(s); "
        f"{len(f['cuda_devices'])} CUDA device(s)" + ("; MPS available" if f["mps"] else ""),
    ]
    lines += [
        f"  cuda:{d['index']} {d['name']}, {d['memory_gib']} GiB, compute capability {d['capability']}"
        for d in f["cuda_devices"]
    ]
    lines.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in f["backends"].items()))
    lines.append("environment:" if f["env"] else "environment: none of the rendezvous / NCCL / gloo variables is set")
    lines += [f"  {k}={v}" for k, v in f["env"].items()]
    return lines


def bus_factor(world: int) -> float:
    """All-reduce moves 2(n-1)/n of the buffer over each rank's link (ring algorithm; nccl-tests' busbw)."""
    return 2 * (world - 1) / world


def allreduce_bench(sizes_mb: list[float], iters: int, device) -> list[dict[str, float]]:
    """Time all-reduce for each size; check every element of every result."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    rows = []
    for size_mb in sizes_mb:
        numel = max(1, int(size_mb * 2**20) // 4)
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        buf.fill_(rank + 1)
        dist.all_reduce(buf)  # warm-up, and the correctness check
        ok = bool(torch.all(buf == expected).item())
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / iters
        # The slowest rank sets the pace of a collective; report that.
        t = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = torch.tensor([0.0 if ok else 1.0], device=device)
        dist.all_reduce(flags)
        seconds = float(t.item())
        algbw = numel * 4 / seconds / 1e9
        rows.append(
            {
                "size_bytes": numel * 4,
                "seconds": seconds,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * bus_factor(world),
                "wrong_ranks": int(flags.item()),
            }
        )
    return rows


def run_check(sizes_mb: list[float], iters: int, backend: str, timeout_s: float) -> dict[str, Any]:
    """Join the process group the environment describes and measure; every rank takes part."""
    import torch
    import torch.distributed as dist

    from phalanx.runtime.dist import env_rank_info, resolve_backend

    rank, world, local_rank, _ = env_rank_info()
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    started = time.perf_counter()
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        joined = time.perf_counter() - started
        mine = facts()
        everyone = [None] * world
        dist.all_gather_object(everyone, {k: mine[k] for k in ("host", "torch", "cuda", "nccl", "phalanx", "packages")})
        rows = allreduce_bench(sizes_mb, iters, device)
    except Exception as exc:  # a timeout or a dead peer: name it, with the rank
        raise PhalanxError(
            f"the all-reduce check failed on rank {rank} of {world} after {time.perf_counter() - started:.0f} s "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Check that every node can reach "
            f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} and each other (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME "
            "name the interface to use), and that all ranks were started."
        ) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"backend": backend, "world_size": world, "join_seconds": joined, "ranks": everyone, "allreduce": rows}


def mismatches(ranks: list[dict[str, Any]]) -> list[str]:
    """Versions that differ between ranks: the classic cause of hangs and odd NCCL errors."""
    out = []
    for key in ("phalanx", "torch", "cuda", "nccl"):
        seen = {}
        for i, r in enumerate(ranks):
            seen.setdefault(str(r[key]), []).append(i)
        if len(seen) > 1:
            out.append(f"{key} differs between ranks: " + "; ".join(f"{v} on ranks {ids}" for v, ids in seen.items()))
    return out


def format_size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def describe_check(result: dict[str, Any]) -> list[str]:
    hosts = sorted({r["host"] for r in result["ranks"]})
    lines = [
        f"all-reduce check: {result['world_size']} ranks on {len(hosts)} host(s) ({', '.join(hosts)}), "
        f"backend {result['backend']}, joined in {result['join_seconds']:.1f} s",
        f"  {'size':>10}  {'time':>10}  {'algbw':>11}  {'busbw':>11}  result",
    ]
    for row in result["allreduce"]:
        verdict = "correct on every rank" if row["wrong_ranks"] == 0 else f"WRONG on {row['wrong_ranks']} rank(s)"
        lines.append(
            f"  {format_size(row['size_bytes']):>10}  {row['seconds'] * 1e3:8.2f} ms  "
            f"{row['algbw_gbps']:7.3f} GB/s  {row['busbw_gbps']:7.3f} GB/s  {verdict}"
        )
    lines += [f"  warning: {m}" for m in mismatches(result["ranks"])]
    return lines


def env(sizes_mb: list[float], iters: int, backend: str, timeout_s: float, as_json: bool) -> int:
    from phalanx.runtime.dist import launched_by_torchrun

    mine = facts()
    result = None
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        result = run_check(sizes_mb, iters, backend, timeout_s)
        if int(os.environ["RANK"]) != 0:
            return 0
        bad = any(r["wrong_ranks"] for r in result["allreduce"])
    else:
        bad = False
    if as_json:
        print(json.dumps({"facts": mine, "check": result}, indent=2))
    else:
        print("\n".join(describe(mine)))
        if result is None:
            print(
                "all-reduce check: skipped (one process). Run `phalanx env --world_size 2`, or start it the way "
                "training starts (torchrun, a launcher or SLURM script) to check the ranks can talk."
            )
        else:
            print("\n".join(describe_check(result)))
    sys.stdout.flush()
    return 1 if bad else 0
