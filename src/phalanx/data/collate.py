"""Pad a list of tokenized examples into one batch of tensors (right padding, to the longest example)."""

from __future__ import annotations

import torch

from phalanx.data.chat import IGNORE_INDEX


def pad_batch(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` padded with ``pad_token_id``, ``attention_mask`` 1 on real tokens, ``labels`` padded with -100."""
    if not examples:
        raise ValueError("pad_batch needs at least one example")
    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        if len(e["labels"]) != n:
            raise ValueError(f"example {row}: {n} input_ids but {len(e['labels'])} labels")
        input_ids[row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.as_tensor(e["labels"], dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
