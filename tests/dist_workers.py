"""Functions that run inside real gloo ranks started by tests (importable by spawned children)."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, world, *args)
    except Exception:
        results[rank] = "ERROR " + traceback.format_exc()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) on `world` real gloo ranks; returns each rank's result."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_entry, args=(world, _free_port(), fn, args, results), nprocs=world, start_method="spawn")
        out = [results.get(r) for r in range(world)]
    for r in out:
        if isinstance(r, str) and r.startswith("ERROR"):
            raise AssertionError(r)
    return out


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 13):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return type("Out", (), {"logits": self.head(self.emb(input_ids))})()


def eval_batches_for(rank: int) -> list[dict]:
    """Rank 0 holds three long rows, rank 1 one short row: different token counts per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    rows, length = (3, 12) if rank == 0 else (1, 4)
    ids = torch.randint(0, 13, (rows, length), generator=g)
    return [
        {
            "input_ids": ids[i : i + 1],
            "attention_mask": torch.ones(1, length, dtype=torch.long),
            "labels": ids[i : i + 1],
        }
        for i in range(rows)
    ]


def evaluate_on_rank(rank: int, world: int) -> dict:
    import contextlib

    from phalanx.train.evaluate import evaluate

    return evaluate(TinyLM(), eval_batches_for(rank), torch.device("cpu"), contextlib.nullcontext)
