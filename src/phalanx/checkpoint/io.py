"""What a training checkpoint holds and how it is written and read back.

Layout of checkpoint-{step}/ (and checkpoint-best/):
  adapter_model.safetensors + adapter_config.json   (LoRA)  or  model.safetensors + config.json (full)
  tokenizer files
  optimizer.pt, scheduler.pt, precision.pt          (rank 0; plain tensors, read with weights_only=True)
  rng_state_{rank}.pt                               (every rank)
  trainer_state.json                                (counters, sampler position, config)
  phalanx_checkpoint.json                           (commit marker, written last)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from phalanx.checkpoint.commit import commit, fresh_staging_dir
from phalanx.errors import PhalanxError
from phalanx.runtime import dist as rt
from phalanx.runtime.seed import load_rng_state, rng_state


class CheckpointWriteError(PhalanxError):
    def __init__(self, final: Path, exc: Exception):
        from phalanx.checkpoint.commit import committed_step_checkpoints

        free_mb = shutil.disk_usage(final.parent).free / 2**20 if final.parent.exists() else 0.0
        kept = [p.name for _, p in committed_step_checkpoints(final.parent)]
        shutil.rmtree(final.parent / f".{final.name}.staging", ignore_errors=True)
        super().__init__(
            f"cannot write checkpoint {final.name} into {final.parent}: {exc}. Free space there: {free_mb:.1f} MB. "
            f"Committed checkpoints are intact: {kept or 'none yet'}. Free space or fix permissions, then rerun "
            "the same command to resume."
        )


def _portable_rng(state: dict) -> dict:
    """RNG state as tensors and ints only, so it loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    out = dict(state)
    out["python"] = [state["python"][0], list(state["python"][1]), state["python"][2]]
    out["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
    return out


def _native_rng(state: dict) -> dict:
    out = dict(state)
    version, internal, gauss = state["python"]
    out["python"] = (version, tuple(internal), gauss)
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    out["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np)
    return out


def save_model_files(model: nn.Module, tokenizer: Any, folder: Path, state_dict: Optional[dict] = None) -> None:
    """The model (or adapter) as safetensors plus the tokenizer: loadable with from_pretrained.

    `state_dict`: full weights gathered by a sharding strategy (the model's own tensors are shards then)."""
    if state_dict is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def save_checkpoint(
    final: Path,
    *,
    rank: rt.RankInfo,
    model: nn.Module,
    tokenizer: Any,
    stateful: dict[str, Any],
    trainer_state: dict,
    model_state: Optional[dict] = None,
    sharded: Optional[Any] = None,
) -> None:
    """Every rank calls this. `stateful` maps names to objects with state_dict() saved by rank 0.

    `model_state`: gathered weights for rank 0's save_pretrained; `sharded`: a strategy whose
    save_sharded(folder) every rank calls to write its part of the training state."""
    try:
        staging = fresh_staging_dir(final) if rank.is_main else final.parent / f".{final.name}.staging"
        rt.barrier()  # staging exists before any rank writes into it
        torch.save(_portable_rng(rng_state()), staging / f"rng_state_{rank.rank}.pt")
        if sharded is not None:
            sharded.save_sharded(staging)
        if rank.is_main:
            save_model_files(model, tokenizer, staging, model_state)
            for name, obj in stateful.items():
                torch.save(obj.state_dict(), staging / f"{name}.pt")
            (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, default=str), encoding="utf-8")
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        raise CheckpointWriteError(final, exc) from exc
    rt.barrier()  # every rank's files are written
    if rank.is_main:
        commit(staging, final, {"global_step": trainer_state.get("global_step"), "world_size": rank.world_size})
    rt.barrier()  # nobody reads or deletes checkpoints while the rename is in flight


def load_checkpoint(
    folder: Path, *, rank: rt.RankInfo, model: nn.Module, stateful: dict[str, Any], finetune: str,
    sharded: Optional[Any] = None,
) -> dict:
    """Restore weights, stateful objects and this rank's RNG; returns trainer_state.json's content."""
    from phalanx.checkpoint.commit import is_committed

    if not is_committed(folder):
        raise PhalanxError(f"{folder} is not a committed phalanx checkpoint (no phalanx_checkpoint.json); it may be a save that crashed")
    if sharded is not None:
        sharded.load_sharded(folder)  # weights and optimizer, each rank its own shards
    else:
        load_model_weights(model, folder, finetune)
    for name, obj in stateful.items():
        obj.load_state_dict(torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True))
    rng_file = folder / f"rng_state_{rank.rank}.pt"
    if rng_file.is_file():
        load_rng_state(_native_rng(torch.load(rng_file, map_location="cpu", weights_only=True)))
    return json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))


def load_model_weights(model: nn.Module, folder: Path, finetune: str) -> None:
    """Load saved safetensors into `model`, refusing a checkpoint of another shape with the names that differ."""
    if finetune == "lora":
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        state = load_file(folder / "adapter_model.safetensors")
        check_same_shapes(folder, state, get_peft_model_state_dict(model), allow_missing=set())
        set_peft_model_state_dict(model, state)
        return
    state = load_file(folder / "model.safetensors")
    own = model.state_dict()
    # save_pretrained leaves out weights tied to others (the output head tied to the embeddings).
    check_same_shapes(folder, state, own, allow_missing={k for k in own if _is_tied(model, k)})
    model.load_state_dict(state, strict=False)


def check_same_shapes(folder: Path, saved: dict, expected: dict, allow_missing: set) -> None:
    """Refuse a checkpoint of another model or adapter shape, naming the tensors that differ."""
    shapes = [f"{k}: checkpoint {list(v.shape)} vs model {list(expected[k].shape)}"
              for k, v in saved.items() if k in expected and expected[k].shape != v.shape]
    unknown = [k for k in saved if k not in expected]
    missing = [k for k in expected if k not in saved and k not in allow_missing]
    if shapes or unknown or missing:
        raise PhalanxError(
            f"{folder} does not fit this model: {len(shapes)} tensor(s) differ in shape {shapes[:3]}, "
            f"{len(unknown)} unknown {unknown[:3]}, {len(missing)} missing {missing[:3]}. "
            "Resume with the model and adapter settings it was trained with."
        )


def _is_tied(model: nn.Module, key: str) -> bool:
    tied: Optional[Any] = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict):
        return key in tied
    return bool(tied) and any(key.endswith(t) or t in key for t in tied)
