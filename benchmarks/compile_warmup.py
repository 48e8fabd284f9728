"""Compiled decoder layers (training.compile) over packed micro-batches whose number of rows changes: how many graphs
dynamo compiles, and how long the warm-up takes (CPU).

A packed micro-batch holds as many rows as fit (1 to `--max-rows` here, lengths drawn uniformly from `--lengths`,
seeded), so both its token count and its number of rows change from step to step. Every graph dynamo compiles is a
warm-up the run pays (minutes per graph for a 1.5B layer with inductor on a GPU), and after `recompile_limit` of them
a layer runs eagerly for good. The embedded tiny Qwen3 with LoRA r8 (phalanx's fused forward), the target-only
loss, one forward+backward per micro-batch, fp32. Reported, never asserted: seconds per step, the steps that compiled
something, and dynamo's counts of graphs and recompiles.

    python benchmarks/compile_warmup.py [--backend inductor|aot_eager] [--steps 12] [--max-rows 4]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.data.collate import collate
from phalanx.models.adapters import apply_finetuning
from phalanx.models.attention import enable_varlen_attention
from phalanx.models.compile import compile_decoder_layers
from phalanx.models.load import load_model
from phalanx.train.loss import install_target_head, token_loss_sum

CPU = torch.device("cpu")


def build_model(backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_model("embedded:tiny-qwen3", torch.float32, False, device=CPU)
    enable_varlen_attention(model, CPU)
    model = apply_finetuning(model, ModelConfig(), LoraConfig(r=8, alpha=16, dropout=0.05))
    install_target_head(model)
    compile_decoder_layers(model, CPU, announce=False, backend=backend)
    return model.train()


def micro_batches(steps: int, max_rows: int, shortest: int, longest: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = []
        for _ in range(int(torch.randint(1, max_rows + 1, (1,), generator=gen))):
            n = int(torch.randint(shortest, longest + 1, (1,), generator=gen))
            ids = torch.randint(3, 250, (n,), generator=gen).tolist()
            rows.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
        yield collate(rows, pad_token_id=0, packing=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-rows", type=int, default=4)
    parser.add_argument("--lengths", default="16,256", help="shortest,longest row in tokens")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    shortest, longest = (int(v) for v in args.lengths.split(","))
    model = build_model(args.backend)
    graphs_before = 0
    total = 0.0
    compiling_steps = []
    for step, batch in enumerate(micro_batches(args.steps, args.max_rows, shortest, longest, args.seed), start=1):
        start = time.perf_counter()
        token_loss_sum(model, batch).backward()
        model.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        total += seconds
        graphs = counters["stats"]["unique_graphs"]
        if graphs > graphs_before:
            compiling_steps.append(step)
        print(
            f"step {step:2d}: {batch['rows']} rows, {batch['input_tokens']:4d} tokens, {seconds:6.2f} s, "
            f"graphs compiled so far {graphs}",
            flush=True,
        )
        graphs_before = graphs
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    print(
        f"backend {args.backend}: {counters['stats']['unique_graphs']} graphs compiled, at steps {compiling_steps}; "
        f"{total:.1f} s in {args.steps} steps; dynamo recompiles counted: {recompiles}"
    )


if __name__ == "__main__":
    main()
