"""Flags and rank functions for the resume tests (importable by spawned ranks as checkpoint.resume_ranks)."""

import torch

from helpers import tiny_run

# 24 train rows (test_size 0.2), global batch 4: one epoch of 6 steps; checkpoints at steps 2, 4 and 6.
FLAGS = tiny_run({"max_steps": 6, "save_steps": 2, "test_size": 0.2, "checkpoint.save_best": False})
ROWS_PER_STEP = 4


def shape(world: int) -> list[str]:
    """The same global batch on any number of ranks."""
    return ["--world_size", str(world), "--batch_size", str(ROWS_PER_STEP // world)]


def resumed_state(rank: int, world: int, flags: list[str]) -> dict:
    """Build a run from `phalanx train FLAGS` as the CLI would (it resumes from the checkpoint the flags name),
    then report what it loaded: the whole model and optimizer state gathered to full tensors (rank 0), the
    counters, and the rows this rank's sampler hands out for the rest of the epoch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.train.run import build_run

    torch.set_num_threads(1)
    cfg = load_config(None, overrides_from_flags(split_flags(flags)[1]))
    run = build_run(cfg)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_state, optim_state = get_state_dict(run.strategy.model, run.optimizer, options=options)
    sampler = run.sampler.state_dict()
    return {
        "model": model_state,
        "optimizer": optim_state,
        "global_step": run.state.global_step,
        "tokens_seen": run.state.tokens_seen,
        "sampler": sampler,
        "rows": list(run.sampler),
        "num_rows": run.sampler.num_rows,
        "strategy": run.strategy.name,
    }
