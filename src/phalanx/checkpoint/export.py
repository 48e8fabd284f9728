"""Write a from_pretrained folder from a checkpoint whose weights live only in its sharded state.

    phalanx export OUTPUT_DIR/checkpoint-400 EXPORTED_DIR

Under FSDP2 and DeepSpeed ZeRO-3, full fine-tuning keeps checkpoint-{step} lean: every rank writes
its shards of the weights and optimizer state (sharded_state/ through DCP, or deepspeed/ through
DeepSpeed's own checkpoint) and nothing is gathered to rank 0 (the final model and checkpoint-best
are complete from_pretrained folders). This reads the weights of such a checkpoint in one process,
whatever number of ranks saved it, builds the model from its config.json, and writes
model.safetensors, the config and the tokenizer files. What a LoRA adapter's export checks of its folder
(check_whole_adapter) is here too; the merge itself is models.merge, the command checkpoint.command.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.commit import is_committed, why_not_committed
from phalanx.checkpoint.layout import BEST, DS_DIR, DS_TAG, SHARDED_DIR, STEP_DIR, WEIGHTS, staging_dir
from phalanx.checkpoint.resume import FINISHED, RUN_RECORD
from phalanx.checkpoint.safe_load import check_deepspeed_checkpoint, dcp_reader
from phalanx.errors import PhalanxError
from phalanx.runtime.durable import check_can_create, fsync_tree, remove_dead_writers


def export_checkpoint(folder: Path, out: Path) -> Path:
    """Write `out` (a new folder) from the committed checkpoint `folder`; returns `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, out = Path(folder), Path(out)
    if not is_committed(folder):
        raise PhalanxError(
            f"{folder} is not a committed phalanx checkpoint ({why_not_committed(folder)}): give a checkpoint-* "
            "folder of a run, e.g. OUTPUT_DIR/checkpoint-400"
        )
    if (folder / WEIGHTS).is_file():
        raise PhalanxError(f"{folder} already holds from_pretrained weights; load it directly")
    deepspeed = (folder / DS_DIR / DS_TAG).is_dir()
    if not (folder / SHARDED_DIR).is_dir() and not deepspeed:
        raise PhalanxError(
            f"{folder} holds neither model weights nor {SHARDED_DIR}/ (FSDP2's sharded state) nor "
            f"{DS_DIR}/ (DeepSpeed's); nothing to export"
        )
    check_new_export_folder(out)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = read_deepspeed_weights(folder) if deepspeed else read_dcp_weights(folder, model)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if (folder / "generation_config.json").is_file():
        # The run's generation settings travel with its weights (the base model's sampling defaults, and the
        # end-of-turn ids its data trains: train/run.py); from_config alone derives them from config.json.
        model.generation_config = GenerationConfig.from_pretrained(folder)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        source = folder / (DS_DIR if deepspeed else SHARDED_DIR)
        raise PhalanxError(
            f"{source} does not fit its config.json: {len(still_meta)} weight(s) missing "
            f"{still_meta[:3]}, {len(unexpected)} unknown {unexpected[:3]}"
        )
    return write_new_folder(out, model, AutoTokenizer.from_pretrained(folder))


def check_new_export_folder(out: Path) -> None:
    """Refuse, before a model is loaded, an `out` that exists or that cannot be created (a read-only disk, a file on
    its path), where the save into its staging folder would end in an OSError traceback."""
    if out.exists():
        raise PhalanxError(f"{out} exists; choose a new folder to export into")
    check_can_create(out, f"phalanx export OUT {out}")


def write_new_folder(out: Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """`model` (safetensors) and `tokenizer` into the new folder `out`, whole or not at all."""
    # This process's own staging folder: two exports into one folder at once must not clear each other's files. Those
    # of exports that were killed (their process is gone) are removed.
    prefix = f"{staging_dir(out).name}-"
    remove_dead_writers(out.parent, prefix)
    staging = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        fsync_tree(staging)
        if out.exists():  # written meanwhile (another export): it is kept, this one is not moved over it
            raise PhalanxError(f"{out} appeared while this export was writing (another export?); it is left as it is")
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_whole_adapter(folder: Path) -> None:
    """A phalanx checkpoint must be committed, and a run's output_dir finished, before its adapter is exported: a
    save cut short can leave a partial adapter file."""
    if folder.name == BEST or STEP_DIR.fullmatch(folder.name):
        if not is_committed(folder):
            raise PhalanxError(
                f"{folder} is not a committed phalanx checkpoint ({why_not_committed(folder)}): give a committed "
                "checkpoint-* folder or the run's output_dir once the run has finished"
            )
    elif (folder / RUN_RECORD).is_file() and not (folder / FINISHED).is_file():
        raise PhalanxError(
            f"{folder}: the run has not finished (no {FINISHED}), so its adapter files may be a final save cut "
            "short; export one of its committed checkpoint-* folders instead"
        )


def read_dcp_weights(folder: Path, model: torch.nn.Module) -> dict:
    """The model's entries of FSDP2's sharded state, read by one process from every rank's pieces."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}  # tied weights once
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items() if k in names}
    # The optimizer's entries are not requested.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(
            {"model": state},
            storage_reader=dcp_reader(folder / SHARDED_DIR),
            no_dist=True,
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    return state


def read_deepspeed_weights(folder: Path) -> dict:
    """The fp32 weights of a ZeRO-3 checkpoint, merged from every rank's partition by DeepSpeed's own converter."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_deepspeed_checkpoint(folder / DS_DIR)  # the converter itself unpickles with weights_only=False
    return get_fp32_state_dict_from_zero_checkpoint(str(folder / DS_DIR), tag=DS_TAG)
