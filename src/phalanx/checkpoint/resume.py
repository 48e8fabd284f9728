"""Decide where a run starts: fresh, from the newest committed checkpoint, or from a named one.

A run in output_dir is resumed by default when its config matches; a changed config is
shown as a diff and refused unless --force. Only committed checkpoints are considered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from phalanx.checkpoint.commit import committed_step_checkpoints, is_committed
from phalanx.config.schema import RunConfig
from phalanx.errors import ConfigError

# Fields that may change between the run that saved and the run that resumes.
RESUME_FREE = ("output_dir", "overwrite_output_dir", "force", "checkpoint.resume_from_checkpoint", "checkpoint.async_save", "logging.",
               "distributed.world_size", "distributed.master_port", "distributed.max_restarts", "distributed.backend",
               "distributed.timeout_minutes", "distributed.init_timeout_minutes")
RUN_ARTIFACTS = ("training_info.json", "final_training_info.json", "metrics.jsonl", "checkpoint-best")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(saved: dict, current: dict) -> list[str]:
    old, new = flatten(saved), flatten(current)
    defaults = flatten(RunConfig().model_dump())
    lines = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUME_FREE) or key in RESUME_FREE:
            continue
        if key not in old and new.get(key) == defaults.get(key):
            continue  # a field added after the checkpoint was written, left at its default
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return lines


def existing_run_artifacts(output_dir: Path) -> list[str]:
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name in RUN_ARTIFACTS or p.name.startswith("checkpoint-"))


def saved_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{folder}/trainer_state.json cannot be read ({exc}); resume from another checkpoint "
                          "with --resume_from_checkpoint PATH, or --overwrite_output_dir") from None


def restarted() -> bool:
    """This process is a restart of the same job: torch's elastic agent or a SLURM requeue started it again."""
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def resume_point(cfg: RunConfig) -> Optional[Path]:
    """The checkpoint folder to resume from, None for a fresh start; ConfigError when neither is right."""
    out = Path(cfg.output_dir)
    requested = cfg.checkpoint.resume_from_checkpoint
    if cfg.overwrite_output_dir:
        if requested:
            raise ConfigError("--overwrite_output_dir starts over, --resume_from_checkpoint continues: choose one")
        return None
    if requested not in (None, "latest"):
        folder = Path(requested)
        if not is_committed(folder):
            raise ConfigError(f"checkpoint.resume_from_checkpoint = {requested!r} is not a committed phalanx checkpoint "
                              "(a checkpoint-N folder holding phalanx_checkpoint.json); use 'latest' or such a folder")
    else:
        checkpoints = committed_step_checkpoints(out)
        found = existing_run_artifacts(out)
        if not checkpoints:
            if restarted():
                return None  # a restart (elastic or SLURM requeue) before the first save starts the run over
            if requested == "latest":
                raise ConfigError(f"--resume_from_checkpoint latest: {out} holds no committed checkpoint-N folder")
            if found:
                raise ConfigError(f"output_dir {out} already holds a run ({', '.join(found[:4])}) with no committed "
                                  "checkpoint to resume from. Choose another --output_dir, or pass --overwrite_output_dir "
                                  "to replace it.")
            return None
        folder = checkpoints[-1][1]
    diff = config_diff(saved_config(folder), cfg.model_dump())
    if requested is None and not diff and (out / "final_training_info.json").is_file():
        raise ConfigError(f"output_dir {out} holds a finished run with this config. Choose another --output_dir, "
                          "pass --overwrite_output_dir to train it again, or change max_steps/num_epochs and --force to extend it.")
    if diff and not cfg.force:
        raise ConfigError(f"{folder} was trained with a different config:\n    " + "\n    ".join(diff) +
                          "\nPass --force to resume with the new values, --overwrite_output_dir to start over, "
                          "or another --output_dir.")
    return folder
