"""Token-sum loss: splitting a batch and dividing by the global token count gives the whole-batch mean."""

import torch
from torch import nn

from phalanx.train.loss import IGNORE_INDEX, count_target_tokens, token_loss_sum


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return type("Out", (), {"logits": self.head(self.emb(input_ids))})()


def test_micro_batches_normalised_by_global_tokens_equal_full_batch_mean():
    ids = torch.randint(0, 11, (4, 6))
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    labels[2, 1:] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    model = TinyLM()
    full = token_loss_sum(model, batch) / count_target_tokens(labels)
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    total = sum(count_target_tokens(h["labels"]) for h in halves)
    split = sum(token_loss_sum(model, h) for h in halves) / total
    assert torch.allclose(full, split, atol=1e-6)
    # the mean over micro-batch means (what a naive loop does) differs when token counts differ
    naive = sum(token_loss_sum(model, h) / count_target_tokens(h["labels"]) for h in halves) / 2
    assert not torch.allclose(full, naive, atol=1e-4)


def test_first_position_label_never_counts():
    labels = torch.tensor([[5, IGNORE_INDEX, 7]])
    assert count_target_tokens(labels) == 1
