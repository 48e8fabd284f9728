"""`phalanx plan CONFIG.yaml [--world_size N] [--device_memory_gb X]`: the table, the recommendation, or JSON."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

from phalanx.config.loader import read_json_mapping
from phalanx.config.schema import RunConfig
from phalanx.errors import ConfigError
from phalanx.plan.estimate import (
    ALLOCATOR_SLACK,
    OVERHEAD_BYTES,
    STRATEGIES,
    GiB,
    Row,
    Setup,
    setup_from_config,
    strategy_rows,
)
from phalanx.plan.fit import THROUGHPUT_BUDGETS, configured_strategy, fitting_merge
from phalanx.plan.model import ModelFacts, model_facts

ORDER = {s.label: k for k, s in enumerate(STRATEGIES)}


@dataclass
class Plan:
    facts: ModelFacts
    setup: Setup
    device_memory: int
    rows: list[Row]
    configured: str  # the row this config runs as
    recommended: Optional[Row]
    recommended_ckpt: bool
    reason: str
    advice: list[str] = field(default_factory=list)


def choose(rows: list[Row]) -> tuple[Optional[Row], bool]:
    """The least communication that fits: without checkpointing, then with it, then offloading (slowest)."""
    ranked = sorted(rows, key=lambda r: ORDER.get(r.strategy, -1))
    plain = [r for r in ranked if "offload" not in r.strategy]
    offload = [r for r in ranked if "offload" in r.strategy]
    for candidates, ckpt in ((plain, False), (plain, True), (offload, False), (offload, True)):
        for row in candidates:
            if row.fits_ckpt if ckpt else row.fits:
                return row, ckpt
    return None, False


def with_data_lengths(cfg: RunConfig, setup: Setup, read: bool = True) -> Setup:
    """`setup` with the largest packed micro-batch the data can make: the batch_size longest rows (tokens) and the
    batch_size rows with the most targets, after max_length, as `phalanx train` tokenizes them (through the same
    cache, so the run reuses the work). For a hub dataset, or with read=False, the bound batch x max_length
    stays and the note says so."""
    if not setup.packing:
        return setup
    if setup.token_budget is not None:
        return replace(
            setup,
            data_note=f"training.batch_tokens = {setup.token_budget:,}: each micro-batch is filled up "
            "to that many tokens",
        )
    bound = f"batch_size x max_length = {setup.tokens:,} tokens, an upper bound"
    if not read:
        return replace(setup, data_note=f"{bound} (--read_data false)")
    from phalanx.data.prepare import BUNDLED_DATASET, prepare_data

    if cfg.data.dataset_name and cfg.data.dataset_name != BUNDLED_DATASET:
        return replace(setup, data_note=f"{bound} (hub data is not downloaded to plan; local files are read)")
    from phalanx.errors import DataError
    from phalanx.models.load import cache_root, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.model.model_name, cfg.model.trust_remote_code, cfg.data.chat_template)
        data = prepare_data(cfg.data, tokenizer, seed=cfg.training.seed, cache_root=cache_root() / "data")
    except (ConfigError, DataError) as exc:
        return replace(setup, data_note=f"{bound} (the data could not be read: {exc})")
    lengths = [len(ids) for ids in data.train["input_ids"]]
    targets = [sum(1 for y in labels[1:] if y != -100) for labels in data.train["labels"]]
    if not lengths:
        return replace(setup, data_note=f"{bound} (the data has no training rows)")
    b = setup.batch
    tokens, most = sum(sorted(lengths)[-b:]), sum(sorted(targets)[-b:])
    mean = sum(lengths) / len(lengths)
    return replace(
        setup,
        data_tokens=tokens,
        data_targets=most,
        data_note=f"from the data: the {min(b, len(lengths))} longest of {len(lengths):,} rows "
        f"({tokens:,} tokens; rows average {mean:,.0f}), at most {most:,} target positions",
    )


def make_plan(cfg: RunConfig, device: str, device_memory: int, read_data: bool = True) -> Plan:
    facts = model_facts(cfg)
    setup = setup_from_config(cfg, device)
    configured = configured_strategy(cfg, setup.world, on_gpu=device == "cuda")  # refuses first, as train does
    fitted = None
    if device == "cuda" and cfg.training.merge_tokens is None:
        fitted = fitting_merge(facts, setup, configured, cfg.model.gradient_checkpointing, device_memory)
    if fitted is not None:  # the run merges a step's micro-batches into passes this large on such a GPU
        setup = replace(setup, merge_tokens=fitted)
    setup = with_data_lengths(cfg, setup, read_data and facts.packable)
    ds_config = _read_json(cfg.distributed.deepspeed_config)
    rows = sorted(
        strategy_rows(facts, setup, device_memory=device_memory, ds_config=ds_config),
        key=lambda r: ORDER.get(r.strategy, -1),
    )
    choice, ckpt = choose(rows)
    if choice is None:
        advice = _more_ranks(facts, setup, device_memory, ds_config) + _smaller(
            cfg, facts, setup, device_memory, ds_config, rows
        )
        return Plan(
            facts,
            setup,
            device_memory,
            rows,
            configured,
            None,
            False,
            f"no strategy fits in {_human(device_memory)} per rank, even with activation checkpointing and offload",
            advice,
        )
    need = choice.total_ckpt if ckpt else choice.total
    reason = f"{choice.comm}; needs {_human(need)} of {_human(device_memory)} per rank"
    if ckpt:
        reason += " (nothing fits without activation checkpointing)"
    if choice.host:
        reason += f", and {_human(choice.host)} of host memory per rank"
    slow = "offload" in choice.strategy or ckpt
    advice = _more_ranks(facts, setup, device_memory, ds_config) if slow else []
    if not slow:
        advice += _more_tokens_per_micro_batch(facts, setup, device_memory, ds_config, choice.strategy)
    return Plan(facts, setup, device_memory, rows, configured, choice, ckpt, reason, advice)


# Token budgets (training.batch_tokens) the plan tries on a GPU, largest first. On an H100 a LoRA step of 4 rows
# (~3,700 tokens) was bound by the host launching kernels: 16,384-token micro-batches gave 2.84x its tokens/s, eager
# (benchmarks/RESULTS.md, 2026-11-27; full fine-tuning: MFU 12.1% -> 39.5%).
def _more_tokens_per_micro_batch(
    facts: ModelFacts, setup: Setup, device_memory: int, ds_config: Optional[dict], strategy: str
) -> list[str]:
    """On a GPU, the largest token budget that still fits under `strategy` without checkpointing, where it holds at
    least twice what batch_size rows do: advice, never applied (a larger batch changes the training, not only its
    speed)."""
    if setup.device != "cuda" or not (setup.packing and facts.packable) or setup.token_budget is not None:
        return []
    if setup.merge_tokens is not None:  # the run merges its micro-batches into larger passes itself, same training
        return []
    for budget in THROUGHPUT_BUDGETS:
        if budget < max(setup.seq, 2 * setup.packed_tokens):
            return []
        rows = strategy_rows(
            facts, replace(setup, token_budget=budget), device_memory=device_memory, ds_config=ds_config
        )
        row = next((r for r in rows if r.strategy == strategy), None)
        if row is not None and row.fits:
            return [
                f"more tokens per micro-batch, for speed: --batch_tokens {budget} fits under {strategy} "
                f"({_human(row.total)} per rank) where {setup.batch} row{'s hold' if setup.batch > 1 else ' holds'} at most "
                f"{setup.packed_tokens:,} tokens. "
                "On an H100, 16,384-token micro-batches gave 2.84x the tokens/s of 4 rows (benchmarks/RESULTS.md). "
                "It is a larger batch: fewer optimizer steps per epoch, so revisit the learning rate"
            ]
    return []


def _more_ranks(facts: ModelFacts, setup: Setup, device_memory: int, ds_config: Optional[dict]) -> list[str]:
    """The fewest ranks on which a strategy without offload fits (checkpointing allowed), if any up to 4096."""
    for world in (2**k for k in range(1, 13)):
        if world <= setup.world:
            continue
        rows = strategy_rows(facts, replace(setup, world=world), device_memory=device_memory, ds_config=ds_config)
        row, ckpt = choose([r for r in rows if "offload" not in r.strategy])
        if row is not None:
            flags = " ".join(
                f for f in (f"--world_size {world}", row.flags, "--gradient_checkpointing true" if ckpt else "")
            )
            return [f"more ranks: {row.strategy} fits on {world} ranks without offload ({flags.strip()})"]
    return []


def _smaller(
    cfg: RunConfig, facts: ModelFacts, setup: Setup, device_memory: int, ds_config: Optional[dict], rows: list[Row]
) -> list[str]:
    advice = []
    smallest = min(rows, key=lambda r: r.total_ckpt)
    share = smallest.activations_ckpt / max(smallest.peak_ckpt, 1)
    if share > 0.25:
        advice.append(
            f"shorter micro-batches: activations are {share:.0%} of the smallest peak ({smallest.strategy}, "
            "checkpointed); lower --batch_size (and raise --gradient_accumulation_steps to keep the global "
            "batch) or --max_length"
        )
    if setup.finetune == "full":
        lora = cfg.model_copy(update={"model": cfg.model.model_copy(update={"finetune": "lora"})})
        lora_rows = strategy_rows(
            model_facts(lora), replace(setup, finetune="lora"), device_memory=device_memory, ds_config=ds_config
        )
        best = min(lora_rows, key=lambda r: r.total_ckpt)
        if best.total_ckpt < 0.9 * smallest.total_ckpt:  # worth saying only where weights, not activations, weigh
            advice.append(
                f"LoRA instead of full fine-tuning (--finetune lora): {best.strategy} with checkpointing "
                f"needs {_human(best.total_ckpt)} per rank"
            )
    advice.append(
        f"the smallest here, {smallest.strategy} with checkpointing, needs {_human(smallest.total_ckpt)} per rank"
    )
    return advice


def _read_json(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    return read_json_mapping(path, "distributed.deepspeed_config")


# ------------------------------------------------------------------------------------------------ output
def _human(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if n >= 10 * size else f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def render(plan: Plan) -> str:
    m, s = plan.facts, plan.setup
    dtype = "fp32" if s.compute_bytes == 4 else "bf16/fp16 mixed precision"
    if s.packing and m.packable and s.merge_tokens is not None:
        batch = (
            f"a merged pass of up to {s.packed_tokens:,} tokens (a step's {s.accumulation} micro-batches packed "
            f"together: training.merge_micro_batches)"
        )
    elif s.packing and m.packable and s.token_budget is not None:
        batch = f"a packed micro-batch of up to {s.packed_tokens:,} tokens ({s.data_note})"
    elif s.packing and m.packable:
        batch = f"a packed micro-batch of {s.batch} rows, {s.packed_tokens:,} tokens ({s.data_note})"
    else:
        why = "" if not s.packing else f" (packing off: {m.model_type or 'this model'} is not checked for packing)"
        batch = f"a padded micro-batch of {s.batch} x {s.seq} tokens{why}"
    if s.graph_shapes and s.packing and m.packable:
        batch += (
            ", padding rows included (training.cuda_graphs' fixed shapes; a run takes them under one process or ddp)"
        )
    head = (
        "output head and loss at target positions only, in chunks"
        if m.target_head
        else "output head over every position (full logits)"
    )
    lines = [
        f"Memory plan for {m.name}: {s.finetune} fine-tuning, {m.trainable_params:,} of {m.total_params:,} parameters train",
        f"{s.world} rank(s), {s.device}, {dtype}; per rank {batch}, accumulation {s.accumulation}; {head}. "
        "Bytes per rank:",
        "",
    ]
    header = ["strategy", "params", "grads", "optimizer", "activ.", "activ.ckpt", "peak", "peak ckpt", "host", "fits"]
    table = [header]
    for r in plan.rows:
        mark = " *" if r.strategy == plan.configured else ""
        table.append(
            [
                r.strategy + mark,
                _human(r.params),
                _human(r.grads),
                _human(r.optimizer),
                _human(r.activations),
                _human(r.activations_ckpt),
                _human(r.peak),
                _human(r.peak_ckpt),
                _human(r.host) if r.host else "-",
                "yes" if r.fits else ("ckpt" if r.fits_ckpt else "no"),
            ]
        )
    widths = [max(len(row[k]) for row in table) for k in range(len(header))]
    for k, row in enumerate(table):
        lines.append(
            "  ".join([row[0].ljust(widths[0])] + [row[j].rjust(widths[j]) for j in range(1, len(row))]).rstrip()
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "* this config's strategy. peak = params + optimizer + the larger of (activations [+ grads while accumulating])",
        "  and (grads + optimizer scratch); 'fits': peak"
        + (f" x {1 + ALLOCATOR_SLACK[s.device]:.2f}" if ALLOCATOR_SLACK[s.device] else "")
        + f" + {_human(OVERHEAD_BYTES[s.device])} fixed overhead <= {_human(plan.device_memory)}"
        + ("; 'ckpt': fits with activation checkpointing" if any(r.fits_ckpt and not r.fits for r in plan.rows) else "")
        + ". Method: docs/plan.md",
    ]
    if s.base_4bit_bytes:
        lines.append(
            f"  load_in_4bit: the single-process/ddp row stores the base's linear weights in "
            f"{s.base_4bit_bytes:.3f} bytes each; the sharded rows price the base unquantized (an overestimate)"
        )
    if not m.known_layout:
        lines.append(
            "  note: not a Llama-family decoder layer: activations use a generic formula, expect a rougher estimate"
        )
    if any(r.strategy.startswith("ZeRO") for r in plan.rows):
        lines.append(
            "  ZeRO rows include DeepSpeed's reduce bucket (reduce_bucket_size elements: what trains, at most 5e8, "
            "unless a --deepspeed_config sets it)"
        )
    lines.append("")
    r = plan.recommended
    if r is None:
        lines.append(f"Recommended: none: {plan.reason}. What would help:")
        lines += [f"  - {a}" for a in plan.advice]
        return "\n".join(lines)
    flags = " ".join(f for f in (r.flags, "--gradient_checkpointing true" if plan.recommended_ckpt else "") if f)
    lines.append(
        f"Recommended: {r.strategy} on {s.world} rank(s)" + (f" ({flags})" if flags else "") + f": {plan.reason}."
    )
    lines += [f"  - {a}" for a in plan.advice]
    if plan.configured != r.strategy:
        mine = next((row for row in plan.rows if row.strategy == plan.configured), None)
        if mine is not None:
            state = "fits too" if mine.fits else ("fits with checkpointing" if mine.fits_ckpt else "does not fit")
            lines.append(f"This config's {plan.configured} {state}.")
        else:
            lines.append(
                f"This config runs as {plan.configured}, which plan has no estimate for: the rows above are the ones it has."
            )
    return "\n".join(lines)


def to_json(plan: Plan) -> dict:
    facts = {
        k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(plan.facts).items() if k != "param_sizes"
    }
    r = plan.recommended
    return {
        "model": facts,
        "setup": asdict(plan.setup),
        "device_memory": plan.device_memory,
        "overhead": OVERHEAD_BYTES[plan.setup.device],
        "allocator_slack": ALLOCATOR_SLACK[plan.setup.device],
        "rows": [asdict(row) for row in plan.rows],
        "configured": plan.configured,
        "recommended": r.strategy if r else None,
        "recommended_flags": r.flags if r else None,
        "recommended_with_checkpointing": plan.recommended_ckpt,
        "reason": plan.reason,
        "advice": plan.advice,
    }


# ------------------------------------------------------------------------------------------------ command
OWN_FLAGS = ("device_memory_gb", "device", "json", "read_data")
USAGE = """usage: phalanx plan [CONFIG.yaml] [--world_size N] [--device_memory_gb X] [--device cuda|cpu] [--json]
                    [--read_data true|false] [--flag value ...]

Bytes per rank for parameters, gradients, optimizer state and activations (with and without activation
checkpointing) under each strategy, and the one with the least communication that fits. Takes the same
CONFIG.yaml and flags as `phalanx train`; reads the model's config.json only, never its weights.

  --world_size N        ranks to plan for (default: the config's distributed.world_size)
  --device_memory_gb X  memory of one rank's device in GiB (default: the visible CUDA device's; on CPU the
                        machine's RAM divided by the ranks, which share it)
  --device cuda|cpu     the device type to plan for (default: cuda when one is visible); mixed_precision
                        'auto' means bf16 on cuda, fp32 on cpu
  --json                print the plan as JSON
  --read_data true|false  packed micro-batches (data.packing) hold the sum of their rows' lengths: plan tokenizes
                        local data (data.dataset_path, the bundled rows) as train would (same cache) and prices
                        the batch_size longest rows (default true); false, or hub data: batch_size x max_length, an upper bound

The method and its measured accuracy: docs/plan.md."""


def device_memory_for(device: str, world: int) -> int:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "no CUDA device is visible here: say how much memory one has, e.g. --device_memory_gb 80, "
                "or plan for this machine's CPU with --device cpu"
            )
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world


def main(args: Sequence[str]) -> int:
    if "-h" in args or "--help" in args:
        print(USAGE)
        return 0
    from phalanx.config.loader import config_from_args
    from phalanx.runtime.quiet import quiet_libraries

    cfg, _, pairs = config_from_args(args, own_flags=OWN_FLAGS)
    own = dict((name, value) for name, value in pairs if name in OWN_FLAGS)
    quiet_libraries()
    import torch

    device = own.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device!r}: accepted values are cuda and cpu")
    if "device_memory_gb" in own:
        try:
            gb = float(own["device_memory_gb"])
        except ValueError:
            gb = math.nan
        if not (gb > 0 and math.isfinite(gb)):
            raise ConfigError(
                f"--device_memory_gb {own['device_memory_gb']!r}: give one rank's device memory in GiB, "
                "a number above 0 (e.g. 80 for an 80 GB GPU)"
            )
        device_memory = int(gb * GiB)
    else:
        device_memory = device_memory_for(device, cfg.distributed.world_size)
    read = own.get("read_data", "true").lower()
    if read not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"--read_data {own['read_data']!r}: accepted values are true and false")
    switch = own.get("json", "false").lower()
    if switch not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(
            f"--json takes no value (got {own['json']!r}); give CONFIG.yaml first: phalanx plan CONFIG.yaml --json"
        )
    as_json = switch in ("true", "1", "yes")
    plan = make_plan(cfg, device, device_memory, read_data=read in ("true", "1", "yes"))
    print(json.dumps(to_json(plan), indent=2) if as_json else render(plan))
    return 0
