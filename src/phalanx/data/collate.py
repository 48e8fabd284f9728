"""Turn a list of tokenized examples into one micro-batch: padding-free packed (default) or right-padded.

`collate` (what training and evaluation use) also works out on the host what the loss needs to know: the
token counts (`input_tokens`: real tokens; `target_tokens`: positions whose label is a target, labels[1:] !=
-100 within each row) and where the targets are (`target_positions`: flat indices of the positions whose next
label is a target; `target_labels`: those labels). The loop then never reads a count back from the device,
and the loss selects target positions with an index, not a boolean mask (which would wait for the device).
"""

from __future__ import annotations

from typing import Optional

import torch

from phalanx.config.schema import UNMERGED_STRATEGIES, RunConfig
from phalanx.data.chat import IGNORE_INDEX


def _checked(examples: list[dict]) -> None:
    if not examples:
        raise ValueError("a micro-batch needs at least one example")
    for row, e in enumerate(examples):
        if len(e["labels"]) != len(e["input_ids"]):
            raise ValueError(f"example {row}: {len(e['input_ids'])} input_ids but {len(e['labels'])} labels")


def pad_batch(examples: list[dict], pad_token_id: int) -> dict:
    """``input_ids`` padded with ``pad_token_id``, ``attention_mask`` 1 on real tokens, ``labels`` padded with -100."""
    _checked(examples)
    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.as_tensor(e["labels"], dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pack_batch(examples: list[dict]) -> dict:
    """The examples concatenated into one row of shape (1, total tokens), with no padding and no attention mask.

    ``position_ids`` restart at 0 with every example (the attention and the rotary embedding see each one as
    its own sequence) and ``row_lengths`` says where each ends. The label at every example's first token is
    -100: the loss shifts labels by one, and the first token of example k+1 must not be predicted from the
    last token of example k. An example's first label never counts unpacked either, so the targets (and the
    loss normalisation) are exactly the padded batch's."""
    _checked(examples)
    lengths = tuple(len(e["input_ids"]) for e in examples)
    input_ids = torch.cat([torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples])
    labels = torch.cat([torch.as_tensor(e["labels"], dtype=torch.long) for e in examples])
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    labels[starts] = IGNORE_INDEX
    return {
        "input_ids": input_ids[None],
        "position_ids": position_ids[None],
        "labels": labels[None],
        "row_lengths": lengths,
    }


def pad_packed(batch: dict, tokens: int, rows: int, pad_token_id: int) -> dict:
    """A packed micro-batch grown to exactly `tokens` tokens in `rows` rows by rows of padding after its own (a fixed
    shape: models/graphs.py). Each padding row is at least one token long, its labels are -100 and its positions
    start at 0, so it predicts nothing and, as a row of its own, no real row attends to it. The host counts, the
    target positions and the real rows are left as they were: the loss and its normalisation do not change."""
    lengths = tuple(batch["row_lengths"])
    extra_rows, extra_tokens = rows - len(lengths), tokens - batch["input_ids"].shape[1]
    if extra_rows == 0 and extra_tokens == 0:
        return batch
    if extra_rows < 1 or extra_tokens < extra_rows:
        raise ValueError(
            f"cannot pad a packed micro-batch of {batch['input_ids'].shape[1]} tokens in {len(lengths)} rows to "
            f"{tokens} tokens in {rows} rows: padding rows need at least one token each"
        )
    pad_lengths = (1,) * (extra_rows - 1) + (extra_tokens - extra_rows + 1,)
    padded = dict(batch)
    padded["input_ids"] = torch.cat(
        [batch["input_ids"], torch.full((1, extra_tokens), pad_token_id, dtype=torch.long)], 1
    )
    padded["labels"] = torch.cat([batch["labels"], torch.full((1, extra_tokens), IGNORE_INDEX, dtype=torch.long)], 1)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in pad_lengths])
    padded["position_ids"] = torch.cat([batch["position_ids"], positions[None]], 1)
    padded["row_lengths"] = lengths + pad_lengths
    return padded


def collate(examples: list[dict], pad_token_id: int, packing: bool) -> dict:
    """A training or evaluation micro-batch: packed or padded, with its host-side token counts."""
    batch = pack_batch(examples) if packing else pad_batch(examples, pad_token_id)
    labels = batch["labels"]
    before_target = torch.zeros_like(labels, dtype=torch.bool)
    before_target[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # the last position of a row never predicts a target
    positions = before_target.reshape(-1).nonzero().squeeze(1)
    batch["target_positions"] = positions
    batch["target_labels"] = labels.reshape(-1)[positions + 1]
    batch["rows"] = len(examples)
    batch["input_tokens"] = sum(len(e["input_ids"]) for e in examples)
    batch["target_tokens"] = len(positions)
    return batch


def batch_counts(batch: dict) -> tuple[int, int]:
    """(target tokens, input tokens) of a batch: the collator's host counts, else counted from its (CPU) tensors."""
    if "target_tokens" in batch:
        return batch["target_tokens"], batch["input_tokens"]
    labels = batch["labels"]
    inputs = int(batch["attention_mask"].sum()) if "attention_mask" in batch else labels.numel()
    return int((labels[:, 1:] != IGNORE_INDEX).sum()), inputs


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch with its tensors on `device`; host-side counts and row lengths stay as they are."""
    return {k: host_to_device(v, device) if torch.is_tensor(v) else v for k, v in batch.items()}


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, without making the host wait for a GPU. The loader pins what it collates, but a merged or
    graph-padded pass and the row ends are built afterwards, in pageable memory, and a copy from pageable memory may
    wait for the device's stream to drain first: the host would then stop launching the next pass's kernels until
    the last pass has run. Pinned first (a host copy into the pinned cache), the copy is queued like any kernel."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# What collate() puts in a packed micro-batch: merge_packed joins exactly these.
_PACKED_KEYS = frozenset(
    {"input_ids", "position_ids", "labels", "row_lengths", "target_positions", "target_labels", "rows"}
    | {"input_tokens", "target_tokens"}
)


def merge_budget(cfg: RunConfig, device: torch.device, packing: bool) -> Optional[int]:
    """The most tokens in one merged forward/backward pass (training.merge_micro_batches), or None: one pass per
    micro-batch. Merging needs packed rows and more than one micro-batch per step; 'auto' merges on CUDA outside
    DeepSpeed. Unset merge_tokens: what one micro-batch can hold already, so memory keeps the unmerged bound."""
    t = cfg.training
    wanted = t.merge_micro_batches == "true" or (
        t.merge_micro_batches == "auto"
        and device.type == "cuda"
        and cfg.distributed.strategy not in UNMERGED_STRATEGIES
    )
    if not (wanted and packing and t.gradient_accumulation_steps > 1):
        return None
    return t.merge_tokens or micro_batch_bound(cfg)


def micro_batch_bound(cfg: RunConfig) -> int:
    """The most tokens one packed micro-batch can hold: the token budget, else batch_size rows at max_length."""
    return cfg.training.batch_tokens or cfg.training.batch_size * cfg.data.max_length


def passes_per_step(cfg: RunConfig, merge_tokens: Optional[int]) -> int:
    """Forward/backward passes one step makes at most: one per micro-batch, or with merged micro-batches as many as
    the step's micro-batches fill at their token bound (what sizes a compile decision: warm-up pays back per pass)."""
    t = cfg.training
    if not merge_tokens:
        return t.gradient_accumulation_steps
    step = t.gradient_accumulation_steps * micro_batch_bound(cfg)
    return max(1, min(t.gradient_accumulation_steps, -(-step // merge_tokens)))


def merge_packed(batches: list[dict], max_tokens: int) -> list[dict]:
    """Consecutive packed micro-batches joined into as few as hold at most `max_tokens` tokens each, in order.

    A join is exactly the packed micro-batch of all its rows (pack_batch over their rows, in order): each row keeps
    its own position ids and row boundary, and a row's first label is already -100, so no row predicts across a
    join. The step's rows, targets and counts are unchanged; only the number of forward/backward passes falls.
    Batches that are not collate()'s packed ones (padded, or from elsewhere) are returned as they are."""
    if len(batches) < 2 or any(b.keys() != _PACKED_KEYS for b in batches):
        return batches
    merged, group, tokens = [], [], 0
    for batch in batches:
        n = batch["input_ids"].shape[1]
        if group and tokens + n > max_tokens:
            merged.append(_join(group))
            group, tokens = [], 0
        group.append(batch)
        tokens += n
    merged.append(_join(group))
    return merged


def _join(group: list[dict]) -> dict:
    if len(group) == 1:
        return group[0]
    offsets, total = [], 0
    for batch in group:
        offsets.append(total)
        total += batch["input_ids"].shape[1]
    joined = {key: torch.cat([b[key] for b in group], dim=1) for key in ("input_ids", "position_ids", "labels")}
    joined["row_lengths"] = tuple(n for b in group for n in b["row_lengths"])
    joined["target_positions"] = torch.cat([b["target_positions"] + o for b, o in zip(group, offsets)])
    joined["target_labels"] = torch.cat([b["target_labels"] for b in group])
    for key in ("rows", "input_tokens", "target_tokens"):
        joined[key] = sum(b[key] for b in group)
    return joined
