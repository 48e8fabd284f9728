"""Decide what trains: a LoRA adapter through PEFT (on a 4-bit base for QLoRA), or every weight (full fine-tuning).

LoRA layers run phalanx's fused forward over PEFT's parameters unless `lora.kernel` is 'peft' (models/lora_fused.py)."""

from __future__ import annotations

import logging
import warnings

# Importing peft imports bitsandbytes when it is installed, and its CPU backend then warns, on every rank, that an
# optional faster kernel package is missing. The fallback it uses is correct: the warning is noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from peft import LoraConfig as PeftLoraConfig  # noqa: E402
from peft import TaskType, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402

from phalanx.config.schema import LoraConfig, ModelConfig  # noqa: E402
from phalanx.errors import ConfigError  # noqa: E402
from phalanx.models.lora_fused import install_fused_lora  # noqa: E402
from phalanx.runtime.dist import env_rank_info  # noqa: E402


def apply_finetuning(model: nn.Module, model_cfg: ModelConfig, lora_cfg: LoraConfig) -> nn.Module:
    """Return the model to train: wrapped in a PEFT LoRA adapter, or as-is with every weight trainable."""
    # QLoRA needs nothing more here: get_peft_model freezes the 4-bit base, and its unquantized weights (norms,
    # embeddings, head) stay in the dtype they were loaded in, as in plain LoRA. peft's prepare_model_for_kbit_training
    # would upcast them to fp32, which makes the residual stream fp32: measured on an H100 (Qwen2.5-1.5B shape,
    # batch 4 x 2048, bf16) that took the 4-bit run's peak to 50.2 GB against 41.1 GB for plain LoRA.
    if model_cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen base weights and DDP's single gradient-ready hook. transformers
        # 5.24 renamed the method (the old name warns, and goes in v6); earlier releases have only the old one.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
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
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' old `is_gradient_checkpointing` name, which warns on every run from
            # transformers 5.24 on; it is peft's call, not the user's to act on.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)})
        raise ConfigError(
            f"lora.target_modules = {lora_cfg.target_modules!r}: {str(exc).rstrip('.')}. Linear modules in this model: "
            f"{names}"
        ) from None
    if model_cfg.gradient_checkpointing:
        peft_model.enable_input_require_grads()
    if lora_cfg.kernel == "fused":
        use_fused_kernel(peft_model)
    return peft_model


def use_fused_kernel(peft_model: nn.Module) -> None:
    """Give the LoRA layers phalanx's fused forward (models/lora_fused.py); say once which layers keep PEFT's."""
    fused, others = install_fused_lora(peft_model)
    if others and env_rank_info()[0] == 0:
        kept = ", ".join(f"{count} {kind}" for kind, count in sorted(others.items()))
        print(
            f"LoRA kernel: fused on {fused} layers; PEFT's forward on {kept} (an adapter variant, LoRA bias or base "
            "the fused path does not cover; --lora.kernel peft silences this).",
            flush=True,
        )


def trainable_parameter_count(model: nn.Module) -> tuple[int, int]:
    # Under ZeRO-3 a parameter is a partitioned placeholder; ds_numel is its full size. A 4-bit weight packs two
    # values per byte; its quantization state knows the real shape.
    def size(p) -> int:
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None:
            return quant_state.shape.numel()
        return getattr(p, "ds_numel", p.numel())

    trainable = sum(size(p) for p in model.parameters() if p.requires_grad)
    total = sum(size(p) for p in model.parameters())
    return trainable, total
