"""Decide where a run starts: fresh, from the newest committed checkpoint, or from a named one.

A run in output_dir is resumed by default when its config matches; a changed config is
shown as a diff and refused unless --force. Only committed checkpoints are considered.
A run of the same config that stopped before its first checkpoint starts over from step 0,
its logs moved aside (set_aside_crashed_run), never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from phalanx.checkpoint.commit import (
    commit,
    committed_step_checkpoints,
    fresh_staging_dir,
    is_committed,
    recover_replaced,
    why_not_committed,
)
from phalanx.checkpoint.layout import (
    ADAPTER_WEIGHTS,
    BEST,
    MARKER,
    METRICS_FILE,
    TENSORBOARD_DIR,
    TRAINER_STATE,
    WEIGHTS,
    final_model_staging,
    step_dir,
)
from phalanx.config.schema import RunConfig
from phalanx.errors import ConfigError, NothingToDo
from phalanx.runtime.durable import check_can_create
from phalanx.runtime.output_lock import check_free, training_lock

# Fields that decide how fast a run goes, or when it saves and evaluates, and not what it trains: a resume may change
# them without --force (a slow first run, a faster kernel found since, checkpoints wanted more often) and says which
# it changed (speed_and_cadence_changes). The run goes on the same course, up to the rounding another kernel or
# summation order gives, as with another world size.
SPEED_AND_CADENCE = (
    "training.compile",
    "training.liger_kernels",
    "training.cuda_graphs",
    "training.loader_workers",
    "training.merge_micro_batches",
    "training.merge_tokens",
    "lora.kernel",
    # Activations recomputed in backward instead of kept: the same forward, dropout's masks included (the checkpoint
    # restores the RNG for the recomputation), for less memory; what a resume that ran out of memory needs.
    "model.gradient_checkpointing",
    "training.gradient_checkpointing",
    "eval.eval_steps",
    "eval.eval_batch_size",
    "checkpoint.save_steps",
    "checkpoint.save_total_limit",
    "checkpoint.save_best",
)
# Fields that may change between the run that saved and the run that resumes.
RESUME_FREE = (
    "output_dir",
    "overwrite_output_dir",
    "force",
    "checkpoint.resume_from_checkpoint",
    "checkpoint.async_save",
    "logging.",
    "distributed.world_size",
    "distributed.master_port",
    "distributed.max_restarts",
    "distributed.backend",
    "distributed.timeout_minutes",
    "distributed.init_timeout_minutes",
    "distributed.shutdown_timeout_s",  # how long a stop may take to save: raised after a save the launcher cut short
    *SPEED_AND_CADENCE,
)
RUN_ARTIFACTS = ("training_info.json", "final_training_info.json", METRICS_FILE, BEST)
# What a run that stopped before its first checkpoint leaves besides RUN_ARTIFACTS; moved aside with them.
CRASH_LEFTOVERS = (TENSORBOARD_DIR, "loss_curve.png")
# The final model written into output_dir itself, and the record written after it: the run has finished only when
# that record (FINISHED) exists; model files without it are a final save cut short (set aside, never trusted).
FINISHED = "final_training_info.json"
FINAL_OUTPUTS = (
    FINISHED,
    "adapter_model.safetensors",
    "model.safetensors",
    "model.safetensors.index.json",
)
RUN_RECORD = "training_info.json"  # written when a run starts, with its config, and at every save
# What save_pretrained of a model, an adapter or a tokenizer writes, and so what the final save may write into
# output_dir itself (besides FINAL_OUTPUTS).
MODEL_FOLDER_FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(saved: dict, current: dict) -> list[str]:
    """`field: old -> new` for each field that differs and must not change on a resume without --force."""
    return _changes(saved, current, lambda key: not (key.startswith(RESUME_FREE) or key in RESUME_FREE))


def speed_and_cadence_changes(saved: dict, current: dict) -> list[str]:
    """`field: old -> new` for each SPEED_AND_CADENCE field that differs: what a resume changes without --force."""
    return _changes(saved, current, lambda key: key in SPEED_AND_CADENCE)


def global_batch_change(saved: dict, saved_world: int, current: dict, world: int) -> Optional[str]:
    """What one optimizer step trains, when a resume on another number of ranks (free, without --force) changes it:
    batch_size is per rank, so 2 ranks x 2 rows resumed on 1 rank trained on at 2 rows a step, half the global
    batch, and nothing said so. None when the ranks or the global batch stay the same (batch_size changed with them,
    under --force, as docs/checkpoints.md advises)."""
    old, new = saved.get("training", {}), current["training"]
    unit = "tokens" if new.get("batch_tokens") else "rows"
    per_rank = "batch_tokens" if unit == "tokens" else "batch_size"
    if saved_world == world or unit != ("tokens" if old.get("batch_tokens") else "rows"):
        return None  # another unit is a config change that --force already showed
    before = old.get(per_rank, 0) * saved_world * old.get("gradient_accumulation_steps", 1)
    accumulation = new["gradient_accumulation_steps"]
    after = new[per_rank] * world * accumulation
    if before == after:
        return None
    # What keeps it: another per-rank batch (a token budget no smaller than max_length, which it must hold), or
    # another accumulation; each where it divides.
    ways = []
    size, steps = before // (world * accumulation), before // (world * new[per_rank])
    if size * world * accumulation == before and (unit == "rows" or size >= current["data"]["max_length"]):
        ways.append(f"--{per_rank} {size}")
    if steps * world * new[per_rank] == before and steps >= 1:
        ways.append(f"--gradient_accumulation_steps {steps}")
    advice = (
        f"{' or '.join(ways)} (with --force) keeps it"
        if ways
        else f"keep {per_rank} x world_size x gradient_accumulation_steps at {before:,} (--force) to keep it"
    )
    return (
        f"world_size {saved_world} -> {world}: each optimizer step now trains {after:,} {unit} ({per_rank} "
        f"{new[per_rank]} x {world} ranks x gradient_accumulation_steps {accumulation}), where the checkpoint's "
        f"run trained {before:,}; {advice}"
    )


def _changes(saved: dict, current: dict, compared) -> list[str]:
    old, new = flatten(saved), flatten(current)
    defaults = flatten(RunConfig().model_dump())
    lines = []
    for key in sorted(set(old) | set(new)):
        if not compared(key):
            continue
        if key not in old and new.get(key) == defaults.get(key):
            continue  # a field added after the checkpoint was written, left at its default
        if old.get(key) != new.get(key) and not same_file(old.get(key), new.get(key)):
            lines.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return lines


def same_file(saved: object, current: object) -> bool:
    """True when two spellings of a path name the same existing file or folder from here (`data/train.jsonl` and
    `/home/me/project/data/train.jsonl`, `./out` and `out`): the same input, not a changed config."""
    if not (isinstance(saved, str) and isinstance(current, str) and saved and current):
        return False
    try:
        a, b = Path(saved).expanduser(), Path(current).expanduser()
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    except (OSError, RuntimeError, ValueError):
        return False


def existing_run_artifacts(output_dir: Path) -> list[str]:
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name in RUN_ARTIFACTS or p.name.startswith("checkpoint-"))


def model_folder_files(output_dir: Path) -> list[str]:
    if not output_dir.is_dir():
        return []
    shards = sorted(p.name for p in output_dir.glob("model-*-of-*.safetensors"))
    return [name for name in MODEL_FOLDER_FILES if (output_dir / name).exists()] + shards


def saved_config(folder: Path) -> dict:
    return saved_trainer_state(folder, "config")


def saved_trainer_state(folder: Path, key: str) -> Any:
    """One entry of a checkpoint's trainer_state.json: `config` (what it was trained with), `sampler` (its data
    position), a counter."""
    try:
        return json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{folder}/trainer_state.json cannot be read ({exc}); resume from another checkpoint "
            "with --resume_from_checkpoint PATH, or --overwrite_output_dir"
        ) from None


def data_changes(folder: Path, sources: dict[str, str]) -> list[str]:
    """The data fields (`data.dataset_path`) whose files hold something else now than when the checkpoint in
    `folder` was saved: `sources` is the run's data.prepare.PreparedData.sources, compared with the one its
    trainer_state.json recorded (none in a checkpoint from before phalanx recorded it)."""
    try:
        recorded = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8")).get("data_sources")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(recorded, dict):
        return []
    return [name for name, digest in recorded.items() if name in sources and sources[name] != digest]


def recorded_config(output_dir: Path) -> Optional[dict]:
    """The config the run in output_dir started with (training_info.json), None when there is no readable record."""
    return _config_in(output_dir / RUN_RECORD)


def run_config_of(folder: Path) -> dict:
    """The config of the run that wrote a model or adapter folder: its output_dir's training_info.json, or a
    checkpoint's own trainer_state.json; {} where there is no readable record (a bare PEFT adapter)."""
    return _config_in(folder / RUN_RECORD) or _config_in(folder / TRAINER_STATE) or {}


def _config_in(record: Path) -> Optional[dict]:
    try:
        config = json.loads(record.read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def check_start_over(out: Path, cfg: RunConfig, requested: Optional[str]) -> None:
    """output_dir holds no committed checkpoint-N: a fresh start is right when it holds nothing, or a crashed run of
    this config (its logs are set aside at start). A finished run, or one of another config, is refused."""
    found = existing_run_artifacts(out)
    flag = "--resume_from_checkpoint latest: " if requested == "latest" else ""
    if not found:
        # No run of ours, nothing to resume ('latest' included: there is no checkpoint yet). What a model folder
        # holds is someone else's (the base model's own folder, a model downloaded there, notes in a README.md),
        # and the final save would write over it.
        theirs = model_folder_files(out)
        if theirs:
            raise ConfigError(
                f"{flag}output_dir {out} holds files of a model folder that the final save would replace "
                f"({', '.join(theirs[:6])}{', ...' if len(theirs) > 6 else ''}), and no phalanx run. Choose an empty "
                "or new --output_dir, or pass --overwrite_output_dir to let the run replace them."
            )
        return
    if (out / FINISHED).exists():
        saved = recorded_config(out)
        kind = NothingToDo if saved is not None and not config_diff(saved, cfg.model_dump()) else ConfigError
        raise kind(
            f"{flag}output_dir {out} holds a finished run{' with this config' if kind is NothingToDo else ''} ({FINISHED})"
            " and no committed checkpoint-N to continue from"
            f"{': nothing to do' if kind is NothingToDo else ''}. Choose another --output_dir, or pass "
            "--overwrite_output_dir to train it again."
        )
    if restarted():
        return  # a restart (elastic or SLURM requeue) runs the same command: the crashed run is this job's own
    saved = recorded_config(out)
    if saved is None:
        raise ConfigError(
            f"{flag}output_dir {out} already holds a run ({', '.join(found[:4])}) with no committed "
            f"checkpoint to resume from and no record of its config ({out / RUN_RECORD}). Choose another "
            "--output_dir, or pass --overwrite_output_dir to replace it."
        )
    diff = config_diff(saved, cfg.model_dump())
    if diff and not cfg.force:
        raise ConfigError(
            f"{flag}output_dir {out} holds a run that stopped before its first checkpoint, with a different "
            "config:\n    " + "\n    ".join(diff) + "\nPass --overwrite_output_dir to replace it, --force to "
            "start over beside its logs (they are moved to a crashed-<time> folder), or another --output_dir."
        )


def set_aside_crashed_run(output_dir: Path) -> Optional[Path]:
    """Move what a run that stopped before its first checkpoint left in output_dir into output_dir/crashed-<time>/
    (kept for a look, out of the new run's way); returns that folder, None when there was nothing to move.

    A run killed during its final save (model files moved into output_dir, no final_training_info.json yet) leaves
    a final model that may lack files (an adapter without its config): it moves aside with the rest, and the staging
    folder with what was not moved yet. Those files sit beside a record of this run, so they are its own (or files
    --overwrite_output_dir allowed it to replace); they are moved, never deleted.

    A replacement of checkpoint-best that the crash cut short is undone first (recover_replaced): the committed best
    it was replacing moves aside, not the unmarked copy, and nothing of the crashed run stays behind for the new run's
    first best save to take for its own.

    Rank 0 only. The record (training_info.json) moves last: a rank still deciding where to start (resume_point) sees
    either the crashed run with its record, or an empty folder: a fresh start either way."""
    recover_replaced(output_dir / BEST)
    names = existing_run_artifacts(output_dir) + [name for name in CRASH_LEFTOVERS if (output_dir / name).exists()]
    if not names:
        return None
    final_staging = final_model_staging(output_dir)
    names += model_folder_files(output_dir) + ([final_staging.name] if final_staging.exists() else [])
    aside = crashed_folder(output_dir)
    for name in sorted(names, key=lambda name: name == RUN_RECORD):
        os.replace(output_dir / name, aside / name)
    return aside


def crashed_folder(output_dir: Path, kind: str = "crashed") -> Path:
    """A new output_dir/crashed-<time>/ for what an earlier run left (a crashed one, or one a resume goes back from) that
    the run starting now will not continue; `kind` names another reason (TrainingEngine's "earlier-run")."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = output_dir / f"{kind}-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = output_dir / f"{kind}-{stamp}-{n}"
    aside.mkdir()
    return aside


def set_aside_ahead(output_dir: Path, step: int, best_now: str, best_step: Optional[int] = None) -> list[str]:
    """Move what output_dir holds from after `step`, the checkpoint a run resumes from, into one
    output_dir/crashed-<time>/: checkpoint-best, checkpoint-{N} with N > step, and a final model; returns the lines that
    say so (none when nothing is ahead). `best_now`: the best the resumed run starts from, as its record reads (said
    with a best that is set aside). Rank 0 only; `phalanx train` and TrainingEngine call it on a resume.

    Steps after `step` are a future the resumed run has not lived, as the rows they logged in metrics.jsonl (dropped on
    resume) and their TensorBoard events (purged).
    - checkpoint-best: a crashed run may commit it at step 7 and die before checkpoint-8; the resumed run continues
      from checkpoint-6 with the best eval loss recorded there. Kept in place, it would outlive the resumed run's own
      records (training_info.json would name a best that checkpoint-best does not hold) whenever the resumed run goes
      another way (--force with another config, kernels that are not bit-reproducible) and never beats it; adopting
      its loss would compare against a value the run never reached. When the record names its best's step
      (`best_step`, at or before `step`) and checkpoint-{best_step} is still there with the model's weights,
      checkpoint-best is rebuilt from it, so the best the run reports has its folder even if the resumed run never
      beats it; otherwise the lines say that the next eval to beat it writes checkpoint-best.
    - checkpoint-{N}: a run resumed from an older checkpoint on purpose (--resume_from_checkpoint out/checkpoint-2,
      often with --force and a lower learning rate) left checkpoint-4 and checkpoint-6 of the run it abandons; if it
      stopped before writing its own, a requeue's --resume_from_checkpoint latest resumed checkpoint-6, the abandoned
      run, and reported it finished without training a step.
    - the final model of a run that finished after `step`: it is not this run's, which may stop before its own end.
    Set aside, never deleted (models someone may still want): a resumed run that retraces the same steps writes
    them again."""
    moves: list[tuple[Path, str]] = []
    lines: list[str] = []
    committed_best = _committed_best_step(output_dir)
    if committed_best is not None and committed_best > step:
        moves.append((output_dir / BEST, BEST))
    later = [path for n, path in committed_step_checkpoints(output_dir) if n > step]
    moves += [(path, path.name) for path in later]
    final_step = _final_step(output_dir)
    finals = [name for name in FINAL_OUTPUTS if (output_dir / name).exists()] if (final_step or 0) > step else []
    # The record first: it says the run finished, so a move cut short must not leave it beside part of the model.
    moves += [(output_dir / name, name) for name in sorted(finals, key=lambda name: name != FINISHED)]
    if not moves:
        return []
    aside = crashed_folder(output_dir)
    for path, name in moves:
        os.replace(path, aside / name)
    if committed_best is not None and committed_best > step:
        lines.append(
            f"checkpoint-best came from step {committed_best}, after step {step} where this run resumes: moved to "
            f"{aside / BEST}; the best is tracked again from step {step}'s record ({best_now})"
            + _rebuild_best(output_dir, best_step)
        )
    if later:
        lines.append(
            f"{', '.join(path.name for path in later)} came after step {step} where this run resumes: moved to "
            f"{aside}, so that a rerun with --resume_from_checkpoint latest continues this run, not the one it leaves"
        )
    if finals:
        lines.append(
            f"the final model of a run that finished at step {final_step} ({', '.join(finals)}) moved to {aside}: "
            "this run writes its own when it ends"
        )
    return lines


def _rebuild_best(output_dir: Path, best_step: Optional[int]) -> str:
    """Commit checkpoint-best again from checkpoint-{best_step} (hard links where the file system allows, else
    copies); returns the words to add to the line that says checkpoint-best was set aside."""
    if best_step is None:
        return ""
    source = output_dir / step_dir(best_step)
    if not is_committed(source) or not any((source / name).is_file() for name in (WEIGHTS, ADAPTER_WEIGHTS)):
        why = "is gone" if not source.exists() else "holds no model weights (sharded state only)"
        return f"; {source.name} {why}, so checkpoint-best is written again when an eval beats step {best_step}'s"
    staging = fresh_staging_dir(output_dir / BEST)
    shutil.copytree(
        source, staging, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(MARKER), dirs_exist_ok=True
    )
    commit(staging, output_dir / BEST, json.loads((source / MARKER).read_text(encoding="utf-8")))
    return f"; checkpoint-best is rebuilt from {source.name}, which holds that best"


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (no bytes copied; checkpoints are never changed in place), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _committed_best_step(output_dir: Path) -> Optional[int]:
    """The step checkpoint-best was saved at, None when there is none or its marker does not say (an older version)."""
    best = output_dir / BEST
    recover_replaced(best)  # a replacement of checkpoint-best cut short: the committed copy it replaced is the best
    if not is_committed(best):
        return None
    try:
        return int(json.loads((best / MARKER).read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _final_step(output_dir: Path) -> Optional[int]:
    """The step of the final model in output_dir (final_training_info.json), None when there is none or it is unread."""
    try:
        return int(json.loads((output_dir / FINISHED).read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def restarted() -> bool:
    """This process is a restart of the same job: torch's elastic agent or a SLURM requeue started it again."""
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def check_apart_from_data(cfg: RunConfig) -> None:
    """Refuse an output_dir that is a folder the run reads its data from (--dataset_path ./data --output_dir ./data):
    a folder of jsonl files is read whole, so the next run, a resume or a restart included, would read the run's
    metrics.jsonl as rows and stop on it; a dataset repository would get the model card as its README.md."""
    out = Path(cfg.output_dir).expanduser().resolve()
    d = cfg.data
    for field, value in (
        ("data.dataset_path", d.dataset_path),
        ("data.eval_dataset_path", d.eval_dataset_path),
        ("data.dataset_name", d.dataset_name),
    ):
        if value and Path(value).expanduser().is_dir() and Path(value).expanduser().resolve() == out:
            raise ConfigError(
                f"output_dir {cfg.output_dir} is the folder {field} = {value!r} reads: the run would write its "
                "metrics.jsonl, info files and checkpoints among the data, where the next run (or a resume) would "
                "read them as rows. Choose an output_dir apart from the data, e.g. a sibling folder."
            )


def resume_point(cfg: RunConfig) -> Optional[Path]:
    """The checkpoint folder to resume from, None for a fresh start; ConfigError when neither is right."""
    out = Path(cfg.output_dir)
    requested = cfg.checkpoint.resume_from_checkpoint
    # The run writes inside output_dir: a file there or on the way there, or a folder that takes no new entry,
    # stops it before anything is written.
    check_can_create(out, f"output_dir = {str(out)!r}")
    check_apart_from_data(cfg)
    # A run that is still going owns what is there: nothing below may judge it crashed, finished or different.
    # Rank 0 (or the launcher) asks; another rank could find the lock taken by its own job's rank 0.
    if os.environ.get("RANK", "0") == "0":
        check_free(training_lock(out), f"--output_dir {out}")
    if cfg.overwrite_output_dir:
        if requested:
            raise ConfigError("--overwrite_output_dir starts over, --resume_from_checkpoint continues: choose one")
        return None
    if requested not in (None, "latest"):
        folder = Path(requested)
        if not is_committed(folder):
            raise ConfigError(
                f"checkpoint.resume_from_checkpoint = {requested!r} is not a committed phalanx checkpoint "
                f"({why_not_committed(folder)}); use 'latest' or a checkpoint-N folder holding phalanx_checkpoint.json"
            )
    else:
        checkpoints = committed_step_checkpoints(out)
        if not checkpoints:
            check_start_over(out, cfg, requested)
            return None
        folder = checkpoints[-1][1]
    diff = config_diff(saved_config(folder), cfg.model_dump())
    if requested is None and not diff and (out / FINISHED).is_file():
        raise NothingToDo(
            f"output_dir {out} holds a finished run with this config ({FINISHED}): nothing to do. Choose another "
            "--output_dir, pass --overwrite_output_dir to train it again, or change max_steps/num_epochs and --force "
            "to extend it."
        )
    if diff and not cfg.force:
        raise ConfigError(
            f"{folder} was trained with a different config:\n    "
            + "\n    ".join(diff)
            + "\nPass --force to resume with the new values, --overwrite_output_dir to start over, "
            "or another --output_dir."
        )
    return folder
