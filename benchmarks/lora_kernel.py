"""LoRA forward+backward, phalanx's fused kernel vs PEFT's forward, on CPU: seconds per step and bytes kept for backward.

A Qwen2-shaped model with random weights (default hidden 512, 4 layers, batch 4 x 512 tokens), LoRA r16 alpha 32 on
every linear, one forward+backward per step, in fp32 and in bf16 (base weights bf16 under bf16 autocast, as phalanx
runs LoRA with mixed precision; adapters fp32). The arms alternate step by step so that drift in a shared machine's
load hits both alike. "saved" is every distinct storage that autograd keeps for backward (saved_tensors_hooks),
parameters excluded: the activation memory of a step. "ops" counts the operators of one step that each launch a
kernel on a GPU (every operator the step dispatches but views and allocations; NO_KERNEL_OPS): on a GPU an eager LoRA step is bound by
the host launching them, so their number is the figure a CPU can measure for it. Times are reported, never asserted.

    python benchmarks/lora_kernel.py [--hidden 512 --layers 4 --seq 512 --batch 4 --steps 5 --threads 2] [--redraw-mask]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.models import lora_fused
from phalanx.models.adapters import apply_finetuning


def build(args, kernel: str, dropout: float, dtype: torch.dtype):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model = apply_finetuning(model, ModelConfig(), LoraConfig(r=16, alpha=32, dropout=dropout, kernel=kernel))
    with torch.no_grad():  # B starts at zero in PEFT; the work is the same either way, but keep the numbers honest
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return model.train()


def step(model, ids, autocast: bool, count_saved: bool = False) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else contextlib.nullcontext()
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


# Operators that launch no kernel on a GPU: views, metadata and allocations. Every other operator the step dispatches
# is counted as one launch. They are counted as the step dispatches them (a TorchDispatchMode sees each call once, not
# the operators a CPU kernel calls inside it: CPU's native_dropout draws, multiplies and scales in three passes, CUDA's
# in one fused kernel). CPU-only decompositions still count as several (PEFT's dropout on CPU is bernoulli_ and two
# scalings; on CUDA it is one native_dropout), so PEFT's count here is a little above its count on a GPU.
NO_KERNEL_OPS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.t",
        "aten.transpose",
        "aten.permute",
        "aten.expand",
        "aten.slice",
        "aten.select",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.reshape",
        "aten.alias",
        "aten.as_strided",
        "aten.detach",
        "aten.split",
        "aten.split_with_sizes",
        "aten.unbind",
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.lift_fresh",
        "aten._local_scalar_dense",
    }
)


def kernel_ops(model, ids, autocast: bool) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) not in NO_KERNEL_OPS:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(model, ids, autocast)
    return Count.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dropouts", default="0.05,0")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument(
        "--redraw-mask",
        action="store_true",
        help="redraw dropout masks in backward on CPU too (CUDA's policy) instead of keeping bools",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.redraw_mask:
        lora_fused.REDRAW_MASK_ON = frozenset({"cpu", "cuda"})
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        for dropout in (float(d) for d in args.dropouts.split(",")):
            models = {kernel: build(args, kernel, dropout, dtype) for kernel in ("fused", "peft")}
            saved = {k: step(m, ids, dtype != torch.float32, count_saved=True) for k, m in models.items()}
            ops = {k: kernel_ops(m, ids, dtype != torch.float32) for k, m in models.items()}
            times: dict[str, list[float]] = {k: [] for k in models}
            for _ in range(args.steps):
                for kernel, model in models.items():
                    start = time.perf_counter()
                    step(model, ids, dtype != torch.float32)
                    times[kernel].append(time.perf_counter() - start)
            row = {
                "dtype": dtype_name,
                "dropout": dropout,
                "mask": "redraw" if args.redraw_mask and dropout else "keep",
            }
            for kernel in models:
                row[f"{kernel}_s_per_step"] = round(statistics.median(times[kernel]), 3)
                row[f"{kernel}_saved_MiB"] = round(saved[kernel] / 2**20, 1)
                row[f"{kernel}_ops"] = ops[kernel]
            row["speedup"] = round(row["peft_s_per_step"] / row["fused_s_per_step"], 2)
            row["saved_ratio"] = round(saved["fused"] / saved["peft"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
