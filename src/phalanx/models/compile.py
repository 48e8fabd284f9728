"""Fusing the elementwise work between the GEMMs (RMSNorm, rotary embedding, SwiGLU, residual adds, the LoRA update's
scaling): regional `torch.compile` (training.compile), or Liger's kernels (training.liger_kernels), never both.

Regional compile, as torchtitan does it: each decoder layer compiled on its own, in place (`nn.Module.compile`),
so compile time is one layer's graph (the layers share their code), the embedding, the target-only head
(train/loss.py) and the wrappers stay outside, and every module and state-dict name stays as it was. Order: after
activation checkpointing (models/adapters.py, so a checkpointed layer recomputes its compiled forward), before
DDP/FSDP/DeepSpeed wrap the model.

Liger's RMSNorm, SwiGLU and rotary kernels (CUDA, liger-kernel installed, Qwen2/Qwen3/Llama) are patched in only when
the layers run eagerly: on an H100 with torch 2.11 (2026-11-26), dynamo could not trace Liger's autograd functions
inside a compiled layer and the run died at its first step.

Packed rows' ends reach the compiled layers as a device tensor only (models/attention.py: `layers_compiled`), so
the graphs compiled at the first step serve micro-batches with any number of rows.

'auto' compile is on only where a side-by-side GPU measurement showed it pays: LoRA on CUDA over packed micro-batches
with DDP or one process, and a run long enough to pay the warm-up back. On an H200 at e61b8e0 (benchmarks/RESULTS.md,
2026-11-28 03:14) compiled layers took 0.143-0.154 s a batch-4 step against eager's 0.294 s (the lora arm of the
session's call before, 03:03), after about 29 s more start-up (55 s from launch to the first step with a cold compile
cache, eager ~26 s): paid back after ~200 micro-batches. (On an H100 at c956c65, 2026-11-27 05:47: 0.226 s against
0.273 s, ~750 micro-batches.) So 'auto' asks for AUTO_COMPILE_MIN_MICRO_BATCHES, twice the newer break-even. Not
measured on a GPU, so eager under 'auto': full fine-tuning, QLoRA, padded micro-batches (whose shapes recompile more),
FSDP and DeepSpeed. On CPU compilation takes minutes to warm up and is not faster for small models. 'auto' Liger is on
for CUDA when liger-kernel imports and the layers are not compiled.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import nn

from phalanx.models.attention import layers_compiled

# torch.compile backend: inductor, unless this names another ("aot_eager" traces and checks without generating
# kernels: a machine with no C++ compiler for CPU inductor, or a quick test of the wiring).
BACKEND_ENV = "PHALANX_COMPILE_BACKEND"
# "1": inductor's C++ wrapper (cpp_wrapper) launches each compiled graph's kernels, instead of generated Python. A
# compiled LoRA step at batch 4 on an H100 was still bound by the host (device busy 44%, ~3,900 launches a step,
# RESULTS 2026-11-27 06:00), and Python launching costs more per kernel than C++; the wrapper's C++ is compiled at
# warm-up, which takes longer. Off until a GPU measurement shows it pays (benchmarks/phalanx_arms.py arm
# lora-compile-cpp; the CPU host proxy in RESULTS 2026-11-27); the same losses and gradients as eager on CPU
# (tests/models/test_compile.py).
CPP_WRAPPER_ENV = "PHALANX_COMPILE_CPP_WRAPPER"
# liger_kernel.transformers' patch for each model type it covers and phalanx trains packed.
LIGER_PATCHES = {
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
}


# 'auto' compiles a run of at least this many micro-batches per rank (the measured break-even, ~200, with a margin).
AUTO_COMPILE_MIN_MICRO_BATCHES = 400


def compile_wanted(
    setting: str,
    device: torch.device,
    *,
    plain_lora: bool = False,
    packed: bool = False,
    strategy: str = "ddp",
    micro_batches: Optional[int] = None,
) -> bool:
    """training.compile: 'true', 'false', or 'auto': on for `plain_lora` (LoRA over an unquantized base) and `packed`
    micro-batches on CUDA under DDP or one process, for a run of at least AUTO_COMPILE_MIN_MICRO_BATCHES
    `micro_batches` per rank (None: not known, so eager). See the module doc for the measurement."""
    if setting != "auto":
        return setting == "true"
    return (
        device.type == "cuda"
        and plain_lora
        and packed
        and strategy == "ddp"
        and micro_batches is not None
        and micro_batches >= AUTO_COMPILE_MIN_MICRO_BATCHES
    )


def auto_compile_line(
    setting: str,
    device: torch.device,
    *,
    plain_lora: bool,
    packed: bool,
    strategy: str,
    micro_batches: Optional[int],
    steps: int,
) -> Optional[str]:
    """What 'auto' chose, for the run's log, where the length of the run decided it: compiling a long run, or eager
    for a run too short to pay the warm-up back that a longer one would compile (a user who knows the run will be
    repeated, with a warm compile cache, may want it anyway). None where 'auto' was not asked or length did not
    matter (CPU, full fine-tuning, QLoRA, FSDP, DeepSpeed: eager whatever the length)."""
    if setting != "auto":
        return None
    kind = dict(plain_lora=plain_lora, packed=packed, strategy=strategy)
    if not compile_wanted(setting, device, **kind, micro_batches=AUTO_COMPILE_MIN_MICRO_BATCHES):
        return None
    if compile_wanted(setting, device, **kind, micro_batches=micro_batches):
        return (
            f"🧩 training.compile auto: compiling, as this LoRA run on CUDA is {steps:,} optimizer steps long, "
            "enough to pay back the warm-up (--training.compile false keeps the layers eager)."
        )
    return (
        f"🧩 training.compile auto: eager, as this LoRA run is {micro_batches or 0:,} passes long and 'auto' compiles "
        f"from {AUTO_COMPILE_MIN_MICRO_BATCHES:,} (compiled layers run a step about 1.9x faster on an H200 after about "
        "30 s of warm-up; --training.compile true compiles anyway)."
    )


def fuse_elementwise(
    model: nn.Module,
    compile_layers: bool,
    liger_setting: str,
    device: torch.device,
    *,
    announce: bool = True,
    backend: Optional[str] = None,
    cuda_graphs: bool = False,
) -> nn.Module:
    """Compile `model`'s decoder layers in place when `compile_layers` (compile_wanted's answer), else patch Liger's
    kernels in when training.liger_kernels allows it (see the module doc); returns `model`. One line says what was
    done, on the main rank. `cuda_graphs`: the compiled layers are captured as CUDA graphs (models/graphs.py)."""
    if compile_layers:
        return compile_decoder_layers(model, device, announce=announce, backend=backend, cuda_graphs=cuda_graphs)
    liger = apply_liger_kernels(model, device) if liger_setting == "auto" else None
    if liger and announce:
        print(f"🧩 Liger RMSNorm/SwiGLU/RoPE kernels patched into the {liger} layers (eager).", flush=True)
    return model


def compile_decoder_layers(
    model: nn.Module,
    device: torch.device,
    *,
    announce: bool = True,
    backend: Optional[str] = None,
    cuda_graphs: bool = False,
) -> nn.Module:
    """Compile `model`'s decoder layers in place; returns `model`. `backend`: torch.compile's (else
    $PHALANX_COMPILE_BACKEND, else 'inductor'). `cuda_graphs`: inductor captures each compiled layer as CUDA graphs
    (its 'reduce-overhead' trees; on CUDA only, and only inductor captures)."""
    from phalanx.models.blocks import decoder_layers  # the same units FSDP wraps

    layers = decoder_layers(model)
    if not layers:
        if announce:
            print(
                f"🧩 training.compile: no decoder layers found in {type(model).__name__}; nothing compiled", flush=True
            )
        return model
    backend = backend or os.environ.get(BACKEND_ENV) or "inductor"
    cpp_wrapper = backend == "inductor" and os.environ.get(CPP_WRAPPER_ENV) == "1"
    graphs = cuda_graphs and backend == "inductor" and device.type == "cuda"
    options = {**({"cpp_wrapper": True} if cpp_wrapper else {}), **({"triton.cudagraphs": True} if graphs else {})}
    layers_compiled()  # packed rows' ends reach the layers as a tensor only: no recompile per number of rows
    for layer in layers:
        # Not fullgraph: a layer whose code dynamo cannot trace in one graph (a 4-bit base, an adapter variant)
        # still runs, in pieces. dynamic: micro-batches change length every step (packed: the sum of their rows;
        # padded: the longest row), so the token dimension is traced as symbolic from the first step instead of
        # compiling a static graph first and recompiling at the second length.
        layer.compile(backend=backend, dynamic=True, options=options or None)
    if announce:
        print(
            f"🧩 Compiled {len(layers)} {type(layers[0]).__name__} layers one by one (torch.compile, {backend}"
            f"{', C++ wrapper' if cpp_wrapper else ''}{', CUDA graphs' if graphs else ''}); the first steps include "
            "compilation.",
            flush=True,
        )
        if cuda_graphs and not graphs:
            where = f"the {backend} backend" if backend != "inductor" else f"a {device.type} device"
            print(
                f"🧩 training.cuda_graphs: no CUDA graphs on {where} (inductor captures them on CUDA only).", flush=True
            )
    return model


def liger_covers(device: torch.device, model_type: Optional[str]) -> bool:
    """Liger's kernels can be patched in here: a CUDA device, liger-kernel installed, a model type it covers (what
    'auto' needs besides eager layers; `phalanx plan` prices the layers' saved tensors by the same answer)."""
    return (
        device.type == "cuda" and model_type in LIGER_PATCHES and importlib.util.find_spec("liger_kernel") is not None
    )


def apply_liger_kernels(model: nn.Module, device: torch.device) -> Optional[str]:
    """Patch Liger's RMSNorm, SwiGLU and rotary kernels into `model` (liger_covers it); returns the model type
    patched, or None. Any failure leaves the model as it was and is said once."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if not liger_covers(device, model_type):
        return None
    name = LIGER_PATCHES[model_type]
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
