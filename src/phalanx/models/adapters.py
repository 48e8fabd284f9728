"""Decide what trains: a LoRA adapter through PEFT, or every weight (full fine-tuning)."""

from __future__ import annotations

from peft import LoraConfig as PeftLoraConfig
from peft import TaskType, get_peft_model
from torch import nn

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.errors import ConfigError


def apply_finetuning(model: nn.Module, model_cfg: ModelConfig, lora_cfg: LoraConfig) -> nn.Module:
    """Return the model to train: wrapped in a PEFT LoRA adapter, or as-is with every weight trainable."""
    if model_cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen base weights and DDP's single gradient-ready hook.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if model_cfg.finetune == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    peft_cfg = PeftLoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
    )
    try:
        peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)})
        raise ConfigError(f"lora.target_modules = {lora_cfg.target_modules!r}: {exc}. Linear modules in this model: {names}") from None
    if model_cfg.gradient_checkpointing:
        peft_model.enable_input_require_grads()
    return peft_model


def trainable_parameter_count(model: nn.Module) -> tuple[int, int]:
    # Under ZeRO-3 a parameter is a partitioned placeholder; ds_numel is its full size.
    def size(p) -> int:
        return getattr(p, "ds_numel", p.numel())

    trainable = sum(size(p) for p in model.parameters() if p.requires_grad)
    total = sum(size(p) for p in model.parameters())
    return trainable, total
