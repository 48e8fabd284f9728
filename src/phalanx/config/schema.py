"""The typed run configuration: one small pydantic model per component, documented field by field.

Every field's description is rendered into the README (``python -m phalanx.config.docs``),
so the documentation cannot drift from what is validated.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EMBEDDED_MODEL = "embedded:tiny-qwen3"
BUNDLED_DATASET = "bundled:health-agent"


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def home_expanded(value: Any) -> Any:
    """A path field's `~/...` as the shell would expand it. A YAML file is read by no shell: `output_dir: ~/runs/a`
    made a folder named '~' in the current one, and `dataset_path: ~/data.jsonl` was not found."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


class ModelConfig(Section):
    model_name: str = Field(
        EMBEDDED_MODEL,
        description="Local folder or Hugging Face Hub id loaded with from_pretrained; "
        f"'{EMBEDDED_MODEL}' builds the small embedded Qwen3-architecture model.",
    )
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the checkpoint. Off unless you trust it."
    )
    finetune: Literal["lora", "full"] = Field("lora", description="Train a LoRA adapter, or every weight of the model.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (non-reentrant) to save memory."
    )
    load_in_4bit: bool = Field(
        False,
        description="QLoRA: load the frozen base quantized to 4 bits with bitsandbytes (`pip install "
        "'phalanx[qlora]'`) and train a LoRA adapter on it (finetune 'lora'); under ddp, fsdp and deepspeed alike.",
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type of the base weights: NormalFloat4 (QLoRA's) or plain FP4."
    )
    bnb_4bit_use_double_quant: bool = Field(
        True, description="Quantize the 4-bit blocks' scales too (about 0.4 bits per weight saved)."
    )
    bnb_4bit_compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="dtype the 4-bit weights are dequantized to for each matmul; 'auto' is the run's mixed "
        "precision dtype (bf16/fp16 on CUDA), fp32 on CPU.",
    )


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear",
        description="Module names to adapt (a list, or one comma-separated value: --target_modules q_proj,v_proj), "
        "or 'all-linear' (every linear layer but the output head).",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_in_one_value(cls, value: Any) -> Any:
        # `--target_modules q_proj,v_proj` (and `target_modules: q_proj` in YAML) is how people write it; pydantic
        # alone accepted only a YAML list and answered anything else with two lines about union members.
        if isinstance(value, str) and value != "all-linear":
            names = [name.strip() for name in value.split(",") if name.strip()]
            if names:
                return names
        return value

    kernel: Literal["fused", "peft"] = Field(
        "fused",
        description="Forward of the LoRA layers. 'fused': phalanx's own over PEFT's parameters (same names and "
        "files): the update runs in the activation dtype and keeps no copy of the input, so far less memory; "
        "dropout draws an independent mask per adapter as PEFT does and redraws it in backward instead of keeping "
        "it; over 4-bit (QLoRA) bases too. Variants such as DoRA keep PEFT's forward (the run says so). 'peft': "
        "PEFT's forward everywhere.",
    )


class DataConfig(Section):
    dataset_path: Optional[str] = Field(
        None,
        description="A jsonl or Parquet file, a folder of *.jsonl / *.parquet files, or a datasets save_to_disk folder.",
    )
    dataset_name: Optional[str] = Field(
        None,
        description="A Hugging Face Hub dataset id (or a local dataset repository folder) for datasets.load_dataset; "
        "a save_to_disk folder is read with load_from_disk, a DatasetDict's splits picked as load_dataset's.",
    )
    dataset_split: str = Field("train", description="Split of dataset_name to train on.")
    eval_dataset_split: Optional[str] = Field(
        None,
        description="A split of dataset_name to evaluate on (its own 'test' or 'validation'); when set, test_size is "
        "not used.",
    )
    format: Literal["auto", "messages", "sharegpt", "alpaca", "text"] = Field(
        "auto", description="Row format; 'auto' detects it from the first row's fields."
    )
    eval_dataset_path: Optional[str] = Field(
        None, description="Separate evaluation data; when set, test_size is not used."
    )
    test_size: float = Field(0.2, ge=0.0, lt=1.0, description="Fraction of the training rows held out for evaluation.")
    max_length: int = Field(1024, gt=0, description="Longest tokenized conversation, in tokens.")
    truncation: Literal["truncate", "keep_recent", "drop", "error"] = Field(
        "truncate",
        description="What to do with a conversation longer than max_length: 'truncate' cuts its end; 'keep_recent' "
        "drops its oldest exchanges (from a user message up to the next), never the system prompt or tools, until it "
        "fits, and cuts the end only if the last exchange alone is too long; 'drop' leaves the row out; 'error' stops.",
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row stops the run with its location, or is skipped and counted."
    )
    chat_template: Optional[str] = Field(
        None,
        description="Replace the tokenizer's chat template: a jinja file, a chat_template.json or tokenizer_config.json "
        "(its chat_template field), a model folder holding one, or the name of a template phalanx ships (`phalanx data "
        "templates` lists them). The template used is saved with the tokenizer in every checkpoint.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables passed to the chat template at every rendering, as apply_chat_template's keyword "
        "arguments: e.g. {enable_thinking: false} for Qwen3's non-thinking mode. Give the same to `phalanx generate "
        "--chat_template_kwargs` (it reads them from an adapter's training_info.json by default).",
    )
    multi_turn: Literal["auto", "full", "per_turn"] = Field(
        "auto",
        description="How conversations with several assistant turns train: 'full' = one row, every assistant turn "
        "masked in the whole rendering; 'per_turn' = one row per assistant turn, rendered as the model sees that "
        "context at inference (for templates that rewrite earlier turns, e.g. drop past reasoning); 'auto' = full "
        "where every turn renders the same whatever follows it, else per_turn.",
    )
    special_token_text: Literal["text", "token"] = Field(
        "text",
        description="A special token's text written in a row (a user quoting ChatML's end of turn, an answer "
        "mentioning '</s>'): 'text' encodes it as ordinary text (in an answer, the sequence tokens only: end, begin, "
        "padding), so only the chat template's own markup becomes control tokens and a row cannot close a turn or "
        "teach a stop in mid-sentence; 'token' reads it as the token (rows that write a model's markup by hand). "
        "Added tokens that are not special (<think>, <tool_call>) are tokens either way.",
    )
    packing: bool = Field(
        True,
        description="Padding-free micro-batches: a micro-batch's rows are concatenated into one sequence with "
        "position ids restarting per row and attention that cannot cross rows (varlen attention), so no compute "
        "goes to padding; the same rows per micro-batch, the same loss. Model types not checked for it train padded "
        "(the run says so). false: right-pad each micro-batch to its longest row.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        from phalanx.config.chat_templates import template_variables_problem

        problem = template_variables_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    _home = field_validator("dataset_path", "eval_dataset_path", "chat_template", mode="before")(home_expanded)

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, value: Optional[str]) -> Optional[str]:
        # Checked when the config is read, so a typo stops train/launcher/slurm before any rank starts.
        if value is not None:
            from phalanx.config.chat_templates import ChatTemplateError, resolve_chat_template

            try:
                resolve_chat_template(value)
            except ChatTemplateError as exc:
                raise ValueError(exc.reason) from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        if self.dataset_path and self.dataset_name:
            raise ValueError("set dataset_path or dataset_name, not both")
        if self.dataset_split != "train" and not self.dataset_name:
            # A file of rows has no splits, and a save_to_disk folder read as dataset_path gives its 'train': the split
            # asked for would be left unread without a word.
            raise ValueError(
                f"dataset_split {self.dataset_split!r} names a split of dataset_name, which is not set"
                + (
                    f"; for a split of the save_to_disk DatasetDict or the Hub-style folder at dataset_path, give "
                    f"{self.dataset_path} as dataset_name"
                    if self.dataset_path
                    else ""
                )
            )
        if self.eval_dataset_split is not None:
            if not self.dataset_name:
                raise ValueError(
                    f"eval_dataset_split {self.eval_dataset_split!r} names a split of dataset_name, which is not set; "
                    "evaluate a file or folder with eval_dataset_path instead"
                    + (
                        f" (or, for a split of the save_to_disk DatasetDict at dataset_path, give {self.dataset_path} "
                        "as dataset_name)"
                        if self.dataset_path
                        else ""
                    )
                )
            if self.eval_dataset_path:
                raise ValueError("set eval_dataset_split or eval_dataset_path, not both")
            if self.eval_dataset_split == self.dataset_split:
                raise ValueError(
                    f"eval_dataset_split {self.eval_dataset_split!r} is the split the run trains on "
                    "(dataset_split): its rows would be trained on and then scored; name another split, or leave it "
                    "out to hold out test_size of the training rows"
                )
        return self


class TrainingConfig(Section):
    num_epochs: float = Field(3, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: Optional[int] = Field(None, gt=0, description="Stop after this many optimizer steps.")
    batch_size: int = Field(
        1,
        gt=0,
        description="Sequences per micro-batch per rank (global batch = batch_size x world_size x accumulation).",
    )
    batch_tokens: Optional[int] = Field(
        None,
        gt=0,
        description="Token budget per packed micro-batch per rank, in place of batch_size: rows are packed "
        "(first fit, in the shuffled order) into micro-batches of at most this many tokens, so every micro-batch does "
        "about the same work however long its rows are. At least data.max_length; needs data.packing. A checkpoint "
        "resumes only with the same value.",
    )
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    merge_micro_batches: Literal["auto", "true", "false"] = Field(
        "auto",
        description="With gradient_accumulation_steps > 1 and packed rows: run one optimizer step's micro-batches as "
        "few forward/backward passes of at most training.merge_tokens tokens each (their rows packed together). The "
        "same rows, the same loss normalisation (the global batch's target tokens), the same gradients up to the "
        "order of summation; fewer, larger passes keep a GPU busy, where a one-row pass is bound by launching "
        "kernels. 'auto': on for CUDA under DDP or FSDP (one process included); off on CPU, where passes are not "
        "launch-bound, and under DeepSpeed, whose engine is not checked with merged passes.",
    )
    merge_tokens: Optional[int] = Field(
        None,
        gt=0,
        description="Most tokens in one merged pass (training.merge_micro_batches). Unset: on a GPU the largest pass "
        "`phalanx plan`'s memory model fits there (8192, 16384 or 32768 tokens, at most a whole step; 16384 for the "
        "seeds' 1.5B LoRA at batch 1 x 8 on 80 GB), else the most one micro-batch holds already (batch_tokens, else "
        "batch_size x max_length), within the unmerged run's memory bound. At least data.max_length.",
    )
    learning_rate: float = Field(5e-5, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(
        0.0, ge=0, lt=1, description="Fraction of the steps spent warming the learning rate up from 0."
    )
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field("linear", description="Decay after warm-up.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 turns clipping off.")
    seed: int = Field(42, description="Seed for data order, dropout and initialisation.")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        "auto", description="'auto' is bf16 on CUDA devices that support it, else fp16 on CUDA, fp32 on CPU."
    )
    compile: Literal["auto", "true", "false"] = Field(
        "auto",
        description="Regional torch.compile: each decoder layer compiled on its own (after activation checkpointing, "
        "before the strategy wraps the model), fusing the elementwise work between matmuls; the first steps include "
        "compiling (about 30 s for a 1.5B model on an H200). 'auto' is on where it was measured to pay: LoRA over an "
        "unquantized base, packed micro-batches, on CUDA, one process or DDP, in runs of at least 400 "
        "micro-batches per rank (a batch-4 step 1.9x faster on an H200: benchmarks/RESULTS.md); off elsewhere.",
    )
    liger_kernels: Literal["auto", "false"] = Field(
        "auto",
        description="Liger's kernels, on CUDA where liger-kernel is installed: 'auto' patches its RMSNorm/SwiGLU/RoPE "
        "into Qwen2/Qwen3/Llama layers that are not compiled (compiled layers fuse that work themselves), and runs the "
        "output head's target-only loss in its fused linear cross-entropy (checked once against phalanx's chunked "
        "head); 'false' keeps Liger out of both.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Capture the compiled decoder layers as CUDA graphs (inductor's 'reduce-overhead'), so a layer's "
        "kernels launch as one graph: for steps bound by the host launching kernels (small micro-batches on a fast "
        "GPU). Compiles the layers (training.compile must not be false); packed micro-batches are padded with rows "
        "that hold no targets to 16 token counts per bound, each captured at its first use. One process or DDP, "
        "packed rows, no activation checkpointing, no 4-bit base. Measured slower than compiled layers without graphs "
        "(an H200, batch 4: 9,966 tokens/s against ~25,000, and minutes to capture): an experiment, not a speed-up.",
    )
    loader_workers: Optional[int] = Field(
        None,
        ge=0,
        description="DataLoader worker processes that pack the next micro-batches while the current step runs. Unset: "
        "1 on CUDA, 0 on CPU. The saved data position counts the micro-batches the loop took, so resume is exact "
        "with any number.",
    )
    gradient_checkpointing: Optional[bool] = Field(
        None, description="Seed 003's place for model.gradient_checkpointing; when set, it sets that field."
    )
    nan_policy: Literal["skip", "stop"] = Field(
        "skip",
        description="A step whose global loss is NaN or Inf is skipped and counted, or saves a checkpoint and stops the run.",
    )


class EvalConfig(Section):
    eval_steps: int = Field(50, gt=0, description="Evaluate every this many optimizer steps (and at the end).")
    eval_batch_size: Optional[int] = Field(None, gt=0, description="Per-rank evaluation batch; defaults to batch_size.")


class CheckpointConfig(Section):
    save_steps: int = Field(50, gt=0, description="Save checkpoint-{step} every this many optimizer steps.")
    save_total_limit: Optional[int] = Field(
        None,
        description="Keep at most this many checkpoint-{step} folders, at least 2 (checkpoint-best is kept apart; "
        "the folder being written is never deleted).",
    )
    save_best: bool = Field(True, description="Keep checkpoint-best with the lowest evaluation loss.")

    _home = field_validator("resume_from_checkpoint", mode="before")(home_expanded)

    @field_validator("save_total_limit")
    @classmethod
    def keep_a_fallback(cls, limit: Optional[int]) -> Optional[int]:
        # One kept checkpoint leaves nothing to go back to when the newest turns out unusable (a disk error after
        # its commit, a bad step saved just before a crash): retention always keeps the one before it too.
        if limit is not None and limit < 2:
            raise ValueError(
                f"save_total_limit must be at least 2 (got {limit}): the newest checkpoint and the one "
                "before it are always kept. Leave it unset to keep every checkpoint."
            )
        return limit

    async_save: bool = Field(
        False,
        description="Write checkpoints in the background: training waits only while the state is copied to CPU "
        "memory (FSDP2's sharded state through torch.distributed.checkpoint.async_save, rank 0's files in a thread). "
        "A checkpoint is committed only once complete; the next save and the end of training wait for it.",
    )
    resume_from_checkpoint: Optional[str] = Field(
        None,
        description="'latest' or a checkpoint folder to resume from. Unset: resume from the newest committed "
        "checkpoint when output_dir holds a run with the same config, else start fresh.",
    )


class LoggingConfig(Section):
    log_steps: int = Field(10, gt=0, description="Log metrics every this many optimizer steps.")
    tensorboard: bool = Field(True, description="Write TensorBoard events under output_dir/tensorboard.")
    loss_curve: bool = Field(
        True, description="Draw the run's losses into output_dir/loss_curve.png at the end (matplotlib, about 1 s)."
    )
    progress_bar: bool = Field(
        True,
        description="Show a progress bar on rank 0 (on a terminal; where stdout is a file or pipe, one plain line per logged step).",
    )


# FSDP sharding strategies (seed 003's names), defined once: the FSDP strategy and `phalanx config fsdp` read these.
ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
SHARDING_STRATEGIES: tuple[str, ...] = get_args(ShardingStrategy)


class DistributedConfig(Section):
    world_size: int = Field(
        1, gt=0, description="Processes to start on this machine (ignored under torchrun, which sets it)."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="'auto' is NCCL on CUDA, gloo on CPU.")
    ddp_comm_hook: Literal["none", "fp16", "bf16"] = Field(
        "none", description="Compress DDP gradients before the all-reduce."
    )
    strategy: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp",
        description="How several ranks train: 'ddp' (a full replica per rank), 'fsdp' (PyTorch FSDP2, sharded "
        "parameters, gradients and optimizer state) or 'deepspeed' (the DeepSpeed ZeRO engine). One process runs plain under 'ddp' and on a one-rank group under the others (their CPU offload works on a single device).",
    )
    sharding_strategy: ShardingStrategy = Field(
        "FULL_SHARD",
        description="FSDP: shard everything and regather per layer (FULL_SHARD), keep parameters gathered "
        "between forward and backward (SHARD_GRAD_OP), shard within a node and replicate across nodes (HYBRID_SHARD), "
        "or replicate only (NO_SHARD).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."
    )
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state (and the step) in CPU memory.")
    offload_param: bool = Field(
        False,
        description="Keep sharded parameters in CPU memory (DeepSpeed ZeRO-3 parameter offload; FSDP CPU offload, which also moves gradients and the optimizer step).",
    )
    deepspeed_config: Optional[str] = Field(
        None,
        description='DeepSpeed: a JSON config of your own; its "auto" values are filled from this config, and conflicts are reported.',
    )
    fsdp_config: Optional[str] = Field(
        None,
        description="FSDP: a JSON config as `phalanx config fsdp` writes it; its fields override sharding_strategy (and "
        "can turn CPU offload on); its fsdp_mixed_precision must be the run's precision (BFLOAT16 for bf16 on CUDA; "
        "a CPU run is fp32), or NO to take the run's. Its other fields are accelerate's: phalanx shards each of the "
        "model's decoder layers whatever fsdp_transformer_layer_cls_to_wrap lists.",
    )
    use_deepspeed: bool = Field(False, description="Seed 003's switch: true means strategy 'deepspeed'.")
    use_fsdp: bool = Field(False, description="Seed 003's switch: true means strategy 'fsdp'.")
    gradient_accumulation_steps: Optional[int] = Field(
        None,
        gt=0,
        description="Seed 003's place for training.gradient_accumulation_steps; when set, it sets that field.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Restart all ranks this many times when one fails; each restart resumes from the newest committed checkpoint.",
    )
    shutdown_timeout_s: int = Field(
        300,
        gt=0,
        description="After a SIGTERM or Ctrl-C, how long the launcher (--world_size, and torchrun in `phalanx launcher` / `phalanx slurm` scripts) lets the ranks finish their step and commit the preemption checkpoint before it kills them; torch's own default is 30 s. Give it the time a save takes on your model.",
    )
    master_port: Optional[int] = Field(
        None, gt=0, lt=65536, description="Rendezvous port for --world_size; a free one when unset."
    )
    init_timeout_minutes: float = Field(
        10, gt=0, description="How long ranks wait for each other to start (and through the first step)."
    )
    timeout_minutes: float = Field(
        5, gt=0, description="How long a training collective may wait for a missing rank before every rank gives up."
    )

    _home = field_validator("deepspeed_config", "fsdp_config", mode="before")(home_expanded)


# What seed 003's `report_to` may name (Hugging Face's spelling): phalanx writes TensorBoard events or none.
REPORT_TO = ("tensorboard", "none")


# Strategies whose runs never merge a step's micro-batches (training.merge_micro_batches): DeepSpeed's engine is not
# checked with merged passes. One rule for the config check, the run (data/collate.py) and the plan's table.
UNMERGED_STRATEGIES = frozenset({"deepspeed"})


class RunConfig(Section):
    output_dir: str = Field("./phalanx-output", description="Where checkpoints, the final model and logs go.")
    overwrite_output_dir: bool = Field(
        False, description="Replace an earlier run in output_dir instead of resuming it or refusing to start."
    )
    force: bool = Field(
        False, description="Resume even though the config differs from the one the checkpoint was trained with."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    report_to: Optional[Union[str, list[str]]] = Field(
        None,
        description="Seed 003's switch: 'tensorboard' (or a list holding it) writes TensorBoard events, 'none' (or "
        "[]) writes none; it sets logging.tensorboard. metrics.jsonl is written either way.",
    )

    _home = field_validator("output_dir", mode="before")(home_expanded)

    @model_validator(mode="after")
    def _seed_003_spellings_and_impossible_combinations(self) -> "RunConfig":
        d, t = self.distributed, self.training
        if self.report_to is not None:
            names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
            unknown = [name for name in names if name not in REPORT_TO]
            if unknown:
                raise ValueError(
                    f"report_to {unknown}: phalanx reports to TensorBoard (and metrics.jsonl, always); accepted: "
                    "'tensorboard', 'none', or a list of them"
                )
            wanted = "tensorboard" in names
            if "tensorboard" in self.logging.model_fields_set and self.logging.tensorboard != wanted:
                raise ValueError(
                    f"report_to {self.report_to!r} but logging.tensorboard is {self.logging.tensorboard}; keep one"
                )
            self.logging.tensorboard = wanted
        if d.use_deepspeed and d.use_fsdp:
            raise ValueError("distributed.use_deepspeed and distributed.use_fsdp are both true; pick one strategy")
        for flag, name in ((d.use_deepspeed, "deepspeed"), (d.use_fsdp, "fsdp")):
            if flag:
                if "strategy" in d.model_fields_set and d.strategy != name:
                    raise ValueError(
                        f"distributed.use_{name} is true but distributed.strategy is '{d.strategy}'; keep one of them"
                    )
                d.strategy = name
        # A DeepSpeed or FSDP file with no strategy named means that strategy.
        for file, name in ((d.deepspeed_config, "deepspeed"), (d.fsdp_config, "fsdp")):
            if file and "strategy" not in d.model_fields_set and not (d.use_deepspeed or d.use_fsdp):
                d.strategy = name
        if d.gradient_accumulation_steps is not None:
            if (
                "gradient_accumulation_steps" in t.model_fields_set
                and t.gradient_accumulation_steps != d.gradient_accumulation_steps
            ):
                raise ValueError(
                    f"distributed.gradient_accumulation_steps = {d.gradient_accumulation_steps} but "
                    f"training.gradient_accumulation_steps = {t.gradient_accumulation_steps}; keep one of them"
                )
            t.gradient_accumulation_steps = d.gradient_accumulation_steps
        if t.gradient_checkpointing is not None:
            self.model.gradient_checkpointing = t.gradient_checkpointing
        if d.strategy == "ddp" and (d.offload_optimizer or d.offload_param):
            raise ValueError(
                "CPU offload needs a sharding strategy: DDP keeps a full replica on every device. Use "
                "--strategy deepspeed (--offload_optimizer / --offload_param) or --strategy fsdp --offload_param"
            )
        if d.strategy == "fsdp" and d.offload_optimizer:
            raise ValueError(
                "FSDP offloads parameters, gradients and the optimizer step together: use --offload_param "
                "with --strategy fsdp (or --strategy deepspeed for optimizer-only offload)"
            )
        if d.strategy == "deepspeed" and d.offload_param and d.zero_stage != 3 and not d.deepspeed_config:
            raise ValueError(
                f"--offload_param needs --zero_stage 3 (parameters are partitioned only there); got {d.zero_stage}"
            )
        if d.strategy != "deepspeed" and d.deepspeed_config:
            raise ValueError(
                f"distributed.deepspeed_config is set but the strategy is '{d.strategy}'; add --strategy deepspeed"
            )
        if d.strategy != "fsdp" and d.fsdp_config:
            raise ValueError(f"distributed.fsdp_config is set but the strategy is '{d.strategy}'; add --strategy fsdp")
        if t.batch_tokens is not None:
            if not self.data.packing:
                raise ValueError(
                    f"training.batch_tokens = {t.batch_tokens} packs rows into token-budget micro-batches "
                    "and needs data.packing true; drop --batch_tokens to pad batch_size rows instead"
                )
            if t.batch_tokens < self.data.max_length:
                raise ValueError(
                    f"training.batch_tokens = {t.batch_tokens} is less than data.max_length = "
                    f"{self.data.max_length}: the longest row would not fit; raise batch_tokens to at least "
                    f"{self.data.max_length} or lower max_length"
                )
        self._check_merge()
        self._check_4bit()
        self._check_cuda_graphs()
        return self

    def _check_cuda_graphs(self) -> None:
        """CUDA graphs capture compiled, packed layers whose hooks and shapes do not change between replays."""
        if not self.training.cuda_graphs:
            return
        clashes = [
            (self.training.compile == "false", "training.compile false (the graphs are the compiled layers')"),
            (not self.data.packing, "data.packing false (padded batches are not padded to graph shapes)"),
            (
                self.distributed.strategy not in ("ddp",),
                f"--strategy {self.distributed.strategy} (its per-layer hooks run between the layers; one process or "
                "ddp)",
            ),
            (self.model.gradient_checkpointing, "model.gradient_checkpointing (recomputing in backward)"),
            (self.model.load_in_4bit, "model.load_in_4bit (bitsandbytes' kernels are not checked in graphs)"),
        ]
        named = [why for clash, why in clashes if clash]
        if named:
            raise ValueError(
                f"training.cuda_graphs true cannot run with {'; '.join(named)}: turn training.cuda_graphs off or "
                f"change {'that setting' if len(named) == 1 else 'those settings'}"
            )

    def _check_merge(self) -> None:
        t = self.training
        if t.merge_micro_batches == "true" and not self.data.packing:
            raise ValueError(
                "training.merge_micro_batches = true packs a step's micro-batches together and needs data.packing "
                "true; drop it (or set it to auto) to train padded"
            )
        if t.merge_micro_batches == "true" and self.distributed.strategy in UNMERGED_STRATEGIES:
            raise ValueError(
                "training.merge_micro_batches = true is not supported under --strategy deepspeed (its engine is not "
                "checked with merged passes); use auto or false there"
            )
        if t.merge_tokens is not None:
            if t.merge_micro_batches == "false":
                raise ValueError(
                    f"training.merge_tokens = {t.merge_tokens} is set but training.merge_micro_batches is false; "
                    "drop one of them"
                )
            if t.merge_tokens < self.data.max_length:
                raise ValueError(
                    f"training.merge_tokens = {t.merge_tokens} is less than data.max_length = {self.data.max_length}: "
                    f"the longest row would not fit; raise merge_tokens to at least {self.data.max_length}"
                )

    def _check_4bit(self) -> None:
        """QLoRA trains an adapter on a frozen 4-bit base; its settings mean nothing without it."""
        m = self.model
        if m.load_in_4bit and m.finetune == "full":
            raise ValueError(
                "model.load_in_4bit with model.finetune 'full': 4-bit weights cannot be trained. Use "
                "--finetune lora (QLoRA: a LoRA adapter on the frozen 4-bit base), or drop --load_in_4bit"
            )
        # A 4-bit setting with load_in_4bit left out is a forgotten switch; an explicit false turns QLoRA off.
        given = sorted(name for name in m.model_fields_set if name.startswith("bnb_4bit_"))
        if given and "load_in_4bit" not in m.model_fields_set:
            raise ValueError(
                f"model.{given[0]} is set but model.load_in_4bit is not: the base would load unquantized "
                "and the setting would do nothing. Add --load_in_4bit (or model.load_in_4bit: true)"
            )

    def check_nodes(self, nodes: int) -> None:
        """Refuse, before any process starts, a layout the job's node count cannot give (HYBRID_SHARD on one node).

        Called where the node count is known: `phalanx train` (one node), `phalanx launcher` / `phalanx slurm`."""
        from phalanx.errors import ConfigError

        d = self.distributed
        if d.strategy == "fsdp" and d.sharding_strategy == "HYBRID_SHARD" and nodes < 2:
            raise ConfigError(
                "distributed.sharding_strategy = 'HYBRID_SHARD' shards within a node and replicates across nodes, "
                "but this job runs on one node. Use FULL_SHARD on one node (or SHARD_GRAD_OP for less communication), "
                "or start several nodes (`phalanx launcher --num_nodes N` / `phalanx slurm --num_nodes N`)."
            )
