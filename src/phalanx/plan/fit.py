"""What fits on one device, for callers outside `phalanx plan`'s own command too: the strategy row a config runs as,
and the size of the merged passes a GPU run takes (training.merge_micro_batches). `phalanx train` asks
`merge_tokens_that_fit` on every rank before it builds its run; `phalanx plan` prices the same pass."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from phalanx.config.schema import RunConfig
from phalanx.plan.estimate import Setup, setup_from_config, strategy_rows, zero_label
from phalanx.plan.model import ModelFacts, model_facts

# Token budgets tried for larger passes, largest first (plan's --batch_tokens advice, merged passes).
THROUGHPUT_BUDGETS = (32768, 16384, 8192)


def configured_strategy(cfg: RunConfig, world: int, on_gpu: bool) -> str:
    """The row this config runs as, with its DeepSpeed / FSDP JSON read as the run reads it. First the refusals the
    run would give before any rank starts (a JSON that contradicts the run config): the same function as train's."""
    from phalanx.parallel import check_before_launch, launch_precision

    check_before_launch(cfg, world, on_gpu)
    d = cfg.distributed
    if d.strategy == "fsdp":
        from phalanx.parallel.config_files import fsdp_settings

        sharding, offload, _ = fsdp_settings(d)  # an FSDP JSON's settings, as the run will take them
        sharding = "FULL_SHARD" if sharding == "HYBRID_SHARD" else sharding  # the same bytes per rank
        return f"fsdp {sharding}" + (" +offload" if offload else "")
    if d.strategy == "deepspeed":
        stage, offload_opt, offload_param = d.zero_stage, d.offload_optimizer, d.offload_param
        if d.deepspeed_config:  # the JSON's stage and offload where the run config leaves them, as the run merges
            from phalanx.parallel.deepspeed import build_ds_config

            zero = build_ds_config(cfg, world, launch_precision(cfg, on_gpu)).get("zero_optimization", {})
            stage = zero.get("stage", stage)
            offload_opt, offload_param = (
                (zero.get(key) or {}).get("device", "none") != "none" for key in ("offload_optimizer", "offload_param")
            )
        return zero_label(stage or 1, offload_opt, offload_param)
    return "single process" if d.world_size == 1 else "ddp"


def merge_tokens_that_fit(cfg: RunConfig, device_memory: int) -> Optional[int]:
    """For a CUDA run whose step's micro-batches merge with no merge_tokens set: the largest of THROUGHPUT_BUDGETS,
    above what one micro-batch holds, whose merged pass this estimate fits in `device_memory` under the run's own
    strategy and checkpointing (no data read: every row at its bound). None: merging keeps that bound. The estimate
    runs above the measured peaks (RESULTS: 51.6 GiB estimated for 38.7 GB measured), so the margin is on the safe
    side."""
    setup = setup_from_config(cfg, "cuda")
    if setup.merge_tokens is None or cfg.training.merge_tokens is not None:
        return None
    facts = model_facts(cfg)
    strategy = configured_strategy(cfg, setup.world, on_gpu=True)
    return fitting_merge(facts, setup, strategy, cfg.model.gradient_checkpointing, device_memory)


def fitting_merge(
    facts: ModelFacts, setup: Setup, strategy: str, checkpointing: bool, device_memory: int
) -> Optional[int]:
    """merge_tokens_that_fit over what the caller already has (`phalanx plan` builds the facts once)."""
    if setup.merge_tokens is None or not facts.packable:
        return None
    for budget in THROUGHPUT_BUDGETS:
        if budget <= setup.merge_tokens:
            return None
        rows = strategy_rows(facts, replace(setup, merge_tokens=budget), device_memory=device_memory, ds_config=None)
        row = next((r for r in rows if r.strategy == strategy), None)
        if row is not None and (row.fits_ckpt if checkpointing else row.fits):
            return min(budget, setup.merge_tokens * setup.accumulation)  # never more than a whole step holds
    return None
