"""What the FSDP tests run inside real gloo ranks (tests/dist_workers.run_ranks imports this in each child)."""

import torch
import torch.distributed as dist

from phalanx.config.schema import EMBEDDED_MODEL, LoraConfig, ModelConfig
from phalanx.models.adapters import apply_finetuning
from phalanx.models.load import load_model
from phalanx.parallel.base import Precision
from phalanx.runtime.dist import RankInfo

STEPS = 3


def lora_bf16_steps(rank: int, world: int, strategy_name: str) -> dict:
    """LoRA on a base loaded in bf16, bf16 mixed precision on CPU (asked for directly: Precision.choose gives CPU fp32),
    a few AdamW steps with per-rank batches: the wrapped parameters' dtypes and the mean loss of each step."""
    from phalanx.parallel.ddp import DDPStrategy
    from phalanx.parallel.fsdp import FSDPStrategy

    info = RankInfo(rank, world, rank, world, torch.device("cpu"))
    bf16 = Precision(torch.bfloat16)
    torch.manual_seed(0)  # the same LoRA A init on every rank and under both strategies
    model = load_model(EMBEDDED_MODEL, torch.bfloat16)
    model = apply_finetuning(model, ModelConfig(), LoraConfig(dropout=0.0))
    strategy = (
        FSDPStrategy(info, bf16, "FULL_SHARD", finetune="lora") if strategy_name == "fsdp" else DDPStrategy(info, bf16)
    )
    model, _ = strategy.prepare(
        model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    )
    params = list(strategy.unwrap().named_parameters())
    dtypes = {
        "frozen": sorted({str(p.dtype) for _, p in params if not p.requires_grad}),
        "trainable": sorted({str(p.dtype) for _, p in params if p.requires_grad}),
        "frozen_local_bytes": sum(
            _local(p).numel() * _local(p).element_size() for _, p in params if not p.requires_grad
        ),
    }
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, strategy.unwrap().config.vocab_size, (2, 24), generator=g)
    losses = []
    for _ in range(STEPS):
        with strategy.micro_step(True), strategy.autocast():
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        strategy.backward(loss)
        strategy.step(1.0)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {**dtypes, "losses": losses}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param
