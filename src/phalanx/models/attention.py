"""Padding-free (varlen) attention for packed micro-batches: several rows in one sequence, none seeing another.

A packed micro-batch is one row of the rows' concatenation with `position_ids` restarting at 0 per row
(data/collate.py:pack_batch). Attention must stay inside each row. The chooser, in order:

- `flash_attention_2` when the `flash_attn` package imports on a CUDA device (transformers' own varlen path,
  given `cu_seq_lens_q/k` and `max_length_q/k`);
- else `phalanx_varlen`, registered here with transformers' AttentionInterface: torch's
  `torch.nn.attention.varlen.varlen_attn` (flash kernels in torch, causal, GQA) on CUDA, checked once
  against the per-row path before it is trusted; everywhere else (CPU) one causal SDPA per row, sliced by
  the host-side row lengths, so no mask is built and no position attends across a row boundary.

The row boundaries travel twice: as host lengths (`ROW_LENGTHS`, what the eager per-row path slices by) and as
one int32 tensor of cumulative ends on the device (`CU_SEQ_LENS`, built once per micro-batch, shared by every
layer). A compiled layer (training.compile) reads only the tensor: host lengths read inside a traced graph are
guarded on, and the layer was recompiled for every new number of rows per micro-batch, until dynamo's recompile
limit sent it back to eager. There the CUDA kernel is given the micro-batch's token count as its longest row (an
upper bound, so no value from the host enters the graph), and elsewhere the per-row path runs as one opaque
operator (`phalanx::packed_causal_sdpa`, with its own backward) that reads the lengths from the tensor.

Packing needs a model whose decoder honours `position_ids` for its rotary embedding and passes attention
kwargs through to the attention function, with full (not sliding-window) attention in every layer. Model types
checked for that (packed logits equal per-row logits, tests/train/test_packing.py) are in PACKABLE_MODEL_TYPES;
others train padded, and the run says so.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data.collate import host_to_device

VARLEN = "phalanx_varlen"
ROW_LENGTHS = "phalanx_row_lengths"  # forward kwarg: host tuple of the packed rows' lengths
CU_SEQ_LENS = "phalanx_cu_seq_lens"  # forward kwarg: int32 tensor [0, end of row 1, end of row 2, ...] on the device

# Decoders verified to give packed logits equal to per-row logits (rotary from position_ids, attention kwargs
# passed through to the attention function).
PACKABLE_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

_registered = False
_active = VARLEN  # the varlen attention this process's model was switched to (enable_varlen_attention)
_host_lengths = True  # pass ROW_LENGTHS too (eager layers); off once the layers are compiled (layers_compiled)
_torch_varlen_ok: dict = {}  # (device, dtype, heads, kv heads, head dim) -> bool: varlen_attn agreed with per-row


def packing_unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why `model` cannot train on packed rows (None: it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not among those checked for padding-free packing "
            f"({', '.join(PACKABLE_MODEL_TYPES)})"
        )
    if getattr(config, "attention_dropout", 0.0):
        return "the model uses attention dropout, which the varlen path does not implement"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and not layer_types
    ):
        return "the model uses sliding-window attention, which the varlen path does not implement"
    return None


def flash_attn_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def enable_varlen_attention(
    model: nn.Module, device: torch.device, activation_dtype: Optional[torch.dtype] = None
) -> str:
    """Switch `model` (a transformers PreTrainedModel, before any wrapping) to a varlen attention; returns its name.

    `activation_dtype`: the dtype the attention will see (the autocast dtype, else the model's). On CUDA torch's
    varlen kernel is checked for the model's head shape now, eagerly: a compiled layer cannot run the check while
    it is being traced, and only reads its outcome."""
    global _active, _host_lengths
    name = "flash_attention_2" if flash_attn_available(device) else VARLEN
    _host_lengths = True
    if name == VARLEN:
        register_varlen_attention()
        if device.type == "cuda":
            _check_torch_varlen_for(model, device, activation_dtype or next(model.parameters()).dtype)
    model.set_attn_implementation(name)
    _active = name
    return name


def _check_torch_varlen_for(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    _torch_varlen_usable(
        torch.empty(1, heads, 1, head_dim, device=device, dtype=dtype),
        torch.empty(1, kv_heads, 1, head_dim, device=device, dtype=dtype),
    )


def register_varlen_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention_forward)
        _registered = True


def layers_compiled() -> None:
    """The decoder layers are compiled: from now on the packed rows' ends reach them as a device tensor only (host
    lengths in a traced graph are guarded on: see the module doc)."""
    global _host_lengths
    _host_lengths = False


def graph_unsafe_reason(device: torch.device) -> Optional[str]:
    """Why the packed attention cannot be captured in a CUDA graph on `device` (None: it can, or there are no graphs
    there). A graph replays what it captured: the longest row must not come from the host (flash_attn's path takes it
    as an int), and the rows must not be read back from the device (the per-row path does)."""
    if device.type != "cuda":
        return None
    if _active != VARLEN:
        return f"the {_active} attention takes each micro-batch's longest row from the host"
    if not _torch_varlen_ok or not all(_torch_varlen_ok.values()):
        return "torch's varlen kernel is not usable here, and the per-row attention reads the row lengths back"
    return None


def packed_attention_kwargs(row_lengths: tuple[int, ...], device: torch.device) -> dict:
    """Forward kwargs that tell the attention where the packed rows start and end (an SDPA or eager model ignores
    them: transformers' masking derives a block-diagonal causal mask from position_ids instead)."""
    cu = _cu_seq_lens(row_lengths, device)
    if _active.startswith("flash_attention"):
        longest = max(row_lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return {ROW_LENGTHS: tuple(row_lengths), CU_SEQ_LENS: cu} if _host_lengths else {CU_SEQ_LENS: cu}


def _cu_seq_lens(row_lengths, device: torch.device) -> torch.Tensor:
    """[0, end of row 1, end of row 2, ...] as int32 on `device`: the form varlen kernels take row boundaries in."""
    return host_to_device(torch.tensor([0, *_cumsum(row_lengths)], dtype=torch.int32), device)


def _cumsum(values) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each packed row. query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D).

    Without row lengths (a padded batch, or generation) it is plain SDPA with the mask it was given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = kwargs.pop(ROW_LENGTHS, None)
    cu_seq_lens = kwargs.pop(CU_SEQ_LENS, None)
    if rows is None and cu_seq_lens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or attention_mask is not None or sliding_window is not None:
        raise ValueError("phalanx_varlen attention takes one packed row, no attention mask and no sliding window")
    if dropout:
        raise ValueError("phalanx_varlen attention has no attention dropout")
    if cu_seq_lens is None:
        raise ValueError(f"packed rows need {CU_SEQ_LENS} (packed_attention_kwargs gives it with the row lengths)")
    query, key, value = _one_dtype(query, key, value)
    if torch.compiler.is_compiling():
        # Traced: only the tensor of row ends enters the graph (see the module doc).
        if query.device.type == "cuda" and _torch_varlen_ok.get(_signature(query, key), False):
            return _torch_varlen(query, key, value, cu_seq_lens, query.shape[2], scaling), None
        return torch.ops.phalanx.packed_causal_sdpa(query, key, value, cu_seq_lens, scaling), None
    rows = rows if rows is not None else _lengths(cu_seq_lens)  # host lengths are left out once layers compile
    if query.device.type == "cuda" and _torch_varlen_usable(query, key):
        return _torch_varlen(query, key, value, cu_seq_lens, max(rows), scaling), None
    return _per_row_sdpa(query, key, value, rows, scaling), None


def _one_dtype(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v in the dtype SDPA would run them in: autocast's where it is on, else the query's.

    With fp32 weights under bf16 autocast (full fine-tuning), RoPE leaves q and k in fp32 while v comes out of an
    autocast linear in bf16. SDPA is cast by autocast; the varlen kernel and phalanx's operator are not (they run
    below it), so they would get mixed dtypes (and the varlen kernel's check, made for bf16, would not apply)."""
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _lengths(cu_seq_lens: torch.Tensor) -> list[int]:
    ends = cu_seq_lens.tolist()
    return [b - a for a, b in zip(ends, ends[1:])]


def _per_row_sdpa(query, key, value, rows, scaling) -> torch.Tensor:
    """One causal SDPA per row (rows are few per micro-batch; each call gets the kernel's causal fast path).
    query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D); grouped heads as SDPA's `enable_gqa`."""
    if sum(rows) != query.shape[2]:
        raise ValueError(f"packed row lengths add up to {sum(rows)}, the batch holds {query.shape[2]} tokens")
    grouped = key.shape[1] != query.shape[1]
    outputs, start = [], 0
    for n in rows:
        end = start + n
        out = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=n > 1,
            scale=scaling,
            enable_gqa=grouped,
        )
        outputs.append(out.transpose(1, 2))
        start = end
    return outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs, dim=1)


@torch.library.custom_op("phalanx::packed_causal_sdpa", mutates_args=())
def packed_causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor, scale: Optional[float]
) -> torch.Tensor:
    """The per-row path as one operator a compiled graph does not look into: the row lengths are read from
    `cu_seq_lens` when it runs, so they are no part of the graph."""
    return _per_row_sdpa(query, key, value, _lengths(cu_seq_lens), scale)


@packed_causal_sdpa.register_fake
def _(query, key, value, cu_seq_lens, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("phalanx::packed_causal_sdpa_backward", mutates_args=())
def packed_causal_sdpa_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `packed_causal_sdpa`: its forward again, row by row, differentiated (the path that is used
    where no varlen kernel is: CPU, and tests)."""
    lengths = _lengths(cu_seq_lens)
    # torch.func, not torch.autograd: an operator's body runs below the autograd dispatch, where nothing is recorded.
    _, vjp = torch.func.vjp(lambda q, k, v: _per_row_sdpa(q, k, v, lengths, scale), query, key, value)
    return tuple(g.contiguous() for g in vjp(grad))


@packed_causal_sdpa_backward.register_fake
def _(grad, query, key, value, cu_seq_lens, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _packed_setup(ctx, inputs, output) -> None:
    query, key, value, cu_seq_lens, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seq_lens)
    ctx.scale = scale


def _packed_backward(ctx, grad):
    query, key, value, cu_seq_lens = ctx.saved_tensors
    grads = torch.ops.phalanx.packed_causal_sdpa_backward(grad, query, key, value, cu_seq_lens, ctx.scale)
    return *grads, None, None


packed_causal_sdpa.register_autograd(_packed_backward, setup_context=_packed_setup)


def _torch_varlen(query, key, value, cu_seq_lens, longest, scaling) -> torch.Tensor:
    """torch's varlen_attn over the packed rows; `longest`: the longest row, or any bound above it."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    options, k, v = _varlen_options(varlen_attn, scaling, k, v, q.shape[1])
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, **options).unsqueeze(0)  # (1, T, Hq, D)


_accepted_names: dict = {}  # function -> the names it takes


def _parameters(function) -> frozenset:
    """The keyword names `function` takes: read once, not in every layer's attention call of every step (a plain
    dict, not functools.lru_cache, which dynamo warns about and bypasses when it traces a compiled layer)."""
    if function not in _accepted_names:
        _accepted_names[function] = frozenset(inspect.signature(function).parameters)
    return _accepted_names[function]


def _varlen_options(varlen_attn, scaling, key, value, query_heads: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Causal, scaled and grouped-query keyword arguments in the form this torch's `varlen_attn` takes (its signature
    changed between releases: `is_causal` became `window_size=(-1, 0)`; `scale` and `enable_gqa` came later). Where
    there is no `enable_gqa`, the key/value heads are repeated to the query's."""
    accepted = _parameters(varlen_attn)
    options: dict = {"window_size": (-1, 0)} if "window_size" in accepted else {"is_causal": True}
    if scaling is not None and "scale" in accepted:
        options["scale"] = scaling
    elif scaling is not None and abs(scaling - key.shape[-1] ** -0.5) > 1e-9:
        raise TypeError("this torch's varlen_attn takes no scale, and the model's is not 1/sqrt(head_dim)")
    if key.shape[1] != query_heads:
        if "enable_gqa" in accepted:
            options["enable_gqa"] = True
        else:
            groups = query_heads // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return options, key, value


def _signature(query: torch.Tensor, key: torch.Tensor) -> tuple:
    # int(): in a layer traced with dynamic shapes the head counts are symbolic; this pins them (they never change).
    return (str(query.device), query.dtype, int(query.shape[1]), int(key.shape[1]), int(query.shape[-1]))


def _torch_varlen_usable(query, key) -> bool:
    """torch's varlen_attn exists, runs on this device/dtype/head shape, and equals the per-row path (checked once)."""
    signature = _signature(query, key)
    if signature in _torch_varlen_ok:
        return _torch_varlen_ok[signature]
    ok = False
    try:
        import torch.nn.attention.varlen  # noqa: F401

        g = torch.Generator(device=query.device).manual_seed(0)
        rows = (5, 17, 9)
        shape = lambda h: (1, h, sum(rows), query.shape[-1])  # noqa: E731
        q, k, v = (
            torch.randn(shape(h), generator=g, device=query.device, dtype=query.dtype)
            for h in (query.shape[1], key.shape[1], key.shape[1])
        )
        cu = _cu_seq_lens(rows, query.device)
        with torch.no_grad():
            b = _per_row_sdpa(q, k, v, rows, None)
            # The longest row as the host knows it (eager), and the token count (compiled layers: an upper bound).
            error = max(
                float((_torch_varlen(q, k, v, cu, bound, None).float() - b.float()).abs().max())
                for bound in (max(rows), sum(rows))
            )
        ok = error < 2e-2
        reason = None if ok else f"it differs from the per-row path by {error:.1e}"
    except Exception as exc:  # noqa: BLE001 - any failure means: use the per-row path
        ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
    _torch_varlen_ok[signature] = ok
    if reason is not None and _main_process():
        # Said once per head shape: the run is still correct, but each packed row gets its own SDPA call.
        print(f"🧮 torch varlen_attn is not used ({reason}); packed rows get one SDPA call each.", flush=True)
    return ok


def _main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
