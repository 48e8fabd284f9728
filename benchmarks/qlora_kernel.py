"""QLoRA's LoRA forward, phalanx's fused kernel vs PEFT's Linear4bit forward, on CPU: bytes kept for backward and the
operators that launch a kernel on a GPU, for one forward+backward of the embedded tiny model with a 4-bit NF4 base.

Both arms load the same 4-bit base and the same adapters (seeded), under bf16 autocast as phalanx trains QLoRA with
mixed precision, dropout as given. "saved" counts every distinct storage autograd keeps (saved_tensors_hooks),
parameters excluded; "ops" as in benchmarks/lora_kernel.py. Reported, never asserted.

    .venv/bin/python benchmarks/qlora_kernel.py [--dropout 0.05] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_kernel import KERNEL_OPS  # noqa: E402


def build(kernel: str, dropout: float):
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.models.adapters import apply_finetuning
    from phalanx.models.load import load_model, quantization_config

    flags = [("load_in_4bit", "true"), ("lora_dropout", str(dropout)), ("lora.kernel", kernel)]
    cfg = load_config(None, overrides_from_flags(flags))
    model = load_model(
        "embedded:tiny-qwen3", torch.float32, quantization=quantization_config(cfg.model, torch.bfloat16)
    )
    torch.manual_seed(0)
    return apply_finetuning(model, cfg.model, cfg.lora).train()


def step(model, embeds, count: bool) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs_embeds=embeds).logits
        logits.float().sum().backward()
    ops = sum(e.count for e in prof.key_averages() if e.key in KERNEL_OPS)
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    row = {"dropout": args.dropout, "tokens": args.tokens}
    for kernel in ("fused", "peft"):
        model = build(kernel, args.dropout)
        gen = torch.Generator().manual_seed(1)
        embeds = torch.randn(1, args.tokens, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        saved, ops = step(model, embeds.requires_grad_(True), count=True)
        row[f"{kernel}_saved_MiB"], row[f"{kernel}_ops"] = round(saved / 2**20, 2), ops
    row["saved_ratio"] = round(row["fused_saved_MiB"] / row["peft_saved_MiB"], 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
