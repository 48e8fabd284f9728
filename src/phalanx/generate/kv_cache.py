"""The KV caches the decoding loops write into, and how a model takes one.

- `GrowingLayer` (engine.py's loop): grows one position per step into spare room, and drops the rows that
  finished, so the remaining ones do not pay for them.
- `FixedLayer` (static_decode.py): preallocated buffers written in place at an index on the device, so
  that every tensor of a decoding step keeps its shape and address (what a CUDA graph needs).
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

# The attention implementations a fixed-size cache's prepared 4-D mask is built for.
FIXED_CACHE_ATTENTIONS = ("sdpa", "eager")


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The first transformers model inside (wrappers such as PEFT's pass their keywords through to it)."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which the model takes its KV cache: `cache` from transformers 5.24 on (where `past_key_values`
    warns that it goes away in 5.40), `past_key_values` before. Read from the first transformers model inside, so
    wrappers that pass keywords through (PEFT's) get the name their base model takes."""
    return _forward_cache_keyword(type(inner_model(model)))


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into spare room instead of copying the whole cache at every step.

    DynamicLayer.update concatenates, so every decoding step copies the entire cache (as much memory
    traffic as the attention itself; half the decoding time on CPU here). Here keys and values are
    views into a buffer with `room` spare positions, and a step writes one position. Rows leaving
    the batch are selected from the buffer, room included; any other replacement of the tensors
    (reorder_cache) is noticed by the data pointer and moves into a fresh buffer at the next update.
    """

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self.buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        used, adding = self.keys.shape[-2], key_states.shape[-2]
        buffers = self.buffers
        if (
            buffers is None
            or buffers[0].data_ptr() != self.keys.data_ptr()
            or buffers[0].shape[0] != self.keys.shape[0]
            or buffers[0].shape[-2] < used + adding
        ):
            length = used + max(adding, self.room)
            # Keys and values may differ in width (multi-head latent attention: DeepSeek-V2/V3's 192 against 128).
            buffers = (
                self.keys.new_empty((*self.keys.shape[:-2], length, self.keys.shape[-1])),
                self.values.new_empty((*self.values.shape[:-2], length, self.values.shape[-1])),
            )
            buffers[0][..., :used, :] = self.keys
            buffers[1][..., :used, :] = self.values
            self.buffers = buffers
        buffers[0][..., used : used + adding, :] = key_states
        buffers[1][..., used : used + adding, :] = value_states
        self.keys, self.values = buffers[0][..., : used + adding, :], buffers[1][..., : used + adding, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.buffers is None or self.buffers[0].data_ptr() != self.keys.data_ptr():
            return super().batch_select_indices(indices)
        used = self.keys.shape[-2]
        self.buffers = (self.buffers[0][indices], self.buffers[1][indices])
        self.keys, self.values = self.buffers[0][..., :used, :], self.buffers[1][..., :used, :]


class FixedLayer(DynamicLayer):
    """A cache layer over preallocated [rows, kv_heads, capacity, head_dim] buffers: a step writes its keys and
    values at `index` (a one-element tensor on the device, shared by every layer and advanced by the caller) and
    attention reads the whole buffer, the mask hiding what is not written yet."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.index = keys, values, index
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.index, key_states)
        self.values.index_copy_(2, self.index, value_states)
        return self.keys, self.values


def fixed_cache_problem(model: torch.nn.Module, capacity: Optional[int] = None) -> Optional[str]:
    """Why this model cannot decode over a fixed-size cache of `capacity` positions (None: not known), or None when it
    can."""
    config = inner_model(model).config
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in FIXED_CACHE_ATTENTIONS:
        return (
            f"its attention is {attention!r}, and a fixed-size cache is built for {' or '.join(FIXED_CACHE_ATTENTIONS)}"
        )
    return cache_layers_problem(config, capacity)


def cache_layers_problem(config, capacity: Optional[int] = None) -> Optional[str]:
    """The part of fixed_cache_problem a model's config answers before any weights load: its cache layers.

    Sliding-window layers are served while every position fits in their window (`capacity` <= the window): nothing
    then falls out of it, and the attention is the full attention a fixed cache computes (Mistral 7B v0.1 and its
    fine-tunes, Phi-3 mini: windows of 4,096 and 2,047 tokens)."""
    layers = DynamicCache(config=config).layers
    kinds = {type(layer).__name__ for layer in layers}
    if kinds <= {DynamicLayer.__name__}:
        return None
    if kinds <= {DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__}:
        window = _smallest_window(layers)
        if capacity is None:
            return f"its sliding-window layers (window {window}) need the job's longest prompt + max_new_tokens"
        if capacity > window:
            return (
                f"its sliding-window layers keep {window} positions, and the longest prompt + max_new_tokens is "
                f"{capacity}"
            )
        return None
    return f"its cache has {', '.join(sorted(kinds))} layers (linear attention or another non-plain kind)"


def sliding_window_of(config) -> Optional[int]:
    """The smallest window of the model's sliding-window cache layers (None: it has none)."""
    return _smallest_window(DynamicCache(config=config).layers)


def _smallest_window(layers) -> Optional[int]:
    windows = [layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)]
    return min(windows) if windows else None
