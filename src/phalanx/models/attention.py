"""Padding-free (varlen) attention for packed micro-batches: several rows in one sequence, none seeing another.

A packed micro-batch is one row of the rows' concatenation with `position_ids` restarting at 0 per row
(data/collate.py:pack_batch). Attention must stay inside each row. The chooser, in order:

- `flash_attention_2` when the `flash_attn` package imports on a CUDA device (transformers' own varlen path,
  given `cu_seq_lens_q/k` and `max_length_q/k`);
- else `phalanx_varlen`, registered here with transformers' AttentionInterface: torch's
  `torch.nn.attention.varlen.varlen_attn` (flash kernels in torch, causal, GQA) on CUDA, checked once
  against the per-row path before it is trusted; everywhere else (CPU) one causal SDPA per row, sliced by
  the host-side row lengths, so no mask is built and no position attends across a row boundary.

Packing needs a model whose decoder honours `position_ids` for its rotary embedding and passes attention
kwargs through to the attention function, with full (not sliding-window) attention in every layer. Model types
checked for that (packed logits equal per-row logits, tests/train/test_packing.py) are in PACKABLE_MODEL_TYPES;
others train padded, and the run says so.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Optional

import torch
from torch import nn

VARLEN = "phalanx_varlen"
ROW_LENGTHS = "phalanx_row_lengths"  # forward kwarg: host tuple of the packed rows' lengths

# Decoders verified to give packed logits equal to per-row logits (rotary from position_ids, attention kwargs
# passed through to the attention function).
PACKABLE_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

_registered = False
_active = VARLEN  # the varlen attention this process's model was switched to (enable_varlen_attention)
_torch_varlen_ok: dict = {}  # (device, dtype) -> bool: torch varlen_attn agreed with the per-row path


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


def enable_varlen_attention(model: nn.Module, device: torch.device) -> str:
    """Switch `model` (a transformers PreTrainedModel, before any wrapping) to a varlen attention; returns its name."""
    global _active
    name = "flash_attention_2" if flash_attn_available(device) else VARLEN
    if name == VARLEN:
        register_varlen_attention()
    model.set_attn_implementation(name)
    _active = name
    return name


def register_varlen_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_attention_forward)
        _registered = True


def packed_attention_kwargs(row_lengths: tuple[int, ...], device: torch.device) -> dict:
    """Forward kwargs that tell the attention where the packed rows start and end (an SDPA or eager model ignores
    them: transformers' masking derives a block-diagonal causal mask from position_ids instead)."""
    if _active.startswith("flash_attention"):
        cu = torch.tensor([0, *_cumsum(row_lengths)], dtype=torch.int32).to(device, non_blocking=True)
        longest = max(row_lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return {ROW_LENGTHS: tuple(row_lengths)}


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
    if rows is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or attention_mask is not None or sliding_window is not None:
        raise ValueError("phalanx_varlen attention takes one packed row, no attention mask and no sliding window")
    if dropout:
        raise ValueError("phalanx_varlen attention has no attention dropout")
    if query.device.type == "cuda" and _torch_varlen_usable(module, query, key):
        return _torch_varlen(module, query, key, value, rows, scaling), None
    return _per_row_sdpa(module, query, key, value, rows, scaling), None


def _per_row_sdpa(module, query, key, value, rows, scaling) -> torch.Tensor:
    """One causal SDPA per row (rows are few per micro-batch; each call gets the kernel's causal fast path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outputs, start = [], 0
    for n in rows:
        end = start + n
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            dropout=0.0,
            scaling=scaling,
            is_causal=True,
        )
        outputs.append(out)
        start = end
    if start != query.shape[2]:
        raise ValueError(f"packed row lengths add up to {start}, the batch holds {query.shape[2]} tokens")
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _torch_varlen(module, query, key, value, rows, scaling) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, *_cumsum(rows)], dtype=torch.int32).to(query.device, non_blocking=True)
    longest = max(rows)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    options, k, v = _varlen_options(varlen_attn, scaling, k, v, q.shape[1])
    return varlen_attn(q, k, v, cu, cu, longest, longest, **options).unsqueeze(0)  # (1, T, Hq, D)


@functools.lru_cache(maxsize=None)
def _parameters(function) -> frozenset:
    """The keyword names `function` takes: read once, not in every layer's attention call of every step."""
    return frozenset(inspect.signature(function).parameters)


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


def _torch_varlen_usable(module, query, key) -> bool:
    """torch's varlen_attn exists, runs on this device/dtype/head shape, and equals the per-row path (checked once)."""
    signature = (str(query.device), query.dtype, query.shape[1], key.shape[1], query.shape[-1])
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
        with torch.no_grad():
            a = _torch_varlen(module, q, k, v, rows, None)
            b = _per_row_sdpa(module, q, k, v, rows, None)
        error = float((a.float() - b.float()).abs().max())
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
