"""Causal-LM loss as a sum over target tokens, so the caller can divide by the global token count.

Dividing each micro-batch's sum by the number of target tokens in the whole global batch
(all micro-batches, all ranks) makes accumulation and data parallelism exact: 2 ranks x
batch b x accumulation a gives the loss of one process with batch 2ab.

Only positions whose next token is a target reach the output head (24% of the bundled rows' tokens):
the head and the cross-entropy run there alone, in chunks of positions, with an fp32 log-sum-exp, so
no [tokens x vocab] logits tensor (let alone an fp32 one) exists. For the model types whose logits are
exactly `lm_head(hidden)` (TARGET_HEAD_MODEL_TYPES), `install_target_head` makes the head itself compute
the loss while `token_loss_sum` asks it to: the forward still goes through the wrapped model (DDP, FSDP2
and DeepSpeed see their forward; the head's weight is gathered where they gather it), and the head's
chunks compute their gradients as they go (forward and backward of the head in one pass, as Liger's
fused linear cross-entropy does). Other models return logits, which are then cut to the target
positions and reduced in chunks (each chunk's fp32 softmax recomputed in backward, never kept).

On CUDA with liger-kernel installed the head's chunks run in Liger's fused (Triton) linear cross-entropy
instead: the same sum, with the softmax and its gradient fused into one kernel per chunk. It is compared
once per (device, dtypes, vocabulary) against the chunked path here on a small problem and used only if it
agrees; otherwise (or on any error) the chunked path runs, and the run says so once. `training.liger_kernels
false` keeps it out (the chunked path takes no host sync; Liger's reads its target count and its output
gradient back to the host: three waits a step, profiled on an H200).
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.models.attention import packed_attention_kwargs

IGNORE_INDEX = -100
# fp32 logits per chunk of positions: 2**26 = 256 MiB (441 positions of a 151,936-token vocabulary).
CHUNK_LOGITS = 2**26
# Model types whose CausalLM forward is `logits = self.lm_head(hidden_states)` and nothing after it.
TARGET_HEAD_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss: a label at position t+1 is predicted from position t."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def chunk_rows(vocab: int, chunk_logits: Optional[int] = None) -> int:
    return max(1, (chunk_logits or CHUNK_LOGITS) // max(vocab, 1))


@dataclass
class _HeadRequest:
    positions: torch.Tensor  # (N,) flat indices (into B*T) of the positions whose next label is a target
    targets: torch.Tensor  # (N,) those next labels
    tokens: int  # B*T
    chunk_logits: Optional[int] = None
    used: bool = False


_request: Optional[_HeadRequest] = None  # set by token_loss_sum for the duration of one forward


def install_target_head(model: nn.Module, fused: bool = True) -> bool:
    """Let `model`'s output head compute the target-only loss when token_loss_sum asks it to (otherwise it is the
    plain linear layer it was: generation, export and saving see no difference). True if installed. `fused`: False
    keeps Liger's fused kernel out (training.liger_kernels false), so the head's chunks always run the path here."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "model_type", None) not in TARGET_HEAD_MODEL_TYPES:
        return False
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not nn.Linear:  # an adapted (LoRA) or quantized head keeps the logits path
        return False
    head.forward = types.MethodType(_target_head_forward, head)
    head.phalanx_fused_head = fused
    return True


def _target_head_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    request = _request
    if request is None:
        return F.linear(hidden, self.weight, self.bias)
    if hidden.shape[:-1].numel() != request.tokens:
        raise RuntimeError(
            f"the output head got hidden states of shape {tuple(hidden.shape)} for {request.tokens} labels"
        )
    request.used = True
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, request.positions)
    return linear_cross_entropy_sum(
        selected, self.weight, self.bias, request.targets, request.chunk_logits, fused=self.phalanx_fused_head
    )


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    chunk_logits: Optional[int] = None,
    fused: bool = True,
) -> torch.Tensor:
    """sum_i CE(hidden[i] @ weight.T + bias, targets[i]) in fp32, computed in chunks of positions.

    The matmuls run in the ambient (autocast) dtype, the log-sum-exp in fp32. With gradients enabled each
    chunk's gradient with respect to `hidden` (and to `weight`/`bias` when they train) is computed in the
    forward, so only chunk-sized logits ever exist; backward scales the stored gradients. `fused`: whether a fused
    kernel may run it instead (fused_kernel_for)."""
    if hidden.shape[0] == 0:
        return F.linear(hidden, weight, bias).float().sum()  # 0, still connected to the graph (DDP waits on it)
    kernel = fused_kernel_for(hidden, weight, bias) if fused else None
    if kernel is not None:
        return kernel(hidden, weight, bias, targets)
    if torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_rows(weight.shape[0], chunk_logits))
    total, *_ = _chunked(
        hidden, weight, bias, targets, chunk_rows(weight.shape[0], chunk_logits), (False, False, False)
    )
    return total


def _chunked(hidden, weight, bias, targets, rows: int, need: tuple[bool, bool, bool]):
    need_h, need_w, need_b = need
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
    for start in range(0, hidden.shape[0], rows):
        h, y = hidden[start : start + rows], targets[start : start + rows]
        logits = F.linear(h, weight, bias)
        compute_dtype = logits.dtype
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if need_h or need_w or need_b:
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            probs[torch.arange(len(y), device=y.device), y] -= 1.0  # d CE / d logits
            g = probs.to(compute_dtype)
            if need_h:
                grad_h[start : start + rows] = g @ weight
            if need_w:
                grad_w += (g.t() @ h).float()
            if need_b:
                grad_b += probs.sum(0)
    return total, grad_h, grad_w, grad_b


FusedKernel = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]
_fused_checked: dict = {}  # (device, dtypes, vocab, bias) -> the fused kernel, or None: it disagreed or failed
# Agreement with the chunked path on the check problem: relative to the loss / gradient scale, in the compute dtype.
FUSED_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def liger_linear_cross_entropy() -> Optional[FusedKernel]:
    """Liger's fused linear cross-entropy as a sum over positions, or None when liger-kernel is not importable."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def kernel(hidden, weight, bias, targets):
        out = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="sum")
        return (out[0] if isinstance(out, tuple) else out).float()  # some versions return (loss, z_loss)

    return kernel


def fused_kernel_for(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    find: Callable = liger_linear_cross_entropy,
) -> Optional[FusedKernel]:
    """The fused kernel to use for this head on this device, after it agreed once with the chunked path; None on
    CPU, without liger-kernel, or when it disagreed or failed (said once)."""
    if hidden.device.type != "cuda":
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else hidden.dtype
    key = (str(hidden.device), dtype, weight.dtype, tuple(weight.shape), bias is not None)
    if key not in _fused_checked:
        kernel = find()
        reason = None if kernel is None else _disagreement(kernel, weight, bias, dtype)
        _fused_checked[key] = _in_dtype(kernel, dtype) if kernel is not None and reason is None else None
        if reason is not None:
            print(f"🧮 The fused linear cross-entropy is not used ({reason}); the chunked head runs.", flush=True)
    return _fused_checked[key]


def _in_dtype(kernel: FusedKernel, dtype: torch.dtype) -> FusedKernel:
    """`kernel` called as it was checked: hidden states, weight and bias in the compute dtype (autocast would cast a
    matmul's operands, but a Triton kernel sees the tensors as given; `.to` is free when the dtype already matches)."""

    def call(hidden, weight, bias, targets):
        return kernel(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), targets)

    return call


def _disagreement(kernel: FusedKernel, weight: torch.Tensor, bias, dtype: torch.dtype) -> Optional[str]:
    """None if `kernel` gives the chunked path's loss and input gradient on 96 random positions of this head."""
    try:
        g = torch.Generator(device=weight.device).manual_seed(0)
        hidden = torch.randn(96, weight.shape[1], generator=g, device=weight.device, dtype=dtype)
        targets = torch.randint(0, weight.shape[0], (96,), generator=g, device=weight.device)
        w = weight.detach().to(dtype)
        b = None if bias is None else bias.detach().to(dtype)
        results = []
        for run in (kernel, _reference_sum):
            h = hidden.clone().requires_grad_(True)
            with torch.autocast(weight.device.type, enabled=False):
                loss = run(h, w, b, targets)
            loss.backward()
            results.append((loss.detach().float(), h.grad.float()))
        (loss_k, grad_k), (loss_r, grad_r) = results
        tolerance = FUSED_TOLERANCE.get(dtype, 2e-2)
        loss_error = float((loss_k - loss_r).abs() / loss_r.abs().clamp(min=1.0))
        grad_error = float((grad_k - grad_r).abs().max() / grad_r.abs().max().clamp(min=1e-12))
        if loss_error > tolerance or grad_error > tolerance:
            return f"it differs from the chunked path by {loss_error:.1e} in the loss, {grad_error:.1e} in the gradient"
    except Exception as exc:  # noqa: BLE001 - an optional kernel: the chunked path is always correct
        return f"{type(exc).__name__}: {exc}"
    return None


def _reference_sum(hidden, weight, bias, targets) -> torch.Tensor:
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_rows(weight.shape[0]))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        total, grad_h, grad_w, grad_b = _chunked(hidden, weight, bias, targets, rows, need)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = []
        for g, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            grads.append(None if g is None else (g * grad_out).to(dtype))
        return (*grads, None, None)


def target_positions(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices of the positions whose next label is a target, those labels): the collator's, computed on the
    host, else found here (a boolean selection: on a GPU it waits for the device)."""
    if "target_positions" in batch:
        return batch["target_positions"], batch["target_labels"]
    labels = batch["labels"]
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    positions = mask.reshape(-1).nonzero().squeeze(1)
    return positions, labels.reshape(-1)[positions + 1]


def model_inputs(batch: dict) -> dict:
    """What the model is called with: packed rows (position_ids, row boundaries) or padded (attention_mask)."""
    inputs = {"input_ids": batch["input_ids"], "use_cache": False}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
        if batch.get("row_lengths") is not None:
            inputs.update(packed_attention_kwargs(tuple(batch["row_lengths"]), batch["input_ids"].device))
    else:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def token_loss_sum(model: nn.Module, batch: dict, chunk_logits: Optional[int] = None) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (fp32 log-sum-exp), target positions only.

    `batch`: a padded batch (input_ids, attention_mask, labels) or a packed one (input_ids, position_ids, labels,
    and `row_lengths` on the host), as data.collate makes them."""
    global _request
    positions, targets = target_positions(batch)
    _request = request = _HeadRequest(positions, targets, batch["labels"].numel(), chunk_logits)
    try:
        out = model(**model_inputs(batch))
    finally:
        _request = None
    if request.used:
        return out.logits  # the head returned the loss sum
    logits = out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, positions)
    return _chunked_cross_entropy_sum(logits, targets, chunk_rows(logits.shape[-1], chunk_logits))


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def _chunked_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    if logits.shape[0] == 0:
        return logits.float().sum()
    total = None
    for start in range(0, logits.shape[0], rows):
        args = (logits[start : start + rows], targets[start : start + rows])
        part = (
            checkpoint(_ce_sum, *args, use_reentrant=False)
            if torch.is_grad_enabled() and logits.requires_grad
            else _ce_sum(*args)
        )
        total = part if total is None else total + part
    return total
