"""What a training checkpoint holds and how it is written and read back.

Layout of checkpoint-{step}/ (and checkpoint-best/):
  adapter_model.safetensors + adapter_config.json   (LoRA)  or  model.safetensors + config.json (full; under FSDP2
                                                    config.json only in checkpoint-{step}: sharded_state/ holds it)
  tokenizer files
  optimizer.pt, scheduler.pt, precision.pt          (rank 0; plain tensors, read with weights_only=True: safe_load)
  rng_state_{rank}.pt                               (every rank)
  trainer_state.json                                (counters, sampler position, config)
  sharded_state/                                    (FSDP2: every rank's shards of weights + optimizer, DCP)
  phalanx_checkpoint.json                           (commit marker, written last)

A save is synchronous (committed when save_checkpoint returns) or asynchronous (state copied
to CPU memory, written in the background, committed by rank 0 once complete: PendingCheckpoint).
This module is the mechanism; when to save, which folder is best, one save in flight and retention
are the Checkpointer's decisions (checkpoint/checkpointer.py). File and folder names: layout.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from phalanx.checkpoint.commit import (
    commit,
    committed_copy,
    committed_step_checkpoints,
    fresh_staging_dir,
    is_committed,
    why_not_committed,
)
from phalanx.checkpoint.layout import (
    ADAPTER_WEIGHTS,
    DS_DIR,
    SHARDED_DIR,
    TRAINER_STATE,
    WEIGHTS,
    rng_file,
    staging_dir,
    state_file,
)
from phalanx.checkpoint.safe_load import load_state_file
from phalanx.errors import PhalanxError
from phalanx.runtime import dist as rt
from phalanx.runtime.seed import load_rng_state, rng_state


class CheckpointWriteError(PhalanxError):
    def __init__(self, final: Path, exc: Exception, main: bool):
        free_mb = shutil.disk_usage(final.parent).free / 2**20 if final.parent.exists() else 0.0
        kept = [p.name for _, p in committed_step_checkpoints(final.parent)]
        if main:  # the staging folder is rank 0's: removed under another rank, rank 0's own write failed on its parent
            shutil.rmtree(staging_dir(final), ignore_errors=True)
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


def save_model_files(
    model: nn.Module, tokenizer: Any, folder: Path, state_dict: Optional[dict] = None, weights: bool = True
) -> None:
    """The model (or adapter) as safetensors plus the tokenizer: loadable with from_pretrained.

    `state_dict`: full weights gathered by a sharding strategy (the model's own tensors are shards then).
    `weights=False`: the config and tokenizer only, for a checkpoint whose sharded state holds the weights."""
    if not weights:
        for part in ("config", "generation_config"):
            if getattr(model, part, None) is not None:
                getattr(model, part).save_pretrained(folder)
    elif state_dict is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


class PlainWeights:
    """Any nn.Module as the `save_pretrained` that save_checkpoint calls: its state_dict as one model.safetensors
    (no config, no tokenizer). TrainingEngine's models are saved this way; load_model_weights reads them back."""

    def __init__(self, module: nn.Module):
        self.module = module

    def save_pretrained(self, folder: Path, safe_serialization: bool = True, state_dict: Optional[dict] = None) -> None:
        # Own CPU copies: safetensors refuses tensors that share storage (tied weights).
        state = self.module.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        save_file(state, str(Path(folder) / WEIGHTS), metadata={"format": "pt", "saved_by": "phalanx.engine"})


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
    asynchronous: bool = False,
    after_commit: Optional[Callable[[], Any]] = None,
    model_files: bool = True,
) -> Optional["PendingCheckpoint"]:
    """Every rank calls this. `stateful` maps names to objects with state_dict() saved by rank 0.

    `model_state`: gathered weights for rank 0's save_pretrained; `sharded`: a strategy whose
    save_sharded(folder) every rank calls to write its part of the training state; `after_commit`:
    run by rank 0 once the checkpoint is committed (retention); `model_files=False`: no from_pretrained weights
    (the sharded state holds them; `phalanx export` writes them from it).

    `asynchronous`: copy everything to CPU memory now, write it in the background and return a
    PendingCheckpoint; rank 0 commits it only once every rank's files are on disk. Call its wait()
    before the next save and before the process ends. Synchronous: committed when this returns."""
    try:
        staging = fresh_staging_dir(final) if rank.is_main else staging_dir(final)
        rt.barrier()  # staging exists before any rank writes into it
        torch.save(_portable_rng(rng_state()), staging / rng_file(rank.rank))
        background = sharded.save_sharded(staging, asynchronous=asynchronous) if sharded is not None else None
        write_main = None
        if rank.is_main:
            write_main = _main_files_writer(
                model,
                tokenizer,
                staging,
                stateful,
                trainer_state,
                model_state,
                snapshot=asynchronous,
                weights=model_files,
            )
            if not asynchronous:
                write_main()
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        raise CheckpointWriteError(final, exc, rank.is_main) from exc
    rt.barrier()  # every rank's synchronous files are written (and its background writes started)
    meta = {"global_step": trainer_state.get("global_step"), "world_size": rank.world_size}
    if asynchronous:
        return PendingCheckpoint(final, staging, meta, write_main, background, after_commit)
    if rank.is_main:
        commit(staging, final, meta)
        if after_commit is not None:
            after_commit()
    rt.barrier()  # nobody reads or deletes checkpoints while the rename is in flight
    return None


def _main_files_writer(
    model: nn.Module,
    tokenizer: Any,
    staging: Path,
    stateful: dict[str, Any],
    trainer_state: dict,
    model_state: Optional[dict],
    snapshot: bool,
    weights: bool = True,
) -> Callable[[], None]:
    """Rank 0's files as one call. `snapshot`: the states are copied now, so the call may run later, in the
    background, while training changes the live tensors."""
    if snapshot and weights:
        if model_state is None and isinstance(model, PlainWeights):
            model_state = model.module.state_dict()  # every key, tied ones included: the plain format keeps them all
        elif model_state is None and isinstance(model, nn.Module):
            model_state = _trainable_state(model)
        model_state = _copy(model_state)
    states = {name: obj.state_dict() for name, obj in stateful.items()}
    states = _copy(states) if snapshot else states
    text = json.dumps(trainer_state, indent=2, default=str)

    def write() -> None:
        save_model_files(model, tokenizer, staging, model_state, weights=weights)
        for name, state in states.items():
            torch.save(state, staging / state_file(name))
        (staging / TRAINER_STATE).write_text(text, encoding="utf-8")

    return write


def _trainable_state(model: nn.Module) -> dict:
    """What save_pretrained writes: an adapter (PEFT) only needs its trainable weights, a full model everything.
    A weight tied to another appears once, under its first name, as save_pretrained would write it."""
    if hasattr(model, "peft_config"):
        keep = {name for name, p in model.named_parameters() if p.requires_grad}
    else:
        keep = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {k: v for k, v in model.state_dict().items() if k in keep}


def _copy(tree: Any) -> Any:
    """A deep copy with every tensor copied to CPU memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return copy.deepcopy(tree)


class PendingCheckpoint:
    """A checkpoint whose files are being written in the background (checkpoint.async_save).

    Each rank may have a background write (its DCP shards); rank 0 also writes its own files in a thread,
    waits until its DCP write is done (which on rank 0 means every rank's shards and the metadata are on
    disk and fsynced), then fsyncs the folder and commits it: rename, marker last. A crash before that leaves
    only a staging folder, so resume goes back to the previous committed checkpoint.
    """

    def __init__(
        self,
        final: Path,
        staging: Path,
        meta: dict,
        write_main: Optional[Callable[[], None]],
        background: Optional[Future],
        after_commit: Optional[Callable[[], Any]],
    ):
        self.final = final
        self._main = write_main is not None
        self._background = background
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if write_main is not None:  # rank 0
            self._thread = threading.Thread(
                target=self._write_and_commit,
                name=f"phalanx-save-{final.name}",
                args=(staging, meta, write_main, after_commit),
            )
            self._thread.start()

    def _write_and_commit(
        self, staging: Path, meta: dict, write_main: Callable[[], None], after_commit: Optional[Callable[[], Any]]
    ) -> None:
        try:
            write_main()
            if self._background is not None:
                self._background.result()
            commit(staging, self.final, meta)
            if after_commit is not None:
                after_commit()
        except BaseException as exc:  # reported by wait(), in the training thread
            self._error = exc

    def wait(self) -> None:
        """Block until this rank's part is written (rank 0: and the checkpoint committed); raise what failed."""
        try:
            if self._background is not None:
                self._background.result()
        except (OSError, RuntimeError) as exc:
            raise CheckpointWriteError(self.final, exc, self._main) from exc
        if self._thread is not None:
            self._thread.join()
            if isinstance(self._error, (OSError, RuntimeError)):
                raise CheckpointWriteError(self.final, self._error, self._main) from self._error
            if self._error is not None:
                raise self._error


def load_checkpoint(
    folder: Path,
    *,
    rank: rt.RankInfo,
    model: nn.Module,
    stateful: dict[str, Any],
    finetune: str,
    sharded: Optional[Any] = None,
) -> dict:
    """Restore weights, stateful objects and this rank's RNG; returns trainer_state.json's content."""
    folder = committed_copy(Path(folder))  # a replacement of `folder` that a crash cut short: the copy it replaced
    if not is_committed(folder):
        raise PhalanxError(
            f"{folder} is not a committed phalanx checkpoint ({why_not_committed(folder)}): give a checkpoint-* "
            "folder a run committed"
        )
    check_same_finetune(folder, finetune)
    if sharded is not None:
        sharded.load_sharded(folder)  # weights and optimizer, each rank its own shards
    else:
        check_not_sharded(folder)
        load_model_weights(model, folder, finetune)
    for name, obj in stateful.items():
        load_stateful(folder / state_file(name), name, obj)
    load_rng_file(folder, rank)
    return read_or_explain(folder / TRAINER_STATE, lambda path: json.loads(path.read_text(encoding="utf-8")))


def load_stateful(path: Path, name: str, obj: Any) -> None:
    """`obj.load_state_dict` from `path`, refusing by name a state saved by something else: a checkpoint resumed with
    another optimizer loaded without a word (torch's optimizers take any groups of the right sizes) and failed at the
    first step with KeyError: 'betas'; groups of other sizes were torch's ValueError, naming no file."""
    try:
        obj.load_state_dict(read_or_explain(path, load_state_file))
    except (ValueError, KeyError, TypeError) as exc:
        raise PhalanxError(
            f"{path} does not fit this run's {name} ({type(obj).__name__}): {exc}. Resume with the {name} the run "
            "was saved with"
        ) from None
    if isinstance(obj, torch.optim.Optimizer):
        # After loading: __setstate__ fills in the options older torch versions did not save; what is still missing
        # was never this optimizer's.
        lacking = sorted({key for group in obj.param_groups for key in obj.defaults if key not in group})
        if lacking:
            raise PhalanxError(
                f"{path} was saved by another optimizer: its parameter groups lack {lacking}, which this "
                f"{type(obj).__name__} needs. Resume with the optimizer the run was trained with"
            )


def read_or_explain(path: Path, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, or a PhalanxError naming the damaged file and the way on (a committed checkpoint whose file was
    truncated or overwritten later: a disk fault, a copy cut short). Refusals of the restricted loader pass as they are."""
    try:
        return read(path)
    except PhalanxError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's zip reader, safetensors and json each raise their own kind
        raise PhalanxError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}): this checkpoint is damaged. Resume from an earlier "
            f"one with --resume_from_checkpoint {path.parent.parent}/checkpoint-N, or start over with "
            "--overwrite_output_dir"
        ) from None


def load_rng_file(folder: Path, rank: rt.RankInfo) -> bool:
    """Set this process's RNG to what rank `rank.rank` saved in `folder`; False when it saved none (another
    number of ranks: a new rank keeps its seeded state)."""
    path = Path(folder) / rng_file(rank.rank)
    if not path.is_file():
        return False
    load_rng_state(_native_rng(read_or_explain(path, load_state_file)))
    return True


def check_same_finetune(folder: Path, finetune: str) -> None:
    """A resume goes on with the kind of training its checkpoint holds. A LoRA checkpoint resumed with --finetune full
    --force was told its weights were 'in the sharded state of the strategy that saved it' and to export them; a full
    one resumed as LoRA, that its adapter_model.safetensors was damaged. Neither was so."""
    try:
        saved = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))["config"]["model"]["finetune"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record to compare (TrainingEngine's checkpoints); a damaged one is named where it is read
    if saved == finetune:
        return
    if saved == "lora":
        way = (
            f"Resume with --finetune lora, or, to fine-tune every weight from where the adapter got to, merge it "
            f"(phalanx export {folder} MERGED) and train from that (--model_name MERGED) into another --output_dir"
        )
    else:
        way = (
            f"Resume with --finetune {saved}, or, to train an adapter on its weights, write them as a model folder "
            f"(phalanx export {folder} OUT) and train from that (--model_name OUT) into another --output_dir"
        )
    raise PhalanxError(
        f"{folder} holds a checkpoint of model.finetune {saved!r}, and this run trains with {finetune!r}: a resume "
        f"goes on with the training a checkpoint holds. {way}"
    )


def check_not_sharded(folder: Path) -> None:
    """A checkpoint of FSDP2 or DeepSpeed keeps its optimizer state in that strategy's own files, which a DDP or
    one-process run cannot read: resumed with --strategy ddp --force, it was called damaged ('optimizer.pt cannot be
    read'), as if a disk had failed. (The other way round, FSDP2 and DeepSpeed name the strategy already.)"""
    for name, strategy, ranks in ((SHARDED_DIR, "fsdp", "any number of ranks"), (DS_DIR, "deepspeed", "its ranks")):
        if (folder / name).is_dir():
            raise PhalanxError(
                f"{folder} holds {strategy}'s sharded state ({name}/), not the optimizer.pt a ddp or one-process run "
                f"reads: it was saved by another strategy. Resume it with --strategy {strategy} ({ranks}), or start "
                "fresh with --overwrite_output_dir"
            )


def load_model_weights(model: nn.Module, folder: Path, finetune: str) -> None:
    """Load saved safetensors into `model`, refusing a checkpoint of another shape with the names that differ."""
    if finetune == "lora":
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        state = read_or_explain(folder / ADAPTER_WEIGHTS, load_file)
        check_same_shapes(folder, state, get_peft_model_state_dict(model), allow_missing=set())
        set_peft_model_state_dict(model, state)
        return
    if not (folder / WEIGHTS).is_file():
        raise PhalanxError(
            f"{folder} holds no model.safetensors: its weights are in the sharded state of the strategy "
            "that saved it. Resume it with that strategy (any number of ranks), or write the weights first "
            f"with: phalanx export {folder} OUT_DIR"
        )
    state = read_or_explain(folder / WEIGHTS, load_file)
    own = model.state_dict()
    # save_pretrained leaves out weights tied to others (the output head tied to the embeddings).
    check_same_shapes(folder, state, own, allow_missing={k for k in own if _is_tied(model, k)})
    model.load_state_dict(state, strict=False)


def check_same_shapes(folder: Path, saved: dict, expected: dict, allow_missing: set) -> None:
    """Refuse a checkpoint of another model or adapter shape, naming the tensors that differ."""
    shapes = [
        f"{k}: checkpoint {list(v.shape)} vs model {list(expected[k].shape)}"
        for k, v in saved.items()
        if k in expected and expected[k].shape != v.shape
    ]
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
