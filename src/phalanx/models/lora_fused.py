"""A lean forward for PEFT's LoRA linear layers: the same parameters, names and files, less memory and traffic.

PEFT's `lora.Linear.forward` casts each adapter's input to the adapter dtype (fp32), runs dropout on that copy and
keeps it for backward, then casts it back to bf16 under autocast (another copy kept), and scales and adds the
update in separate passes. q/k/v (and gate/up) read the same hidden states, so each keeps its own copies.

Here the layer is one autograd Function,

    out = base(x) + (dropout(x) @ A^T @ B^T) * scale

computed in the activation dtype (the autocast dtype, else x's): A and B stay the fp32 (or whatever dtype the
strategy gives them) parameters PEFT made; they are cast to the activation dtype for the matmuls, and their
gradients come back in their own dtype. Backward needs only x (which the base linear keeps anyway) and the r-wide
intermediate x @ A^T. A plain frozen base linear is applied inside the Function (one autograd node per layer, and
one gradient for x); a 4-bit, trained or hooked base is called as its module and the update added into its output in
place (`addmm_`), with the scale as its alpha, unless that output is a view (then one out-of-place addmm: see
_LoraUpdate). Under torch.compile dropout masks are kept, not redrawn.

Dropout is torch's own dropout operator (`native_dropout`), the one PEFT's `nn.Dropout` reaches: every adapter draws
its own mask from the same default generator, so on CPU in fp32 the masks and outputs are PEFT's bit for bit (on CUDA
it is the same fused kernel, one launch that draws the mask and scales the input). Sharing one mask across q/k/v
would correlate their noise, which changes the estimator, so it is not done. On CUDA no mask is kept: the generator
state before the draw is saved (16 bytes) and backward redraws the mask from it into a temporary, with the same
operator; a draw costs about a copy there, and memory is what limits a GPU step. On CPU a draw costs about 10 ns per
element, ten times the multiply it feeds, so the mask is kept instead, as bools (1 byte per element, where PEFT keeps
about 9 to 11 bytes per element per adapter). With dropout 0 (or in eval mode) there is no mask and no copy at all.

The same forward runs over a bitsandbytes 4-bit base (QLoRA): the update does not depend on how the base computes its
output. Layers this does not cover keep PEFT's forward: DoRA and other variants, LoRA biases, several active adapters,
merged or disabled adapters, per-call `adapter_names`, 8-bit bases.
"""

from __future__ import annotations

from typing import Optional

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

# Devices on which backward redraws the dropout mask from the saved generator state instead of keeping it.
REDRAW_MASK_ON = frozenset({"cuda"})
# The attribute of a fused layer that holds the run's KeptCasts, where it has one.
KEPT_CASTS = "_phalanx_kept_casts"
# Strategies whose LoRA weights are whole, plain tensors of each process, changed in place only (KeptCasts).
KEPT_CAST_STRATEGIES = frozenset({"single", "ddp"})


def _default_generator(device: torch.device) -> Optional[torch.Generator]:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


class _LoraUpdate(torch.autograd.Function):
    """out = base(x) + alpha * d(x) @ A^T @ B^T, with d(x) = m ∘ x / (1 - p) the dropout (x itself when p is 0) and
    alpha the LoRA scale. The matmuls run in `dtype`; A and B are cast to it once, in the forward (or come `kept`:
    fresh casts that KeptCasts holds), and the casts (r x features each) are kept for the backward, where alpha rides
    in the GEMMs (beta 0) instead of a pass of its own; gradients return in the parameters' dtypes. An eager GPU step of ~200 adapters is bound by the host launching
    their kernels and running autograd's nodes (benchmarks/RESULTS.md, 2026-11-26/27), so each one saved counts.

    The base is either given as its output, `base_out` (a 4-bit base, whose matmul bitsandbytes owns), or as the
    frozen `weight` and `bias` of a plain linear, which this Function applies itself (`base_out` None): then the
    output is its own to add into in place, and backward gives x one gradient, the base's and the update's summed
    in the GEMM (`addmm_`) or with the dropout mask (`addcmul_`), instead of two that autograd adds in a pass of its
    own, with one autograd node per adapter instead of two.

    A given base_out is added into in place when `eager` (not being compiled) and it is not a view. A view is added
    to out of place: in place, autograd would copy the whole output back into its base in backward (CopySlices: a
    clone and two copies per layer), and a view made inside a custom Function (bitsandbytes' 4-bit matmul on CUDA)
    may not be modified at all. Compiled graphs add a given base_out out of place (inductor fuses it), and keep the
    dropout mask where eager CUDA redraws it."""

    @staticmethod
    def forward(
        ctx,
        base_out,
        x,
        weight,
        bias,
        weight_a,
        weight_b,
        kept: Optional[tuple[torch.Tensor, torch.Tensor]],
        alpha: float,
        p: float,
        dtype: torch.dtype,
        eager: bool,
    ):
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != dtype:
            flat = flat.to(dtype)
        a, b = kept if kept is not None else (weight_a.to(dtype), weight_b.to(dtype))
        w = None if weight is None else weight.to(dtype)
        state = mask = None
        if p > 0.0:
            redraw = eager and flat.device.type in REDRAW_MASK_ON  # eager only: compiled graphs keep the mask
            if redraw:
                state = _default_generator(flat.device).get_state()
            dropped, mask = torch.native_dropout(flat, p, True)  # what PEFT's nn.Dropout runs: same stream, same mask
            if redraw:
                mask = None
            h = torch.mm(dropped, a.t())
            del dropped
        else:
            h = torch.mm(flat, a.t())
        if w is not None:  # the base applied here (F.linear's GEMM): an output of our own, added into in place
            out_flat = torch.mm(flat, w.t()) if bias is None else torch.addmm(bias.to(dtype), flat, w.t())
            out = out_flat.addmm_(h, b.t(), alpha=alpha).view(*x.shape[:-1], w.shape[0])
        elif base_out.dtype == dtype and base_out.is_contiguous():
            out_flat = base_out.view(-1, base_out.shape[-1])
            if eager and not base_out._is_view():
                out = base_out
                out_flat.addmm_(h, b.t(), alpha=alpha)
                ctx.mark_dirty(out)
            else:
                out = torch.addmm(out_flat, h, b.t(), alpha=alpha).view(base_out.shape)
        else:
            out = base_out + torch.mm(h, b.t()).mul_(alpha).to(base_out.dtype).view(base_out.shape)
        ctx.save_for_backward(x, w, a, b, h, mask)
        ctx.state, ctx.p, ctx.alpha, ctx.dtype = state, p, alpha, dtype
        ctx.weight_dtypes = (weight_a.dtype, weight_b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w, a, b, h, mask = ctx.saved_tensors  # w, A and B in the compute dtype
        dtype, alpha = ctx.dtype, ctx.alpha
        dtype_a, dtype_b = ctx.weight_dtypes
        unused = h.new_empty(())  # addmm's input, ignored with beta 0: the GEMM scales by alpha itself
        need_x = ctx.needs_input_grad[1]
        need_a, need_b = ctx.needs_input_grad[4:6]
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if g.dtype != dtype:
            g = g.to(dtype)
        grad_x = grad_a = grad_b = None
        if need_b:
            grad_b = torch.addmm(unused, g.t(), h, beta=0, alpha=alpha).to(dtype_b)
        if need_x or need_a:
            gh = torch.addmm(unused, g, b, beta=0, alpha=alpha)  # d out / d h, r wide
            flat = x.reshape(-1, x.shape[-1])
            if flat.dtype != dtype:
                flat = flat.to(dtype)
            dropped, scale = flat, 1.0 / (1.0 - ctx.p)
            if ctx.state is not None:
                dropped, mask = _redraw(flat, ctx.p, ctx.state)
            elif mask is not None:
                dropped = torch.ops.aten.native_dropout_backward(flat, mask, scale)  # m ∘ x / (1 - p), one pass
            if need_a:
                grad_a = torch.mm(gh.t(), dropped).to(dtype_a)
            if need_x:
                if w is None:  # the base's own backward gives x its gradient; autograd adds the two
                    grad_x = torch.mm(gh, a)
                    if mask is not None:
                        grad_x = torch.ops.aten.native_dropout_backward(grad_x, mask, scale)
                elif mask is None:
                    grad_x = torch.mm(g, w).addmm_(gh, a)
                else:
                    grad_x = torch.mm(g, w).addcmul_(torch.mm(gh, a), mask, value=scale)
                grad_x = grad_x.view(x.shape).to(x.dtype)
        grad_base = grad_out if ctx.needs_input_grad[0] else None
        return grad_base, grad_x, None, None, grad_a, grad_b, None, None, None, None, None


def _redraw(flat: torch.Tensor, p: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's dropout again, (m ∘ x / (1 - p), m), drawn from the default generator's state saved before it; the
    generator is left where it was (the step's other draws do not move)."""
    generator = _default_generator(flat.device)
    now = generator.get_state()
    generator.set_state(state)
    try:
        return torch.native_dropout(flat, p, True)
    finally:
        generator.set_state(now)


def _applied_here(base: nn.Module) -> bool:
    """The fused Function applies the base itself where it is a plain, frozen nn.Linear that nothing hooks or patches
    (a hook, e.g. ZeRO-3's parameter gathering, or a forward replaced on the instance, runs only when the module is
    called). A 4-bit base (a subclass), a trained one or a hooked one is called as a module, and its output handed
    over."""
    return (
        type(base) is nn.Linear
        and "forward" not in base.__dict__
        and not base.weight.requires_grad
        and (base.bias is None or not base.bias.requires_grad)
        and not (base._forward_hooks or base._forward_pre_hooks or base._backward_hooks or base._backward_pre_hooks)
    )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class _FusedForward:
    """The fused forward, mixed in front of a PEFT LoRA layer class; everything else (parameters, merging, saving) is
    PEFT's, and whatever the fused path does not cover falls through to PEFT's own forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = self.active_adapters
        name = adapters[0] if len(adapters) == 1 else None
        lora_a = self.lora_A[name] if name in self.lora_A else None  # one lookup each: this runs ~200 times a pass
        if (
            lora_a is None
            or self.disable_adapters
            or self.merged
            or args
            or kwargs
            or name in self.lora_variant
            or _default_generator(x.device) is None
            or hasattr(lora_a.weight, "ds_id")
        ):
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        weight = bias = result = None
        if _applied_here(base):
            weight, bias = base.weight, base.bias
        else:
            result = base(x)
        dropout = self.lora_dropout[name]
        p = dropout.p if (self.training and isinstance(dropout, nn.Dropout)) else 0.0
        weight_a, weight_b, dtype = lora_a.weight, self.lora_B[name].weight, _compute_dtype(x)
        # Under torch.compile a given base output is added to out of place (one addmm): AOTAutograd mishandles a
        # custom Function that marks an input dirty (the base output's gradient is lost; checked with aot_eager,
        # torch 2.13). Compiled graphs cast A and B themselves: a kept cast's freshness is checked in Python.
        eager = not torch.compiler.is_compiling()
        kept = self.__dict__.get(KEPT_CASTS)
        casts = kept.casts(self, name, weight_a, weight_b, dtype) if (kept is not None and eager) else None
        return _LoraUpdate.apply(
            result, x, weight, bias, weight_a, weight_b, casts, self.scaling[name], p, dtype, eager
        )


class _KeptCast:
    """One adapter's A and B in the compute dtype, with the versions of the weights they were copied from."""

    __slots__ = ("name", "masters", "copies", "versions")

    def __init__(self, name: str, masters: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> None:
        self.name, self.masters = name, masters
        self.copies = tuple(torch.empty_like(m, dtype=dtype, requires_grad=False) for m in masters)
        self.versions = (-1, -1, -1, -1)  # never fresh until copied

    def matches(self, name: str, weight_a: torch.Tensor, weight_b: torch.Tensor, dtype: torch.dtype) -> bool:
        a, b = self.masters
        if name != self.name or a is not weight_a or b is not weight_b or self.copies[0].dtype != dtype:
            return False
        # A weight moved or resized under `.data` is the same tensor object: its copy must follow.
        copy_a, copy_b = self.copies
        return copy_a.device == a.device and copy_a.shape == a.shape and copy_b.shape == b.shape

    def stale(self) -> bool:
        return self._stamp() != self.versions

    def mark_fresh(self) -> None:
        self.versions = self._stamp()

    def _stamp(self) -> tuple[int, int, int, int]:
        # The version counts in-place changes; the data pointer, a `.data =` swap (which keeps the version).
        a, b = self.masters
        return (a._version, a.data_ptr(), b._version, b.data_ptr())


def keep_casts(
    model: nn.Module, optimizer: torch.optim.Optimizer, dtype: Optional[torch.dtype], strategy: str, compiled: bool
) -> Optional["KeptCasts"]:
    """KeptCasts for this run where they apply (an eager run under autocast, one process or DDP), refreshed after each
    optimizer step; None elsewhere."""
    if dtype is None or compiled or strategy not in KEPT_CAST_STRATEGIES:
        return None
    kept = KeptCasts(model, dtype)
    if not kept.layers:
        return None
    optimizer.register_step_post_hook(kept.refresh)
    return kept


class KeptCasts:
    """Every fused adapter's A and B kept in the compute dtype between optimizer steps, for eager runs whose LoRA
    weights are plain fp32 tensors of this process (one process, DDP) under bf16/fp16 autocast.

    Without it each adapter casts A and B in every forward: 392 launches per micro-batch at the seeds' 196 adapters,
    in a step bound by the host launching kernels (benchmarks/RESULTS.md, 2026-11-26/27). With it the copies are
    refreshed after each optimizer step in one `_foreach_copy_` (`refresh`, an optimizer step post-hook), and a forward
    uses a copy only when it is fresh: the weight is the same tensor, over the same memory, at the same version it was
    copied at (any in-place change bumps the version: the optimizer's, a checkpoint load's; a write through `.data`
    would not, and nothing in a phalanx run makes one), else it copies that one adapter again right there. Sharded
    weights (FSDP2, ZeRO) change under other rules, so they are never given kept casts; nor are compiled layers,
    whose graphs cannot check a version (they cast in the graph)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers = [m for m in model.modules() if isinstance(m, _FusedForward)]
        self._kept: dict[int, _KeptCast] = {}  # id of a layer (held in self.layers) -> its adapter's copies
        for layer in self.layers:
            layer.__dict__[KEPT_CASTS] = self

    def casts(
        self, layer: nn.Module, name: str, weight_a: torch.Tensor, weight_b: torch.Tensor, dtype: torch.dtype
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The fresh compute-dtype copies of `layer`'s adapter's A and B (copied now where they were stale), or None
        where the forward's compute dtype is not the kept one or is the weights' own."""
        if dtype != self.dtype or weight_a.dtype == dtype or weight_b.dtype == dtype:
            return None
        layer_kept = self._kept.get(id(layer))
        if layer_kept is None or not layer_kept.matches(name, weight_a, weight_b, dtype):
            layer_kept = self._kept[id(layer)] = _KeptCast(name, (weight_a, weight_b), dtype)
        if layer_kept.stale():
            _copy_fresh([layer_kept])
        return layer_kept.copies

    def refresh(self, *_args) -> None:
        """Copy every stale adapter's A and B in one foreach (after an optimizer step: all of them)."""
        _copy_fresh([kept for kept in self._kept.values() if kept.stale()])


def _copy_fresh(stale: list[_KeptCast]) -> None:
    """Copy the weights of `stale` into their compute-dtype copies, in one foreach, and mark them fresh."""
    if not stale:
        return
    with torch.no_grad():
        torch._foreach_copy_([c for kept in stale for c in kept.copies], [m for kept in stale for m in kept.masters])
    for kept in stale:
        kept.mark_fresh()


class FusedLoraLinear(_FusedForward, PeftLoraLinear):
    """PEFT's lora.Linear over an nn.Linear, with the fused forward."""


_fused_4bit: Optional[type] = None


def fused_4bit_class() -> type:
    """PEFT's lora Linear4bit (QLoRA: a bitsandbytes 4-bit base) with the fused forward. Made on first use: importing
    PEFT's bnb module imports bitsandbytes, which a run without a 4-bit base never loads. On CUDA the base's output is
    a view made inside bitsandbytes' MatMul4Bit Function, so the update is added out of place (_LoraUpdate); PEFT's
    forward copies it first, and keeps each adapter's dropped-out input and mask."""
    global _fused_4bit
    if _fused_4bit is None:
        from peft.tuners.lora.bnb import Linear4bit

        _fused_4bit = type("FusedLoraLinear4bit", (_FusedForward, Linear4bit), {"__module__": __name__})
    return _fused_4bit


def _is_peft_4bit(module: nn.Module) -> bool:
    cls, base = type(module), type(module.get_base_layer())
    return (cls.__module__, cls.__name__) == ("peft.tuners.lora.bnb", "Linear4bit") and (
        base.__module__.startswith("bitsandbytes.") and base.__name__ == "Linear4bit"
    )


def fused_applies(module: nn.Module) -> bool:
    """True for a PEFT LoRA linear over a plain nn.Linear or a bitsandbytes 4-bit linear, with plain LoRA adapters (no
    DoRA/variants, no LoRA bias)."""
    plain = type(module) is PeftLoraLinear and type(module.get_base_layer()) is nn.Linear
    if not (plain or (hasattr(module, "get_base_layer") and _is_peft_4bit(module))):
        return False
    if module.lora_variant:
        return False
    return all(module.lora_B[name].bias is None for name in module.lora_B)


def install_fused_lora(model: nn.Module) -> tuple[int, dict[str, int]]:
    """Swap the class of every LoRA linear the fused path covers; returns (fused count, {other LoRA layer type: count}).

    Under ZeRO-3 (parameters partitioned by DeepSpeed, `ds_id`) the forward is PEFT's: DeepSpeed gathers lora_A/B's
    weights only at those submodules' own hooks, which the fused forward never calls (marking the layer a ZeRO-3
    leaf instead failed in backward, DeepSpeed 0.19, torch 2.13). DDP and FSDP2 see the same parameters as before."""
    from peft.tuners.lora.layer import LoraLayer

    fused, others = 0, {}
    for module in model.modules():
        if fused_applies(module):
            module.__class__ = FusedLoraLinear if type(module) is PeftLoraLinear else fused_4bit_class()
            fused += 1
        elif isinstance(module, LoraLayer) and not isinstance(module, _FusedForward):
            kind = type(module).__module__.rsplit(".", 1)[-1] + "." + type(module).__name__
            others[kind] = others.get(kind, 0) + 1
    return fused, others
