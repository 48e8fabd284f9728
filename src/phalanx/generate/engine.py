"""Batched generation with the KV cache: one prefill per distinct prompt, left-padded decoding, finished rows leave.

`generate_rows` runs its own decoding loop over the model's logits rather than `model.generate`,
so that each row samples from its own random stream (see sampling.py) and rows can leave the
batch as soon as they stop:

- each distinct prompt of a batch is prefilled once, alone (no padding to compute, the plain
  causal path: on CPU three times faster than a padded, masked batch), and its KV cache is
  repeated for every sequence that continues it (K sequences per question share one prefill);
- the caches are laid side by side, left-padded; positions count real tokens only (padding
  does not shift a row's rotary positions) and the attention mask hides the padding, so a row
  decodes what it would decode alone;
- a row stops at any of the stop ids (EOS, end of turn) or at max_new_tokens; finished rows are
  dropped from the cache so the remaining ones do not pay for them;
- the cache of full-attention layers has room for max_new_tokens reserved, so a step writes one
  position instead of copying the whole cache (what DynamicCache's concatenation does).

`generate_with_fallback` splits a batch on an out-of-memory error, keeps the smaller size for
the batches that follow, and reports it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from phalanx.errors import PhalanxError
from phalanx.generate.sampling import SamplingParams, next_tokens, row_uniforms

# The end-of-turn tokens of common chat templates; any that the tokenizer knows also stop a row.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


@dataclass
class Finished:
    tokens: list[int]  # the new tokens, without the stop token
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)

    @property
    def computed_tokens(self) -> int:
        """Tokens the model produced, the stop token included (what throughput counts)."""
        return len(self.tokens) + (self.finish_reason == "stop")


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """EOS of the model's generation config and of the tokenizer, and every end-of-turn token the tokenizer knows."""
    ids: set[int] = set()
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


@torch.inference_mode()
def generate_rows(
    model,
    prompts: Sequence[Sequence[int]],
    pairs: Sequence[tuple[int, int]],
    row_prompt: Sequence[int],
    params: SamplingParams,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_limit: Optional[int] = None,
) -> list[Finished]:
    """Continue `prompts[row_prompt[i]]` for every row i, sampling row i from the stream of `pairs[i]`.

    Ids at or above `vocab_limit` (len(tokenizer)) are never drawn.
    """
    device = next(model.parameters()).device
    logits, cache, mask = _prefill(model, prompts, device, room=params.max_new_tokens)
    expand = torch.tensor(list(row_prompt), dtype=torch.long, device=device)
    logits = logits[expand]
    cache.reorder_cache(expand)  # index_select on the batch dimension: rows of one prompt share its prefill
    mask = mask[expand]
    next_position = torch.tensor([len(prompts[p]) for p in row_prompt], dtype=torch.long, device=device)

    uniforms = row_uniforms(list(pairs), params).to(device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    cache_keyword = _cache_keyword(model)
    results: list[Optional[Finished]] = [None] * len(pairs)
    tokens: list[list[int]] = [[] for _ in pairs]
    active = torch.arange(len(pairs), device=device)  # slot -> row
    rows = list(range(len(pairs)))  # slot -> row, on the host
    for step in range(params.max_new_tokens):
        chosen = next_tokens(logits, uniforms[active, step], params, vocab_limit)
        # One device-to-host copy per step (tokens and stop flags together): each copy waits for the device.
        picked, stopped = torch.stack([chosen, torch.isin(chosen, stops).long()]).tolist()
        last = step == params.max_new_tokens - 1
        keep = []
        for slot, (row, token, stop) in enumerate(zip(rows, picked, stopped)):
            if stop:
                results[row] = Finished(tokens[row], "stop")
                continue
            tokens[row].append(token)
            if last:
                results[row] = Finished(tokens[row], "length")
            else:
                keep.append(slot)
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            active, chosen, mask, next_position = active[index], chosen[index], mask[index], next_position[index]
            rows = [rows[slot] for slot in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        out = model(
            input_ids=chosen.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_position.unsqueeze(-1),
            use_cache=True,
            **{cache_keyword: cache},
        )
        logits = out.logits[:, -1]
        next_position = next_position + 1
    return results  # type: ignore[return-value]


def _prefill(model, prompts: Sequence[Sequence[int]], device: torch.device, room: int):
    """Last-position logits [P, vocab], a KV cache left-padded to the longest prompt, and its attention mask.

    Each prompt is prefilled alone: no padding to compute, the plain causal attention path, and
    a prompt's cache does not depend on the prompts it is batched with. The caches are then laid
    side by side, left-padded with zeros that the mask hides.
    """
    longest = max(len(p) for p in prompts)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    cache_keyword = _cache_keyword(model)
    logits, layers = [], []
    for i, ids in enumerate(prompts):
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
            use_cache=True,
            **{cache_keyword: cache},
            logits_to_keep=1,
        )
        logits.append(out.logits[:, -1])
        layers.append([(layer.keys, layer.values) for layer in cache.layers])
        mask[i, longest - len(ids) :] = 1
    merged = DynamicCache(config=model.config)
    # Plain full-attention layers (not sliding-window ones) get room to grow in place.
    merged.layers = [_RoomyLayer(room) if type(layer) is DynamicLayer else layer for layer in merged.layers]
    for index in range(len(layers[0])):
        keys = [prompt_layers[index][0] for prompt_layers in layers]
        values = [prompt_layers[index][1] for prompt_layers in layers]
        merged.update(_left_pad(keys, longest), _left_pad(values, longest), index)
    return torch.cat(logits), merged, mask


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name under which the model takes its KV cache: `cache` from transformers 5.24 on (where `past_key_values`
    warns that it goes away in 5.40), `past_key_values` before. Read from the first transformers model inside, so
    wrappers that pass keywords through (PEFT's) get the name their base model takes."""
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    return _forward_cache_keyword(type(inner))


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class _RoomyLayer(DynamicLayer):
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
            size = (*self.keys.shape[:-2], used + max(adding, self.room), self.keys.shape[-1])
            buffers = (self.keys.new_empty(size), self.values.new_empty(size))
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


def _left_pad(states: list[torch.Tensor], length: int) -> torch.Tensor:
    """[1, heads, len_i, dim] tensors -> [n, heads, length, dim], each right-aligned."""
    first = states[0]
    out = first.new_zeros((len(states), first.shape[1], length, first.shape[3]))
    for i, s in enumerate(states):
        out[i, :, length - s.shape[2] :] = s[0]
    return out


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)  # torch.cuda.OutOfMemoryError is the same class


def generate_with_fallback(
    model,
    prompt_ids: dict[int, Sequence[int]],
    pairs: Sequence[tuple[int, int]],
    params: SamplingParams,
    stop_ids: Sequence[int],
    pad_id: int,
    micro_batch: int,
    on_shrink: Callable[[int, int], None] = lambda old, new: None,
    vocab_limit: Optional[int] = None,
) -> tuple[list[Finished], int]:
    """Generate every (prompt id, sequence index) of `pairs` in chunks of at most `micro_batch` rows.

    On an out-of-memory error the chunk size is halved (on_shrink(old, new) is told) and the
    chunk retried; the returned size is what later batches should start with. At one row there
    is nothing left to halve and the error becomes a PhalanxError.
    """
    results: list[Finished] = []
    start = 0
    while start < len(pairs):
        chunk = list(pairs[start : start + micro_batch])
        distinct = list(dict.fromkeys(p for p, _ in chunk))
        where = {p: i for i, p in enumerate(distinct)}
        try:
            results += generate_rows(
                model,
                [prompt_ids[p] for p in distinct],
                chunk,
                [where[p] for p, _ in chunk],
                params,
                stop_ids,
                pad_id,
                vocab_limit,
            )
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
            if not is_out_of_memory(exc):
                raise
        else:
            start += len(chunk)
            continue
        # Out of the except block, so the failed attempt's tensors are no longer referenced.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if micro_batch == 1:
            raise PhalanxError(
                "out of memory generating a single sequence; lower --max_new_tokens, use shorter prompts, "
                "a smaller --dtype or a smaller model"
            )
        on_shrink(micro_batch, micro_batch // 2)
        micro_batch //= 2
    return results, micro_batch
