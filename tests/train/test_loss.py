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


# Liger's fused kernel runs only on CUDA; these check the guard that decides whether a fused kernel may replace the
# chunked head, with kernels written here standing in for it on the CPU.
def _plain_sum(hidden, weight, bias, targets):
    return torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden, weight, bias).float(), targets, reduction="sum"
    )


def test_a_fused_kernel_that_agrees_with_the_chunked_head_is_accepted():
    from phalanx.train.loss import _disagreement

    weight = torch.randn(300, 16)
    assert _disagreement(_plain_sum, weight, None, torch.float32) is None
    assert _disagreement(_plain_sum, weight, torch.randn(300), torch.float32) is None


def test_a_fused_kernel_that_disagrees_or_fails_is_refused_with_the_reason():
    from phalanx.train.loss import _disagreement

    weight = torch.randn(300, 16)

    def mean_not_sum(hidden, weight, bias, targets):
        return _plain_sum(hidden, weight, bias, targets) / len(targets)

    def broken(hidden, weight, bias, targets):
        raise RuntimeError("no kernel image for this device")

    def wrong_gradient(hidden, weight, bias, targets):
        loss = _plain_sum(hidden, weight, bias, targets)
        return loss + (hidden * 0.5).sum() - (hidden * 0.5).sum().detach()  # same value, gradient shifted

    assert "differs from the chunked path" in _disagreement(mean_not_sum, weight, None, torch.float32)
    assert "in the gradient" in _disagreement(wrong_gradient, weight, None, torch.float32)
    assert _disagreement(broken, weight, None, torch.float32) == "RuntimeError: no kernel image for this device"


def test_no_fused_kernel_is_looked_for_off_cuda():
    from phalanx.train.loss import fused_kernel_for, linear_cross_entropy_sum

    def must_not_be_called():
        raise AssertionError("a fused kernel was looked up on the CPU")

    hidden, weight = torch.randn(5, 16, requires_grad=True), torch.randn(300, 16)
    assert fused_kernel_for(hidden, weight, None, find=must_not_be_called) is None
    targets = torch.randint(0, 300, (5,))
    assert torch.allclose(
        linear_cross_entropy_sum(hidden, weight, None, targets), _plain_sum(hidden, weight, None, targets)
    )


def test_liger_kernels_false_keeps_the_fused_kernel_out_of_the_head(monkeypatch):
    """training.liger_kernels false: the output head never asks for a fused kernel (as if one were there: the lookup
    is replaced by one that hands a marked kernel back), and the loss is the chunked path's; 'auto' uses it."""
    import phalanx.train.loss as L
    from phalanx.models.load import load_model

    def marked(hidden, weight, bias, targets):
        return torch.tensor(-1.0)

    monkeypatch.setattr(L, "fused_kernel_for", lambda hidden, weight, bias: marked)
    torch.manual_seed(0)
    model = load_model("embedded:tiny-qwen3", torch.float32, False, device=torch.device("cpu"))
    ids = torch.randint(3, 250, (1, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        plain = L.token_loss_sum(model, batch)  # no head installed: logits, cut and reduced here
        assert L.install_target_head(model, fused=False)
        assert torch.allclose(L.token_loss_sum(model, batch), plain)
        assert L.install_target_head(model, fused=True)
        assert L.token_loss_sum(model, batch).item() == -1.0
