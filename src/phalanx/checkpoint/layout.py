"""Names of what a checkpoint folder holds, in one place: every writer and reader imports them from here.

These names are the on-disk format: a checkpoint written by one version of phalanx is resumed, exported
and loaded by the next, so a name changes only with a way to read the old one.

  output_dir/checkpoint-{step}/       step checkpoints (STEP_DIR); checkpoint-best/ (BEST); engine: checkpoint-last/ (LAST)
  output_dir/.{name}.staging/         a save being written; never read (staging_dir)
  output_dir/.{name}.retired/         the committed copy a new save of the same name is replacing (retired_dir)
  {name}/phalanx_checkpoint.json      the commit marker, written last (MARKER)
  output_dir/metrics.jsonl, tensorboard/   the run's records (METRICS_FILE, TENSORBOARD_DIR)
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "phalanx_checkpoint.json"
STEP_DIR = re.compile(r"checkpoint-(\d+)")
STAGING_STEP_DIR = re.compile(r"\.checkpoint-(\d+)\.staging")  # a step checkpoint still being written
BEST = "checkpoint-best"
LAST = "checkpoint-last"

TRAINER_STATE = "trainer_state.json"  # counters, sampler position, config (rank 0)
WEIGHTS = "model.safetensors"  # a full model (from_pretrained) or an engine model's state_dict
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a PEFT adapter
SHARDED_DIR = "sharded_state"  # FSDP2: every rank's shards of weights and optimizer (DCP)
DS_DIR, DS_TAG = "deepspeed", "state"  # DeepSpeed's own checkpoint: DS_DIR/DS_TAG/
EMA = "ema"  # the engine's EMA weights, saved like any stateful object: ema.pt

# A run's records beside its checkpoints in output_dir: written by observe.metrics, set aside with a run's
# checkpoints when a fresh run starts in the same folder (checkpoint.resume), so both read the names from here.
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def step_dir(step: int) -> str:
    return f"checkpoint-{step}"


def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.staging"


def final_model_staging(output_dir: Path) -> Path:
    """Where the final save writes the model before moving its files into output_dir itself, one rename each."""
    return staging_dir(Path(output_dir) / "final")


def retired_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.retired"


def state_file(name: str) -> str:
    """The file rank 0 writes a stateful object's state_dict() to (torch.save, read with weights_only=True)."""
    return f"{name}.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pt"
