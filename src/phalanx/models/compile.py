"""Regional `torch.compile` (training.compile): each decoder layer compiled on its own, as torchtitan does.

Compiling the layers one by one, not the whole model, keeps compile time to one layer's graph (the layers share
their code, so the first one's compiled graph serves the others), leaves the embedding, the target-only head
(train/loss.py) and the wrappers outside, and keeps every module and state-dict name as it was: each layer is
compiled in place (`nn.Module.compile`), not wrapped. Order, as in torchtitan: after activation checkpointing
(models/adapters.py, so a checkpointed layer recomputes its compiled forward), before DDP/FSDP/DeepSpeed wrap
the model. What it fuses is the elementwise work between the GEMMs: RMSNorm, rotary embedding, SwiGLU, residual
adds, the LoRA update's scaling.

On CUDA, when liger-kernel is installed, its RMSNorm, SwiGLU and rotary kernels are patched into Qwen2, Qwen3 and
Llama models first (not its fused linear cross-entropy: phalanx's own chunked, target-only loss stays).

'auto' compiles on CUDA only: on CPU compilation takes minutes to warm up and is not faster for small models.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import nn

# torch.compile backend: inductor, unless this names another ("aot_eager" traces and checks without generating
# kernels: a machine with no C++ compiler for CPU inductor, or a quick test of the wiring).
BACKEND_ENV = "PHALANX_COMPILE_BACKEND"
# liger_kernel.transformers' patch for each model type it covers and phalanx trains packed.
LIGER_PATCHES = {
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
}


def compile_wanted(setting: str, device: torch.device) -> bool:
    """training.compile: 'true', 'false', or 'auto' (on for CUDA, off elsewhere)."""
    if setting == "auto":
        return device.type == "cuda"
    return setting == "true"


def compile_decoder_layers(
    model: nn.Module, setting: str, device: torch.device, *, announce: bool = True, backend: Optional[str] = None
) -> nn.Module:
    """Compile `model`'s decoder layers in place when `setting` asks for it (see the module doc); returns `model`.

    `backend`: torch.compile's (else $PHALANX_COMPILE_BACKEND, else 'inductor'). One line says what was done, on the
    main rank."""
    if not compile_wanted(setting, device):
        return model
    from phalanx.models.blocks import decoder_layers  # the same units FSDP wraps

    liger = apply_liger_kernels(model, device)
    layers = decoder_layers(model)
    if not layers:
        if announce:
            print(
                f"🧩 training.compile = {setting}: no decoder layers found in {type(model).__name__}; nothing compiled",
                flush=True,
            )
        return model
    backend = backend or os.environ.get(BACKEND_ENV) or "inductor"
    for layer in layers:
        # Not fullgraph: a layer whose code dynamo cannot trace in one graph (a 4-bit base, an adapter variant)
        # still runs, in pieces. dynamic: micro-batches change length every step (packed: the sum of their rows;
        # padded: the longest row), so the token dimension is traced as symbolic from the first step instead of
        # compiling a static graph first and recompiling at the second length.
        layer.compile(backend=backend, dynamic=True)
    if announce:
        kind = type(layers[0]).__name__
        extra = f"; Liger RMSNorm/SwiGLU/RoPE for {liger}" if liger else ""
        print(
            f"🧩 Compiled {len(layers)} {kind} layers one by one (torch.compile, {backend}){extra}; the first "
            "steps include compilation.",
            flush=True,
        )
    return model


def apply_liger_kernels(model: nn.Module, device: torch.device) -> Optional[str]:
    """Patch Liger's RMSNorm, SwiGLU and rotary kernels into `model` (CUDA, liger-kernel installed, a model type it
    covers); returns the model type patched, or None. Any failure leaves the model as it was and is said once."""
    if device.type != "cuda" or importlib.util.find_spec("liger_kernel") is None:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    name = LIGER_PATCHES.get(model_type)
    if name is None:
        return None
    try:
        import liger_kernel.transformers as liger

        getattr(liger, name)(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=base
        )
    except Exception as exc:  # noqa: BLE001 - an optional kernel: the compiled eager path is always correct
        print(
            f"🧩 Liger kernels not applied to {model_type} ({type(exc).__name__}: {exc}); compiled layers only.",
            flush=True,
        )
        return None
    return model_type
