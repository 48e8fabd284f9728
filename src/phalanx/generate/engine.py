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

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from phalanx.errors import PhalanxError
from phalanx.generate.kv_cache import GrowingLayer, cache_keyword
from phalanx.generate.sampling import SamplingParams, next_tokens, row_uniforms
from phalanx.generate.static_decode import StaticDecoder

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
    decoder: Optional[StaticDecoder] = None,
) -> list[Finished]:
    """Continue `prompts[row_prompt[i]]` for every row i, sampling row i from the stream of `pairs[i]`.

    Ids at or above `vocab_limit` (len(tokenizer)) are never drawn. With a `decoder`, the decoding steps run
    over its fixed-size cache (one CUDA graph per step on CUDA); without, over a growing cache that finished
    rows leave. Both draw the same tokens in float32 (in bf16 attention over other lengths may round differently).
    """
    device = next(model.parameters()).device
    logits, states = _prefill(model, prompts, device)
    expand = torch.tensor(list(row_prompt), dtype=torch.long, device=device)
    uniforms = row_uniforms(list(pairs), params).to(device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    if decoder is not None:
        drawn, _ = decoder.decode(model, logits[expand], states, row_prompt, uniforms, params, stops, vocab_limit)
        stop_set = set(stop_ids)
        return [_cut_at_stop(row, stop_set) for row in drawn]
    cache, mask = _side_by_side(model, states, room=params.max_new_tokens)
    cache.reorder_cache(expand)  # index_select on the batch dimension: rows of one prompt share its prefill
    next_position = torch.tensor([len(prompts[p]) for p in row_prompt], dtype=torch.long, device=device)
    return _decode_growing(
        model, logits[expand], cache, mask[expand], next_position, uniforms, stops, params, vocab_limit
    )


def _cut_at_stop(tokens: list[int], stops: set[int]) -> Finished:
    """A row of the fixed-size decoder: its tokens up to the first stop token (what follows it is not the row's)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return Finished(tokens[:i], "stop")
    return Finished(tokens, "length")


def _decode_growing(
    model, logits, cache, mask, next_position, uniforms, stops, params: SamplingParams, vocab_limit
) -> list[Finished]:
    """The decoding loop over a growing cache: one step per token, the rows that stop leave the batch at once."""
    rows_total = logits.shape[0]
    keyword = cache_keyword(model)
    results: list[Optional[Finished]] = [None] * rows_total
    tokens: list[list[int]] = [[] for _ in range(rows_total)]
    active = torch.arange(rows_total, device=logits.device)  # slot -> row
    rows = list(range(rows_total))  # slot -> row, on the host
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
            index = torch.tensor(keep, dtype=torch.long, device=logits.device)
            cache.batch_select_indices(index)
            active, chosen, mask, next_position = active[index], chosen[index], mask[index], next_position[index]
            rows = [rows[slot] for slot in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        out = model(
            input_ids=chosen.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_position.unsqueeze(-1),
            use_cache=True,
            **{keyword: cache},
        )
        logits = out.logits[:, -1]
        next_position = next_position + 1
    return results  # type: ignore[return-value]


def _prefill(model, prompts: Sequence[Sequence[int]], device: torch.device):
    """Each prompt's last-position logits [P, vocab] and its keys and values, [(keys, values)] per layer.

    Each prompt is prefilled alone: no padding to compute, the plain causal attention path, and
    a prompt's cache does not depend on the prompts it is batched with.
    """
    keyword = cache_keyword(model)
    logits, states = [], []
    for ids in prompts:
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
            use_cache=True,
            **{keyword: cache},
            logits_to_keep=1,
        )
        logits.append(out.logits[:, -1])
        states.append([(layer.keys, layer.values) for layer in cache.layers])
    return torch.cat(logits), states


def _side_by_side(model, states, room: int):
    """The prompts' caches laid side by side in one growing cache, left-padded with zeros, and the mask that hides
    the padding [P, longest]."""
    lengths = [prompt[0][0].shape[-2] for prompt in states]
    longest = max(lengths)
    device = states[0][0][0].device
    mask = torch.zeros((len(states), longest), dtype=torch.long, device=device)
    for i, length in enumerate(lengths):
        mask[i, longest - length :] = 1
    merged = DynamicCache(config=model.config)
    # Plain full-attention layers (not sliding-window ones) get room to grow in place.
    merged.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in merged.layers]
    for index in range(len(states[0])):
        keys = [prompt[index][0] for prompt in states]
        values = [prompt[index][1] for prompt in states]
        merged.update(_left_pad(keys, longest), _left_pad(values, longest), index)
    return merged, mask


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
    decoder: Optional[StaticDecoder] = None,
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
                decoder,
            )
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled, the rest re-raised
            if not is_out_of_memory(exc):
                raise
        else:
            start += len(chunk)
            continue
        # Out of the except block, so the failed attempt's tensors are no longer referenced.
        if decoder is not None:
            decoder.release(micro_batch // 2)  # its cache (and graph) was sized for the batch that did not fit
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
