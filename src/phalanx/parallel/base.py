"""The Strategy interface: how a model is wrapped, how gradients are synchronised and applied.

The training loop calls only these verbs (`prepare`, `micro_step`, `backward`, `step`,
`unwrap`), so it never branches on the strategy. Mixed precision lives here too, because
loss scaling is part of how a backward pass and an optimizer step are carried out.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.runtime.dist import RankInfo

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None = fp32) and whether fp16 loss scaling is needed."""

    dtype: Optional[torch.dtype]

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16

    @classmethod
    def choose(cls, mixed_precision: str, device: torch.device) -> "Precision":
        if device.type != "cuda":
            if mixed_precision in ("fp16", "bf16"):
                raise ConfigError(
                    f"training.mixed_precision = '{mixed_precision}' needs a CUDA device; this run is on {device}. "
                    "Use 'auto' or 'no' (fp32) on CPU."
                )
            return cls(None)
        if mixed_precision == "auto":
            return cls(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        return cls({"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision])


class Strategy:
    """Single process: no wrapping, no synchronisation. Other strategies override what differs."""

    name = "single"

    def __init__(self, rank: RankInfo, precision: Precision):
        self.rank = rank
        self.precision = precision
        self.scaler = torch.amp.GradScaler("cuda") if precision.needs_scaler else None
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.keep_gradients = False  # zero .grad in place after a step instead of freeing it (keep_gradient_buffers)

    @classmethod
    def from_config(cls, rank: RankInfo, precision: Precision, cfg: RunConfig) -> "Strategy":
        """This strategy as the run config sets it up (make_strategy calls it); subclasses read their own fields."""
        return cls(rank, precision)

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, precision: Precision) -> None:
        """Raise ConfigError for what every rank would refuse, before any starts (launchers call it; no CUDA call)."""

    def prepare(
        self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.setup_model(model)
        self.optimizer = make_optimizer(self.unwrap())
        return self.model, self.optimizer

    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move and wrap the model only: for callers that bring their own optimizer later (set `optimizer`)."""
        self.model = self.wrap(place_on_device(model, self.rank.device))
        return self.model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self) -> nn.Module:
        assert self.model is not None, "prepare() first"
        return self.model

    def micro_step(self, sync_gradients: bool) -> ContextManager:
        """Context for one micro-batch's forward and backward; gradients sync only on the last one."""
        return contextlib.nullcontext()

    def eval_model(self) -> nn.Module:
        """The module to run evaluation forwards on; ranks may hold different numbers of eval batches."""
        return self.unwrap()

    def autocast(self) -> ContextManager:
        """Mixed precision for forward passes only (backward runs in the dtypes autocast chose)."""
        if self.precision.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rank.device.type, dtype=self.precision.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm: float) -> torch.Tensor | float:
        """Unscale, clip (0 = off, norm still reported), apply and clear gradients; returns the pre-clip norm, as a
        device tensor where there is one (reading it is a host sync: callers read it when they log it)."""
        assert self.optimizer is not None
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip_gradients(max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_gradients)
        return norm.detach()

    def keep_gradient_buffers(self) -> int:
        """Give every trained parameter a zero .grad now and zero it in place after each step from now on, instead
        of freeing it: gradients summed over several CUDA-graphed passes must live outside the graphs' memory
        (models/graphs.py). Returns how many were allocated."""
        assert self.optimizer is not None, "prepare() first"
        allocated = 0
        for p in (p for group in self.optimizer.param_groups for p in group["params"]):
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                allocated += 1
        self.keep_gradients = True
        return allocated

    def clip_gradients(self, max_grad_norm: float) -> torch.Tensor:
        """Clip to max_grad_norm (0 = off) and return the pre-clip global norm; sharded strategies override it."""
        return torch.nn.utils.clip_grad_norm_(
            self.parameters_with_gradients(), max_grad_norm if max_grad_norm > 0 else float("inf")
        )

    def parameters_with_gradients(self) -> list[torch.Tensor]:
        """The parameters the optimizer applies that hold a gradient, from its parameter groups: what a step clips and
        measures. Not a walk over the model's modules: at the seeds' 28 layers x 7 adapters that walk was a third of a
        step's Python calls (though not a measurable share of its time on CPU; benchmarks/RESULTS.md, 2026-11-27)."""
        assert self.optimizer is not None
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def discard_gradients(self) -> None:
        """Drop this step's gradients without applying them (a skipped step)."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=not self.keep_gradients)

    # Saving. Strategies that shard override these; every rank calls them (they may be collective).
    shards_state = False  # True: resume state is written per rank by save_sharded, not optimizer.pt from rank 0
    sharded_state_holds_model = (
        False  # True: save_sharded writes every weight (intermediate checkpoints skip the gather)
    )

    def model_state_for_saving(self) -> Optional[dict]:
        """The weights save_pretrained should write on rank 0; None = read them from the model itself."""
        return None

    def save_sharded(self, folder: Path, asynchronous: bool = False) -> Optional[Future]:
        """Weights and optimizer state for resume, written by every rank into `folder` (sharding strategies).

        `asynchronous`: a strategy that can write in the background returns the write's Future (else None)."""

    def load_sharded(self, folder: Path) -> None:
        """Restore what save_sharded wrote (sharding strategies)."""

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def place_on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """Move `model` to `device`. A bitsandbytes-quantized model was placed when it was loaded (load_model's
    device) and is left there: moving quantized weights again is not supported by every bitsandbytes version."""
    if not is_quantized_model(model):
        return model.to(device)
    elsewhere = {str(p.device) for p in model.parameters() if p.device != device}
    if elsewhere:
        raise ConfigError(
            f"the 4-bit model was loaded on {sorted(elsewhere)} but this rank runs on {device}; "
            "load it with load_model(..., device=rank.device)"
        )
    return model


def is_quantized_model(model: nn.Module) -> bool:
    """True for a model (or PEFT wrapper of one) whose weights bitsandbytes quantized while loading."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def quantized_parameter_names(model: nn.Module) -> list[str]:
    """Names of bitsandbytes' packed weights (Params4bit / Int8Params): frozen, and their scales live beside the
    tensor (quant_state), so a collective that copies only the tensor would pair one rank's bytes with another's scales."""
    return [name for name, p in model.named_parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]


def trainable_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)
