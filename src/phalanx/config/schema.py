"""The typed run configuration: one small pydantic model per component, documented field by field.

Every field's description is rendered into the README (``python -m phalanx.config.docs``),
so the documentation cannot drift from what is validated.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

EMBEDDED_MODEL = "embedded:tiny-qwen3"
BUNDLED_DATASET = "bundled:health-agent"


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    model_name: str = Field(
        EMBEDDED_MODEL,
        description="Local folder or Hugging Face Hub id loaded with from_pretrained; "
        f"'{EMBEDDED_MODEL}' builds the small embedded Qwen3-architecture model.",
    )
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint. Off unless you trust it.")
    finetune: Literal["lora", "full"] = Field("lora", description="Train a LoRA adapter, or every weight of the model.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (non-reentrant) to save memory.")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear' (every linear layer but the output head).",
    )


class DataConfig(Section):
    dataset_path: Optional[str] = Field(
        None, description="A jsonl file, a folder of jsonl files, or a datasets save_to_disk folder."
    )
    dataset_name: Optional[str] = Field(
        None, description="A Hugging Face Hub dataset id (or a local dataset repository folder) for datasets.load_dataset."
    )
    dataset_split: str = Field("train", description="Split of dataset_name to train on.")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "text"] = Field(
        "auto", description="Row format; 'auto' detects it from the first row's fields."
    )
    eval_dataset_path: Optional[str] = Field(None, description="Separate evaluation data; when set, test_size is not used.")
    test_size: float = Field(0.2, ge=0.0, lt=1.0, description="Fraction of the training rows held out for evaluation.")
    max_length: int = Field(1024, gt=0, description="Longest tokenized conversation, in tokens.")
    truncation: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="What to do with a conversation longer than max_length."
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row stops the run with its location, or is skipped and counted."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        if self.dataset_path and self.dataset_name:
            raise ValueError("set dataset_path or dataset_name, not both")
        return self


class TrainingConfig(Section):
    num_epochs: float = Field(3, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: Optional[int] = Field(None, gt=0, description="Stop after this many optimizer steps.")
    batch_size: int = Field(1, gt=0, description="Sequences per micro-batch per rank (global batch = batch_size x world_size x accumulation).")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of the steps spent warming the learning rate up from 0.")
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field("linear", description="Decay after warm-up.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 turns clipping off.")
    seed: int = Field(42, description="Seed for data order, dropout and initialisation.")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        "auto", description="'auto' is bf16 on CUDA devices that support it, else fp16 on CUDA, fp32 on CPU."
    )
    nan_policy: Literal["skip", "stop"] = Field(
        "skip", description="A step whose global loss is NaN or Inf is skipped and counted, or saves a checkpoint and stops the run."
    )


class EvalConfig(Section):
    eval_steps: int = Field(50, gt=0, description="Evaluate every this many optimizer steps (and at the end).")
    eval_batch_size: Optional[int] = Field(None, gt=0, description="Per-rank evaluation batch; defaults to batch_size.")


class CheckpointConfig(Section):
    save_steps: int = Field(50, gt=0, description="Save checkpoint-{step} every this many optimizer steps.")
    save_total_limit: Optional[int] = Field(None, gt=0, description="Keep at most this many checkpoint-{step} folders (checkpoint-best is kept apart).")
    save_best: bool = Field(True, description="Keep checkpoint-best with the lowest evaluation loss.")
    resume_from_checkpoint: Optional[str] = Field(
        None,
        description="'latest' or a checkpoint folder to resume from. Unset: resume from the newest committed "
        "checkpoint when output_dir holds a run with the same config, else start fresh.",
    )


class LoggingConfig(Section):
    log_steps: int = Field(10, gt=0, description="Log metrics every this many optimizer steps.")
    tensorboard: bool = Field(True, description="Write TensorBoard events under output_dir/tensorboard.")
    progress_bar: bool = Field(True, description="Show a progress bar on rank 0.")


class DistributedConfig(Section):
    world_size: int = Field(1, gt=0, description="Processes to start on this machine (ignored under torchrun, which sets it).")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="'auto' is NCCL on CUDA, gloo on CPU.")
    ddp_comm_hook: Literal["none", "fp16", "bf16"] = Field("none", description="Compress DDP gradients before the all-reduce.")
    max_restarts: int = Field(0, ge=0, description="Restart all ranks this many times when one fails; each restart resumes from the newest committed checkpoint.")
    master_port: Optional[int] = Field(None, gt=0, lt=65536, description="Rendezvous port for --world_size; a free one when unset.")
    init_timeout_minutes: float = Field(10, gt=0, description="How long ranks wait for each other to start (and through the first step).")
    timeout_minutes: float = Field(5, gt=0, description="How long a training collective may wait for a missing rank before every rank gives up.")


class RunConfig(Section):
    output_dir: str = Field("./phalanx-output", description="Where checkpoints, the final model and logs go.")
    overwrite_output_dir: bool = Field(False, description="Replace an earlier run in output_dir instead of resuming it or refusing to start.")
    force: bool = Field(False, description="Resume even though the config differs from the one the checkpoint was trained with.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
