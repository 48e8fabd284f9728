"""Assemble a fine-tuning run from its config: runtime -> data + model -> strategy -> loop -> outputs.

`Run` holds the components the loop calls; `build_run` creates them in the order the
design fixes (tokenize before joining the process group, adapter before DDP), and
`finish_run` writes the final model, the info files, the plot and the summary.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch.utils.data import DataLoader, Subset

from phalanx.checkpoint.checkpointer import BestMetric, Checkpointer, CheckpointPolicy
from phalanx.checkpoint.commit import committed_step_checkpoints, recover_replaced, uncommit
from phalanx.checkpoint.io import save_model_files
from phalanx.checkpoint.layout import BEST, final_model_staging
from phalanx.checkpoint.resume import (
    CRASH_LEFTOVERS,
    FINISHED,
    RUN_RECORD,
    data_changes,
    existing_run_artifacts,
    flatten,
    global_batch_change,
    resume_point,
    saved_config,
    saved_trainer_state,
    set_aside_ahead,
    set_aside_crashed_run,
    speed_and_cadence_changes,
)
from phalanx.config.schema import ModelConfig, RunConfig
from phalanx.data.collate import collate as collate_rows
from phalanx.data.collate import merge_budget, passes_per_step
from phalanx.data.prepare import CHAT_TEMPLATE_SOURCE, PreparedData, describe_report, prepare_data
from phalanx.data.sampler import (
    StatefulDistributedSampler,
    TakenPosition,
    TokenBudgetBatchSampler,
    WithPaddingRows,
    eval_shard,
)
from phalanx.errors import ConfigError
from phalanx.models.adapters import apply_finetuning, trainable_parameter_count
from phalanx.models.attention import enable_varlen_attention, graph_unsafe_reason, packing_unsupported_reason
from phalanx.models.compile import auto_compile_line, compile_wanted, fuse_elementwise
from phalanx.models.graphs import GraphShapes
from phalanx.models.load import (
    cache_root,
    four_bit_compute_dtype,
    generation_config_eos_ids,
    load_model,
    load_tokenizer,
    quantization_config,
    stop_also_at,
)
from phalanx.models.lora_fused import keep_casts
from phalanx.observe.memory import peak_memory_mb
from phalanx.observe.metrics import Reporter, last_logged_step
from phalanx.observe.plot import plot_loss_curve
from phalanx.parallel import Precision, Strategy, make_strategy
from phalanx.runtime import dist as rt
from phalanx.runtime.durable import fsync_tree, write_json_atomic
from phalanx.runtime.faults import Fault, planned_fault
from phalanx.runtime.output_lock import hold_on_main_rank, training_lock
from phalanx.runtime.seed import seed_everything
from phalanx.runtime.signals import PreemptionFlag, ignore_preemption_signals
from phalanx.runtime.watch import set_phase
from phalanx.train.loss import install_target_head
from phalanx.train.schedule import make_optimizer, make_scheduler, take_configured_hyperparameters
from phalanx.train.state import TrainerState

# Where a rank is in its epoch: rows one by one (batch_size per micro-batch) or whole token-budget micro-batches.
TrainSampler = Union[StatefulDistributedSampler, TokenBudgetBatchSampler]


@dataclass
class Run:
    cfg: RunConfig
    rank: rt.RankInfo
    tokenizer: Any
    model: torch.nn.Module
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: TakenPosition  # the train sampler, its position counted in micro-batches the loop took
    train_loader: DataLoader
    eval_batches: Optional[DataLoader]
    reporter: Reporter
    data: PreparedData
    total_steps: int
    output_dir: Path
    checkpointer: Checkpointer  # cadence, checkpoint-best, the background save in flight, retention, resume
    state: TrainerState = field(default_factory=TrainerState)
    started: float = field(default_factory=time.perf_counter)
    preemption: PreemptionFlag = field(default_factory=PreemptionFlag)
    fault: Optional[Fault] = None
    resumed_from: Optional[Path] = None
    consecutive_skips: int = 0
    merge_tokens: Optional[int] = None  # most tokens per forward/backward pass when a step's micro-batches merge
    graph_shapes: Optional[GraphShapes] = None  # the shapes passes are padded to for CUDA-graphed layers

    def steps_of_epoch(self) -> Iterator[list[dict]]:
        """This epoch's remaining micro-batches, grouped per optimizer step (the last group may be short)."""
        group: list[dict] = []
        self.sampler.begin_pass()
        for batch in self.train_loader:
            self.sampler.took(batch)
            group.append(batch)
            if len(group) == self.cfg.training.gradient_accumulation_steps:
                yield group
                group = []
        if group:
            yield group


def stateful_objects(strategy: Strategy, optimizer: Any, scheduler: Any) -> dict:
    """What rank 0 saves with torch.save; a sharding strategy writes the optimizer itself, per rank."""
    objects = {"optimizer": optimizer, "scheduler": scheduler, "precision": strategy}
    if strategy.shards_state:
        del objects["optimizer"]
    return objects


def make_checkpointer(
    cfg: RunConfig,
    rank: rt.RankInfo,
    output_dir: Path,
    state: TrainerState,
    strategy: Strategy,
    optimizer: Any,
    scheduler: Any,
    sampler: TakenPosition,
    tokenizer: Any,
    total_steps: int,
) -> Checkpointer:
    """The run's Checkpointer: the unwrapped model or adapter, the stateful objects, and trainer_state.json holding
    the counters, the sampler's position and the config. Each save also rewrites training_info.json (rank 0)."""

    def record_run() -> None:
        if rank.is_main:
            write_run_record(output_dir, cfg, state, total_steps, rank.world_size, strategy.name)

    c = cfg.checkpoint
    return Checkpointer(
        output_dir,
        rank,
        model=strategy.unwrap(),
        tokenizer=tokenizer,
        strategy=strategy,
        finetune=cfg.model.finetune,
        states=stateful_objects(strategy, optimizer, scheduler),
        trainer_state=lambda: {**state.state_dict(), "sampler": sampler.state_dict(), "config": cfg.model_dump()},
        policy=CheckpointPolicy(
            every=c.save_steps, keep=c.save_total_limit, asynchronous=c.async_save, save_best=c.save_best
        ),
        best=BestMetric(state, "best_eval_loss", "best_step"),
        after_save=record_run,
    )


def check_output_dir(cfg: RunConfig) -> Optional[Path]:
    """Where this run starts (see checkpoint.resume); raises before anything is written when it cannot."""
    return resume_point(cfg)


def clear_previous_run(output_dir: Path) -> None:
    """--overwrite_output_dir: delete the earlier run. Every checkpoint is un-marked before any file goes, so a kill
    midway leaves no committed checkpoint with files missing (a resume would trust it); the committed best that a
    cut-short replacement left beside checkpoint-best is deleted with it, not restored later as this run's best."""
    recover_replaced(output_dir / BEST)
    paths = [output_dir / name for name in existing_run_artifacts(output_dir) + list(CRASH_LEFTOVERS)]
    for path in paths:
        if path.is_dir():
            uncommit(path)
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def start_over(cfg: RunConfig, output_dir: Path) -> None:
    """Rank 0, on a fresh start: --overwrite_output_dir deletes the earlier run; otherwise what is there is a run of
    this config that stopped before its first checkpoint (resume_point refused anything else), moved aside."""
    if cfg.overwrite_output_dir:
        clear_previous_run(output_dir)
        return
    step = last_logged_step(output_dir)
    aside = set_aside_crashed_run(output_dir)
    if aside is not None:
        print(
            f"↩️  {output_dir} held a run of this config that stopped before its first checkpoint (last logged step "
            f"{step}): starting over from step 0; what it left is kept in {aside}",
            flush=True,
        )


def set_aside_future(output_dir: Path, state: TrainerState) -> None:
    """Rank 0, on a resume: checkpoints and a final model from after the resumed step are set aside (set_aside_ahead)."""
    best = "none yet" if state.best_step is None else f"{state.best_eval_loss:.4f} at step {state.best_step}"
    for line in set_aside_ahead(output_dir, state.global_step, f"best eval loss {best}", state.best_step):
        print(f"↩️  {line}", flush=True)


def check_same_data(cfg: RunConfig, resume_from: Path, sources: dict[str, str], announce: bool) -> None:
    """A resume reads the data the checkpoint was trained on, or says what changed. The config names the same file,
    so nothing else would: train.jsonl with rows added between a kill and the rerun was split into train and eval
    rows and shuffled anew, and the saved data position went on in that other order (rows trained twice, rows never
    trained, eval rows trained on), without a word. Refused unless --force, as a changed config is."""
    changed = data_changes(resume_from, sources)
    if not changed:
        return
    values = flatten(cfg.model_dump())
    if changed == [CHAT_TEMPLATE_SOURCE]:
        template = values.get(CHAT_TEMPLATE_SOURCE) or "the model's own"
        what, held = f"the chat template ({template})", "writes other text"
        effect = "the rows are rendered and masked otherwise from here (other text, other trained tokens)"
        back = "Put the template back as it was, pass --force to go on with it anyway"
    else:
        data = [name for name in changed if name != CHAT_TEMPLATE_SOURCE]
        what = ", ".join(f"{name} = {values.get(name) or 'the bundled chats'!r}" for name in data)
        held = "holds other rows"
        if data == ["data.eval_dataset_path"]:
            effect = "evaluation losses from here on are measured on other rows than the best the checkpoint records"
        else:
            effect = (
                "on these the shuffled order (and a test_size split into train and eval rows) differ, so from the "
                "saved data position some rows are trained twice and others skipped"
            )
        if CHAT_TEMPLATE_SOURCE in changed:
            effect += ", and the chat template writes other text too"
        back = "Put the data back as it was, pass --force to go on with these rows anyway"
    if not cfg.force:
        raise ConfigError(
            f"{resume_from} was trained on other data: {what} {held} now than when it was saved (its record in "
            f"trainer_state.json differs): {effect}. {back}, --overwrite_output_dir to start over, or another "
            "--output_dir."
        )
    if announce:
        print(f"↩️  {what} {held} than when {resume_from.name} was saved (--force): {effect}", flush=True)


def load_data(cfg: RunConfig) -> tuple[Any, PreparedData]:
    """Tokenizer and tokenized data; cached on disk and safe to call from several processes at once."""
    tokenizer = load_tokenizer(cfg.model.model_name, cfg.model.trust_remote_code, cfg.data.chat_template)
    data = prepare_data(
        cfg.data,
        tokenizer,
        seed=cfg.training.seed,
        cache_root=cache_root() / "data",
        stop_token_ids=generation_config_eos_ids(cfg.model.model_name),
    )
    return tokenizer, data


def count_total_steps(cfg: RunConfig, sampler: TrainSampler, resumed: Optional[tuple[int, int, int]] = None) -> int:
    """max_steps, else the optimizer steps of num_epochs epochs (token-budget epochs differ by a micro-batch or so:
    each is counted, so the last epoch ends where its rows do).

    `resumed`: (step, epoch, data position) of a checkpoint saved with another global batch (world_size, batch_size,
    batch_tokens or gradient_accumulation_steps): its steps, then the rest of the epochs from that position at this
    run's batch. Counted from the start at this batch, the run ended elsewhere than where its epochs do: a 12-step
    epoch on 1 rank, resumed at step 8 on 2 ranks (6 steps an epoch there), stopped at once and reported done with
    a third of the rows never trained; resumed on fewer ranks, it went on into another epoch."""
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    budget = isinstance(sampler, TokenBudgetBatchSampler)

    def units_of(epoch: int) -> int:  # what the sampler's position counts to in an epoch: rows, or micro-batches
        return len(sampler.bins(epoch)) if budget else sampler.total

    def steps_for(units: int) -> int:
        per_rank = units // sampler.world_size
        return math.ceil((per_rank if budget else math.ceil(per_rank / t.batch_size)) / t.gradient_accumulation_steps)

    whole, part = int(t.num_epochs), t.num_epochs - int(t.num_epochs)
    if resumed is not None:
        step, epoch, position = resumed
        shares = [(e, 1.0) for e in range(whole)] + ([(whole, part)] if part else [])
        left = sum(
            steps_for(max(0, math.ceil(share * units_of(e)) - (position if e == epoch else 0)))
            for e, share in shares
            if e >= epoch
        )
        return max(1, step + left)
    steps = sum(steps_for(units_of(e)) for e in range(whole)) + (
        math.ceil(part * steps_for(units_of(whole))) if part else 0
    )
    return max(1, steps)


def regrouped_resume(cfg: RunConfig, resume_from: Optional[Path], world_size: int) -> Optional[tuple[int, int, int]]:
    """(step, epoch, data position) of the checkpoint a resume starts from when it was saved with another global
    batch than this run's (count_total_steps counts the rest of its epochs from there), else None."""
    if resume_from is None:
        return None
    sampler = saved_trainer_state(resume_from, "sampler")
    before = saved_config(resume_from).get("training", {})
    now = cfg.training.model_dump()
    shape = ("batch_size", "batch_tokens", "gradient_accumulation_steps")
    if sampler.get("world_size", world_size) == world_size and all(before.get(k) == now[k] for k in shape):
        return None
    return saved_trainer_state(resume_from, "global_step"), sampler["epoch"], sampler["position"]


def check_not_past_the_end(cfg: RunConfig, resume_from: Path, total_steps: int) -> None:
    """A checkpoint past the run's last step (--max_steps 4 --force over checkpoint-6) leaves nothing to train: the
    run ended at once, 'Done: 6 steps', its final model step 6's under a record of a 4-step run. Refused, naming the
    checkpoint that ends where asked."""
    step = saved_trainer_state(resume_from, "global_step")
    if step <= total_steps:
        return
    field = "training.max_steps" if cfg.training.max_steps else "training.num_epochs"
    earlier = [(at, path) for at, path in committed_step_checkpoints(resume_from.parent) if at <= total_steps]
    back = ""
    if earlier:
        at, path = earlier[-1]
        goes = f"ends it with step {at}'s model" if at == total_steps else f"trains on from step {at} to {total_steps}"
        back = f"--resume_from_checkpoint {path} {goes}; "
    raise ConfigError(
        f"{resume_from} is at step {step}, past this run's last step {total_steps} ({field}): nothing is left to "
        f"train, and the final model would be step {step}'s. {back}or set {field} to reach step {step} at least."
    )


def describe_dataset(cfg: RunConfig) -> str:
    """The header's dataset. Seed 001's train_loop.py read data/traj_chat.jsonl, what generate_data.py (and
    `phalanx generate`) wrote; phalanx trains on what it is given, so with no dataset beside such a file it says so."""
    given = cfg.data.dataset_name or cfg.data.dataset_path
    if given:
        return given
    generated = Path("data") / "traj_chat.jsonl"
    if not generated.is_file():
        return "bundled health-agent chats"
    val = generated.with_name("traj_val.jsonl")
    flags = f"--dataset_path {generated}" + (f" --eval_dataset_path {val}" if val.is_file() else "")
    if cfg.output_dir == RunConfig.model_fields["output_dir"].default:
        from phalanx.launch.scripts import results_folder_of

        flags += f" --output_dir {results_folder_of(generated)}"  # where seed 001 kept what it trained on that file
    return f"bundled health-agent chats (not {generated}, which `phalanx generate` wrote here: {flags} trains on it)"


def describe_epochs(cfg: RunConfig, sampler: TrainSampler, total_steps: int) -> str:
    """The header's epochs: num_epochs, or, when max_steps sets the length, the epochs those steps make (a header
    that said "Epochs: 1.0" over a max_steps run of three epochs contradicted the per-epoch lines below it)."""
    t = cfg.training
    if not t.max_steps:
        return f"{t.num_epochs} ({total_steps} optimizer steps)"
    per_epoch = max(1, math.ceil(micro_batches_per_rank(sampler, 0, t.batch_size) / t.gradient_accumulation_steps))
    return f"{total_steps / per_epoch:.2f} ({total_steps} optimizer steps of {per_epoch} per epoch: max_steps sets them, num_epochs is not used)"


def micro_batches_per_rank(sampler: TrainSampler, epoch: int, batch_size: int) -> int:
    if isinstance(sampler, TokenBudgetBatchSampler):
        return sampler.micro_batches_per_rank(epoch)
    return math.ceil(sampler.total // sampler.world_size / batch_size)


def loader_workers(setting: Optional[int], device: torch.device) -> int:
    """training.loader_workers: as set, else one on CUDA (the next micro-batch is packed while the GPU works on this
    one; a 4-row packed micro-batch takes ~4 ms of host time) and none elsewhere (a CPU rank has no idle core)."""
    if setting is not None:
        return setting
    return 1 if device.type == "cuda" else 0


def make_train_loader(cfg: RunConfig, rows: Any, rank: rt.RankInfo, collate: Any) -> tuple[TakenPosition, DataLoader]:
    """Micro-batches of batch_size rows, or of at most training.batch_tokens tokens, with a resumable position."""
    t = cfg.training
    workers = loader_workers(t.loader_workers, rank.device)
    # The loader gets its own generator: drawing its base seed from the global RNG would shift dropout after a resume.
    common: dict = dict(
        collate_fn=collate,
        pin_memory=rank.device.type == "cuda",
        generator=torch.Generator().manual_seed(t.seed),
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_preemption_signals if workers else None,  # the rank saves, then stops its workers
    )
    # The rows that only even out the ranks at an epoch's end train nothing (WithPaddingRows): no row counts twice.
    if t.batch_tokens:
        budget = TokenBudgetBatchSampler(
            [len(ids) for ids in rows["input_ids"]],
            t.batch_tokens,
            rank.rank,
            rank.world_size,
            seed=t.seed,
            mark_padding=True,
        )
        return TakenPosition(budget), DataLoader(WithPaddingRows(rows), batch_sampler=budget, **common)
    sampler = StatefulDistributedSampler(len(rows), rank.rank, rank.world_size, seed=t.seed, mark_padding=True)
    return TakenPosition(sampler), DataLoader(WithPaddingRows(rows), batch_size=t.batch_size, sampler=sampler, **common)


def stop_loader_workers(loader: DataLoader) -> None:
    """Stop the loader's persistent worker processes now, while the interpreter still runs. At exit torch leaves
    them to multiprocessing, which sends SIGTERM, which they ignore (runtime.signals.ignore_preemption_signals: a
    job-wide SIGTERM must not kill them before their rank saves), and then waits for them forever."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    workers = list(getattr(iterator, "_workers", ()))
    iterator._shutdown_workers()  # the graceful way: tell each worker to stop, join it
    for worker in workers:
        if worker.is_alive():  # did not stop in time: SIGKILL is the one signal it cannot ignore
            worker.kill()
            worker.join(timeout=5)
    loader._iterator = None


def choose_packing(
    wanted: bool, model: torch.nn.Module, rank: rt.RankInfo, activation_dtype: Optional[torch.dtype] = None
) -> bool:
    """Packed (padding-free) micro-batches when asked for and the model supports them; the attention is switched to
    a varlen one. A model that cannot pack trains padded, and rank 0 says why."""
    if not wanted:
        return False
    reason = packing_unsupported_reason(model)
    if reason is not None:
        if rank.is_main:
            print(
                f"📦 Packing off: {reason}; micro-batches are padded instead (--packing false silences this).",
                flush=True,
            )
        return False
    enable_varlen_attention(model, rank.device, activation_dtype)
    return True


def build_run(
    cfg: RunConfig, preemption: Optional[PreemptionFlag] = None, merge_tokens_that_fit: Optional[int] = None
) -> Run:
    """`preemption`: the flag the caller installed when the process started (the CLI does, before its imports), so
    that a SIGTERM/SIGUSR1 while the ranks import, tokenize or load is kept and honoured at the first step (save,
    exit 75) instead of killing the rank. `merge_tokens_that_fit`: a larger pass than one micro-batch holds that the
    memory estimate fits on this device (the train command asks `phalanx plan`'s model), for merged micro-batches."""
    rank_id, world, _, local_world = rt.env_rank_info()
    preemption = preemption or PreemptionFlag().install()
    rt.check_world_fits(local_world, cfg.distributed.backend)
    resume_from = check_output_dir(cfg)
    # Tokenize before joining the process group: a long tokenization can never trip a collective timeout.
    tokenizer, data = load_data(cfg)
    if resume_from is not None:
        check_same_data(cfg, resume_from, data.sources, announce=rank_id == 0)
    rank = rt.init_runtime(
        cfg.distributed.backend, cfg.distributed.init_timeout_minutes, group_of_one=cfg.distributed.strategy != "ddp"
    )
    # Before the lock, which creates output_dir: a precision this device lacks (bf16 on CPU) leaves no folder behind.
    precision = Precision.choose(cfg.training.mixed_precision, rank.device)
    hold_on_main_rank(training_lock(cfg.output_dir), f"--output_dir {cfg.output_dir}", rank.is_main)
    set_phase(rank.rank, "starting")
    seed_everything(cfg.training.seed)
    # Frozen base weights may live in the compute dtype; weights that train stay fp32 (master copy).
    base_dtype = precision.dtype if (precision.dtype and cfg.model.finetune == "lora") else torch.float32
    # QLoRA's base is quantized while loading, on this rank's device, where it stays.
    quantization = quantization_config(cfg.model, precision.dtype)
    model = load_model(
        cfg.model.model_name, base_dtype, cfg.model.trust_remote_code, quantization=quantization, device=rank.device
    )
    if cfg.model.finetune == "full":
        # Saved whole, the model should stop where the turns it is trained on end (a base model under ChatML stops at
        # <|endoftext|>, not at the <|im_end|> it learns to write); the data summary says so. An adapter cannot carry it.
        unstopped = [token_id for _, token_id in data.report.unstopped_end_tokens.values()]
        stop_also_at(model, unstopped, tokenizer.eos_token_id)
    packing = choose_packing(cfg.data.packing, model, rank, precision.dtype)
    model = apply_finetuning(model, cfg.model, cfg.lora)
    # The output head runs at target positions only, in chunks (train/loss.py); Liger's fused kernel may run them
    # unless training.liger_kernels keeps Liger out.
    install_target_head(model, fused=cfg.training.liger_kernels == "auto")
    collate = partial(collate_rows, pad_token_id=tokenizer.pad_token_id, packing=packing)
    sampler, train_loader = make_train_loader(cfg, data.train, rank, collate)
    total_steps = count_total_steps(cfg, sampler.sampler, regrouped_resume(cfg, resume_from, rank.world_size))
    if resume_from is not None:
        check_not_past_the_end(cfg, resume_from, total_steps)
    merge_tokens = merge_budget(cfg, rank.device, packing)
    fitted = bool(merge_tokens and merge_tokens_that_fit and merge_tokens_that_fit > merge_tokens)
    if fitted:
        merge_tokens = merge_tokens_that_fit
    if merge_tokens and rank.is_main:
        source = "the most the memory estimate fits on this device; " if fitted else ""
        print(
            f"🧮 Each step's {cfg.training.gradient_accumulation_steps} micro-batches run as passes of at most "
            f"{merge_tokens:,} tokens ({source}the same rows and gradients in fewer passes; "
            "--training.merge_tokens sets the size, --training.merge_micro_batches false runs one per micro-batch).",
            flush=True,
        )
    graph_shapes = choose_graph_shapes(cfg, rank, packing, merge_tokens, tokenizer.pad_token_id)
    run_kind = dict(
        plain_lora=cfg.model.finetune == "lora" and quantization is None,
        packed=packing,
        strategy=cfg.distributed.strategy,
        micro_batches=total_steps * passes_per_step(cfg, merge_tokens),  # the passes compiled layers run
    )
    compile_layers = cfg.training.cuda_graphs or compile_wanted(cfg.training.compile, rank.device, **run_kind)
    said = auto_compile_line(cfg.training.compile, rank.device, **run_kind, steps=total_steps)
    if said and not cfg.training.cuda_graphs and rank.is_main:
        print(said, flush=True)
    # After activation checkpointing, before the strategy wraps the model.
    model = fuse_elementwise(
        model,
        compile_layers,
        cfg.training.liger_kernels,
        rank.device,
        announce=rank.is_main,
        cuda_graphs=graph_shapes is not None,
    )
    strategy = make_strategy(rank, precision, cfg.distributed.ddp_comm_hook, cfg=cfg)
    make = partial(make_optimizer, cfg=cfg.training, fused_on_cuda=cfg.distributed.strategy != "deepspeed")
    model, optimizer = strategy.prepare(model, make)
    keep_casts(model, optimizer, precision.dtype, strategy.name, compiled=compile_layers)
    if graph_shapes is not None and cfg.training.gradient_accumulation_steps > 1:
        # Gradients summed over a step's passes live outside the graphs' memory (models/graphs.py).
        strategy.keep_gradient_buffers()

    eval_batches = None
    if data.eval is not None and len(data.eval) > 0:
        shard = Subset(data.eval, eval_shard(len(data.eval), rank.rank, rank.world_size))
        # Its own generator too (as make_train_loader's): each evaluation starts an iterator, which would otherwise
        # draw from the global RNG and shift every later dropout mask with how often the run evaluates.
        eval_batches = DataLoader(
            shard,
            batch_size=cfg.eval.eval_batch_size or cfg.training.batch_size,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(cfg.training.seed),
        )
    scheduler = make_scheduler(optimizer, cfg.training, total_steps)

    output_dir = Path(cfg.output_dir)
    state = TrainerState()
    checkpointer = make_checkpointer(
        cfg, rank, output_dir, state, strategy, optimizer, scheduler, sampler, tokenizer, total_steps
    )
    if resume_from is not None:
        saved = checkpointer.load(resume_from)
        state.load_state_dict(saved)
        try:
            sampler.load_state_dict(saved["sampler"])
        except ValueError as exc:  # the data position was counted in other units (batch_tokens changed under --force)
            raise ConfigError(f"{resume_from}: {exc}") from None
        changed = take_configured_hyperparameters(optimizer, scheduler, cfg.training, total_steps)
        if rank.is_main:
            set_aside_future(output_dir, state)
            if changed:
                why = " (--force)" if cfg.force else ""  # without it, a new world_size changed the steps per epoch
                print(f"↩️  {', '.join(changed)} from step {state.global_step} on{why}", flush=True)
            trained_with = saved_config(resume_from)
            retuned = speed_and_cadence_changes(trained_with, cfg.model_dump())
            saved_world = saved["sampler"].get("world_size", rank.world_size)
            regrouped = global_batch_change(trained_with, saved_world, cfg.model_dump(), rank.world_size)
            if regrouped:
                print(f"↩️  {regrouped}", flush=True)
            if not cfg.checkpoint.save_best and (output_dir / BEST).is_dir():
                print(
                    f"note: {output_dir / BEST} (step {state.best_step}) stays as it is: with save_best false a better "
                    "evaluation from here on is recorded (best_step in the run's records), not saved",
                    flush=True,
                )
            if retuned:
                print(
                    f"↩️  {'; '.join(retuned)} from step {state.global_step} on (speed or save/eval cadence only: the "
                    "same training, up to rounding)",
                    flush=True,
                )
    elif rank.is_main:
        start_over(cfg, output_dir)  # a fresh start: overwriting was allowed, nothing was there, or a crashed run
    state.data_sources = data.sources  # what this run trains on from here, for its checkpoints
    if rank.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        # The record of this run's config, before any log exists: a rerun after a crash before the first
        # checkpoint can then tell its own crashed run (start over) from another run (refuse).
        write_run_record(output_dir, cfg, state, total_steps, rank.world_size, strategy.name)
    rt.barrier()
    reporter = Reporter(
        output_dir,
        is_main=rank.is_main,
        total_steps=total_steps,
        resume_step=state.global_step,
        tensorboard=cfg.logging.tensorboard,
        progress_bar=cfg.logging.progress_bar,
    )
    checkpointer.reporter = reporter  # made after the resume, which sets the step it starts counting from
    run = Run(
        cfg=cfg,
        rank=rank,
        tokenizer=tokenizer,
        model=model,
        strategy=strategy,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        train_loader=train_loader,
        eval_batches=eval_batches,
        reporter=reporter,
        data=data,
        total_steps=total_steps,
        output_dir=output_dir,
        checkpointer=checkpointer,
        state=state,
        fault=planned_fault(),
        resumed_from=resume_from,
        preemption=preemption,
        merge_tokens=merge_tokens,
        graph_shapes=graph_shapes,
    )
    announce(run)
    return run


def describe_4bit_base(m: ModelConfig, run_dtype: Optional[torch.dtype]) -> str:
    """' on a 4-bit nf4 double-quantized base computing in bf16': the compute dtype as bitsandbytes takes it, which
    may differ from the run's precision on the World Size line (bf16 asked for on a CPU run, which is fp32)."""
    compute = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(four_bit_compute_dtype(m, run_dtype), "fp32")
    quant = f"{m.bnb_4bit_quant_type}{' double-quantized' if m.bnb_4bit_use_double_quant else ''}"
    return f" on a 4-bit {quant} base computing in {compute}"


def choose_graph_shapes(
    cfg: RunConfig, rank: rt.RankInfo, packing: bool, merge_tokens: Optional[int], pad_token_id: int
) -> Optional[GraphShapes]:
    """The shapes passes are padded to when training.cuda_graphs is on (models/graphs.py), or None. Off, with a line
    that says why, where the packed attention cannot be captured (models/attention.py:graph_unsafe_reason)."""
    if not cfg.training.cuda_graphs:
        return None
    if not packing:
        raise ConfigError(
            f"training.cuda_graphs needs packed micro-batches, and {cfg.model.model_name} trains padded (the line "
            "above says why); drop --training.cuda_graphs"
        )
    reason = graph_unsafe_reason(rank.device)
    if reason is not None:
        if rank.is_main:
            print(f"📐 training.cuda_graphs off: {reason}; the layers are compiled without graphs.", flush=True)
        return None
    shapes = GraphShapes.for_config(cfg, merge_tokens, pad_token_id)
    if rank.is_main:
        print(f"📐 training.cuda_graphs: {shapes.describe()}.", flush=True)
    return shapes


def announce(run: Run) -> None:
    cfg, r, say = run.cfg, run.data.report, run.reporter.say
    trainable, total = trainable_parameter_count(run.strategy.unwrap())
    effective = cfg.training.batch_size * run.rank.world_size * cfg.training.gradient_accumulation_steps
    say("🔧 Distributed Training Configuration:")
    m = cfg.model
    base = describe_4bit_base(m, run.strategy.precision.dtype) if m.load_in_4bit else ""
    say(f"   - Model: {m.model_name} ({m.finetune}{base}; {trainable:,} of {total:,} parameters train)")
    say(f"   - Dataset: {describe_dataset(cfg)}")
    say(
        f"   - World Size: {run.rank.world_size} ({run.strategy.name}, {run.rank.device.type}, "
        f"{run.strategy.precision.dtype or 'fp32'})"
    )
    if cfg.training.batch_tokens:
        per_rank = micro_batches_per_rank(run.sampler.sampler, run.sampler.epoch, cfg.training.batch_size)
        say(
            f"   - Tokens per Micro-batch per GPU: at most {cfg.training.batch_tokens:,} "
            f"({len(run.data.train) / max(1, per_rank * run.rank.world_size):.1f} rows on average)"
        )
        say(f"   - Micro-batches per Optimizer Step: {run.rank.world_size * cfg.training.gradient_accumulation_steps}")
    else:
        say(f"   - Batch Size per GPU: {cfg.training.batch_size}")
        say(f"   - Effective Batch Size: {effective}")
    say(f"   - Learning Rate: {cfg.training.learning_rate}")
    say(f"   - Epochs: {describe_epochs(cfg, run.sampler.sampler, run.total_steps)}")
    say(f"   - Gradient Accumulation: {cfg.training.gradient_accumulation_steps}")
    say(f"   - Max Sequence Length: {cfg.data.max_length}")
    summary, *details = describe_report(r, cfg.data, saves_stop_tokens=cfg.model.finetune == "full")
    say(f"📊 Data: {summary}; tokenization {'cached' if r.cache_hit else 'done'} ({r.cache_dir})")
    for line in details:
        say(line)
    if run.resumed_from is not None:
        say(
            f"↩️  Resuming from {run.resumed_from} at step {run.state.global_step} (epoch {run.state.epoch}, "
            f"{run.state.tokens_seen:,} tokens seen, best eval loss {run.state.best_eval_loss})"
        )
    elif cfg.checkpoint.resume_from_checkpoint == "latest":
        # A requeue script passes 'latest' every time; its first start has nothing to resume, and should say so.
        say(
            f"↩️  --resume_from_checkpoint latest: {cfg.output_dir} holds no committed checkpoint yet; starting at step 0"
        )
    say("🚀 Starting distributed training...")


def info_payload(run: Run) -> dict:
    return run_info(run.cfg, run.state, run.total_steps, run.rank.world_size, run.strategy.name)


def run_info(cfg: RunConfig, state: TrainerState, total_steps: int, world_size: int, strategy: str) -> dict:
    return {
        "model_name": cfg.model.model_name,
        "dataset_name": cfg.data.dataset_name or cfg.data.dataset_path or "bundled:health-agent",
        "finetune": cfg.model.finetune,
        "global_step": state.global_step,
        "total_steps": total_steps,
        "epoch": state.epoch,
        "best_eval_loss": state.best_eval_loss,
        "best_step": state.best_step,
        "last_eval_loss": state.last_eval_loss,
        "world_size": world_size,
        "batch_size": cfg.training.batch_size,
        "batch_tokens": cfg.training.batch_tokens,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
        "effective_batch_size": cfg.training.batch_size * world_size * cfg.training.gradient_accumulation_steps,
        "learning_rate": cfg.training.learning_rate,
        "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps,
        "strategy": strategy,
    }


def write_run_record(
    output_dir: Path, cfg: RunConfig, state: TrainerState, total_steps: int, world_size: int, strategy: str
) -> None:
    """training_info.json: written when a run starts and at every save, with the config it trains with."""
    info = run_info(cfg, state, total_steps, world_size, strategy)
    write_json_atomic(output_dir / RUN_RECORD, {**info, "config": cfg.model_dump()})


def write_info(run: Run, path: Path, extra: Optional[dict] = None) -> None:
    # The config rides along: what the outputs were trained with, and how a rerun recognises its own run.
    write_json_atomic(path, {**info_payload(run), **(extra or {}), "config": run.cfg.model_dump()})


def finish_run(run: Run) -> dict:
    """Final model at output_dir, info files, loss plot and summary. Returns the summary on every rank."""
    run.checkpointer.wait()  # the last checkpoint is committed before the run counts as finished
    set_phase(run.rank.rank, "finishing: gathering memory peaks")
    peaks = rt.gather_objects(peak_memory_mb(run.rank.device))
    elapsed = time.perf_counter() - run.started
    summary = {"train_seconds": round(elapsed, 2), "peak_memory_mb_per_rank": [round(p, 1) for p in peaks]}
    model_state = run.strategy.model_state_for_saving()  # collective under sharding: every rank takes part
    if run.rank.is_main:
        save_final_model(run, model_state)
        write_info(run, run.output_dir / "training_info.json")
        if run.cfg.logging.loss_curve:
            plot_loss_curve(run.reporter.history, run.output_dir / "loss_curve.png")
        # Last: its presence is what says the run finished (checkpoint.resume, the requeue scripts), so a run killed
        # before it is rerun, never taken as finished with a plot or a model missing.
        write_info(run, run.output_dir / FINISHED, summary)
    run.reporter.close()
    s = run.state
    run.reporter.say(
        f"🏁 Done: {s.global_step} steps, {s.tokens_seen:,} target tokens in {elapsed:.1f}s; "
        f"{describe_eval(s)}; "
        f"peak memory per rank (MB): {summary['peak_memory_mb_per_rank']}; outputs in {run.output_dir}"
    )
    rt.barrier()
    return {**info_payload(run), **summary}


def describe_eval(state: TrainerState) -> str:
    """The evaluation part of the closing line; a run that had no evaluation rows says so, not 'eval loss None'."""
    if state.last_eval_loss is None:
        return "no evaluation (no eval rows: the data summary above says where they went)"
    best = "" if state.best_eval_loss is None else f" (best {state.best_eval_loss:.4f} at step {state.best_step})"
    return f"eval loss {state.last_eval_loss:.4f}{best}"


def save_final_model(run: Run, model_state: Optional[dict] = None) -> None:
    """Write the model or adapter next to a staging copy, then move files into output_dir one rename each."""
    staging = final_model_staging(run.output_dir)
    if staging.exists():
        shutil.rmtree(staging)
    save_model_files(run.strategy.unwrap(), run.tokenizer, staging, model_state)
    fsync_tree(staging)
    for item in staging.iterdir():
        os.replace(item, run.output_dir / item.name)
    staging.rmdir()
